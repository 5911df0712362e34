"""Mirroring's cost to production, side by side in one run: understudy and nginx
``mirror``, each with no candidate, with one healthy candidate at 100% sampling, and with
one candidate that never answers at 100% sampling; then the gateway's memory under a
10x overload of a stalled candidate.

    .venv/bin/python bench/mirror.py [--quick] [--rounds N] [--no-nginx] [--no-memory]
                                     [--only TARGET ...] [--rev GIT_REV]

Processes (each its own, stopped by pid at the end): a simulator as the primary
(streamed chats, 32 chunks: TTFT 20 ms, then 15 ms apart), a second one as the healthy
candidate (same shape), a third with ``--fault hang_before_first_byte`` as the stalled
candidate; four gateways (no candidate / healthy / healthy with evaluation off /
stalled; generated TOML, default settings except: sampling 1.0 per request,
``max_concurrency`` 96 so that 64 client streams can all be mirrored, a 60 s first-byte
timeout so the stalled replays really stall, a SQLite store each) and three nginx
(1 worker, upstream keepalive, ``proxy_buffering off``; ``mirror /mirror;
mirror_request_body on`` with an internal location that proxies to the candidate with
5 s timeouts).

Rules of the measurement:
1. The client is bench/_mirror_loadgen.py (its own process): 64 streams in a closed
   loop, every request with its own body (a repeated body would be deduplicated by the
   gateway and not mirror 100%). TTFT = request sent to first content event.
2. Rounds alternate the seven targets, rotating their order and reversing it every
   other round, so that each case runs next to its peer with no candidate; figures are
   medians over rounds. Ratios (case / no candidate) are taken within a round first, then
   their median is reported (the p99 targets too). The tables' latency percentiles are
   taken over every request of every round. Each round also runs gw-none and gw-stalled
   side by side (at the same time, 32 streams each): the machine is shared with other
   work, and what it does then falls on both alike; the p99 target is judged both ways.
   A p99 of one phase's ~500 requests is its 5th worst: on a shared 2-core machine it
   moves by more than 5% from phase to phase; the report shows that spread next to the
   targets ("noise").
3. CPU per primary chunk = utime + stime of the relay (from /proc; nginx = master +
   worker; the gateway = its process and any below it) over the measured phase / SSE
   events the client received. The gateway's figure includes everything it does: relay,
   replays, joins, and (unless evaluation is off) scoring the exchanges. After each gateway
   phase the benchmark waits (<= 60 s) until the gateway is idle (no replay finishing,
   nothing left to score, per its /metrics), so that the next phase has the machine to
   itself; "+after" adds the CPU spent meanwhile. The CPU target uses "+after".
4. The candidate simulators' /metrics tell how each mirrored request ended: a stream
   that the mirroring side cut before its end counts as ``abort``. (nginx's ``mirror``
   subrequest is header-only: it closes the candidate's stream once the headers arrive.)
5. Memory: a gateway with ``memory_budget_bytes`` = 32 MiB and per-candidate buffer
   bounds far above it (so the budget is the binding bound) mirrors to the stalled
   candidate. It first serves 3072 identical 64 KiB requests (a candidate queues one
   payload for them all, by dedup): the heap grows by ~20 MiB over the first thousands
   of large requests whether or not anything is mirrored, and levels off; the baseline
   is read after that. Then the client sends 10x the budget in unique 64 KiB prompts.
   Growth = peak RSS during that phase (sampled VmRSS, and the kernel's VmHWM) - VmRSS
   right before it. Shown too: growth from the just-started gateway, and (full mode) a
   control gateway with no candidate under the same load. /metrics shows the budget was
   the binding bound (``reason="budget"`` drops, no ``buffer_full``).
6. --quick: one round of shorter phases, no "evaluation off" gateway, at most 8 s to
   finish a phase's work (then "+after" is a lower bound), a 16 MiB budget after 1024
   warm-up requests and no control in the memory phase.

Targets: understudy's primary p99 (TTFT and end to end) with the stalled candidate /
with none <= 1.05, with no errors; the gateway's CPU per primary chunk with one healthy
candidate (defaults: evaluation on) <= 2x with none; RSS growth under the overload <=
budget x 1.1.

Results go to stdout and to bench/results/mirror.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loadgen import percentile
from _mirror_loadgen import read_status_kib
from _procs import (
    CLOCK_TICKS,
    Child,
    code_revision,
    cpu_ticks,
    export_code,
    find_nginx,
    free_port,
    git_commit,
    nginx_version,
    process_tree,
    run_loadgens,
    run_main,
    snapshot_code,
    spawn,
    start_nginx,
    understudy_argv,
    wait_ready,
)
from _report import RESULTS_DIR, div, load_figures, median, num, render_table, write_results

RESULTS_PATH = RESULTS_DIR / "mirror.json"
LOADGEN = Path(__file__).resolve().parent / "_mirror_loadgen.py"
SIM_MODEL = "sim-model"
KiB = 1024
MiB = 1024 * KiB

TARGET_P99_RATIO = 1.05
TARGET_CPU_RATIO = 2.0
TARGET_RSS_SLACK = 1.10

# The primary and the healthy candidate answer alike.
TTFT_MS, ITL_MS, TOKENS = 20.0, 15.0, 32
STREAMS = 64
CANDIDATE_CONCURRENCY = 96
STALL_FIRST_BYTE_TIMEOUT_S = 60.0
NGINX_MIRROR_TIMEOUT_S = 5
SIM_MAX_MODEL_LEN = 1_000_000  # room for the 64 KiB prompts of the memory phase
SETTLE_S = 0.3
DRAIN_POLL_S = 0.4
DRAIN_IDLE_CPU = 0.05  # of one core
READY_TIMEOUT_S = 90.0

RSS_BUDGET = 32 * MiB
RSS_BUDGET_QUICK = 16 * MiB
RSS_PROMPT_BYTES = 64 * KiB
RSS_OVERLOAD = 10
RSS_STREAMS = 32
RSS_TOKENS = 4
RSS_BUFFER_ITEMS = 1_000_000
RSS_BUFFER_BYTES = 4096 * MiB

# Rounds rotate this order: stalled runs next to its peer with no candidate; the healthy
# gateways (whose scoring outlasts their phase) come last in the first round.
TARGETS = ("gw-none", "gw-stalled", "nginx-none", "nginx-stalled", "nginx-healthy",
           "gw-healthy", "gw-healthy-noeval")
GATEWAYS = tuple(t for t in TARGETS if t.startswith("gw-"))


@dataclass(frozen=True)
class Plan:
    rounds: int
    requests_per_worker: int
    duration_s: float
    drain_timeout_s: float  # the longest wait for a gateway to finish a phase's work
    memory_warm_requests: int
    memory_budget: int

    @property
    def stream_s(self) -> float:
        return (TTFT_MS + ITL_MS * (TOKENS - 1)) / 1000

    @property
    def deadline_s(self) -> float:
        # nginx with a stalled mirror holds each connection NGINX_MIRROR_TIMEOUT_S more.
        return self.duration_s + 2 * NGINX_MIRROR_TIMEOUT_S + 10


# --- processes -------------------------------------------------------------------------

def spawn_sim(stack: ExitStack, workdir: Path, code: Path, name: str, *extra: str) -> Child:
    """bench/_procs.start_sim with the options it does not take (fault, context); not
    waited for (see ``ready``), so that the Python children start side by side. Stopped
    when ``stack`` closes, as every child here."""
    port = free_port()
    argv = understudy_argv("sim", "--port", str(port), "--ttft-ms", str(TTFT_MS), "--itl-ms",
                           str(ITL_MS), "--tokens", str(TOKENS), "--max-model-len",
                           str(SIM_MAX_MODEL_LEN), *extra)
    return spawn(stack, name, argv, workdir, code, url=f"http://127.0.0.1:{port}")


def spawn_gateway(stack: ExitStack, workdir: Path, code: Path, name: str, primary_url: str,
                  candidates: list[dict[str, Any]], budget_bytes: int | None = None,
                  evaluation: bool = True) -> Child:
    """A gateway from a generated TOML config: default settings except those named here;
    each with its own SQLite store in ``workdir``."""
    port = free_port()
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {port}", "",
             "[primary]", f'url = "{primary_url}"', "",
             "[evaluation]", f"enabled = {json.dumps(evaluation)}", "",
             "[evaluation.store]", f'url = "sqlite+aiosqlite:///{workdir / name}.db"', ""]
    if budget_bytes is not None:
        lines += ["[mirror]", f"memory_budget_bytes = {budget_bytes}", ""]
    for candidate in candidates:
        lines.append("[[candidates]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in candidate.items()]
        lines.append("")
    config = workdir / f"{name}.toml"
    config.write_text("\n".join(lines))
    argv = understudy_argv("serve", "--config", str(config))
    return spawn(stack, name, argv, workdir, code, url=f"http://127.0.0.1:{port}")


def ready(*children: Child) -> None:
    """Wait until each child answers /health (imports take seconds on a busy machine)."""
    for child in children:
        wait_ready(child, READY_TIMEOUT_S)


def candidate_entry(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "sample_rate": 1.0, "sampling_unit": "request",
            "max_concurrency": CANDIDATE_CONCURRENCY,
            "first_byte_timeout_s": STALL_FIRST_BYTE_TIMEOUT_S, **extra}


def scrape(child: Child) -> dict[str, float]:
    """The gateway's /metrics as ``{'name{labels}': value}`` (understudy_* only)."""
    with urllib.request.urlopen(child.url + "/metrics", timeout=5.0) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("understudy_") and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            found[key] = float(value)
    return found


