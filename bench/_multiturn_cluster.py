"""The reference-engine deployments bench/multiturn.py compares, and how it talks to them.

Rules:
1. Every engine process is a child of the benchmark, run from the code snapshot
   (``_procs.snapshot_code``) with its own log file, and stopped by its own pid
   (``_procs.spawn``: on the deployment's exit stack from the moment it runs, so a start
   cut short stops what it started). All listen on 127.0.0.1 only, on free ports.
2. Every child runs with one BLAS and one OpenMP thread (``THREAD_ENV``): on two shared cores,
   numpy's BLAS threads spin-waiting for each other collapse throughput under load, and the
   nodes of a disaggregated deployment must not each claim every core.
3. A deployment's children start at once and must all answer ``/health`` within
   ``ENGINE_READY_TIMEOUT_S``; one that exits earlier fails the start with its log tail.
4. A chat turn is one streamed request with a total timeout. Its TTFT is the time from sending
   to the first event carrying a token (content, or the finish of an empty answer); the
   stream counts only if it ends with ``data: [DONE]`` and carried no error event.
5. Metrics are read from each node's ``/metrics`` and summed over the labels a caller does not
   name, so a reading is one number per (series, label subset).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import Child, spawn
from _stream_timing import StreamError, sse_chunks

from demo.processes import THREAD_ENV, free_port, understudy_argv, wait_healthy

__all__ = [
    "MODEL",
    "ChatError",
    "Deployment",
    "Reply",
    "Scrape",
    "chat_turn",
    "scrape",
    "start_disaggregated",
    "start_unified",
    "wait_ready",
]

MODEL = "SmolLM2-135M-Instruct"  # the engine's default served name
# Loading dequantizes the GGUF and checks the BLAS kernels: ~17 s alone on a busy machine,
# longer when five processes load at once on two cores.
ENGINE_READY_TIMEOUT_S = 300.0
METRICS_TIMEOUT_S = 10.0
MAX_COMPLAINTS_KEPT = 5
_COMPLAINT = re.compile(r" (WARNING|ERROR|CRITICAL) |^Traceback")


@dataclass
class Deployment:
    """One system under test: the URL clients use and the processes behind it."""

    name: str
    url: str
    children: list[Child] = field(default_factory=list)
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)

    def check_alive(self) -> None:
        for child in self.children:
            if not child.alive():
                raise RuntimeError(
                    f"{child.name} exited ({child.proc.returncode}); log tail:\n"
                    f"{child.log_tail(30)}"
                )

    def complaints(self) -> dict[str, dict[str, Any]]:
        """Per child that logged any: how many WARNING/ERROR lines (and tracebacks), and the
        last ``MAX_COMPLAINTS_KEPT`` of them (children run with ``--log-level WARNING``)."""
        out: dict[str, dict[str, Any]] = {}
        for child in self.children:
            try:
                text = child.log.read_text(errors="replace")
            except OSError:
                continue
            lines = [line for line in text.splitlines() if _COMPLAINT.search(line)]
            if lines:
                out[child.name] = {"count": len(lines), "last": lines[-MAX_COMPLAINTS_KEPT:]}
        return out


def _spawn(stack: ExitStack, workdir: Path, code: Path, name: str, args: list[str]) -> Child:
    """An engine from the snapshot ``code`` (rules 1-2), stopped when ``stack`` closes."""
    port = free_port()
    argv = understudy_argv("engine", "--host", "127.0.0.1", "--port", str(port), *args)
    return spawn(stack, name, argv, workdir, code, extra_env=THREAD_ENV,
                 url=f"http://127.0.0.1:{port}")


def wait_ready(*deployments: Deployment) -> None:
    """Wait until every child of ``deployments`` answers ``/health`` (rule 3)."""
    wait_healthy([child for deployment in deployments for child in deployment.children],
                 ENGINE_READY_TIMEOUT_S)


@contextlib.contextmanager
def start_unified(
    workdir: Path, code: Path, name: str, *, prefix_caching: bool, engine_args: list[str]
) -> Iterator[Deployment]:
    """One ``--role unified`` engine, started (not yet ready: ``wait_ready``); stopped when
    the context exits."""
    deployment = Deployment(name, "")
    with ExitStack() as stack:
        args = ["--role", "unified", *engine_args]
        if not prefix_caching:
            args.append("--no-prefix-caching")
        child = _spawn(stack, workdir, code, name, args)
        deployment.children.append(child)
        deployment.url = child.url
        yield deployment


@contextlib.contextmanager
def start_disaggregated(
    workdir: Path,
    code: Path,
    name: str,
    *,
    prefill: int,
    decode: int,
    policy: str,
    engine_args: list[str],
) -> Iterator[Deployment]:
    """``prefill`` + ``decode`` nodes and a router (``--policy``) in front of them, started
    (not yet ready: ``wait_ready``); all stopped when the context exits."""
    deployment = Deployment(name, "")
    with ExitStack() as stack:
        for role, count in (("prefill", prefill), ("decode", decode)):
            for index in range(count):
                child = _spawn(
                    stack, workdir, code, f"{name}-{role}{index}", ["--role", role, *engine_args]
                )
                deployment.children.append(child)
                (deployment.prefill_urls if role == "prefill" else deployment.decode_urls).append(
                    child.url
                )
        router_args = ["--role", "router", "--policy", policy, *engine_args]
        for url in deployment.prefill_urls:
            router_args += ["--prefill", url]
        for url in deployment.decode_urls:
            router_args += ["--decode", url]
        router = _spawn(stack, workdir, code, f"{name}-router", router_args)
        deployment.children.append(router)
        deployment.url = router.url
        yield deployment


# --- one chat turn ----------------------------------------------------------------------------


class ChatError(RuntimeError):
    """The server answered with an error, or the stream was cut or malformed."""


@dataclass(frozen=True, slots=True)
class Reply:
    ttft_s: float
    e2e_s: float
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server did not say


async def chat_turn(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    *,
    max_tokens: int,
    timeout_s: float,
) -> Reply:
    """One greedy streamed chat turn (rule 4)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    usage: dict[str, Any] = {}
    first: float | None = None
    done = False
    sent = time.perf_counter()
    try:
        async for now, chunk in sse_chunks(
            session, url + "/v1/chat/completions", json.dumps(body).encode(), timeout_s=timeout_s
        ):
            if chunk is None:
                done = True
                break
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content") or ""
                if first is None and (content or choice.get("finish_reason")):
                    first = now
                text.append(content)
    except StreamError as exc:
        raise ChatError(str(exc)) from exc
    ended = time.perf_counter()
    if not done or first is None:
        raise ChatError(f"stream cut ({'no token' if first is None else 'no [DONE]'})")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Reply(
        ttft_s=first - sent,
        e2e_s=ended - sent,
        text="".join(text),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=None if cached is None else int(cached),
    )


# --- metrics ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scrape:
    """Every sample of one ``/metrics`` reading: (name, labels, value)."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    def total(self, name: str, **labels: str) -> float:
        """Sum of ``name`` over the samples whose labels include ``labels`` (rule 5)."""
        wanted = set(labels.items())
        return sum(v for n, ls, v in self.samples if n == name and wanted <= set(ls))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, ls, v in self.samples:
            value = dict(ls).get(label)
            if n == name and value is not None:
                out[value] = out.get(value, 0.0) + v
        return out


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url + "/metrics", timeout=METRICS_TIMEOUT_S) as resp:
        text = resp.read().decode()
    samples = tuple(
        (sample.name, tuple(sorted(sample.labels.items())), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )
    return Scrape(samples)
