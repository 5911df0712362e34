"""The load generator of bench/mirror.py: bench/_loadgen.py's closed loop, with a body of
its own for every request, optionally padded to a large prompt, and the RSS of one
process sampled while it runs.

Run as ``python bench/_mirror_loadgen.py SPEC_JSON``; prints one JSON object on stdout.

Why not bench/_loadgen.py as it is: it sends one body over and over, and the gateway
queues a request identical to one still queued for a candidate only once (DESIGN.md
invariant 4), so a repeated body would mirror a fraction of the traffic and hold one
payload however long the overload lasts. Here every measured request differs (a counter
in the prompt), so each one is a new item for the candidate and a new payload for the
budget. Timing, counting and CPU rules are _loadgen's, whose code is reused as it is:
1. Each of ``concurrency`` workers sends at most ``requests_per_worker`` streamed chats
   and starts none after ``duration_s``; the phase is cancelled at ``deadline_s``.
2. Warm-up (not measured): one short request per worker, each its own unless
   ``unique`` is false (then every measured request carries the same body too).
3. CPU of ``cpu_pids`` is read right before the first measured request and right after
   the last. RSS of ``rss_pid`` (VmRSS, VmHWM from /proc/PID/status) is read at the same
   two moments and every ``rss_interval_s`` in between; VmHWM is the kernel's own
   high-water mark, so a peak between two samples is not missed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loadgen import Tally, _stream_once, measure, open_session, warm_up
from _procs import CLOCK_TICKS

_PROMPT = "Tell me about relays, briefly."
_PAD_WORD = "mirror "


def read_status_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in KiB (empty if the process is gone)."""
    found: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return found
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0])
    return found


def chat_body(spec: dict[str, Any], tag: str) -> bytes:
    """A streamed chat request whose prompt holds ``tag`` and, if asked, padding."""
    content = f"{_PROMPT} [{tag}]"
    pad_to = int(spec.get("prompt_bytes", 0))
    if pad_to > len(content):
        words = (pad_to - len(content)) // len(_PAD_WORD) + 1
        content = (content + " " + _PAD_WORD * words)[:pad_to]
    return json.dumps({"model": spec["model"], "max_tokens": spec["max_tokens"],
                       "stream": True,
                       "messages": [{"role": "user", "content": content}]}).encode()


def warm_body(spec: dict[str, Any], tag: str) -> bytes:
    return json.dumps({"model": spec["model"], "max_tokens": 1, "messages": [
        {"role": "user", "content": f"{_PROMPT} [warm-up {tag}]"}]}).encode()


async def _sample_rss(pid: int, interval_s: float, peak: dict[str, int]) -> None:
    while True:
        status = read_status_kib(pid)
        if status:
            peak["rss_kib"] = max(peak.get("rss_kib", 0), status["VmRSS"])
            peak["samples"] = peak.get("samples", 0) + 1
        await asyncio.sleep(interval_s)


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    url = spec["url"].rstrip("/") + "/v1/chat/completions"
    rss_pid: int | None = spec.get("rss_pid")
    unique = bool(spec.get("unique", True))
    tally = Tally()
    sent_bytes = 0
    async with open_session(spec) as session:
        run_tag = f"{time.time_ns():x}"  # differs between phases and between runs
        if failed := await warm_up(session, url, [
                warm_body(spec, f"{run_tag}-{i}" if unique else "same")
                for i in range(int(spec["concurrency"]))]):
            return {"error": failed}

        async def send(worker: int, sequence: int) -> None:
            nonlocal sent_bytes
            body = chat_body(spec, f"{run_tag}-{worker}-{sequence}" if unique else "same")
            sent_bytes += len(body)
            await _stream_once(session, url, body, tally)

        rss_before = read_status_kib(rss_pid) if rss_pid else {}
        peak: dict[str, int] = {}
        sampler = (asyncio.ensure_future(
            _sample_rss(rss_pid, float(spec.get("rss_interval_s", 0.05)), peak))
            if rss_pid else None)
        result = await measure(spec, tally, send)
        rss_after = read_status_kib(rss_pid) if rss_pid else {}
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    result.update({
        "sent_bytes": sent_bytes,
        # Every completed request's, so that percentiles can be taken over several runs.
        "ttft_samples_ms": [round(v * 1000, 2) for v in tally.ttft],
        "e2e_samples_ms": [round(v * 1000, 1) for v in tally.e2e],
        "clock_ticks": CLOCK_TICKS,
    })
    if rss_pid:
        result["rss"] = {
            "before_kib": rss_before.get("VmRSS"), "hwm_before_kib": rss_before.get("VmHWM"),
            "after_kib": rss_after.get("VmRSS"), "hwm_after_kib": rss_after.get("VmHWM"),
            "peak_sampled_kib": peak.get("rss_kib"), "samples": peak.get("samples", 0),
        }
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = uvloop.run(run(spec))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