def mirror_counts(metrics: dict[str, float]) -> dict[str, float]:
    """The mirroring counters, summed over candidates, by what happened."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = key.partition("{")[0]
        if name == "understudy_mirror_dropped_total":
            reason = key.split('reason="')[1].split('"')[0]
            out[f"dropped:{reason}"] = out.get(f"dropped:{reason}", 0) + value
        elif name in ("understudy_mirror_queued_total", "understudy_mirror_completed_total",
                      "understudy_mirror_joined_total", "understudy_mirror_buffer_items",
                      "understudy_mirror_buffer_bytes", "understudy_memory_budget_used_bytes",
                      "understudy_memory_budget_limit_bytes"):
            short = name.removeprefix("understudy_").removesuffix("_total")
            out[short] = out.get(short, 0) + value
        elif name in ("understudy_evaluation_scored_total", "understudy_evaluation_pending"):
            out[name.removeprefix("understudy_").removesuffix("_total")] = value
        elif name == "understudy_evaluation_dropped_total":
            reason = key.split('reason="')[1].split('"')[0]
            out[f"evaluation_dropped:{reason}"] = value
        elif name == "understudy_mirror_failed_total":
            kind = key.split('kind="')[1].split('"')[0] if 'kind="' in key else "?"
            out[f"failed:{kind}"] = out.get(f"failed:{kind}", 0) + value
    return out


# --- running ---------------------------------------------------------------------------

def run_loadgen(spec: dict[str, Any]) -> dict[str, Any]:
    return run_loadgens(LOADGEN, [spec])[0]


def derive(result: dict[str, Any]) -> dict[str, Any]:
    elapsed = result["elapsed_s"]
    relay_ticks = result["cpu_ticks"].get("relay")
    relay_s = relay_ticks / CLOCK_TICKS if relay_ticks is not None else None
    events = result["events"]
    return {
        **load_figures(result),
        "ttft_samples_ms": result["ttft_samples_ms"], "e2e_samples_ms": result["e2e_samples_ms"],
        "cpu_us_per_chunk": relay_s / events * 1e6 if relay_s is not None and events else None,
        "relay_cpu_pct": relay_s / elapsed * 100 if relay_s is not None and elapsed else None,
        "sims_cpu_pct": result["cpu_ticks"].get("sims", 0) / CLOCK_TICKS / elapsed * 100
        if elapsed else None,
        "loadgen_cpu_pct": result["loadgen_cpu_s"] / elapsed * 100 if elapsed else None,
        "machine_busy_pct": (result["machine_busy_s"] / result["machine_capacity_s"] * 100
                             if result["machine_capacity_s"] else None),
    }


def stream_spec(plan: Plan, url: str, relay: Child, sims: list[Child]) -> dict[str, Any]:
    return {"url": url, "model": SIM_MODEL, "concurrency": STREAMS,
            "requests_per_worker": plan.requests_per_worker, "duration_s": plan.duration_s,
            "deadline_s": plan.deadline_s, "request_timeout_s": plan.deadline_s,
            "max_tokens": TOKENS, "stagger_s": plan.stream_s,
            "cpu_pids": {"relay": relay.cpu_pids(),
                         "sims": [pid for sim in sims for pid in sim.cpu_pids()]}}


def round_order(order: list[str], index: int) -> list[str]:
    """Round ``index``'s order: rotated by two places a round (so that neighbours stay
    neighbours for the first rounds) and reversed every other round (so that neither of
    two neighbours always runs first)."""
    shift = 2 * index % len(order)
    rotated = order[shift:] + order[:shift]
    return rotated[::-1] if index % 2 else rotated


def run_rounds(plan: Plan, relays: dict[str, Child], sims: list[Child],
               log: Callable[[str], None]
               ) -> tuple[list[dict[str, dict[str, Any]]], list[dict[str, dict[str, Any]]]]:
    """The rounds (target -> figures) and, per round, the side-by-side phase."""
    order = [t for t in TARGETS if t in relays]
    rounds: list[dict[str, dict[str, Any]]] = []
    pairs: list[dict[str, dict[str, Any]]] = []
    for index in range(plan.rounds):
        if "gw-none" in relays and "gw-stalled" in relays:
            time.sleep(SETTLE_S)
            pair = run_side_by_side(plan, relays["gw-none"], relays["gw-stalled"], sims)
            pairs.append(pair)
            for name, figures in pair.items():
                log(f"  round {index + 1}/{plan.rounds} {name + ' ||':17s} {brief(figures)}")
        this_round: dict[str, dict[str, Any]] = {}
        for target in round_order(order, index):
            for child in (*sims, *relays.values()):
                if not child.alive():
                    raise RuntimeError(f"{child.name} died:\n{child.log_tail()}")
            time.sleep(SETTLE_S)
            relay = relays[target]
            if target.startswith("gw-"):
                relay.extra_pids = process_tree(relay.pid)[1:]  # e.g. a scoring process
            candidate = candidate_sim(target, sims)
            before = sim_outcomes(candidate) if candidate else {}
            figures = derive(run_loadgen(stream_spec(plan, relay.url, relay, sims)))
            if target.startswith("gw-"):
                figures.update(drain(relay, figures, plan.drain_timeout_s))
            if candidate:
                after = sim_outcomes(candidate)
                figures["candidate_finished"] = {k: after[k] - before.get(k, 0) for k in after}
            this_round[target] = figures
            log(f"  round {index + 1}/{plan.rounds} {target:17s} {brief(figures)}")
        rounds.append(this_round)
    return rounds, pairs


def run_side_by_side(plan: Plan, none: Child, stalled: Child,
                     sims: list[Child]) -> dict[str, dict[str, Any]]:
    """gw-none and gw-stalled measured at the same time, half the streams each: whatever
    else the shared machine does falls on both alike, so their p99s compare closely."""
    gateways = {"gw-none": none, "gw-stalled": stalled}
    specs = [{**stream_spec(plan, g.url, g, sims), "concurrency": STREAMS // 2}
             for g in gateways.values()]
    results = run_loadgens(LOADGEN, specs)
    out = {}
    for (name, gateway), result in zip(gateways.items(), results, strict=True):
        figures = derive(result)
        figures.update(drain(gateway, figures, plan.drain_timeout_s))
        out[name] = figures
    return out


def candidate_sim(target: str, sims: list[Child]) -> Child | None:
    """The simulator a target mirrors to (sims: primary, healthy, stalled)."""
    return sims[1] if "healthy" in target else sims[2] if "stalled" in target else None


def sim_outcomes(sim: Child) -> dict[str, float]:
    """The simulator's requests by how they ended (vLLM's ``finished_reason``): a stream
    the client cut before its end counts as ``abort``."""
    with urllib.request.urlopen(sim.url + "/metrics", timeout=5.0) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            found[reason] = found.get(reason, 0) + float(line.rpartition(" ")[2])
    return found


def drain(gateway: Child, figures: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Wait until the gateway has finished what the phase left it (replays in flight,
    exchanges waiting to be scored), so that the next phase does not share the machine
    with it; the CPU it spends meanwhile is the phase's too (``cpu_us_per_chunk_all``).

    Idle = every exchange handed to evaluation is scored or dropped, no counter moved
    and the process used under DRAIN_IDLE_CPU of a core, over two polls in a row (a batch
    being scored is no longer pending but not yet scored: counters alone can stand still).
    """
    ticks = cpu_ticks(gateway.cpu_pids())
    started = time.monotonic()
    last: tuple[float, ...] | None = None
    quiet_polls = 0
    backlog: float | None = None
    while time.monotonic() - started < timeout_s and quiet_polls < 2:
        poll_ticks = cpu_ticks(gateway.cpu_pids())
        counts = mirror_counts(scrape(gateway))
        if backlog is None:
            backlog = counts.get("evaluation_pending")
        state = tuple(v for k, v in sorted(counts.items())
                      if k.startswith(("mirror_completed", "failed:", "evaluation_")))
        evaluated = counts.get("evaluation_scored", 0) + sum(
            v for k, v in counts.items() if k.startswith("evaluation_dropped:"))
        scoring_done = ("evaluation_scored" not in counts
                        or evaluated >= counts.get("mirror_joined", 0))
        time.sleep(DRAIN_POLL_S)
        busy = (cpu_ticks(gateway.cpu_pids()) - poll_ticks) / CLOCK_TICKS / DRAIN_POLL_S
        quiet = state == last and scoring_done and busy < DRAIN_IDLE_CPU
        quiet_polls = quiet_polls + 1 if quiet else 0
        last = state
    drain_cpu_s = (cpu_ticks(gateway.cpu_pids()) - ticks) / CLOCK_TICKS
    phase_cpu_s = (figures["cpu_us_per_chunk"] or 0) * figures["events"] / 1e6
    return {"drain_s": time.monotonic() - started, "drain_cpu_s": drain_cpu_s,
            "drain_settled": quiet_polls >= 2, "scoring_backlog": backlog,
            "cpu_us_per_chunk_all": (phase_cpu_s + drain_cpu_s) / figures["events"] * 1e6
            if figures["events"] else None}


