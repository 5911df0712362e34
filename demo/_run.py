"""``understudy demo``: the whole story on one machine, with the real model.

Theory of operation
-------------------
1. Backends (``_deployments``): the primary is the reference engine serving SmolLM2 as a
   recompute baseline (no prefix cache), or with ``primary_vllm`` the real vLLM that
   ``scripts/setup-vllm.sh`` builds; ``replica`` is a second copy of it, the noise floor.
   Three candidates: ``bidir-kv``, the disaggregated engine (prefill + decode nodes behind
   a KV-aware router) that hands a conversation's KV back from decode to the next turn's
   prefill; ``kivi-4``, a unified engine with prefix caching whose KV cache is stored as
   4-bit KIVI; and ``kivi-2``, deliberately worse: 2-bit KIVI changes answers visibly.
2. The gateway (``_gateway``) fronts the primary and mirrors every session to all four.
3. The workload is ``understudy load``'s (``workload.run_workload``): agentic sessions
   with a system prompt and tool definitions, tool results appended turn by turn, think
   time, Poisson arrivals, through the official ``openai`` client. Progress is live.
4. When the workload ends the demo waits (at most ``SETTLE_TIMEOUT_S``) until every
   mirrored request is joined or dropped, scored and written, then asks the admin API for
   each candidate's report, builds the scorecard (``_scorecard``), promotes what the judge
   passes (rule 3 there) through the admin API and shows the new routing.
5. Every process is the demo's child on loopback and is stopped when it ends; the work
   folder keeps the logs, the config, the store, each candidate's admin report
   (``report-<name>.json``: every metric's statistics and checks) and ``scorecard.json``.
6. Once ready, each deployment runs on its own fixed CPU slice (``_cpu_slices``) where
   the machine allows it, so one deployment's speed does not depend on another's phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from demo._cpu_slices import cpu_slices
from demo._deployments import Deployment, DeploymentSpec, deployments
from demo._gateway import GatewayClient, Samples, gateway_config, new_token, scrape, total
from demo._scorecard import Scorecard, card_from_report, render, would_promote
from demo._spec import DemoSpec
from demo.processes import free_port, signals_deferred, spawn, understudy_argv, wait_healthy
from evaluators.store import create_engine, load_samples_by_turn_depth, session_factory
from workload import TurnResult, WorkloadSpec, WorkloadSummary, run_workload

__all__ = ["run_demo"]

PRIMARY: Final = "primary"
REPLICA: Final = "replica"
CANDIDATES: Final = (
    DeploymentSpec("bidir-kv", "disaggregated", (),
                   "prefill + decode, KV handed back across turns"),
    DeploymentSpec("kivi-4", "unified", ("--kv-codec", "kivi-4"),
                   "prefix cache stored as 4-bit KIVI"),
    DeploymentSpec("kivi-2", "unified", ("--kv-codec", "kivi-2"),
                   "deliberately worse: 2-bit KIVI"),
)
BASELINE_ARGS: Final = ("--no-prefix-caching",)
SERVED_MODEL: Final = "SmolLM2-135M-Instruct"
"""The engines' served name; a real vLLM primary is served under it too."""
SETTLE_TIMEOUT_S: Final = 300.0
GATEWAY_READY_TIMEOUT_S: Final = 120.0
GATEWAY_STOP_TIMEOUT_S: Final = 40.0
PROGRESS_INTERVAL_S: Final = 1.0
DROP_REASONS_SHOWN: Final = 3
MIN_WIDTH: Final = 150
"""The scorecard's columns fit this many characters; narrower terminals get it anyway."""


@contextlib.contextmanager
def _gateway(workdir: Path, primary: tuple[str, str], candidates: list[tuple[str, str, str]],
             min_samples: int) -> Iterator[GatewayClient]:
    """Rule 2: ``understudy serve`` on the written config, stopped with SIGTERM."""
    port, admin_port, token = free_port(), free_port(), new_token()
    config = workdir / "understudy.toml"
    config.write_text(gateway_config(port=port, admin_port=admin_port, token=token,
                                     store_path=workdir / "understudy.db", primary=primary,
                                     candidates=candidates, min_samples=min_samples))
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stopping:
        with signals_deferred():  # its stop in place before a stop signal unwinds
            gateway = spawn("gateway", understudy_argv("serve", "--config", str(config)),
                            workdir, url=url)
            stopping.callback(gateway.stop, GATEWAY_STOP_TIMEOUT_S)
        wait_healthy([gateway], GATEWAY_READY_TIMEOUT_S)
        yield GatewayClient(url, f"http://127.0.0.1:{admin_port}", token)


