"""bench/score.py --gateway: does scoring keep up with what the gateway mirrors?

The gateway (one process and its scoring child) in front of a simulator primary,
mirroring every request to one healthy simulator candidate, offered ``RATE`` requests/s
for ``DURATION_S`` (open loop: a request leaves every 1/RATE s whatever the answers do,
at most ``MAX_IN_FLIGHT`` at once, all on 127.0.0.1). Answers are ``TOKENS`` words,
non-streamed (the relay's per-chunk cost is bench/proxy.py's subject, not this one's).
Each request's prompt is unique, so none is deduplicated. ``variant`` "" makes the
candidate answer as the primary does, byte for byte (an exact engine); "differ" gives
it answers of its own. ``semantic_model`` is the gateway's
``[evaluation.scoring] semantic_model`` ("static", the default, or "minilm").

Then the gateway drains (bounded by ``DRAIN_TIMEOUT_S``) and its /metrics and its store
are read: joined exchanges, ``sink_full`` drops, scored exchanges, rows stored, and the
scoring child's own figures (exchanges, batches, last batch size, queue depth).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
from _procs import Child, free_port, spawn, understudy_argv, wait_ready
from _report import loadavg, render_table

REPO_ROOT = Path(__file__).resolve().parent.parent
RATE = 100.0
DURATION_S = 60.0
QUICK_DURATION_S = 10.0
TOKENS = 200
TTFT_MS, ITL_MS = 20.0, 0.5
MAX_IN_FLIGHT = 400
REQUEST_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 180.0
DRAIN_POLL_S = 1.0
CANDIDATE_CONCURRENCY = 64
READY_TIMEOUT_S = 90.0


def _sim(stack: ExitStack, workdir: Path, name: str, variant: str) -> Child:
    port = free_port()
    argv = understudy_argv("sim", "--port", str(port), "--ttft-ms", str(TTFT_MS), "--itl-ms",
                           str(ITL_MS), "--tokens", str(TOKENS), "--variant", variant)
    return spawn(stack, name, argv, workdir, REPO_ROOT, url=f"http://127.0.0.1:{port}")


def _gateway(stack: ExitStack, workdir: Path, primary: str, candidate: str,
             semantic_model: str) -> tuple[Child, Path]:
    port = free_port()
    db = workdir / "gateway.db"
    candidate_entry = {"name": "cand", "url": candidate, "sample_rate": 1.0,
                       "sampling_unit": "request", "max_concurrency": CANDIDATE_CONCURRENCY}
    lines = ["[server]", 'host = "127.0.0.1"', f"port = {port}", "",
             "[primary]", f'url = "{primary}"', "",
             "[evaluation]", "enabled = true", "",
             "[evaluation.store]", f'url = "sqlite+aiosqlite:///{db}"', "",
             "[evaluation.scoring]", f"semantic_model = {json.dumps(semantic_model)}", "",
             "[[candidates]]", *(f"{k} = {json.dumps(v)}" for k, v in candidate_entry.items())]
    config = workdir / "gateway.toml"
    config.write_text("\n".join(lines) + "\n")
    argv = understudy_argv("serve", "--config", str(config))
    return spawn(stack, "gateway", argv, workdir, REPO_ROOT, cwd=workdir,
                 url=f"http://127.0.0.1:{port}"), db


def scrape(url: str) -> dict[str, float]:
    """understudy_* series of /metrics, summed over labels but ``reason``."""
    with urllib.request.urlopen(url + "/metrics", timeout=5.0) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("understudy_") or "_created" in line.partition(" ")[0]:
            continue
        key, _, value = line.rpartition(" ")
        name = key.partition("{")[0]
        if 'reason="' in key:
            name += ":" + key.split('reason="')[1].split('"')[0]
        found[name] = found.get(name, 0.0) + float(value)
    return found


async def _offer(url: str, duration_s: float) -> dict[str, Any]:
    """Open-loop load: one request every 1/RATE s for ``duration_s``, bounded in flight."""
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    tally: dict[str, float] = {"sent": 0, "ok": 0, "errors": 0, "skipped_in_flight_cap": 0}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    tasks: set[asyncio.Task[None]] = set()

    async def one(session: aiohttp.ClientSession, n: int) -> None:
        body = {"model": "sim-model", "stream": False, "max_tokens": TOKENS + 8,
                "messages": [{"role": "user", "content": f"question {n}: tell me more"}]}
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                tally["ok" if resp.status == 200 else "errors"] += 1
        except (aiohttp.ClientError, TimeoutError):
            tally["errors"] += 1
        finally:
            slots.release()

    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        for n in itertools.count():
            due = start + n / RATE
            if due - start >= duration_s:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if slots.locked():
                tally["skipped_in_flight_cap"] += 1
                continue
            await slots.acquire()
            tally["sent"] += 1
            task = asyncio.ensure_future(one(session, n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        tally["offered_s"] = time.monotonic() - start
        await asyncio.gather(*tasks)
    return tally


_DRAIN_SERIES = ("understudy_mirror_", "understudy_evaluation_", "understudy_scoring_",
                 "understudy_store_")
"""The series that stop moving once the drain is over (the backend scrapes never do)."""


def _drain(url: str) -> tuple[dict[str, float], float]:
    """Until every joined exchange is scored or dropped and no counter moves (bounded)."""
    started = time.monotonic()
    last: dict[str, float] = {}
    while time.monotonic() - started < DRAIN_TIMEOUT_S:
        metrics = scrape(url)
        joined = metrics.get("understudy_mirror_joined_total", 0.0)
        evaluated = metrics.get("understudy_evaluation_scored_total", 0.0) + sum(
            v for k, v in metrics.items() if k.startswith("understudy_evaluation_dropped"))
        settled = {k: v for k, v in metrics.items() if k.startswith(_DRAIN_SERIES)}
        if settled == last and evaluated >= joined:
            return metrics, time.monotonic() - started
        last = settled
        time.sleep(DRAIN_POLL_S)
    return scrape(url), time.monotonic() - started


def _stored(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        exchanges = conn.execute("select count(*) from exchanges").fetchone()[0]
        scores = conn.execute("select count(*) from scores").fetchone()[0]
    return {"exchanges": int(exchanges), "scores": int(scores)}


def run_gateway_phase(*, quick: bool = False, variant: str = "",
                      semantic_model: str = "static") -> dict[str, Any]:
    duration = QUICK_DURATION_S if quick else DURATION_S
    with tempfile.TemporaryDirectory(prefix="score-gw-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        primary = _sim(stack, workdir, "primary", "")
        candidate = _sim(stack, workdir, "candidate", variant)
        for sim in (primary, candidate):
            wait_ready(sim, READY_TIMEOUT_S)
        gateway, db = _gateway(stack, workdir, primary.url, candidate.url, semantic_model)
        wait_ready(gateway, READY_TIMEOUT_S)
        load_before = loadavg()
        tally = asyncio.run(_offer(gateway.url, duration))
        metrics, drain_s = _drain(gateway.url)
        stored = _stored(db)
    pick = {k.removeprefix("understudy_"): v for k, v in metrics.items()
            if k.startswith(_DRAIN_SERIES[:3])}
    return {"rate": RATE, "duration_s": duration, "tokens": TOKENS, "variant": variant,
            "semantic_model": semantic_model,
            "load": tally, "drain_s": drain_s, "metrics": pick, "stored": stored,
            "loadavg_before": load_before, "loadavg_after": loadavg()}


def render_gateway(result: dict[str, Any]) -> str:
    m = result["metrics"]
    rows = [[key, f"{value:g}"] for key, value in sorted(m.items())
            if key.startswith(("mirror_joined", "mirror_dropped", "evaluation_",
                               "scoring_"))]
    rows += [["load: " + k, f"{v:g}" if isinstance(v, float) else str(v)]
             for k, v in result["load"].items()]
    rows += [["stored exchanges", str(result["stored"]["exchanges"])],
             ["stored scores", str(result["stored"]["scores"])],
             ["drain s", f"{result['drain_s']:.1f}"],
             ["loadavg before / after", f"{result['loadavg_before']} / "
                                        f"{result['loadavg_after']}"]]
    sink_full = m.get("mirror_dropped_total:sink_full", 0.0)
    title = (f"gateway at {result['rate']:g} requests/s for {result['duration_s']:g} s, "
             f"one candidate ({'identical' if not result['variant'] else 'differing'} "
             f"answers, {result['tokens']} words), semantic model "
             f"{result.get('semantic_model', 'static')}: sink_full {sink_full:g}")
    return render_table(title, ["figure", "value"], rows)