def brief(f: dict[str, Any]) -> str:
    errors = f" ERRORS {f['errors']} cut {f['cut']} {f['error_samples'][:1]}" \
        if f["errors"] or f["cut"] else ""
    return (f"{f['rps']:6.1f} req/s  ttft p50 {num(f['ttft_p50_ms'], 1)} "
            f"p99 {num(f['ttft_p99_ms'], 1)}  e2e p50 {num(f['e2e_p50_ms'], 0)} "
            f"p99 {num(f['e2e_p99_ms'], 0)} ms  cpu {num(f['cpu_us_per_chunk'], 1)} µs/chunk"
            f"  relay {num(f['relay_cpu_pct'], 0)}% sims {num(f['sims_cpu_pct'], 0)}% "
            f"client {num(f['loadgen_cpu_pct'], 0)}% machine {num(f['machine_busy_pct'], 0)}%"
            + (f"  then {f['drain_s']:.1f} s to finish"
               + (f" ({f['scoring_backlog']:.0f} exchanges left to score)"
                  if f["scoring_backlog"] else "")
               + f": {num(f['cpu_us_per_chunk_all'], 1)} µs/chunk in all"
               + ("" if f["drain_settled"] else " (NOT settled)")
               if "drain_s" in f else "") + errors)


def spawn_memory_gateways(stack: ExitStack, workdir: Path, code: Path, primary: Child,
                          stalled: Child, plan: Plan, quick: bool) -> dict[str, Child]:
    """The overload phase's gateways: the budget, buffers far above it."""
    candidate = candidate_entry("stalled", stalled.url, buffer_items=RSS_BUFFER_ITEMS,
                                buffer_bytes=RSS_BUFFER_BYTES)
    variants = {"stalled": [candidate]} if quick else {"control": [], "stalled": [candidate]}
    return {label: spawn_gateway(stack, workdir, code, f"gw-memory-{label}", primary.url,
                                 candidates, budget_bytes=plan.memory_budget)
            for label, candidates in variants.items()}


