"""``understudy load``: the workload generator (or a recorded replay) from the command line.

Ctrl-C (SIGINT) or SIGTERM ends a run early as ``stop`` does (the drivers' rule): the summary
of what was sent is printed and the exit status is 128 + the signal's number; a second one
interrupts at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import threading
import urllib.parse
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from gateway.terminal import print_table
from workload._spec import DEFAULT_SESSION_HEADER, ReplaySpec, WorkloadSpec, WorkloadSummary

__all__ = ["load_command"]

QUIET_LOGGERS = ("httpx", "httpx2", "openai")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SPACE_OR_CONTROL = re.compile(r"[\x00-\x20\x7f]")
_NOT_HEADER_TEXT = re.compile(r"[^\x20-\x7e]")


@click.command("load")
@click.option("--url", required=True, help="OpenAI-compatible server: a root "
              "(http://127.0.0.1:8080) or a base URL ending in /v1.")
@click.option("--sessions", type=int, default=8, show_default=True)
@click.option("--turns", type=int, default=4, show_default=True, help="Turns per session.")
@click.option("--rate", type=float, default=1.0, show_default=True,
              help="Session arrivals per second (Poisson).")
@click.option("--think-s", type=float, default=1.0, show_default=True,
              help="Mean think time between turns (uniform within ±50%).")
@click.option("--duration-s", type=float, default=300.0, show_default=True,
              help="No session or turn starts after this; in-flight turns get --drain-s.")
@click.option("--drain-s", type=float, default=30.0, show_default=True)
@click.option("--concurrency", type=int, default=16, show_default=True,
              help="Sessions (or replayed requests) in flight at most.")
@click.option("--model", help="Model name (default: the first the server lists; "
              "with --replay: the recorded one).")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--tool-choice", type=click.Choice(["auto", "none", "omit"]), default="auto",
              show_default=True, help="Send the tools with this tool_choice, or omit them.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--session-header", default=DEFAULT_SESSION_HEADER, show_default=True)
@click.option("--timeout-s", type=float, default=300.0, show_default=True,
              help="Per request.")
@click.option("--replay", "replay_path", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), help="Send a recorded JSONL (the gateway's [record]) instead, "
              "with its original relative timing.")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="With --replay: time runs this many times faster.")
@click.option("--max-requests", type=int, default=None, help="With --replay: at most this "
              "many records.")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Bearer key (env OPENAI_API_KEY).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def load_command(url: str, sessions: int, turns: int, rate: float, think_s: float,
                 duration_s: float, drain_s: float, concurrency: int, model: str | None,
                 max_tokens: int, tool_choice: str, seed: int, session_header: str,
                 timeout_s: float, replay_path: Path | None, speed: float,
                 max_requests: int | None, api_key: str | None, as_json: bool) -> None:
    """Drive agentic multi-turn sessions (or a recorded replay) against URL."""
    # Here, not at the top: the openai client is a second of imports that --help need not pay.
    import openai

    from backends.openai_wire import config_error
    from workload._driver import run_workload
    from workload._replay import replay_workload

    url = _checked_url(url)
    if api_key is not None and _NOT_HEADER_TEXT.search(api_key):  # not echoed: a secret
        raise click.UsageError(
            "--api-key (or OPENAI_API_KEY) must be printable ASCII: a header carries it")
    for name in QUIET_LOGGERS:  # a line per request would bury the summary
        logging.getLogger(name).setLevel(logging.WARNING)
    try:  # the flags alone: a ValidationError while driving is no usage error
        if replay_path is not None:
            replay = ReplaySpec.model_validate(dict(
                speed=speed, duration_s=duration_s, concurrency=concurrency, model=model,
                session_header=session_header, request_timeout_s=timeout_s, drain_s=drain_s,
                **({"max_requests": max_requests} if max_requests is not None else {})))
        else:
            spec = WorkloadSpec.model_validate(dict(
                sessions=sessions, turns=turns, rate=rate, think_s=think_s,
                duration_s=duration_s, drain_s=drain_s, concurrency=concurrency, model=model,
                max_tokens=max_tokens, tool_choice=tool_choice, seed=seed,
                session_header=session_header, request_timeout_s=timeout_s))
    except ValidationError as exc:
        raise config_error(exc) from exc
    try:
        if replay_path is not None:
            path = replay_path
            summary, stopped_by = _run_until_signalled(lambda stop: replay_workload(
                path, url, spec=replay, api_key=api_key, stop=stop))
        else:
            summary, stopped_by = _run_until_signalled(lambda stop: run_workload(
                spec, url, api_key=api_key, stop=stop))
    except openai.APIConnectionError as exc:  # its message names no address
        raise click.ClickException(f"cannot reach {url}: {exc}") from exc
    except openai.APIStatusError as exc:  # the model lookup's (each turn counts its own)
        # Its message is 'Error code: 404 - ...' alone: the URL asked is what tells a --url
        # with a wrong path apart from a server that refuses.
        raise click.ClickException(
            f"{exc.request.method} {exc.request.url}: {exc.message}") from exc
    except (ValueError, RuntimeError, openai.OpenAIError) as exc:
        # A file that is not a recording; a server that cannot be reached or lists no model.
        raise click.ClickException(str(exc)) from exc
    _print(summary, as_json)
    if stopped_by is not None:
        click.echo(f"Stopped by {stopped_by.name}: the summary covers what was sent before it.",
                   err=True)
        raise SystemExit(128 + stopped_by.value)
    if summary.turns == 0 or summary.errors == summary.turns:
        raise SystemExit(1)


def _checked_url(url: str) -> str:
    """``url`` as the client can use it, or a usage error before anything is sent: the
    client would fail on it mid-run with a traceback (a bad port, a control character), or
    append its routes after a query (``/?key=1/v1models``)."""
    url = url.strip()  # e.g. read from a file with its newline
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises for a port that is no number or out of range
    except ValueError as exc:
        raise click.UsageError(f"--url is not a valid URL ({exc}): {url!r}") from exc
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise click.UsageError(f"--url must be an http:// or https:// URL, got {url!r}")
    if _SPACE_OR_CONTROL.search(url):
        raise click.UsageError(f"--url holds a space or a control character: {url!r}")
    if not parts.hostname:
        raise click.UsageError(f"--url names no host: {url!r}")
    if "?" in url or "#" in url:
        raise click.UsageError("--url must carry no query or fragment (the client appends "
                               f"the API's routes to its path): {url!r}")
    return url


def _run_until_signalled(run: Callable[[asyncio.Event], Coroutine[Any, Any, WorkloadSummary]]
                         ) -> tuple[WorkloadSummary, signal.Signals | None]:
    """``run(stop)`` with ``stop`` set by the first SIGINT or SIGTERM; the summary and that
    signal (None: the run ended by itself). The handlers are removed at the first signal, so
    a second one interrupts at once. Off the main thread (a test's runner) signals are not
    ours to take: none is handled."""
    received: list[signal.Signals] = []
    handled = STOP_SIGNALS if threading.current_thread() is threading.main_thread() else ()

    async def main() -> WorkloadSummary:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(signum: signal.Signals) -> None:
            received.append(signum)
            for each in handled:
                loop.remove_signal_handler(each)
            stop.set()

        for signum in handled:
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            return await run(stop)
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    summary = asyncio.run(main())
    return summary, (received[0] if received else None)


def _print(summary: WorkloadSummary, as_json: bool) -> None:
    from workload._summary import summary_table

    if as_json:
        click.echo(json.dumps(summary.to_json()))
    else:
        print_table(summary_table(summary))
