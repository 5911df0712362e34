"""Proxy overhead, side by side in one run: direct to the simulator, through the
understudy gateway, through a bare aiohttp relay (bench/_bare_relay.py: the same stack
doing nothing but relaying), and through nginx ``proxy_pass``.

    .venv/bin/python bench/proxy.py [--quick] [--profile] [--rounds N] [--plain] ...

Scenarios (each against its own simulator, with its own relays in front):
  small-c1   small non-streamed chat requests, 1 at a time: added latency per request
  small-c32  the same, 32 concurrent: requests/s the relay sustains on this machine
  stream     streamed answers of 64 chunks at 20 ms spacing, 100 concurrent streams

Rules of the measurement:
1. Rounds alternate the targets and rotate their order (direct, gateway, aiohttp, nginx;
   then gateway, aiohttp, nginx, direct; ...), so drift on a shared machine falls on all.
   Figures are medians over rounds; differences and ratios are taken within a round
   first (gateway vs the direct run next to it), then their median is reported.
2. The load generator is its own process (bench/_loadgen.py, started once per run); it
   reads the relay's CPU time from /proc at the start and end of its measured phase.
   CPU per relayed chunk = (utime + stime of the relay, nginx = master + worker) / SSE
   events the client got; the table also splits it into user and kernel time.
3. Streams start spread evenly over one answer's duration, so 100 are in flight at a
   steady arrival rate (``--burst`` starts each wave of 100 within 20 ms instead).
4. The targets (issue 15): in the stream scenario gateway/direct throughput >= 0.97,
   gateway - direct median TTFT <= 5 ms, gateway CPU per chunk <= 1.3x nginx's; in each
   small scenario gateway CPU per request <= 2.5x nginx's. Each is printed PASS or MISS;
   without nginx the benchmark still runs and says the CPU targets were not measured.

Results go to stdout and to bench/results/proxy.json (``--from-json`` prints them
again); ``--profile`` adds a py-spy view of where the gateway's CPU goes, per chunk in
the stream scenario and per request in small-c32 (raw stacks in bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import (
    CLOCK_TICKS,
    REPO_ROOT,
    Child,
    LoadGen,
    code_revision,
    find_nginx,
    nginx_version,
    popen,
    run_main,
    snapshot_code,
    start_bare_relay,
    start_gateway,
    start_nginx,
    start_sim,
)
from _report import RESULTS_DIR, load_figures, loadavg, median, num, render_table, signed
from _report import write_results as write_json

RESULTS_PATH = RESULTS_DIR / "proxy.json"
SIM_MODEL = "sim-model"

TARGET_THROUGHPUT_RATIO = 0.97
TARGET_ADDED_TTFT_MS = 5.0
TARGET_CPU_VS_NGINX = 1.3
"""Gateway CPU per relayed chunk over nginx's, stream scenario."""
TARGET_SMALL_CPU_VS_NGINX = 2.5
"""Gateway CPU per small non-streamed request over nginx's, each small scenario."""
PROFILED = ("stream", "small-c32")
SETTLE_S = 0.3


@dataclass(frozen=True)
class SimShape:
    ttft_ms: float
    itl_ms: float
    tokens: int


SMALL_SIM = SimShape(ttft_ms=0.0, itl_ms=0.0, tokens=16)
STREAM_SIM = SimShape(ttft_ms=20.0, itl_ms=20.0, tokens=64)


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    mode: str  # "small" | "stream"
    sim: SimShape
    concurrency: int
    requests_per_worker: int
    duration_s: float
    rounds: int
    burst: bool = False  # streams start within one inter-token gap instead of spread out

    @property
    def stream_s(self) -> float:
        """How long one answer takes at the simulator: TTFT plus the token gaps."""
        return (self.sim.ttft_ms + self.sim.itl_ms * (self.sim.tokens - 1)) / 1000

    @property
    def stagger_s(self) -> float:
        """Worker i starts at i/concurrency of this: steady arrivals, or a burst."""
        if self.mode != "stream":
            return 0.0
        return self.sim.itl_ms / 1000 if self.burst else self.stream_s

    @property
    def deadline_s(self) -> float:
        if self.mode == "stream":
            planned = self.stagger_s + self.requests_per_worker * self.stream_s
            return min(self.duration_s, planned) * 3 + 10
        return self.duration_s + 10