def run_memory(gateways: dict[str, Child], plan: Plan,
               log: Callable[[str], None]) -> dict[str, Any]:
    """The overload phase: a stalled candidate, 10x the budget offered, RSS sampled."""
    budget = plan.memory_budget
    requests = math.ceil(RSS_OVERLOAD * budget / RSS_PROMPT_BYTES)
    out: dict[str, Any] = {"budget_bytes": budget, "prompt_bytes": RSS_PROMPT_BYTES,
                           "overload": RSS_OVERLOAD, "streams": RSS_STREAMS,
                           "requests": requests}
    warm_requests = plan.memory_warm_requests
    out["warm_requests"] = warm_requests
    for label, gateway in gateways.items():
        gateway.extra_pids = process_tree(gateway.pid)[1:]
        started = read_status_kib(gateway.pid)
        spec = {"url": gateway.url, "model": SIM_MODEL, "concurrency": RSS_STREAMS,
                "requests_per_worker": math.ceil(warm_requests / RSS_STREAMS),
                "duration_s": 30.0, "deadline_s": 60.0, "request_timeout_s": 60.0,
                "max_tokens": RSS_TOKENS, "prompt_bytes": RSS_PROMPT_BYTES, "unique": False}
        warm = run_loadgen(spec)
        spec.update({"requests_per_worker": math.ceil(requests / RSS_STREAMS),
                     "duration_s": 60.0, "deadline_s": 90.0, "unique": True,
                     "cpu_pids": {"relay": gateway.cpu_pids()}, "rss_pid": gateway.pid,
                     "rss_interval_s": 0.02})
        result = run_loadgen(spec)
        time.sleep(0.5)
        metrics = mirror_counts(scrape(gateway))
        ended = read_status_kib(gateway.pid)
        rss = result["rss"]
        # VmHWM moved: its new value is this phase's peak; else the samples are.
        peak = (rss["hwm_after_kib"] if rss["hwm_after_kib"] != rss["hwm_before_kib"]
                else rss["peak_sampled_kib"])
        entry = {
            "ok": result["ok"], "errors": result["errors"],
            "cut": result["cut_by_deadline"], "error_samples": result["error_samples"],
            "elapsed_s": result["elapsed_s"], "sent_bytes": result["sent_bytes"],
            "rss_started_kib": started.get("VmRSS"), "rss_before_kib": rss["before_kib"],
            "rss_peak_kib": peak, "rss_peak_sampled_kib": rss["peak_sampled_kib"],
            "rss_samples": rss["samples"], "hwm_before_kib": rss["hwm_before_kib"],
            "hwm_after_kib": rss["hwm_after_kib"], "rss_after_kib": rss["after_kib"],
            "rss_end_kib": ended.get("VmRSS"), "warm_ok": warm["ok"],
            "warm_errors": warm["errors"] + warm["cut_by_deadline"],
            "growth_bytes": (peak - rss["before_kib"]) * KiB,
            "growth_from_start_bytes": (peak - started["VmRSS"]) * KiB,
            "metrics": metrics,
        }
        out[label] = entry
        log(f"  memory {label:8s} {entry['ok']} ok {entry['errors']} errors in "
            f"{entry['elapsed_s']:.1f} s, sent {entry['sent_bytes'] / MiB:.0f} MiB; RSS "
            f"start {started['VmRSS'] / KiB:.1f} before {rss['before_kib'] / KiB:.1f} peak "
            f"{peak / KiB:.1f} MiB: growth {entry['growth_bytes'] / MiB:.1f} MiB")
    return out