class _Progress:
    """Rule 3's live view: turns from the workload, the rest scraped from the gateway."""

    def __init__(self, spec: DemoSpec, names: list[str]) -> None:
        self.spec = spec
        self.names = names
        self.turns: Counter[str] = Counter()
        self.sessions: set[str] = set()
        self.metrics: Samples = {}
        self.started = time.monotonic()

    def on_turn(self, turn: TurnResult) -> None:
        self.sessions.add(turn.session)
        self.turns["error" if turn.error else "ok"] += 1

    def view(self) -> Group:
        m = self.metrics
        head = (f"{time.monotonic() - self.started:5.0f} s  sessions {len(self.sessions)}/"
                f"{self.spec.sessions}  turns {self.turns['ok']} ok, {self.turns['error']} "
                f"failed  budget {total(m, 'understudy_memory_budget_used_bytes') / 2**20:.1f}"
                f" / {total(m, 'understudy_memory_budget_limit_bytes') / 2**20:.0f} MiB  "
                f"scored {total(m, 'understudy_evaluation_scored_total'):.0f}")
        table = Table(box=None)
        for column in ("candidate", "mirrored", "joined", "dropped"):
            table.add_column(column, justify="right" if column != "candidate" else "left")
        for name in self.names:
            drops = {ls: v for (n, ls), v in m.items()
                     if n == "understudy_mirror_dropped_total" and ("candidate", name) in ls
                     and ("reason", "not_sampled") not in ls and v}
            shown = ", ".join(f"{dict(ls)['reason']} {v:.0f}" for ls, v in
                              sorted(drops.items(), key=lambda x: -x[1])[:DROP_REASONS_SHOWN])
            table.add_row(name, f"{total(m, 'understudy_mirror_queued_total', candidate=name):.0f}",
                          f"{total(m, 'understudy_mirror_joined_total', candidate=name):.0f}",
                          shown or "0")
        return Group(head, table)


def _settled(metrics: Samples, names: list[str]) -> bool:
    """Rule 4: every mirrored request joined or dropped, nothing left to score or write."""
    for name in names:
        queued = total(metrics, "understudy_mirror_queued_total", candidate=name)
        joined = total(metrics, "understudy_mirror_joined_total", candidate=name)
        dropped = (total(metrics, "understudy_mirror_dropped_total", candidate=name)
                   - total(metrics, "understudy_mirror_dropped_total", candidate=name,
                           reason="not_sampled"))
        if joined + dropped < queued:
            return False
    return (total(metrics, "understudy_evaluation_pending") == 0
            and total(metrics, "understudy_store_queued_rows") == 0)


async def _by_depth(store: Path, name: str, metric: str
                    ) -> dict[int | None, tuple[list[float], list[float]]]:
    engine = create_engine("sqlite+aiosqlite:///" + str(store))
    try:
        async with session_factory(engine)() as session:
            found = await load_samples_by_turn_depth(session, name, metric)
    finally:
        await engine.dispose()
    return {depth: (s.candidate, s.primary) for depth, s in found.items()}


def _kv_bytes_per_token(deployment: Deployment) -> float | None:
    values = []
    for url in deployment.metrics_urls:
        with contextlib.suppress(OSError, ValueError):
            value = total(scrape(url), "understudy_kv_bytes_per_token")
            if value:
                values.append(value)
    return max(values) if values else None


async def _drive(spec: DemoSpec, client: GatewayClient, names: list[str],
                 console: Console) -> WorkloadSummary:
    """Rule 3, with the live view refreshed while the workload runs."""
    progress = _Progress(spec, names)
    workload = WorkloadSpec(
        sessions=spec.sessions, turns=spec.turns, rate=spec.rate, think_s=spec.think_s,
        duration_s=spec.minutes * 60, concurrency=spec.concurrency,
        max_tokens=spec.max_tokens, tool_tokens=(40, 90), session_prefix="demo",
        request_timeout_s=600, drain_s=120)
    task = asyncio.create_task(run_workload(workload, client.url, api_key="demo",
                                            on_turn=progress.on_turn))
    with Live(progress.view(), console=console, refresh_per_second=2) as live:
        while not task.done():
            with contextlib.suppress(OSError, ValueError):
                progress.metrics = await asyncio.to_thread(client.metrics)
            live.update(progress.view())
            await asyncio.wait({task}, timeout=PROGRESS_INTERVAL_S)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:  # rule 4
            with contextlib.suppress(OSError, ValueError):
                progress.metrics = await asyncio.to_thread(client.metrics)
            live.update(progress.view())
            if _settled(progress.metrics, names):
                break
            await asyncio.sleep(PROGRESS_INTERVAL_S)
    return task.result()


def _work_folder(workdir: Path | None) -> Path:
    """Rule 5's folder, made and found writable before anything starts (a RuntimeError, the
    command's one-line error, where it cannot be)."""
    try:
        if workdir is None:
            return Path(tempfile.mkdtemp(prefix="understudy-demo-"))
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as exc:
        raise RuntimeError(f"cannot use the work folder {workdir}: "
                           f"{exc.strerror or exc}") from exc
    return workdir


