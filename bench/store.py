"""Score rows per second the ScoreWriter sustains into PostgreSQL (and SQLite, for scale);
and the proxy's latency with evaluation (scoring and that writer, in the evaluation
process) saturated vs idle, side by side in one run.

    .venv/bin/python bench/store.py [--quick] [--rounds N] [--pg-admin URL] [--skip-proxy]
                                    [--scorers all|NAME,NAME...]

The workload is what the gateway produces: every mirrored request goes to C candidates,
so C exchanges share one primary Observation; each exchange carries S scores. A producer
submits as fast as the writer takes them, keeping the queue under half its bound (it
never lets submit refuse, so the figure is the writer's, not the queue's), in the same
event loop as the writer, as in the evaluation process.

Rules of the measurement:
1. Each round writes into a fresh database (PostgreSQL: CREATE DATABASE ... per round,
   dropped afterwards; SQLite: a temp file), migrated by Alembic, with the default
   StoreConfig except the URL.
2. The clock runs from the first submit to the moment the writer reports every record
   written. Rate = score rows written / that time; the median over rounds is reported.
3. Every ``submit`` is timed; its median, p99 and max are reported (it must not block).
   The pre-built workload is frozen out of the garbage collector (``gc.freeze``), so a
   full collection walking the benchmark's own objects does not pass for a submit stall.
4. Target: >= 10,000 score rows/s into PostgreSQL on this machine.
5. Proxy half: the gateway runs in this process with its evaluation as in production
   (PostgreSQL): scoring and writing in the evaluation process it starts; a simulator
   is the primary, another the candidate (their own processes), bench/_loadgen.py the
   client (its own process: streamed chats). Rounds alternate "idle" (evaluation gets
   only the mirrored exchanges) and "saturated" (a task in the gateway's loop submits
   exchanges through the gateway's own ``submit`` so that the evaluation process always
   has FLOOD_QUEUED_S of work queued: it scores and writes at its maximum rate). The
   scorers are PROXY_SCORERS unless ``--scorers`` names others. Reported: TTFT and
   end-to-end p50/p99 of each, medians over rounds, saturated - idle and saturated /
   idle (target TARGET_TTFT_P99_RATIO); the gateway loop's lag (how late a 1 ms timer
   fires), which tells stretches of CPU on the loop apart from the machine's CPU going
   elsewhere (on this machine: the same 2 cores); the gateway process's CPU; and the
   cost of ``submit`` on the gateway's side (the timed call, and the pickling its
   queue's feeder thread does afterwards).

Results go to stdout and to bench/results/store.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import asyncpg  # noqa: E402
from aiohttp import web  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "bench"))
from _procs import LOADGEN_SCRIPT, loadgen_result, run_main, start_sim  # noqa: E402
from _report import RESULTS_DIR, write_results  # noqa: E402

from evaluators import DEFAULT_SCORERS, Exchange, Observation, Usage  # noqa: E402
from evaluators.store import (  # noqa: E402
    ScoreWriter,
    StoreConfig,
    create_engine,
    upgrade,
)
from gateway import STATE, build_app, load_config, make_runner  # noqa: E402
from gateway._scorekeeper import Scorekeeper  # noqa: E402

RESULTS_PATH = RESULTS_DIR / "store.json"
TARGET_SCORE_ROWS_PER_S = 10_000
TARGET_TTFT_P99_RATIO = 1.05
"""Proxy TTFT p99 with evaluation saturated over idle (reported, not gated on: this
machine's two cores are shared by the gateway, its evaluation process, PostgreSQL,
the simulators and the load generator)."""
DEFAULT_PG_ADMIN = "postgresql://root@127.0.0.1:5432/postgres"
CANDIDATES = 2
SCORES_PER_EXCHANGE = 8
CHUNKS_PER_ANSWER = 64
PRODUCER_CHUNK = 100
"""Records submitted between yields to the event loop."""
FLOOD_QUEUED_S = 0.5
"""Seconds of the evaluation process's work the saturating flood keeps queued for it."""
FLOOD_MIN_PENDING = 128
PROXY_SCORERS = tuple(name for name in DEFAULT_SCORERS if name != "semantic_similarity")
"""The proxy half's scorers unless --scorers says otherwise: all but the sentence encoder
(tens of ms of CPU per exchange here), so that the writer is what saturates, as in the
measurement this half was written for. ``--scorers all`` runs the default set."""


@dataclass(frozen=True, slots=True)
class Score:
    metric: str
    candidate: float | None
    primary: float | None