def scenarios(quick: bool, rounds: int | None, burst: bool) -> list[Scenario]:
    small_s = 1.0 if quick else 2.0
    small_rounds = rounds or (1 if quick else 3)
    stream_rounds = rounds or (1 if quick else 5)
    return [
        Scenario("small-c1", "small non-streamed, concurrency 1", "small", SMALL_SIM,
                 concurrency=1, requests_per_worker=50_000, duration_s=small_s,
                 rounds=small_rounds),
        Scenario("small-c32", "small non-streamed, concurrency 32", "small", SMALL_SIM,
                 concurrency=32, requests_per_worker=50_000, duration_s=small_s,
                 rounds=small_rounds),
        Scenario("stream", "streamed, 64 chunks x 20 ms, 100 concurrent streams, "
                 + ("starts in bursts of 100 within 20 ms" if burst
                    else "starts spread evenly (steady arrivals)"), "stream",
                 STREAM_SIM, concurrency=100, requests_per_worker=2 if quick else 4,
                 duration_s=60.0, rounds=stream_rounds, burst=burst),
    ]


# --- running ---------------------------------------------------------------------------

def run_loadgen(loadgen: LoadGen, scenario: Scenario, url: str,
                cpu_pids: dict[str, list[int]], client_usage: bool) -> dict[str, Any]:
    spec = {
        "url": url, "mode": scenario.mode, "model": SIM_MODEL,
        "concurrency": scenario.concurrency,
        "requests_per_worker": scenario.requests_per_worker,
        "duration_s": scenario.duration_s, "deadline_s": scenario.deadline_s,
        "request_timeout_s": scenario.deadline_s,
        "max_tokens": scenario.sim.tokens,
        "stagger_s": scenario.stagger_s,
        "client_usage": client_usage,
        "cpu_pids": cpu_pids,
    }
    return loadgen.run(spec, scenario.deadline_s + 60)


def derive(result: dict[str, Any]) -> dict[str, Any]:
    """Per-run figures in the units the report uses (ms, µs, %)."""
    elapsed = result["elapsed_s"]
    ticks = result["cpu_ticks"]
    relay_s = ticks.get("relay", 0) / CLOCK_TICKS if "relay" in ticks else None
    relay_user_s = result["cpu_user_ticks"].get("relay", 0) / CLOCK_TICKS
    sim_s = ticks.get("sim", 0) / CLOCK_TICKS
    events = result["events"]
    return {
        **load_figures(result),
        "relay_cpu_us_per_chunk": (relay_s / events * 1e6) if relay_s is not None and events
        else None,
        "relay_user_us_per_chunk": (relay_user_s / events * 1e6)
        if relay_s is not None and events else None,
        "relay_sys_us_per_chunk": ((relay_s - relay_user_s) / events * 1e6)
        if relay_s is not None and events else None,
        "relay_cpu_pct": (relay_s / elapsed * 100) if relay_s is not None else None,
        "sim_cpu_pct": sim_s / elapsed * 100,
        "loadgen_cpu_pct": result["loadgen_cpu_s"] / elapsed * 100,
        "machine_busy_pct": (result["machine_busy_s"] / result["machine_capacity_s"] * 100
                             if result["machine_capacity_s"] else None),
    }


def start_sim_and_gateway(stack: ExitStack, workdir: Path, code: Path, scenario: Scenario,
                          *, name: str) -> tuple[Child, Child]:
    """The scenario's simulator (child ``name``) and a gateway in front of it, both stopped
    when ``stack`` closes."""
    sim = start_sim(stack, workdir, code, ttft_ms=scenario.sim.ttft_ms,
                    itl_ms=scenario.sim.itl_ms, tokens=scenario.sim.tokens, name=name)
    return sim, start_gateway(stack, workdir, code, sim.url)