# --- summarising -----------------------------------------------------------------------

_FIGURES = ("rps", "chunks_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
            "cpu_us_per_chunk", "cpu_us_per_chunk_all", "drain_s", "relay_cpu_pct",
            "sims_cpu_pct", "loadgen_cpu_pct", "machine_busy_pct")


def ratio(rounds: list[dict[str, dict[str, Any]]], target: str, base: str,
          key: str) -> float | None:
    """Median over rounds of target/base for ``key``, each taken within its round."""
    if not rounds or target not in rounds[0] or base not in rounds[0]:
        return None
    return median([r[target][key] / r[base][key] if r[target].get(key) and r[base].get(key)
                    else None for r in rounds])


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    order = [t for t in TARGETS if rounds and t in rounds[0]]
    medians: dict[str, dict[str, Any]] = {
        t: {k: median([r[t].get(k) for r in rounds]) for k in _FIGURES} for t in order}
    for t in order:
        medians[t]["errors"] = sum(r[t]["errors"] + r[t]["cut"] for r in rounds)
        medians[t]["requests"] = sum(r[t]["ok"] for r in rounds)
        finished: dict[str, float] = {}
        for r in rounds:
            for reason, count in r[t].get("candidate_finished", {}).items():
                finished[reason] = finished.get(reason, 0) + count
        medians[t]["candidate_finished"] = finished
    ratios: dict[str, dict[str, float | None]] = {}
    for target in order:
        base = "gw-none" if target.startswith("gw-") else "nginx-none"
        if target != base:
            ratios[target] = {key: ratio(rounds, target, base, key) for key in
                              ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
                               "rps", "cpu_us_per_chunk", "cpu_us_per_chunk_all")}
    pooled = {t: pooled_percentiles([r[t] for r in rounds]) for t in order}
    pooled_ratios = {
        t: {k: div(pooled[t][k], pooled[base][k]) for k in pooled[t]}
        for t in order if (base := "gw-none" if t.startswith("gw-") else "nginx-none") != t
        and base in pooled}
    return {"order": order, "medians": medians, "vs_none": ratios, "pooled": pooled,
            "pooled_vs_none": pooled_ratios,
            "per_round_ttft_p99": {t: [r[t]["ttft_p99_ms"] for r in rounds] for t in order}}


def pooled_percentiles(phases: list[dict[str, Any]]) -> dict[str, float | None]:
    """p50 and p99 of TTFT and end to end over every request of ``phases`` together."""
    ttft = [v for f in phases for v in f["ttft_samples_ms"]]
    e2e = [v for f in phases for v in f["e2e_samples_ms"]]
    return {"ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
            "e2e_p50_ms": percentile(e2e, 0.5), "e2e_p99_ms": percentile(e2e, 0.99)}


def summarise_pairs(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any] | None:
    if not pairs:
        return None
    medians: dict[str, dict[str, Any]] = {}
    for name in ("gw-none", "gw-stalled"):
        medians[name] = {k: median([p[name].get(k) for p in pairs]) for k in _FIGURES}
        medians[name]["errors"] = sum(p[name]["errors"] + p[name]["cut"] for p in pairs)
        medians[name]["requests"] = sum(p[name]["ok"] for p in pairs)
    ratios = {key: median([p["gw-stalled"][key] / p["gw-none"][key]
                            if p["gw-stalled"].get(key) and p["gw-none"].get(key) else None
                            for p in pairs])
              for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "rps",
                          "cpu_us_per_chunk_all")}
    pooled = {name: pooled_percentiles([p[name] for p in pairs])
              for name in ("gw-none", "gw-stalled")}
    pooled_ratios = {k: div(pooled["gw-stalled"][k], pooled["gw-none"][k])
                     for k in pooled["gw-none"]}
    return {"medians": medians, "vs_none": ratios, "pooled": pooled,
            "pooled_vs_none": pooled_ratios,
            "per_round_ttft_p99": [[p["gw-none"]["ttft_p99_ms"], p["gw-stalled"]["ttft_p99_ms"]]
                                   for p in pairs]}