def _observation(request_id: str, backend: str, started_at: float, i: int) -> Observation:
    gaps = tuple(0.02 + ((i * 7 + k) % 13) * 1e-3 for k in range(CHUNKS_PER_ANSWER - 1))
    return Observation(
        request_id=request_id, backend=backend, route="chat_completions", status=200,
        streamed=True, started_at=started_at, ttft_s=0.05 + (i % 17) * 1e-3,
        chunk_gaps_s=gaps, e2e_s=0.05 + sum(gaps),
        usage=Usage(prompt_tokens=500 + i % 100, completion_tokens=CHUNKS_PER_ANSWER,
                    cached_tokens=None if i % 3 else 256),
        finish_reason="stop", text="word " * CHUNKS_PER_ANSWER, tool_calls=(), model="m",
        bytes=9000, truncated=False, error=None,
    )


def workload(requests: int, tag: str) -> list[tuple[Exchange, list[Score]]]:
    now = time.time()
    records: list[tuple[Exchange, list[Score]]] = []
    for i in range(requests):
        request_id = f"{tag}-{i}"
        primary = _observation(request_id, "primary", now, i)
        for c in range(CANDIDATES):
            candidate = f"candidate-{c}"
            exchange = Exchange(request_id, f"session-{i % 500}", "chat_completions", candidate,
                                primary, _observation(request_id, candidate, now, i + c))
            scores = [Score(f"metric_{k}", 1.0 + (i % 10) / 10, 1.0 if k % 2 else None)
                      for k in range(SCORES_PER_EXCHANGE)]
            records.append((exchange, scores))
    return records


async def run_round(url: str, requests: int) -> dict[str, Any]:
    await upgrade(url)
    config = StoreConfig(url=url)
    engine = create_engine(config)
    records = workload(requests, secrets.token_hex(4))
    # The workload is the benchmark's, not the writer's: keep the collector from walking
    # its millions of objects during the timed phase (it would show as a submit stall).
    gc.collect()
    gc.freeze()
    durations: list[float] = []
    refused = 0
    half = config.queue_rows // 2
    try:
        async with ScoreWriter(engine, config) as writer:
            cpu0, started = time.process_time(), time.perf_counter()
            for n, (exchange, scores) in enumerate(records, 1):
                t = time.perf_counter()
                ok = writer.submit(exchange, scores)
                durations.append(time.perf_counter() - t)
                refused += not ok
                if n % PRODUCER_CHUNK == 0:
                    await asyncio.sleep(0)
                    while writer.stats.queued_rows > half:  # noqa: ASYNC110 - polling counters
                        await asyncio.sleep(0.001)
            while writer.stats.written_records < len(records) - refused:  # noqa: ASYNC110
                await asyncio.sleep(0.002)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
            stats = writer.stats
    finally:
        await engine.dispose()
        gc.unfreeze()
    scores_written = stats.written_rows["scores"]
    durations.sort()
    return {
        "records": len(records),
        "refused": refused,
        "dropped": {k: v for k, v in stats.dropped.items() if v},
        "score_rows": scores_written,
        "all_rows": sum(v for k, v in stats.written_rows.items() if k != "backends"),
        "batches": stats.batches,
        "retries": stats.retries,
        "seconds": elapsed,
        "score_rows_per_s": scores_written / elapsed,
        "process_cpu_s": cpu,
        "submit_us": {
            "median": statistics.median(durations) * 1e6,
            "p99": durations[int(0.99 * (len(durations) - 1))] * 1e6,
            "max": durations[-1] * 1e6,
        },
    }


async def _admin(admin_url: str, statement: str) -> None:
    connection = await asyncpg.connect(admin_url, timeout=5)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


