"""Agentic multi-turn conversations on the reference engine: recompute every turn vs
bidirectional KV, and the router's policies under a load that makes sticky sessions queue.

    .venv/bin/python bench/multiturn.py [--quick] [--no-prefix-ref] [--only depth|policies]

A session is what an agent loop sends: a shared system prompt describing tools (~330 tokens),
a task, then turn after turn the model's own answer (greedy, small ``max_tokens``) and a "tool
result" user message (log lines, JSON records or a metrics table of a few hundred tokens,
``workload``), so the history grows by ~500 tokens a turn.

Part 1, depth (one run, side by side; every system keeps its own conversation state):
  (a) recompute   ``--role unified --no-prefix-caching``: every turn prefills the whole history
  (b) bidir-kv    a router (``--policy kv-aware``) + 1 prefill + 1 decode node: the decode node
                  retains each turn's prompt + answer, the router attaches it to the next
                  turn's prefill, which reads back what its cache lacks and computes the rest
  (c) prefix      ``--role unified`` with prefix caching (a reference; ``--no-prefix-ref``
                  leaves it out)
  Sessions run one after another; each turn goes to the three systems back to back, the order
  rotating with every turn so that drift on a shared machine falls on all. A session ends once
  its prompt reached ``STOP_AT_TOKENS`` (or after its last scripted turn). TTFT is bucketed by
  the history length the baseline (a) counted for that turn; the ratio (a)/(b) is given per
  bucket on the p50s, the p99s, and as the median of per-turn ratios. Transfer share: the
  seconds the prefill and decode nodes spent pulling KV (``understudy_kv_pull_seconds`` sum,
  read before and after) over the time saved, sum TTFT(a) - sum TTFT(b) on the same turns.

Part 2, policies (``kv-aware``, ``affinity``, ``round-robin``; fresh nodes for each, so no run
inherits another's caches; the same seeds, so the same texts): 2 prefill + 2 decode nodes
(``--quick``: 2 + 1) behind a router, and four sessions created in the order H, L, H, L --
heavy sessions append a large tool result every turn, light ones a few dozen tokens.
  Construction: the router's warm-up request (rule 2) is a new conversation and takes the
  first round-robin slot; then the sessions are created one at a time in that order, so every
  policy that places a new conversation round robin puts both heavy sessions on prefill node 1
  (and decode node 1) and both light ones on node 0. Then come waves: every session sends its
  next turn at once (starts ``WAVE_STAGGER_S`` apart, in session order, so arrival order is the
  same in every run), and the next wave starts when all have answered. ``affinity`` keeps each
  conversation on the nodes of its previous turn: both heavy prefills queue on node 1 every
  wave while node 0 has only the light ones. ``round-robin`` rotates per request, and with four
  requests a wave in a fixed order it lines up the same way -- the pile-up without even the
  excuse of locality. ``kv-aware`` prices each prefill node (queued prefill tokens + tokens to
  compute + read-back), so the second heavy prefill of a wave goes to the other node, which
  reads the history back from the decode node that retains it; decode nodes it prices by the
  blocks they lack plus the streams they run.
  Reported per policy: TTFT p50/p99 of the wave turns (all, heavy, light), the waves' total
  time, requests per prefill and decode node and read-back outcomes (router metrics), the
  prompt tokens each prefill node computed, per wave (its prefix-cache misses: where the heavy
  work went), and the KV pulls of every node.

Rules of the measurement:
1. Every engine child runs from a snapshot of the code with one BLAS/OpenMP thread, logs to its
   own file and is stopped by its pid (``_multiturn_cluster``); all listen on 127.0.0.1.
2. Every deployment gets one short unmeasured request first (distinct text: nothing of it is
   reused by the workload).
3. Bounded: every request times out after ``REQUEST_TIMEOUT_S``; sessions, turns and waves are
   fixed by the mode; no depth turn starts after ``DEPTH_DEADLINE_S`` and no wave after
   ``POLICY_DEADLINE_S`` of its run; a system whose turn failed leaves that session (its history
   would lack the answer), and the failure is reported.
4. The machine is shared: each part reports how busy the machine was and how much of that was
   other processes than this benchmark's.

Target: (a)/(b) p50 TTFT >= 8x for turns over a ~4k-token history (bucket 3.5k-4.5k).

Results go to stdout and to bench/results/multiturn-<time>.json (``--from-json`` reprints one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from workload import SessionScript

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multiturn_cluster import (
    ChatError,
    Deployment,
    Scrape,
    chat_turn,
    scrape,
    start_disaggregated,
    start_unified,
    wait_ready,
)
from _multiturn_report import (
    BIDIR,
    PREFIX,
    RECOMPUTE,
    TurnResult,
    counts,
    print_report,
    summarise_depth,
)
from _procs import (
    CLOCK_TICKS,
    code_revision,
    cpu_ticks,
    machine_ticks,
    run_main,
    snapshot_code,
)
from _report import RESULTS_DIR, loadavg, write_results

ENGINE_ARGS = ["--max-model-len", "8192", "--kv-gib", "1"]
POLICIES = ("kv-aware", "affinity", "round-robin")

REQUEST_TIMEOUT_S = 300.0
DEPTH_DEADLINE_S = 20 * 60.0
POLICY_DEADLINE_S = 6 * 60.0
DEPTH_MAX_TOKENS = 32
POLICY_MAX_TOKENS = 8
STOP_AT_TOKENS = 4000  # a depth session ends once a turn's prompt reached this
WAVE_STAGGER_S = 0.05
SETTLE_S = 0.2
WARM_UP = [{"role": "user", "content": "Warm-up: reply with one word."}]

HEAVY_PATTERN = (True, False, True, False)  # the creation order of part 2's sessions


@dataclass(frozen=True, slots=True)
class Plan:
    """The sizes of one mode."""

    seed: int
    depth_sessions: int
    depth_turns: int  # at most; a session also ends at STOP_AT_TOKENS
    tool_tokens: tuple[int, int]
    waves: int
    heavy_context_tokens: int
    heavy_tool_tokens: tuple[int, int]
    light_tool_tokens: tuple[int, int]
    prefill_nodes: int
    decode_nodes: int


FULL = Plan(
    seed=20250301,
    depth_sessions=3,
    depth_turns=12,
    tool_tokens=(300, 500),
    waves=4,
    heavy_context_tokens=800,
    heavy_tool_tokens=(550, 650),
    light_tool_tokens=(40, 80),
    prefill_nodes=2,
    decode_nodes=2,
)
QUICK = Plan(
    seed=20250301,
    depth_sessions=2,
    depth_turns=3,
    tool_tokens=(150, 250),
    waves=2,
    heavy_context_tokens=300,
    heavy_tool_tokens=(250, 300),
    light_tool_tokens=(30, 50),
    prefill_nodes=2,
    decode_nodes=1,
)


Log = Callable[[str], None]


class MachineShare:
    """How busy the machine was over a phase, and how much of it was this benchmark."""

    def __init__(self, deployments: list[Deployment]) -> None:
        self._pids = [c.pid for d in deployments for c in d.children]
        self._machine = machine_ticks()
        self._ours = cpu_ticks(self._pids) + time.process_time() * CLOCK_TICKS

    def read(self) -> dict[str, float]:
        busy, total = (a - b for a, b in zip(machine_ticks(), self._machine, strict=True))
        ours = cpu_ticks(self._pids) + time.process_time() * CLOCK_TICKS - self._ours
        total = max(total, 1)
        return {
            "machine_busy_pct": busy / total * 100,
            "others_busy_pct": max(0.0, busy - ours) / total * 100,
        }


async def warm_up(http: aiohttp.ClientSession, deployments: list[Deployment]) -> None:
    for deployment in deployments:
        await chat_turn(http, deployment.url, WARM_UP, max_tokens=2, timeout_s=REQUEST_TIMEOUT_S)


async def one_turn(
    http: aiohttp.ClientSession,
    system: str,
    url: str,
    script: SessionScript,
    answers: list[str],
    max_tokens: int,
) -> TurnResult:
    turn = len(answers)
    try:
        reply = await chat_turn(
            http, url, script.messages(answers), max_tokens=max_tokens, timeout_s=REQUEST_TIMEOUT_S
        )
    except (ChatError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return TurnResult(system, script.name, turn, error=f"{type(exc).__name__}: {exc}")
    return TurnResult.of(system, script.name, turn, reply)


# --- part 1: depth ------------------------------------------------------------------------------


def _node_scrapes(deployment: Deployment) -> dict[str, Scrape]:
    urls = {f"prefill{i}": u for i, u in enumerate(deployment.prefill_urls)}
    urls |= {f"decode{i}": u for i, u in enumerate(deployment.decode_urls)}
    urls["router"] = deployment.url
    return {name: scrape(url) for name, url in urls.items()}


def _computed_by_prefill_node(
    before: dict[str, Scrape], after: dict[str, Scrape]
) -> dict[str, float]:
    """Prompt tokens each prefill node computed (looked up in its cache and not found)."""
    out = {}
    for name in before:
        if name.startswith("prefill"):
            queries = after[name].total("vllm:prefix_cache_queries_total") - before[name].total(
                "vllm:prefix_cache_queries_total"
            )
            hits = after[name].total("vllm:prefix_cache_hits_total") - before[name].total(
                "vllm:prefix_cache_hits_total"
            )
            out[name.removeprefix("prefill")] = queries - hits
    return out


def _pull_figures(before: dict[str, Scrape], after: dict[str, Scrape]) -> dict[str, Any]:
    """KV pulls by node over a phase (the router has none; it has read-back outcomes)."""
    nodes: dict[str, Any] = {}
    for name in before:
        if name == "router":
            continue
        b, a = before[name], after[name]

        def delta(series: str, b: Scrape = b, a: Scrape = a) -> float:
            return a.total(series) - b.total(series)

        outcomes = {
            k: v - b.by_label("understudy_kv_pulls_total", "outcome").get(k, 0.0)
            for k, v in a.by_label("understudy_kv_pulls_total", "outcome").items()
        }
        nodes[name] = {
            "computed_tokens": delta("vllm:prefix_cache_queries_total")
            - delta("vllm:prefix_cache_hits_total"),
            "pull_s": delta("understudy_kv_pull_seconds_sum"),
            "pulls_ok": delta("understudy_kv_pull_seconds_count"),
            "blocks": delta("understudy_kv_pulled_blocks_total"),
            "bytes": delta("understudy_kv_pulled_bytes_total"),
            "outcomes": {k: v for k, v in outcomes.items() if v},
        }
    rb, ra = before["router"], after["router"]
    readback = {
        k: v - rb.by_label("understudy_router_readback_total", "outcome").get(k, 0.0)
        for k, v in ra.by_label("understudy_router_readback_total", "outcome").items()
    }
    routed = {
        kind: {
            k: v - rb.by_label("understudy_router_requests_total", kind).get(k, 0.0)
            for k, v in ra.by_label("understudy_router_requests_total", kind).items()
        }
        for kind in ("prefill", "decode")
    }
    return {
        "nodes": nodes,
        "readback": readback,
        "routed": routed,
        "pull_s": sum(n["pull_s"] for n in nodes.values()),
    }


async def run_depth(plan: Plan, systems: list[Deployment], log: Log) -> dict[str, Any]:
    scripts = [
        SessionScript.draw(
            f"s{i}", plan.seed + i, turns=plan.depth_turns, tool_tokens=plan.tool_tokens
        )
        for i in range(plan.depth_sessions)
    ]
    bidir = next(d for d in systems if d.name == BIDIR)
    results: list[TurnResult] = []
    aborted: str | None = None
    cut = False
    async with aiohttp.ClientSession() as http:
        await warm_up(http, systems)
        share = MachineShare(systems)
        before = _node_scrapes(bidir)
        started = time.monotonic()
        rotation = 0
        try:
            for script in scripts:
                answers: dict[str, list[str]] = {d.name: [] for d in systems}
                live = {d.name for d in systems}
                for turn in range(script.turns):
                    if time.monotonic() - started > DEPTH_DEADLINE_S:
                        cut = True
                        break
                    shift = rotation % len(systems)
                    rotation += 1
                    line: list[str] = []
                    prompts = [0]
                    for deployment in systems[shift:] + systems[:shift]:
                        if deployment.name not in live:
                            continue
                        deployment.check_alive()
                        await asyncio.sleep(SETTLE_S)
                        result = await one_turn(
                            http,
                            deployment.name,
                            deployment.url,
                            script,
                            answers[deployment.name],
                            DEPTH_MAX_TOKENS,
                        )
                        results.append(result)
                        if result.error is not None or result.answer is None:
                            live.discard(deployment.name)
                            line.append(f"{deployment.name} FAILED {result.error}")
                            continue
                        answers[deployment.name].append(result.answer)
                        prompts.append(result.prompt_tokens or 0)
                        line.append(
                            f"{deployment.name} {result.prompt_tokens} tok "
                            f"ttft {result.ttft_s:.2f}s"
                        )
                    log(f"  {script.name} turn {turn + 1}: " + "; ".join(line))
                    if not live or max(prompts) >= STOP_AT_TOKENS:
                        break
                if cut:
                    break
        except RuntimeError as exc:  # a child died
            aborted = str(exc)
            log(f"  ABORTED: {aborted}")
        elapsed = time.monotonic() - started
        after = _node_scrapes(bidir)
        machine = share.read()
    return {
        "turns": [asdict(r) for r in results],
        "pulls": _pull_figures(before, after),
        "elapsed_s": elapsed,
        "cut_by_deadline": cut,
        "aborted": aborted,
        "machine": machine,
        "systems": [d.name for d in systems],
    }


# --- part 2: policies ---------------------------------------------------------------------------


def policy_scripts(plan: Plan) -> list[SessionScript]:
    return [
        SessionScript.draw(
            f"{'H' if heavy else 'L'}{i}",
            plan.seed + 100 + i,
            turns=1 + plan.waves,
            tool_tokens=plan.heavy_tool_tokens if heavy else plan.light_tool_tokens,
            context_tokens=plan.heavy_context_tokens if heavy else 0,
        )
        for i, heavy in enumerate(HEAVY_PATTERN)
    ]


async def run_policy(plan: Plan, deployment: Deployment, log: Log) -> dict[str, Any]:
    scripts = policy_scripts(plan)
    answers: dict[str, list[str]] = {s.name: [] for s in scripts}
    created: list[TurnResult] = []
    waves: list[list[TurnResult]] = []
    computed: list[dict[str, float]] = []  # per wave: prefill tokens computed by each node
    aborted: str | None = None
    cut = False
    async with aiohttp.ClientSession() as http:
        await warm_up(http, [deployment])
        try:
            for script in scripts:  # one at a time, in order: the construction
                result = await one_turn(
                    http, deployment.name, deployment.url, script, [], POLICY_MAX_TOKENS
                )
                created.append(result)
                if result.answer is not None and result.error is None:
                    answers[script.name].append(result.answer)
            log("  created " + ", ".join(brief(r) for r in created))
            live = [s for s in scripts if answers[s.name]]
            share = MachineShare([deployment])
            before = _node_scrapes(deployment)
            started = time.monotonic()
            waves_s = 0.0  # the waves themselves, not the metric reads between them
            mark = before
            for wave in range(plan.waves):
                if time.monotonic() - started > POLICY_DEADLINE_S or not live:
                    cut = bool(live)
                    break
                deployment.check_alive()

                async def send(index: int, script: SessionScript) -> TurnResult:
                    await asyncio.sleep(index * WAVE_STAGGER_S)
                    return await one_turn(
                        http,
                        deployment.name,
                        deployment.url,
                        script,
                        answers[script.name],
                        POLICY_MAX_TOKENS,
                    )

                wave_started = time.monotonic()
                results = await asyncio.gather(*(send(i, s) for i, s in enumerate(live)))
                waves_s += time.monotonic() - wave_started
                waves.append(list(results))
                for script, result in zip(live, results, strict=True):
                    if result.error is None and result.answer is not None:
                        answers[script.name].append(result.answer)
                live = [s for s, r in zip(live, results, strict=True) if r.error is None]
                now = _node_scrapes(deployment)
                computed.append(_computed_by_prefill_node(mark, now))
                mark = now
                log(
                    f"  wave {wave + 1}: "
                    + ", ".join(brief(r) for r in results)
                    + f"; prefill tokens computed by node {counts(computed[-1])}"
                )
            after = mark
            machine = share.read()
        except RuntimeError as exc:
            aborted = str(exc)
            log(f"  ABORTED: {aborted}")
            return {
                "created": [asdict(r) for r in created],
                "aborted": aborted,
                "waves": [[asdict(r) for r in w] for w in waves],
            }
    return {
        "created": [asdict(r) for r in created],
        "waves": [[asdict(r) for r in w] for w in waves],
        "waves_s": waves_s,
        "pulls": _pull_figures(before, after),
        "computed_per_wave": computed,
        "machine": machine,
        "cut_by_deadline": cut,
        "aborted": aborted,
    }


def brief(r: TurnResult) -> str:
    if r.error is not None:
        return f"{r.session} FAILED {r.error}"
    return f"{r.session} {r.prompt_tokens} tok ttft {r.ttft_s:.2f}s"


# --- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 sessions x 3 short turns; policies with 2 waves, 2+1 nodes",
    )
    parser.add_argument("--only", choices=["depth", "policies"], help="run one part")
    parser.add_argument(
        "--no-prefix-ref",
        action="store_true",
        help="leave out (c), the unified engine with prefix caching",
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated, run in this order"
    )
    parser.add_argument("--seed", type=int, help="workload seed (default: the mode's)")
    parser.add_argument(
        "--from-json", type=Path, metavar="PATH", help="print the report of an earlier run and exit"
    )
    args = parser.parse_args()
    if args.from_json is not None:
        print_report(json.loads(args.from_json.read_text()))
        return 0
    policies = [p for p in args.policies.split(",") if p]
    if unknown := set(policies) - set(POLICIES):
        parser.error(f"unknown policies: {sorted(unknown)}")
    plan = QUICK if args.quick else FULL
    if args.seed is not None:
        plan = replace(plan, seed=args.seed)

    def log(line: str) -> None:
        print(line, flush=True)

    began = time.monotonic()
    revision = code_revision()
    log(
        "understudy bench/multiturn.py — agentic multi-turn: recompute vs bidirectional KV; "
        "router policies"
    )
    log(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"{'quick' if args.quick else 'full'} mode, load average {loadavg()}, code {revision} "
        "(copied at start)"
    )
    log(
        f"engines: {' '.join(ENGINE_ARGS)}, OPENBLAS/OMP threads 1; max_tokens "
        f"{DEPTH_MAX_TOKENS} (depth), {POLICY_MAX_TOKENS} (policies); greedy"
    )
    saved: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="understudy-multiturn-") as tmp:
        workdir = Path(tmp)
        code = snapshot_code(workdir)
        if args.only in (None, "depth"):
            log(
                "\npart 1: depth — starting (a) recompute, (b) bidir-kv, "
                + ("" if args.no_prefix_ref else "(c) prefix ")
                + "..."
            )
            with ExitStack() as stack:
                systems = [
                    stack.enter_context(
                        start_unified(
                            workdir, code, RECOMPUTE, prefix_caching=False, engine_args=ENGINE_ARGS
                        )
                    ),
                    stack.enter_context(
                        start_disaggregated(
                            workdir,
                            code,
                            BIDIR,
                            prefill=1,
                            decode=1,
                            policy="kv-aware",
                            engine_args=ENGINE_ARGS,
                        )
                    ),
                ]
                if not args.no_prefix_ref:
                    systems.append(
                        stack.enter_context(
                            start_unified(
                                workdir, code, PREFIX, prefix_caching=True, engine_args=ENGINE_ARGS
                            )
                        )
                    )
                wait_ready(*systems)
                log(f"  ready after {time.monotonic() - began:.0f} s")
                depth = asyncio.run(run_depth(plan, systems, log))
            depth["complaints"] = {d.name: d.complaints() for d in systems}
            saved["depth"] = depth
            saved["depth_summary"] = summarise_depth(depth)
        if args.only in (None, "policies"):
            saved["policies"] = {}
            for policy in policies:
                log(
                    f"\npart 2: policy {policy} — starting {plan.prefill_nodes} prefill + "
                    f"{plan.decode_nodes} decode nodes and a router"
                )
                step = time.monotonic()
                with start_disaggregated(
                    workdir,
                    code,
                    policy,
                    prefill=plan.prefill_nodes,
                    decode=plan.decode_nodes,
                    policy=policy,
                    engine_args=ENGINE_ARGS,
                ) as deployment:
                    wait_ready(deployment)
                    log(f"  ready after {time.monotonic() - step:.0f} s")
                    saved["policies"][policy] = asyncio.run(run_policy(plan, deployment, log))
                saved["policies"][policy]["complaints"] = {policy: deployment.complaints()}
    wall = time.monotonic() - began
    saved["meta"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "mode": "quick" if args.quick else "full",
        "code": revision,
        "plan": asdict(plan),
        "engine_args": ENGINE_ARGS,
        "wall_s": wall,
        "loadavg_end": loadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print()
    print_report(saved)
    print(f"wall time {wall:.0f} s, load average {loadavg()} (1, 5, 15 min; 2 cores = 2.0)")
    print(write_results(RESULTS_DIR / f"multiturn-{time.strftime('%Y%m%d-%H%M%S')}.json", saved))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
