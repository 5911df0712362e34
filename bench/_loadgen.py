"""The load generator: one process, one aiohttp session, a bounded closed loop.

Run as ``python bench/_loadgen.py SPEC_JSON`` (prints one JSON result on stdout), or as
``python bench/_loadgen.py --serve``: one JSON spec per line on stdin, one JSON result per
line on stdout, so a benchmark pays the interpreter's start once, not once per round.

Rules:
1. Every run is bounded twice: each of the ``concurrency`` workers sends at most
   ``requests_per_worker`` requests and stops starting new ones after ``duration_s``;
   the whole phase is cancelled at ``deadline_s`` (what finished still counts).
2. A warm-up (one short non-streamed request per worker, all at once) opens the
   connections first; it is not measured, and neither CPU nor latency includes it.
3. CPU of the processes named in ``cpu_pids`` is read from /proc right before the first
   measured request and right after the last one, so it covers the measured phase only.
4. Streams: TTFT is the time from sending the request to the first SSE event that
   carries content (the chat role event does not); events are counted by newlines
   (an SSE event is ``data: ...\\n\\n`` and JSON never holds a raw newline); a stream
   counts as complete only if it ends with ``data: [DONE]``.
5. Worker i starts ``stagger_s * i / concurrency`` after the phase begins: spread over one
   answer's duration, the streams arrive steadily and stay at ``concurrency`` in flight;
   spread over one inter-token gap, every wave of streams starts as a burst.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import CLOCK_TICKS, cpu_ticks_split, machine_ticks

_CONTENT_MARK = b'"delta":{"content":"'
_DONE = b"data: [DONE]\n\n"
_MAX_ERRORS_KEPT = 5


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    events: int = 0
    ok: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < _MAX_ERRORS_KEPT:
            self.error_samples.append(what)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99), "max": max(values) if values else None,
            "mean": sum(values) / len(values) if values else None}


async def _stream_once(session: aiohttp.ClientSession, url: str, body: bytes,
                       tally: Tally) -> None:
    started = time.perf_counter()
    ttft: float | None = None
    head = b""
    tail = b""
    newlines = 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            tally.fail(f"status {resp.status}: {(await resp.read())[:200]!r}")
            return
        reader = resp.content
        while data := await reader.readany():
            newlines += data.count(b"\n")
            if ttft is None:
                head += data
                if _CONTENT_MARK in head:
                    ttft = time.perf_counter() - started
                    head = b""
            tail = (tail + data)[-len(_DONE):]
    ended = time.perf_counter() - started
    tally.events += newlines // 2
    if tail != _DONE or ttft is None:
        tally.fail(f"incomplete stream: {newlines // 2} events, tail {tail!r}")
        return
    tally.ok += 1
    tally.ttft.append(ttft)
    tally.e2e.append(ended)


async def _small_once(session: aiohttp.ClientSession, url: str, body: bytes,
                      tally: Tally) -> None:
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        payload = await resp.read()
        if resp.status != 200 or not payload:
            tally.fail(f"status {resp.status}: {payload[:200]!r}")
            return
    tally.ok += 1
    tally.events += 1
    tally.e2e.append(time.perf_counter() - started)


def _bodies(spec: dict[str, Any]) -> tuple[bytes, bytes]:
    """(measured request body, warm-up body)."""
    base = {"model": spec["model"],
            "messages": [{"role": "user", "content": "Tell me about relays, briefly."}]}
    measured = {**base, "max_tokens": spec["max_tokens"]}
    if spec["mode"] == "stream":
        measured["stream"] = True
        if spec.get("client_usage"):
            measured["stream_options"] = {"include_usage": True}
    warm = {**base, "max_tokens": 1}
    return json.dumps(measured).encode(), json.dumps(warm).encode()


def open_session(spec: dict[str, Any]) -> aiohttp.ClientSession:
    """The one session of a run: a connection per worker, each request bounded."""
    concurrency = int(spec["concurrency"])
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=float(spec["request_timeout_s"]))
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def warm_up(session: aiohttp.ClientSession, url: str, bodies: list[bytes]) -> str | None:
    """One short request per body, all at once (rule 2); what failed, or None."""
    warm = Tally()
    await asyncio.gather(*(_small_once(session, url, body, warm) for body in bodies))
    return f"warm-up failed: {warm.error_samples}" if warm.errors else None


async def measure(spec: dict[str, Any], tally: Tally,
                  send: Callable[[int, int], Awaitable[None]]) -> dict[str, Any]:
    """The measured phase: each worker calls ``send(worker, sequence)`` in a closed loop,
    bounded by rules 1 and 5; the figures it counted in ``tally``, with the CPU (rule 3)."""
    concurrency = int(spec["concurrency"])
    per_worker = int(spec["requests_per_worker"])
    stagger_s = float(spec.get("stagger_s", 0.0))
    cpu_pids: dict[str, list[int]] = spec.get("cpu_pids", {})
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + float(spec["duration_s"])

    async def worker(index: int) -> None:
        if stagger_s:
            await asyncio.sleep(stagger_s * index / concurrency)
        for sequence in range(per_worker):
            if loop.time() >= stop_at:
                return
            try:
                await send(index, sequence)
            except (aiohttp.ClientError, TimeoutError) as exc:
                tally.fail(f"{type(exc).__name__}: {exc}")

    before = {name: cpu_ticks_split(pids) for name, pids in cpu_pids.items()}
    machine_before = machine_ticks()
    own_before = time.process_time()
    started = time.perf_counter()
    tasks = [asyncio.ensure_future(worker(i)) for i in range(concurrency)]
    _done, pending = await asyncio.wait(tasks, timeout=float(spec["deadline_s"]))
    elapsed = time.perf_counter() - started
    own_cpu = time.process_time() - own_before
    machine_after = machine_ticks()
    after = {name: cpu_ticks_split(pids) for name, pids in cpu_pids.items()}
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    busy = machine_after[0] - machine_before[0]
    total = machine_after[1] - machine_before[1]
    return {
        "elapsed_s": elapsed,
        "ok": tally.ok,
        "errors": tally.errors,
        "error_samples": tally.error_samples,
        "cut_by_deadline": len(pending),
        "events": tally.events,
        "rps": tally.ok / elapsed if elapsed else 0.0,
        "events_per_s": tally.events / elapsed if elapsed else 0.0,
        "ttft_s": summary(tally.ttft),
        "e2e_s": summary(tally.e2e),
        "cpu_ticks": {name: sum(after[name]) - sum(before[name]) for name in before},
        "cpu_user_ticks": {name: after[name][0] - before[name][0] for name in before},
        "loadgen_cpu_s": own_cpu,
        "machine_busy_s": busy / CLOCK_TICKS,
        "machine_capacity_s": total / CLOCK_TICKS,
    }


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    url = spec["url"].rstrip("/") + "/v1/chat/completions"
    body, warm_body = _bodies(spec)
    once = _stream_once if spec["mode"] == "stream" else _small_once
    tally = Tally()
    async with open_session(spec) as session:
        if failed := await warm_up(session, url, [warm_body] * int(spec["concurrency"])):
            return {"error": failed}

        async def send(_worker: int, _sequence: int) -> None:
            await once(session, url, body, tally)

        return await measure(spec, tally, send)


def main() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        if sys.argv[1:] != ["--serve"]:
            sys.stdout.write(json.dumps(runner.run(run(json.loads(sys.argv[1])))) + "\n")
            return
        for line in sys.stdin:
            if line.strip():
                sys.stdout.write(json.dumps(runner.run(run(json.loads(line)))) + "\n")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
