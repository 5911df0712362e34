"""The simulator's load model: latency grows with requests in flight; a prefix cache that
remembers the chat prefixes it saw."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from tests.utils import run_sim


async def _timed(http: aiohttp.ClientSession, url: str,
                 messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    started = time.monotonic()
    async with http.post(url + "/v1/chat/completions",
                         json={"model": "sim-model", "messages": messages}) as resp:
        body: dict[str, Any] = await resp.json()
    return time.monotonic() - started, body["usage"]


async def test_ttft_grows_with_requests_in_flight() -> None:
    async with run_sim(ttft_ms=5, itl_ms=0, tokens=1, ttft_per_inflight_ms=40) as sim, \
            aiohttp.ClientSession() as http:
        alone, _ = await _timed(http, sim.url, [{"role": "user", "content": "a"}])
        crowd = await asyncio.gather(*(
            _timed(http, sim.url, [{"role": "user", "content": f"q{i}"}]) for i in range(6)))
    # The last of six arrivals waits 5 + 5 * 40 ms; alone, 5 ms.
    assert alone < 0.1
    assert max(t for t, _ in crowd) > 0.15


async def test_prefix_cache_reports_the_turns_it_saw() -> None:
    first = [{"role": "user", "content": "one two three four five"}]
    later = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "six"}]
    async with run_sim(cache="prefix", tokens=2) as warm, run_sim(cache="prefix",
                                                                   tokens=2) as cold, \
            aiohttp.ClientSession() as http:
        _, usage_first = await _timed(http, warm.url, first)
        _, usage_warm = await _timed(http, warm.url, later)
        _, usage_cold = await _timed(http, cold.url, later)
    assert usage_first["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage_warm["prompt_tokens_details"]["cached_tokens"] == usage_first["prompt_tokens"]
    assert usage_cold["prompt_tokens_details"]["cached_tokens"] == 0