async def postgres_round(admin_url: str, requests: int) -> dict[str, Any]:
    name = f"understudy_bench_{secrets.token_hex(6)}"
    await _admin(admin_url, f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
    try:
        return await run_round(f"{base}/{name}", requests)
    finally:
        await _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def sqlite_round(requests: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="understudy-bench-") as folder:
        return await run_round(f"sqlite+aiosqlite:///{folder}/store.db", requests)


# --- the proxy, with evaluation idle and saturated ----------------------------------------

SIM_MODEL = "sim-model"
STREAM_TTFT_MS, STREAM_ITL_MS, STREAM_TOKENS = 20.0, 20.0, 32
STREAM_CONCURRENCY = 32


async def _loadgen(url: str, requests_per_worker: int) -> dict[str, Any]:
    answer_s = (STREAM_TTFT_MS + STREAM_ITL_MS * (STREAM_TOKENS - 1)) / 1000
    spec = {
        "url": url, "mode": "stream", "model": SIM_MODEL, "concurrency": STREAM_CONCURRENCY,
        "requests_per_worker": requests_per_worker, "duration_s": 120.0,
        "deadline_s": 120.0, "request_timeout_s": 60.0, "max_tokens": STREAM_TOKENS,
        "stagger_s": answer_s, "client_usage": False, "cpu_pids": {},
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(LOADGEN_SCRIPT), json.dumps(spec), cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return loadgen_result(proc.returncode, out.decode(), err.decode())


async def _flood(scorekeeper: Scorekeeper, records: list[tuple[Exchange, list[Score]]],
                 submit_s: list[float]) -> None:
    """Keep the evaluation process busy: FLOOD_QUEUED_S of its work always queued.

    Submits in runs of PRODUCER_CHUNK with a yield between them, as the mirror would,
    through the gateway's own ``submit``; each call is timed into ``submit_s``. The
    process's rate and pending count come from its reports (every few hundred ms), so
    the queue swings around the mark; it never fills (that would refuse the mirrored
    exchanges), and the round's end drains in well under a second.
    """
    n = 0
    started = time.perf_counter()
    first = scorekeeper.pipeline_stats
    scored_before = first.scored if first is not None else 0
    while True:
        stats = scorekeeper.pipeline_stats
        assert stats is not None
        rate = (stats.scored - scored_before) / (time.perf_counter() - started)
        if stats.pending >= max(FLOOD_MIN_PENDING, rate * FLOOD_QUEUED_S):
            await asyncio.sleep(0.005)
            continue
        for _ in range(PRODUCER_CHUNK):
            exchange, _scores = records[n % len(records)]
            n += 1
            fresh = Exchange(f"{exchange.request_id}-{n}", exchange.session_key,
                             exchange.route, exchange.candidate, exchange.primary,
                             exchange.candidate_observation)
            t = time.perf_counter()
            scorekeeper.submit(fresh)
            submit_s.append(time.perf_counter() - t)
        await asyncio.sleep(0)


async def _loop_lag(lags: list[float]) -> None:
    """How late a 1 ms timer fires: what any task in this loop waits behind others."""
    while True:
        started = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - started - 0.001)


def _scores_written(scorekeeper: Scorekeeper) -> int:
    stats = scorekeeper.writer_stats
    return stats.written_rows["scores"] if stats is not None else 0


async def _drained(scorekeeper: Scorekeeper) -> None:
    def busy() -> bool:
        pipeline, writer = scorekeeper.pipeline_stats, scorekeeper.writer_stats
        return (pipeline is None or writer is None or pipeline.pending > 0
                or writer.queued_records > 0 or writer.held_records > 0)

    while busy():  # noqa: ASYNC110 - polling counters
        await asyncio.sleep(0.05)


def _pickle_us(records: list[tuple[Exchange, list[Score]]]) -> float:
    """What the multiprocessing queue's feeder thread spends per exchange (pickling)."""
    exchanges = [exchange for exchange, _ in records]
    started = time.perf_counter()
    for exchange in exchanges:
        ForkingPickler.dumps(exchange)
    return (time.perf_counter() - started) / len(exchanges) * 1e6


async def proxy_rounds(admin_url: str, rounds: int, requests_per_worker: int,
                       workdir: Path, scorers: tuple[str, ...]) -> dict[str, Any]:
    name = f"understudy_bench_{secrets.token_hex(6)}"
    await _admin(admin_url, f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
    url = f"{base}/{name}"
    figures: dict[str, list[dict[str, Any]]] = {"idle": [], "saturated": []}
    submit_s: list[float] = []
    simulators = ExitStack()  # stops them as it closes (_procs rule 3)
    try:
        sims = [start_sim(simulators, workdir, REPO_ROOT, ttft_ms=STREAM_TTFT_MS,
                          itl_ms=STREAM_ITL_MS, tokens=STREAM_TOKENS, name=f"sim-{role}")
                for role in ("primary", "candidate")]
        records = workload(2_000, secrets.token_hex(4))  # built before anything is measured
        pickle_us = statistics.median(_pickle_us(records) for _ in range(3))
        gc.collect()
        gc.freeze()
        gateway = load_config(None, {
            "server": {"port": 0}, "primary": {"url": sims[0].url},
            "candidates": [{"name": "candidate", "url": sims[1].url}],
            "evaluation": {"enabled": True, "store": {"url": url}, "scorers": scorers},
        })
        app = build_app(gateway)
        scorekeeper = app[STATE].scorekeeper
        assert scorekeeper is not None
        runner = make_runner(app)
        await runner.setup()  # migrates, then starts the evaluation process
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            gateway_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            for i in range(rounds):
                order = ("idle", "saturated") if i % 2 == 0 else ("saturated", "idle")
                for mode in order:
                    before = _scores_written(scorekeeper)
                    started, cpu0 = time.perf_counter(), time.process_time()
                    lags: list[float] = []
                    tasks = [asyncio.create_task(_loop_lag(lags))]
                    if mode == "saturated":
                        tasks.append(asyncio.create_task(_flood(scorekeeper, records, submit_s)))
                    try:
                        result = await _loadgen(gateway_url, requests_per_worker)
                    finally:
                        for task in tasks:
                            task.cancel()
                        await asyncio.gather(*tasks, return_exceptions=True)
                    elapsed = time.perf_counter() - started
                    cpu = time.process_time() - cpu0
                    rate = (_scores_written(scorekeeper) - before) / elapsed
                    await _drained(scorekeeper)  # the next round starts from idle
                    figures[mode].append(_proxy_figures(result, rate, lags, cpu / elapsed))
                    print(f"  {mode:9s} " + _proxy_line(figures[mode][-1]), flush=True)
        finally:
            await runner.cleanup()
    finally:
        simulators.close()
        gc.unfreeze()
        await _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    medians = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]
                      if isinstance(rs[0][key], float)} for mode, rs in figures.items()}
    submit_s.sort()
    submit = {
        "calls": len(submit_s),
        "median_us": statistics.median(submit_s) * 1e6 if submit_s else 0.0,
        "p99_us": submit_s[int(0.99 * (len(submit_s) - 1))] * 1e6 if submit_s else 0.0,
        "feeder_pickle_us": pickle_us,
    }
    return {"rounds": figures, "medians": medians, "submit": submit, "scorers": scorers}