def verdicts(summary: dict[str, Any], memory: dict[str, Any] | None,
             side_by_side: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target with its measured value; ``met`` is None where it was not measured."""
    def check(target: str, value: float | None, limit: float, unit: str = "") -> None:
        out.append({"target": target, "value": value, "unit": unit,
                    "met": None if value is None else value <= limit})

    out: list[dict[str, Any]] = []
    stalled = summary["vs_none"].get("gw-stalled", {})
    for key, what in (("ttft_p99_ms", "TTFT"), ("e2e_p99_ms", "end-to-end")):
        check(f"gateway {what} p99 stalled/none <= {TARGET_P99_RATIO}", stalled.get(key),
              TARGET_P99_RATIO)
    pair = side_by_side["vs_none"] if side_by_side else {}
    for key, what in (("ttft_p99_ms", "TTFT"), ("e2e_p99_ms", "end-to-end")):
        check(f"gateway {what} p99 stalled/none <= {TARGET_P99_RATIO}, side by side",
              pair.get(key), TARGET_P99_RATIO)
    errors = summary["medians"].get("gw-stalled", {}).get("errors")
    if errors is not None and side_by_side:
        errors += side_by_side["medians"]["gw-stalled"]["errors"]
    check("gateway with stalled candidate: no errors", errors, 0)
    check(f"gateway CPU/chunk healthy/none <= {TARGET_CPU_RATIO} (defaults: scoring on)",
          summary["vs_none"].get("gw-healthy", {}).get("cpu_us_per_chunk_all"),
          TARGET_CPU_RATIO)
    out[-1]["note"] = "all the work the phase caused, scoring that ran after it included"
    limit = (memory["budget_bytes"] if memory else RSS_BUDGET) * TARGET_RSS_SLACK
    check(f"RSS growth under {RSS_OVERLOAD}x overload <= budget x {TARGET_RSS_SLACK} "
          f"({limit / MiB:.1f} MiB)",
          memory["stalled"]["growth_bytes"] / MiB if memory else None, limit / MiB, "MiB")
    return out


def info_lines(summary: dict[str, Any]) -> list[str]:
    """Figures next to the targets that explain them (no target of their own)."""
    ratios, medians = summary["vs_none"], summary["medians"]
    lines = []
    if (r := ratios.get("gw-healthy")) is not None:
        lines.append(f"gateway CPU/chunk healthy/none, during the phase only (scoring on): "
                     f"{num(r['cpu_us_per_chunk'], 3)}")
    if (r := ratios.get("gw-healthy-noeval")) is not None:
        lines.append(f"gateway CPU/chunk healthy/none with evaluation off (mirroring alone): "
                     f"{num(r['cpu_us_per_chunk_all'], 3)}")
    for target in ("gw-none", "nginx-none"):
        if target in summary["per_round_ttft_p99"]:
            values = summary["per_round_ttft_p99"][target]
            lines.append(f"noise: {target} TTFT p99 of each round " + ", ".join(
                f"{v:.1f}" for v in values) + " ms" + (
                f" (max/min x{max(values) / min(values):.2f})" if min(values) else ""))
    if "nginx-stalled" in medians and "nginx-none" in medians:
        none, stalled = summary["pooled"]["nginx-none"], summary["pooled"]["nginx-stalled"]
        lines.append(f"nginx with a mirror that never answers: median TTFT "
                     f"{num(none['ttft_p50_ms'])} -> {num(stalled['ttft_p50_ms'])} ms, "
                     f"throughput x{num(ratios['nginx-stalled']['rps'], 3)}")
    return lines


# --- printing --------------------------------------------------------------------------

def latency_report(summary: dict[str, Any], rounds: int) -> str:
    header = ["target", "req/s", "chunks/s", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99",
              "errors", "µs/chunk", "+after", "after s", "relay %", "sims %", "client %",
              "machine %", "TTFT p99/none", "e2e p99/none", "xput/none", "CPU/none",
              "+after/none"]
    rows = []
    for t in summary["order"]:
        m, pooled = summary["medians"][t], summary["pooled"][t]
        r = summary["vs_none"].get(t)
        rows.append([t, num(m["rps"]), num(m["chunks_per_s"], 0), num(pooled["ttft_p50_ms"]),
                     num(pooled["ttft_p99_ms"]), num(pooled["e2e_p50_ms"], 0),
                     num(pooled["e2e_p99_ms"], 0), str(m["errors"]),
                     num(m["cpu_us_per_chunk"]), num(m["cpu_us_per_chunk_all"]),
                     num(m["drain_s"]), num(m["relay_cpu_pct"], 0), num(m["sims_cpu_pct"], 0),
                     num(m["loadgen_cpu_pct"], 0), num(m["machine_busy_pct"], 0),
                     *([num(r["ttft_p99_ms"], 3), num(r["e2e_p99_ms"], 3), num(r["rps"], 3),
                        num(r["cpu_us_per_chunk"], 2), num(r["cpu_us_per_chunk_all"], 2)]
                       if r else ["1", "1", "1", "1", "1"])])
    return render_table(
        f"primary as the client sees it: {STREAMS} streams x {TOKENS} chunks "
        f"(TTFT {TTFT_MS:.0f} ms, {ITL_MS:.0f} ms apart), {rounds} alternating round(s); "
        "times in ms, percentiles over all rounds' requests; other figures medians of the "
        "rounds; µs/chunk = relay CPU per primary chunk during the phase, +after = including "
        "what the gateway still did after it (replays, scoring) until idle ('after s' "
        "seconds); CPU % of one core; ratios (x/none) taken within a round, then their "
        "median", header, rows)


def rounds_report(rounds: list[dict[str, dict[str, Any]]]) -> str:
    header = ["round", "target", "req/s", "TTFT p50", "TTFT p99", "e2e p99", "µs/chunk",
              "+after", "machine %", "errors"]
    rows = [[str(i), t, num(f["rps"]), num(f["ttft_p50_ms"]), num(f["ttft_p99_ms"]),
             num(f["e2e_p99_ms"], 0), num(f["cpu_us_per_chunk"]),
             num(f.get("cpu_us_per_chunk_all")), num(f["machine_busy_pct"], 0),
             str(f["errors"] + f["cut"])]
            for i, r in enumerate(rounds, 1) for t, f in r.items()]
    return render_table("per round", header, rows)


def side_by_side_report(pair: dict[str, Any], rounds: int) -> str:
    header = ["gateway", "req/s", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "errors",
              "µs/chunk", "+after"]
    rows = [[name, num(m["rps"]), num(pair["pooled"][name]["ttft_p50_ms"]),
             num(pair["pooled"][name]["ttft_p99_ms"]), num(pair["pooled"][name]["e2e_p50_ms"], 0),
             num(pair["pooled"][name]["e2e_p99_ms"], 0), str(m["errors"]),
             num(m["cpu_us_per_chunk"]), num(m["cpu_us_per_chunk_all"])]
            for name, m in pair["medians"].items()]
    r, p = pair["vs_none"], pair["pooled_vs_none"]
    per_round = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in pair["per_round_ttft_p99"])
    return (render_table(f"side by side: gw-none and gw-stalled at the same time, {STREAMS // 2} "
                         f"streams each, {rounds} round(s); ms, percentiles over all rounds' "
                         "requests", header, rows)
            + f"\nstalled/none, medians of within-round ratios [over all requests]: TTFT p50 "
              f"x{num(r['ttft_p50_ms'], 3)} [{num(p['ttft_p50_ms'], 3)}]  p99 "
              f"x{num(r['ttft_p99_ms'], 3)} [{num(p['ttft_p99_ms'], 3)}]  e2e p99 "
              f"x{num(r['e2e_p99_ms'], 3)} [{num(p['e2e_p99_ms'], 3)}]  throughput "
              f"x{num(r['rps'], 3)}  CPU/chunk "
              f"x{num(r['cpu_us_per_chunk_all'], 3)}; TTFT p99 of each round, none/stalled: "
              f"{per_round}")


def mirroring_report(counts: dict[str, dict[str, float]]) -> str:
    names = list(counts)
    keys = sorted({k for c in counts.values() for k in c})
    rows = [[key, *(num(counts[n].get(key), 1 if key == "rss_mib" else 0) for n in names)]
            for key in keys]
    return render_table("gateways' /metrics after the rounds (summed over candidates; "
                        "rss_mib from /proc)", ["counter", *names], rows)


def memory_report(memory: dict[str, Any]) -> str:
    header = ["gateway", "ok", "errors", "sent MiB", "sent/budget", "RSS start", "RSS before",
              "RSS peak", "RSS end", "growth", "growth from start", "budget used", "queued",
              "drop budget", "drop buffer_full", "drop dedup"]
    rows = []
    for label in ("control", "stalled"):
        e = memory.get(label)
        if e is None:
            continue
        m = e["metrics"]
        rows.append([label, str(e["ok"]), str(e["errors"] + e["cut"] + e["warm_errors"]),
                     num(e["sent_bytes"] / MiB, 0),
                     num(e["sent_bytes"] / memory["budget_bytes"], 1),
                     num(e["rss_started_kib"] / KiB), num(e["rss_before_kib"] / KiB),
                     num(e["rss_peak_kib"] / KiB), num(e["rss_end_kib"] / KiB),
                     num(e["growth_bytes"] / MiB), num(e["growth_from_start_bytes"] / MiB),
                     num(m.get("memory_budget_used_bytes", 0) / MiB, 2),
                     num(m.get("mirror_queued"), 0), num(m.get("dropped:budget"), 0),
                     num(m.get("dropped:buffer_full"), 0), num(m.get("dropped:dedup"), 0)])
    text = render_table(
        f"memory: budget {memory['budget_bytes'] / MiB:.0f} MiB, buffers {RSS_BUFFER_ITEMS} "
        f"items / {RSS_BUFFER_BYTES / MiB:.0f} MiB, {memory['streams']} streams of "
        f"{memory['prompt_bytes'] // KiB} KiB prompts, each unique, after "
        f"{memory['warm_requests']} identical ones; RSS in MiB (peak = max of VmHWM and "
        "20 ms VmRSS samples; growth = peak - before)", header, rows)
    if "control" in memory:
        extra = memory["stalled"]["growth_bytes"] - memory["control"]["growth_bytes"]
        used = memory["stalled"]["metrics"].get("memory_budget_used_bytes", 0)
        items = memory["stalled"]["metrics"].get("mirror_queued", 0)
        text += (f"\nstalled - control growth: {extra / MiB:.1f} MiB = "
                 f"{extra / memory['budget_bytes']:.2f}x the budget; beyond the "
                 f"{used / MiB:.1f} MiB charged: {(extra - used) / MiB:.1f} MiB"
                 + (f", {(extra - used) / items / KiB:.1f} KiB per queued request"
                    if items else ""))
    return text


# --- main ------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one short round, memory phase without its control")
    parser.add_argument("--rounds", type=int, help="rounds (overrides the mode)")
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx out")
    parser.add_argument("--only", choices=TARGETS, action="append",
                        help="measure only these latency targets (repeatable)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    parser.add_argument("--rev", help="measure this git revision's code instead of the "
                                      "working tree (e.g. HEAD, while others edit the tree)")
    args = parser.parse_args()
    plan = (Plan(rounds=args.rounds or 1, requests_per_worker=4, duration_s=3.0,
                 drain_timeout_s=8.0, memory_warm_requests=1024,
                 memory_budget=RSS_BUDGET_QUICK) if args.quick
            else Plan(rounds=args.rounds or 3, requests_per_worker=8, duration_s=7.0,
                      drain_timeout_s=60.0, memory_warm_requests=3072,
                      memory_budget=RSS_BUDGET))
    chosen = args.only or [t for t in TARGETS if not (args.quick and t == "gw-healthy-noeval")
                           and not (args.no_nginx and t.startswith("nginx-"))]
    began = time.monotonic()
    nginx = None if args.no_nginx else find_nginx()
    version = nginx_version(nginx) if nginx else None
    revision = code_revision() if args.rev is None else git_commit(args.rev)
    print("understudy bench/mirror.py — mirroring's cost to the primary: understudy vs "
          "nginx mirror, one run")
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{'quick' if args.quick else 'full'} mode, code {revision} (copied at start)")
    print(f"nginx: {version} ({nginx}), mirror subrequest timeouts {NGINX_MIRROR_TIMEOUT_S} s"
          if nginx else "nginx: left out or not installed — nginx rows NOT measured")
    print(f"gateway candidates: sampling 1.0 per request, max_concurrency "
          f"{CANDIDATE_CONCURRENCY}, first_byte_timeout {STALL_FIRST_BYTE_TIMEOUT_S:.0f} s",
          flush=True)

    def log(line: str) -> None:
        print(line, flush=True)

    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="understudy-mirror-")))
        code = snapshot_code(workdir) if args.rev is None else export_code(workdir, args.rev)
        primary = spawn_sim(stack, workdir, code, "sim-primary")
        healthy = spawn_sim(stack, workdir, code, "sim-healthy", "--variant", "candidate")
        stalled = spawn_sim(stack, workdir, code, "sim-stalled",
                            "--fault", "hang_before_first_byte")
        candidates = {"none": None, "healthy": healthy, "stalled": stalled}
        relays: dict[str, Child] = {}
        for target in (t for t in chosen if t.startswith("gw-")):
            sim = candidates[target.split("-")[1]]
            relays[target] = spawn_gateway(
                stack, workdir, code, target, primary.url,
                [candidate_entry(sim.name.removeprefix("sim-"), sim.url)] if sim else [],
                evaluation=not target.endswith("-noeval"))
        memory_gateways = {} if args.no_memory else spawn_memory_gateways(
            stack, workdir, code, primary, stalled, plan, args.quick)
        ready(primary, healthy, stalled, *relays.values(), *memory_gateways.values())
        for target in (t for t in chosen if t.startswith("nginx-")):
            if nginx is None:
                continue
            sim = candidates[target.split("-")[1]]
            relays[target] = start_nginx(
                stack, workdir, nginx, primary.url, name=target,
                candidate_url=sim.url if sim else None, mirror_timeout_s=NGINX_MIRROR_TIMEOUT_S)
        rounds, pairs = run_rounds(plan, relays, [primary, healthy, stalled], log)
        side_by_side = summarise_pairs(pairs)
        gateways = [name for name in GATEWAYS if name in relays]
        counts = {name: mirror_counts(scrape(relays[name])) for name in gateways}
        for name in gateways:
            counts[name]["rss_mib"] = read_status_kib(relays[name].pid).get("VmRSS", 0) / KiB
        # Stop the latency phase's gateways first: the memory phase wants the machine.
        for name in gateways:
            relays[name].stop()
        memory = run_memory(memory_gateways, plan, log) if memory_gateways else None

    summary = summarise(rounds)
    checks = verdicts(summary, memory, side_by_side)
    print()
    print(latency_report(summary, plan.rounds))
    print()
    print(rounds_report(rounds))
    print()
    if side_by_side is not None:
        print(side_by_side_report(side_by_side, plan.rounds))
        print()
    if counts:
        print(mirroring_report(counts))
    print()
    if memory is not None:
        print(memory_report(memory))
        print()
    print("requests the candidate simulators saw end, summed over rounds (sim /metrics; a "
          "stream cut by the mirroring side before its end is 'abort'; warm-ups included):")
    for target in summary["order"]:
        finished = summary["medians"][target]["candidate_finished"]
        if finished:
            shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(finished.items()) if v)
            print(f"  {target:17s} {shown or 'none ended'} "
                  f"(client completed {summary['medians'][target]['requests']})")
    print()
    print("each case / its peer with no candidate, medians of within-round ratios (in "
          "brackets: ratios of the percentiles over all rounds' requests):")
    for target, r in summary["vs_none"].items():
        p = summary["pooled_vs_none"][target]
        print(f"  {target:17s} TTFT p50 x{num(r['ttft_p50_ms'], 2)} "
              f"[{num(p['ttft_p50_ms'], 2)}]  p99 x{num(r['ttft_p99_ms'], 2)} "
              f"[{num(p['ttft_p99_ms'], 2)}]  e2e p50 x{num(r['e2e_p50_ms'], 2)}  p99 "
              f"x{num(r['e2e_p99_ms'], 2)} [{num(p['e2e_p99_ms'], 2)}]  "
              f"throughput x{num(r['rps'], 3)}  "
              f"CPU/chunk x{num(r['cpu_us_per_chunk'], 2)}"
              + (f" (x{num(r['cpu_us_per_chunk_all'], 2)} with what it did after)"
                 if r["cpu_us_per_chunk_all"] is not None else ""))
    print()
    print("targets:")
    for v in checks:
        value = v["value"]
        shown = str(value) if isinstance(value, int) else num(value, 3)
        state = {True: "PASS", False: "MISS", None: "NOT MEASURED"}[v["met"]]
        print(f"  {state:5s} {v['target']:66s} measured {shown}"
              f"{' ' + v['unit'] if v['unit'] else ''}")
    for line in info_lines(summary):
        print(f"  info  {line}")
    wall = time.monotonic() - began
    print(f"\nwall time {wall:.0f} s")
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(),
            "mode": "quick" if args.quick else "full", "nginx": version, "code": revision,
            "plan": asdict(plan), "streams": STREAMS, "tokens": TOKENS, "ttft_ms": TTFT_MS,
            "itl_ms": ITL_MS, "candidate_concurrency": CANDIDATE_CONCURRENCY,
            "nginx_mirror_timeout_s": NGINX_MIRROR_TIMEOUT_S, "wall_s": wall,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(write_results(RESULTS_PATH, {
        "meta": meta, "rounds": rounds, "summary": summary,
        "side_by_side": {"rounds": pairs, "summary": side_by_side},
        "gateway_metrics": counts, "memory": memory, "targets": checks}))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