def run_demo(spec: DemoSpec, console: Console | None = None) -> Scorecard:
    """The whole demo (module rules 1-5); the scorecard it printed."""
    console = console or Console(width=max(Console().width, MIN_WIDTH))
    started = time.monotonic()
    for noisy in ("httpx", "httpx2"):  # the openai client's HTTP library logs every request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    workdir = _work_folder(spec.workdir)
    console.print(f"[bold]understudy demo[/]: logs, config and store in {workdir}")
    baseline = DeploymentSpec(PRIMARY, "unified", BASELINE_ARGS, "recompute baseline")
    replica = DeploymentSpec(REPLICA, "unified", BASELINE_ARGS, "noise floor")
    specs = [baseline, replica, *CANDIDATES]
    with contextlib.ExitStack() as stack:
        if spec.primary_vllm:
            specs = specs[2:]
            primary_url, replica_url = stack.enter_context(_vllm_pair(workdir))
        console.print(f"starting {len(specs)} reference-engine deployments (the real "
                      "SmolLM2-135M, numpy) ...")
        started_deployments = stack.enter_context(deployments(workdir, specs))
        by_name = {d.name: d for d in started_deployments}
        slices = stack.enter_context(cpu_slices(
            {d.name: [e.pid for e in d.engines] for d in started_deployments}))
        console.print(f"CPU: {escape(slices.how)}")
        if not spec.primary_vllm:
            primary_url, replica_url = by_name[PRIMARY].url, by_name[REPLICA].url
        candidates = [(REPLICA, replica_url, "secondary"),
                      *((c.name, by_name[c.name].url, "candidate") for c in CANDIDATES)]
        client = stack.enter_context(_gateway(workdir, (PRIMARY, primary_url), candidates,
                                              spec.min_samples))
        names = [name for name, _, _ in candidates]
        console.print(f"gateway {client.url} (admin {client.admin_url}); driving "
                      f"{spec.sessions} agentic sessions of up to {spec.turns} turns ...")
        summary = asyncio.run(_drive(spec, client, names, console))
        console.print()  # the live view's last frame ends without a newline off a terminal
        card = Scorecard(sessions=summary.sessions, turns=summary.turns, cpu=slices.how)
        turns_per_session = summary.turns / max(summary.sessions, 1)
        descriptions = {REPLICA: "noise floor", **{c.name: c.description for c in CANDIDATES}}
        for name in names:
            report = client.admin("GET", f"/candidates/{name}/report")
            (workdir / f"report-{name}.json").write_bytes(orjson.dumps(
                report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
            card.cards.append(card_from_report(
                name, descriptions[name], report,
                ttft_by_depth=asyncio.run(_by_depth(workdir / "understudy.db", name,
                                                    "latency.ttft_s")),
                itl_by_depth=asyncio.run(_by_depth(workdir / "understudy.db", name,
                                                   "latency.itl_mean_s")),
                turns_per_session=turns_per_session,
                kv_bytes_per_token=(_kv_bytes_per_token(by_name[name])
                                    if name in by_name else None),
                judged=name != REPLICA))
        card.wall_s = time.monotonic() - started
        render(console, card, REPLICA)
        card.promoted = would_promote(card.cards, REPLICA)
        if card.promoted is None:
            console.print("[bold]would promote[/]: nothing: no candidate passes")
        else:
            console.print(f"[bold]would promote[/]: {card.promoted}")
            if spec.promote:
                card.promotion = client.admin("POST", f"/candidates/{card.promoted}/promote",
                                              {"reason": "understudy demo"})
                card.routing = client.admin("GET", "/routing")
                console.print("promotion:", orjson.dumps(card.promotion).decode())
                console.print("routing now:", orjson.dumps(card.routing).decode())
        card.wall_s = time.monotonic() - started
        (workdir / "scorecard.json").write_bytes(
            orjson.dumps(card.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        console.print(f"demo: {card.wall_s:.0f} s; scorecard.json in {workdir}")
        return card


@contextlib.contextmanager
def _vllm_pair(workdir: Path) -> Iterator[tuple[str, str]]:
    """Rule 1 with ``primary_vllm``: two real vLLM servers, the primary and its replica."""
    from backends.vllm import VLLMProfile, VLLMServer, model_dir

    servers = [VLLMServer(VLLMProfile(model_dir=model_dir(), port=free_port(),
                                      served_model_name=SERVED_MODEL,
                                      enable_prefix_caching=False),
                          workdir / f"vllm-{name}", workdir / f"vllm-{name}.log")
               for name in (PRIMARY, REPLICA)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy()
        yield servers[0].profile.url, servers[1].profile.url
    finally:
        for server in servers:
            server.stop()