def _proxy_figures(result: dict[str, Any], score_rows_per_s: float,
                   lags: list[float], gateway_cpu: float) -> dict[str, Any]:
    def ms(summary: dict[str, Any], key: str) -> float:
        return float(summary[key] or 0.0) * 1000

    return {
        "ok": result["ok"], "errors": result["errors"],
        "ttft_p50_ms": ms(result["ttft_s"], "p50"), "ttft_p99_ms": ms(result["ttft_s"], "p99"),
        "e2e_p50_ms": ms(result["e2e_s"], "p50"), "e2e_p99_ms": ms(result["e2e_s"], "p99"),
        "writer_score_rows_per_s": score_rows_per_s,
        "loop_lag_p99_ms": sorted(lags)[int(0.99 * (len(lags) - 1))] * 1000 if lags else 0.0,
        "loop_lag_max_ms": max(lags, default=0.0) * 1000,
        "gateway_cpu": gateway_cpu,
    }


def _proxy_line(f: dict[str, Any]) -> str:
    return (f"TTFT p50 {f['ttft_p50_ms']:6.1f} ms  p99 {f['ttft_p99_ms']:6.1f} ms   "
            f"e2e p50 {f['e2e_p50_ms']:6.1f} ms  p99 {f['e2e_p99_ms']:6.1f} ms   "
            f"loop lag p99 {f['loop_lag_p99_ms']:5.1f} ms max {f['loop_lag_max_ms']:5.1f} ms   "
            f"({f['ok']} streams, {f['errors']} errors; gateway CPU "
            f"{f['gateway_cpu']:.0%}; writer {f['writer_score_rows_per_s']:,.0f} score rows/s)")