def run_scenario(loadgen: LoadGen, scenario: Scenario, workdir: Path, code: Path,
                 nginx: str | None,
                 bare: bool, client_usage: bool,
                 log: Callable[[str], None]) -> dict[str, Any]:
    with ExitStack() as stack:
        sim, gateway = start_sim_and_gateway(stack, workdir, code, scenario,
                                             name=f"sim-{scenario.key}")
        relays: dict[str, Child | None] = {"direct": None, "gateway": gateway}
        if bare:
            relays["aiohttp"] = start_bare_relay(stack, workdir, sim.url)
        if nginx is not None:
            relays["nginx"] = start_nginx(stack, workdir, nginx, sim.url)
        order = list(relays)
        rounds: list[dict[str, dict[str, Any]]] = []
        for index in range(scenario.rounds):
            shift = index % len(order)
            this_round: dict[str, dict[str, Any]] = {}
            for target in order[shift:] + order[:shift]:
                relay = relays[target]
                for child in (sim, *(c for c in relays.values() if c is not None)):
                    if not child.alive():
                        raise RuntimeError(f"{child.name} died:\n{child.log_tail()}")
                cpu_pids = {"sim": sim.cpu_pids()}
                if relay is not None:
                    cpu_pids["relay"] = relay.cpu_pids()
                url = relay.url if relay is not None else sim.url
                time.sleep(SETTLE_S)
                try:
                    figures = derive(run_loadgen(loadgen, scenario, url, cpu_pids,
                                                 client_usage))
                except RuntimeError as exc:
                    raise RuntimeError(f"{scenario.key} round {index + 1}, {target}: {exc}\n"
                                       + _children_state(sim, relays)) from exc
                this_round[target] = figures
                log(f"  {scenario.key} round {index + 1}/{scenario.rounds} {target:7s} "
                    + _brief(scenario, figures))
            rounds.append(this_round)
        return {"scenario": asdict(scenario), "targets": order, "rounds": rounds,
                "summary": summarise(order, rounds)}


def _children_state(sim: Child, relays: dict[str, Child | None]) -> str:
    lines = []
    for child in (sim, *(c for c in relays.values() if c is not None)):
        state = "running" if child.alive() else f"exited with {child.proc.returncode}"
        lines.append(f"--- {child.name} ({child.url}, pid {child.pid}): {state}; log tail:\n"
                     f"{child.log_tail(15)}")
    return "\n".join(lines)


def _brief(scenario: Scenario, f: dict[str, Any]) -> str:
    cpu = f["relay_cpu_us_per_chunk"]
    cpu_text = f" relay {cpu:.1f} µs/{'chunk' if scenario.mode == 'stream' else 'req'}" \
        if cpu is not None else ""
    lat = (f"ttft p50 {f['ttft_p50_ms']:.2f} p99 {f['ttft_p99_ms']:.2f} ms"
           if scenario.mode == "stream" and f["ttft_p50_ms"] is not None
           else f"p50 {num(f['e2e_p50_ms'], 3)} p99 {num(f['e2e_p99_ms'], 3)} ms")
    errors = f" ERRORS {f['errors']} cut {f['cut']}" if f["errors"] or f["cut"] else ""
    return f"{f['rps']:8.1f} req/s  {lat}{cpu_text}{errors}"


# --- summarising -----------------------------------------------------------------------

_FIGURES = ("rps", "chunks_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
            "relay_cpu_us_per_chunk", "relay_user_us_per_chunk", "relay_sys_us_per_chunk",
            "relay_cpu_pct", "sim_cpu_pct", "loadgen_cpu_pct",
            "machine_busy_pct")
_DELTAS = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")