def _line(backend: str, r: dict[str, Any]) -> str:
    s = r["submit_us"]
    return (f"  {backend:10s} {r['score_rows_per_s']:>9,.0f} score rows/s  "
            f"({r['score_rows']:,} scores + {r['all_rows'] - r['score_rows']:,} other rows "
            f"in {r['seconds']:.2f} s, {r['batches']} batches, CPU {r['process_cpu_s']:.2f} s)  "
            f"submit median {s['median']:.1f} us, p99 {s['p99']:.1f} us, max {s['max']:.0f} us"
            + (f"  REFUSED {r['refused']}" if r["refused"] else ""))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rounds = args.rounds or (1 if args.quick else 3)
    requests = 1_000 if args.quick else 5_000
    exchanges = requests * CANDIDATES
    print("understudy bench/store.py — ScoreWriter throughput, one run")
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average at start {os.getloadavg()[0]:.2f}")
    print(f"workload: {requests:,} requests x {CANDIDATES} candidates = {exchanges:,} "
          f"exchanges, {SCORES_PER_EXCHANGE} scores each "
          f"({exchanges * SCORES_PER_EXCHANGE:,} score rows a round), {rounds} round(s)\n",
          flush=True)
    results: dict[str, list[dict[str, Any]]] = {"postgresql": [], "sqlite": []}
    for i in range(rounds):
        print(f"round {i + 1}:", flush=True)
        pg = await postgres_round(args.pg_admin, requests)
        results["postgresql"].append(pg)
        print(_line("postgresql", pg), flush=True)
        lite = await sqlite_round(requests)
        results["sqlite"].append(lite)
        print(_line("sqlite", lite), flush=True)
    summary = {
        backend: {
            "median_score_rows_per_s": statistics.median(r["score_rows_per_s"] for r in rs),
            "rounds": rs,
        }
        for backend, rs in results.items()
    }
    pg_rate = summary["postgresql"]["median_score_rows_per_s"]
    passed = pg_rate >= TARGET_SCORE_ROWS_PER_S
    print("\nmedians over rounds:")
    for backend, s in summary.items():
        print(f"  {backend:10s} {s['median_score_rows_per_s']:>9,.0f} score rows/s")
    proxy: dict[str, Any] | None = None
    if not args.skip_proxy:
        print(f"\nproxy latency, evaluation idle vs saturated: streamed chats, {STREAM_TOKENS} "
              f"chunks x {STREAM_ITL_MS:.0f} ms, {STREAM_CONCURRENCY} concurrent, mirrored "
              f"to one candidate, {rounds} round(s) each, alternating; scorers: "
              f"{', '.join(args.scorers)}", flush=True)
        with tempfile.TemporaryDirectory(prefix="understudy-bench-") as workdir:
            proxy = await proxy_rounds(args.pg_admin, rounds, 3 if args.quick else 8,
                                       Path(workdir), args.scorers)
        idle, busy = proxy["medians"]["idle"], proxy["medians"]["saturated"]
        print("  medians:")
        for mode, m in (("idle", idle), ("saturated", busy)):
            print(f"  {mode:9s} TTFT p99 {m['ttft_p99_ms']:6.1f} ms   e2e p99 "
                  f"{m['e2e_p99_ms']:6.1f} ms   loop lag p99 {m['loop_lag_p99_ms']:5.1f} ms   "
                  f"writer {m['writer_score_rows_per_s']:,.0f} score rows/s")
        print(f"  saturated - idle: TTFT p99 {busy['ttft_p99_ms'] - idle['ttft_p99_ms']:+.1f} ms"
              f", e2e p99 {busy['e2e_p99_ms'] - idle['e2e_p99_ms']:+.1f} ms; saturated / idle: "
              f"TTFT p99 {busy['ttft_p99_ms'] / idle['ttft_p99_ms']:.2f}x "
              f"(target <= {TARGET_TTFT_P99_RATIO:.2f}x)")
        submit = proxy["submit"]
        print(f"  gateway-side submit: median {submit['median_us']:.1f} us, p99 "
              f"{submit['p99_us']:.1f} us over {submit['calls']:,} calls; the queue's feeder "
              f"thread then pickles each exchange: {submit['feeder_pickle_us']:.0f} us")
    print(f"\ntarget: {'PASS' if passed else 'FAIL'}  >= {TARGET_SCORE_ROWS_PER_S:,} score "
          f"rows/s into PostgreSQL, measured {pg_rate:,.0f} "
          f"({pg_rate / TARGET_SCORE_ROWS_PER_S:.2f}x)")
    return {
        "proxy": proxy,
        "meta": {"python": platform.python_version(), "cpus": os.cpu_count(),
                 "loadavg_at_start": os.getloadavg()[0], "quick": args.quick,
                 "requests": requests, "candidates": CANDIDATES,
                 "scores_per_exchange": SCORES_PER_EXCHANGE, "rounds": rounds},
        "target": {"score_rows_per_s": TARGET_SCORE_ROWS_PER_S, "measured": pg_rate,
                   "passed": passed},
        "results": summary,
    }


def _scorers(value: str) -> tuple[str, ...]:
    return DEFAULT_SCORERS if value == "all" else tuple(value.split(","))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, a smaller workload")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--skip-proxy", action="store_true",
                        help="only the writer's throughput, not the proxy's latency")
    parser.add_argument("--scorers", type=_scorers, default=PROXY_SCORERS,
                        help="the proxy half's scorers, comma-separated, or 'all' "
                             "(default: all but semantic_similarity)")
    parser.add_argument("--pg-admin", default=os.environ.get("UNDERSTUDY_BENCH_PG_ADMIN",
                                                             DEFAULT_PG_ADMIN),
                        help="a PostgreSQL URL allowed to CREATE/DROP DATABASE")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(write_results(RESULTS_PATH, result))
    return 0 if result["target"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