def summarise(order: list[str], rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    medians = {t: {k: median([r[t][k] for r in rounds]) for k in _FIGURES} for t in order}
    for t in order:
        medians[t]["errors"] = sum(r[t]["errors"] + r[t]["cut"] for r in rounds)
    vs_direct: dict[str, dict[str, float | None]] = {}
    for t in order:
        if t == "direct":
            continue
        entry: dict[str, float | None] = {
            "throughput_ratio": median([r[t]["rps"] / r["direct"]["rps"]
                                         if r["direct"]["rps"] else None for r in rounds]),
        }
        for key in _DELTAS:
            entry[f"added_{key}"] = median([
                r[t][key] - r["direct"][key]
                if r[t][key] is not None and r["direct"][key] is not None else None
                for r in rounds])
        vs_direct[t] = entry

    def cpu_ratio(target: str, base: str) -> float | None:
        if target not in order or base not in order:
            return None
        return median([
            r[target]["relay_cpu_us_per_chunk"] / r[base]["relay_cpu_us_per_chunk"]
            if r[target]["relay_cpu_us_per_chunk"] and r[base]["relay_cpu_us_per_chunk"]
            else None for r in rounds])

    cpu_vs_nginx = {t: cpu_ratio(t, "nginx") for t in order if t not in ("direct", "nginx")}
    return {"medians": medians, "vs_direct": vs_direct, "cpu_vs_nginx": cpu_vs_nginx,
            "gateway_cpu_vs_nginx": cpu_vs_nginx.get("gateway"),
            "gateway_cpu_vs_aiohttp": cpu_ratio("gateway", "aiohttp")}


def targets(results: dict[str, Any], nginx_present: bool) -> list[dict[str, Any]]:
    """The issue's targets, each met, missed, or not measured (``None``), for the
    scenarios this run measured."""
    out: list[dict[str, Any]] = []

    def cpu_target(key: str, unit: str, limit: float) -> None:
        cpu = results[key]["summary"]["gateway_cpu_vs_nginx"]
        out.append({"target": f"{key}: gateway CPU per {unit} <= {limit}x nginx",
                    "value": cpu,
                    "met": (cpu is not None and cpu <= limit) if nginx_present else None})

    if "stream" in results:
        gw = results["stream"]["summary"]["vs_direct"]["gateway"]
        out += [
            {"target": f"stream: gateway/direct throughput >= {TARGET_THROUGHPUT_RATIO}",
             "value": gw["throughput_ratio"],
             "met": gw["throughput_ratio"] is not None
             and gw["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO},
            {"target": f"stream: gateway - direct median TTFT <= {TARGET_ADDED_TTFT_MS} ms",
             "value": gw["added_ttft_p50_ms"],
             "met": gw["added_ttft_p50_ms"] is not None
             and gw["added_ttft_p50_ms"] <= TARGET_ADDED_TTFT_MS},
        ]
        cpu_target("stream", "chunk", TARGET_CPU_VS_NGINX)
    for key in ("small-c1", "small-c32"):
        if key in results:
            cpu_target(key, "request", TARGET_SMALL_CPU_VS_NGINX)
    errors = sum(m["errors"] for r in results.values() for m in r["summary"]["medians"].values())
    out.append({"target": "no failed or cut requests", "value": errors, "met": errors == 0})
    return out


# --- printing --------------------------------------------------------------------------

_PLAIN = False  # --plain: set once by main before anything is printed


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    return render_table(title, header, rows, rich=not _PLAIN)


def scenario_report(result: dict[str, Any]) -> str:
    sc = result["scenario"]
    summary = result["summary"]
    stream = sc["mode"] == "stream"
    unit = "chunk" if stream else "req"
    header = ["target", "req/s"]
    header += ["chunks/s", "TTFT p50", "TTFT p99", "+TTFT p50", "+TTFT p99"] if stream else []
    header += ["e2e p50", "e2e p99", "+e2e p50", "+e2e p99", "xput/dir",
               f"relay µs/{unit}", "user", "kernel", "CPU/nginx", "relay %", "sim %",
               "loadgen %", "machine %", "errors"]
    rows = []
    for t in result["targets"]:
        m = summary["medians"][t]
        d = summary["vs_direct"].get(t, {})
        row = [t, num(m["rps"])]
        if stream:
            row += [num(m["chunks_per_s"], 0), num(m["ttft_p50_ms"], 2),
                    num(m["ttft_p99_ms"], 2), signed(d.get("added_ttft_p50_ms")),
                    signed(d.get("added_ttft_p99_ms"))]
        row += [num(m["e2e_p50_ms"], 2 if stream else 3), num(m["e2e_p99_ms"], 2 if stream
                                                                  else 3),
                signed(d.get("added_e2e_p50_ms"), 2 if stream else 3),
                signed(d.get("added_e2e_p99_ms"), 2 if stream else 3),
                num(d.get("throughput_ratio"), 3) if d else "1",
                num(m["relay_cpu_us_per_chunk"]), num(m["relay_user_us_per_chunk"]),
                num(m["relay_sys_us_per_chunk"]),
                num(summary["cpu_vs_nginx"].get(t), 2) if t in summary["cpu_vs_nginx"]
                else ("1" if t == "nginx" else "-"),
                num(m["relay_cpu_pct"]),
                num(m["sim_cpu_pct"]), num(m["loadgen_cpu_pct"]),
                num(m["machine_busy_pct"]), str(m["errors"])]
        rows.append(row)
    title = (f"{sc['key']}: {sc['title']} — medians of {sc['rounds']} alternating round(s); "
             "times in ms; + = minus direct in the same round; relay CPU split into user "
             "and kernel time; CPU % of one core")
    text = _table(title, header, rows)
    if summary["gateway_cpu_vs_nginx"] is not None:
        text += (f"\ngateway CPU per {unit} / nginx CPU per {unit}: "
                 f"{summary['gateway_cpu_vs_nginx']:.2f}x")
    if summary["gateway_cpu_vs_aiohttp"] is not None:
        text += (f"\ngateway CPU per {unit} / bare aiohttp relay CPU per {unit}: "
                 f"{summary['gateway_cpu_vs_aiohttp']:.2f}x (the rest is understudy's own work)")
    return text


def rounds_report(result: dict[str, Any]) -> str:
    sc = result["scenario"]
    stream = sc["mode"] == "stream"
    header = ["round", "target", "req/s", "p50", "p99", "relay µs", "errors"]
    rows = []
    for index, r in enumerate(result["rounds"], 1):
        for t in result["targets"]:
            f = r[t]
            key = "ttft" if stream else "e2e"
            rows.append([str(index), t, num(f["rps"]), num(f[f"{key}_p50_ms"], 2 if stream
                                                               else 3),
                         num(f[f"{key}_p99_ms"], 2 if stream else 3),
                         num(f["relay_cpu_us_per_chunk"]), str(f["errors"] + f["cut"])])
    what = "TTFT" if stream else "latency"
    return _table(f"{sc['key']} per round ({what} ms; relay CPU µs per "
                        f"{'chunk' if stream else 'request'})", header, rows)


# --- profiling -------------------------------------------------------------------------

def profile_path(scenario_key: str) -> Path:
    return RESULTS_DIR / f"gateway-pyspy-{scenario_key}.txt"


def profile_gateway(loadgen: LoadGen, scenario: Scenario, workdir: Path, code: Path,
                    client_usage: bool, us_per_unit: float | None,
                    log: Callable[[str], None]) -> str:
    """One extra round of ``scenario`` through the gateway with py-spy sampling it."""
    pyspy = Path(sys.executable).parent / "py-spy"
    if not pyspy.exists():
        return "profile: py-spy not installed (.venv/bin/pip install py-spy)"
    path = profile_path(scenario.key)
    with ExitStack() as stack:
        _, gateway = start_sim_and_gateway(stack, workdir, code, scenario,
                                           name=f"sim-profile-{scenario.key}")
        # A first round opens the gateway's upstream pool, so the sampled one is steady.
        run_loadgen(loadgen, scenario, gateway.url, {}, client_usage)
        if scenario.mode == "stream":
            duration = int(scenario.stagger_s
                           + scenario.stream_s * scenario.requests_per_worker) + 3
        else:
            duration = int(scenario.duration_s) + 3
        path.parent.mkdir(parents=True, exist_ok=True)
        # --native shows where the time inside uvloop and aiohttp's C parts goes; it
        # pauses the gateway for each sample, so this round's timings are not reported.
        spy = popen(stack, [str(pyspy), "record", "--pid", str(gateway.pid), "--rate", "200",
                           "--native", "--format", "raw", "--duration", str(duration),
                           "--output", str(path)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)
        figures = derive(run_loadgen(loadgen, scenario, gateway.url,
                                     {"relay": gateway.cpu_pids()}, client_usage))
        log(f"  profile round (py-spy attached, timings distorted) {scenario.key} gateway "
            + _brief(scenario, figures))
        _, err = spy.communicate(timeout=duration + 30)
        if spy.returncode != 0 or not path.exists():
            return f"profile: py-spy failed ({spy.returncode}): {err.decode()[-500:]}"
    unit = "chunk" if scenario.mode == "stream" else "req"
    return summarise_profile(path.read_text(), us_per_unit, unit=unit,
                             what=f"one {scenario.key} round", source=path)


def summarise_profile(raw: str, us_per_unit: float | None = None, top: int = 30, *,
                      unit: str = "chunk", what: str = "one stream round",
                      source: Path | None = None) -> str:
    """Self and inclusive shares of py-spy's raw stacks; with ``us_per_unit`` (the
    gateway's median CPU per chunk, or per request, in the measured rounds) each share
    also in µs per unit."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = idle = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        if any(wait in stack for wait in _IDLE_WAITS):
            idle += count  # a helper thread blocked on a lock: no CPU
            continue
        frames = [_frame_name(f) for f in stack.split(";")
                  if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for name in set(frames):
            inclusive[name] = inclusive.get(name, 0) + count
    if not total:
        return "profile: no samples"
    where = f"raw stacks: {source.relative_to(REPO_ROOT)}; " if source is not None else ""
    lines = [f"py-spy: {total} samples of the gateway's CPU during {what} "
             f"({where}{idle} samples of helper threads blocked on a lock left out)"]
    if us_per_unit is not None:
        lines.append(f"µs/{unit} columns: share x {us_per_unit:.1f} µs, the gateway's median "
                     f"CPU per {unit} in the measured rounds (py-spy distorts its own round)")
    lines += ["", "self (leaf) time:"]
    lines += [f"  {n / total * 100:5.1f}%{_share_us(n / total, us_per_unit, unit)}  {name}"
              for name, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]]
    ours = {name: n for name, n in inclusive.items()
            if name.split(" (")[-1].startswith(("gateway/", "evaluators/"))}
    lines += ["", "inclusive time of understudy's own frames (gateway/, evaluators/):"]
    lines += [f"  {n / total * 100:5.1f}%{_share_us(n / total, us_per_unit, unit)}  {name}"
              for name, n in sorted(ours.items(), key=lambda kv: -kv[1])[:top]]
    # The event loop and the CLI hold every sample; below them the split is what matters.
    inner = {name: n for name, n in inclusive.items() if n < 0.9 * total}
    lines += ["", "inclusive time (frames under 90%):"]
    lines += [f"  {n / total * 100:5.1f}%{_share_us(n / total, us_per_unit, unit)}  {name}"
              for name, n in sorted(inner.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


# py-spy --native counts a thread blocked in a lock wait as busy; these are idle.
_IDLE_WAITS = ("PyThread_acquire_lock_timed", "_queue_SimpleQueue_get_impl")


def _share_us(share: float, us_per_unit: float | None, unit: str) -> str:
    return "" if us_per_unit is None else f" {share * us_per_unit:6.2f} µs/{unit}"


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (to/file.py)``."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{name} ({short})"


# --- main ------------------------------------------------------------------------------

def main() -> int:
    with ExitStack() as stack:
        return _main(stack)


def _main(stack: ExitStack) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round per scenario")
    parser.add_argument("--rounds", type=int, help="rounds per scenario (overrides the mode)")
    parser.add_argument("--only", choices=["small-c1", "small-c32", "stream"], action="append",
                        help="run only these scenarios (repeatable)")
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx out")
    parser.add_argument("--no-aiohttp", action="store_true",
                        help="leave the bare aiohttp relay out (saves a quarter of the time)")
    parser.add_argument("--client-usage", action="store_true",
                        help="clients ask for stream_options.include_usage themselves (the "
                             "gateway then relays without its usage filter)")
    parser.add_argument("--burst", action="store_true",
                        help="start each wave of streams within 20 ms instead of spreading "
                             "the starts over one answer's duration")
    parser.add_argument("--plain", action="store_true",
                        help="plain-text tables even where rich is installed")
    parser.add_argument("--from-json", type=Path, metavar="PATH",
                        help="print the report of an earlier run (its results JSON) and exit")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, sample the gateway with py-spy for one more "
                             "stream round and print where its CPU goes")
    args = parser.parse_args()
    global _PLAIN
    _PLAIN = args.plain
    if args.from_json is not None:
        return reprint(args.from_json)

    began = time.monotonic()
    nginx = None if args.no_nginx else find_nginx()
    version = nginx_version(nginx) if nginx else None
    print("understudy bench/proxy.py — direct vs gateway vs nginx proxy_pass, one run")
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{'quick' if args.quick else 'full'} mode, load average {loadavg()}")
    if nginx:
        print(f"nginx: {version} ({nginx}), 1 worker, proxy_buffering off, upstream keepalive")
    else:
        why = "left out (--no-nginx)" if args.no_nginx else "ABSENT (not installed)"
        print(f"nginx: {why} — nginx column and the CPU-vs-nginx target are NOT measured; "
              "install it with scripts/setup-bench.sh")
    if not args.no_aiohttp:
        print("aiohttp: bench/_bare_relay.py, the gateway's stack relaying chunks and nothing "
              "else (the floor for the gateway)")
    print(f"streams: client {'asks for' if args.client_usage else 'does not ask for'} "
          "include_usage" + ("" if args.client_usage else
                             " (the gateway injects it and filters the usage event out)"))
    print(flush=True)

    def log(line: str) -> None:
        print(line, flush=True)

    results: dict[str, Any] = {}
    chosen = [s for s in scenarios(args.quick, args.rounds, args.burst)
              if not args.only or s.key in args.only]
    revision = code_revision()
    print(f"code: {revision} (copied at start; the run does not see later edits)", flush=True)
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="understudy-bench-")))
    code = snapshot_code(workdir)
    loadgen = LoadGen(stack, workdir)
    for scenario in chosen:
        results[scenario.key] = run_scenario(loadgen, scenario, workdir, code, nginx,
                                             not args.no_aiohttp, args.client_usage, log)

    verdicts = targets(results, nginx is not None)
    print()
    print_report(results, verdicts)
    wall = time.monotonic() - began
    print(f"\nwall time {wall:.0f} s, load average {loadavg()} (1, 5, 15 min; 2 cores = 2.0)")
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(),
            "mode": "quick" if args.quick else "full", "nginx": version,
            "code": revision, "bare_aiohttp": not args.no_aiohttp,
            "client_usage": args.client_usage, "burst": args.burst, "wall_s": wall,
            "loadavg_end": loadavg(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_results(meta, results, verdicts, None)

    profiled = [s for s in chosen if s.key in PROFILED] if args.profile else []
    profiles: list[str] = []
    for scenario in profiled:
        print()
        try:
            gateway_us = results[scenario.key]["summary"]["medians"]["gateway"][
                "relay_cpu_us_per_chunk"]
            profile_text = profile_gateway(loadgen, scenario, workdir, code,
                                           args.client_usage, gateway_us, log)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            profile_text = f"profile: {scenario.key} failed: {exc}"
        print(profile_text)
        profiles.append(profile_text)
        write_results(meta, results, verdicts, "\n\n".join(profiles))
    return 0


def print_report(results: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
    for result in results.values():
        print(scenario_report(result))
        print()
        print(rounds_report(result))
        print()
    if verdicts:
        print("targets (issue 15; medians over rounds of ratios taken within a round):")
        for v in verdicts:
            state = {True: "PASS", False: "MISS",
                     None: "NOT MEASURED (no nginx in this run)"}[v["met"]]
            value = v["value"]
            shown = value if isinstance(value, int) else num(value, 3)
            print(f"  {state:5s}  {v['target']:50s} measured {shown}")
        if "stream" in results:
            stream_vs = results["stream"]["summary"]["vs_direct"]["gateway"]
            print(f"  info   gateway - direct p99 TTFT: "
                  f"{signed(stream_vs['added_ttft_p99_ms'])} ms"
                  " (no target; p99 on 2 shared cores is noisy)")


def reprint(path: Path) -> int:
    """Print the report of an earlier run from its JSON, without measuring anything."""
    saved = json.loads(path.read_text())
    meta = saved["meta"]
    print(f"{path}: {meta['mode']} run of {meta['time']}, code {meta.get('code')}, "
          f"nginx {meta['nginx'] or 'absent'}, wall {meta['wall_s']:.0f} s, "
          f"load average at the end {meta.get('loadavg_end')}")
    print()
    print_report(saved["scenarios"], saved["targets"])
    if saved.get("profile"):
        print()
        print(saved["profile"])
    return 0


def write_results(meta: dict[str, Any], results: dict[str, Any],
                  verdicts: list[dict[str, Any]], profile_text: str | None) -> None:
    print(write_json(RESULTS_PATH, {"meta": meta, "scenarios": results,
                                    "targets": verdicts, "profile": profile_text}))


if __name__ == "__main__":
    sys.exit(run_main(main))
