"""Mirrored traffic scored, stored and judged: the gateway with evaluation on.

The simulator plays the primary, a secondary replica of it (the noise floor) and a
candidate that answers differently and more slowly; the store is SQLite and the real
PostgreSQL in turn.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import aiohttp
import openai
import pytest

from evaluators import EvaluationProcessError
from tests.utils import RunningGateway, eventually, judged_candidate, run_gateway, run_sim

REQUESTS = 24


async def _traffic(gw: RunningGateway, n: int) -> None:
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
    for i in range(n):
        stream = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": f"question {i}"}],
            stream=True)
        async for _ in stream:
            pass
    await client.close()


async def test_report_shows_a_worse_candidate_beyond_the_noise_floor(db_url: str) -> None:
    slower_and_other = {"ttft_ms": 150, "itl_ms": 2, "variant": "other"}
    async with judged_candidate(db_url, slower_and_other, ttft_ms=5, itl_ms=1,
                                tokens=12) as gw, aiohttp.ClientSession() as http:
        await _traffic(gw, REQUESTS)
        await eventually(lambda: gw.written_records >= 2 * REQUESTS, within_s=30)
        async with http.get(gw.admin_url + "/candidates/cand/report") as resp:
            assert resp.status == 200
            report: dict[str, Any] = await resp.json()
        async with http.get(gw.admin_url + "/candidates/replica/report") as resp:
            replica: dict[str, Any] = await resp.json()
        metrics = await _metrics(http, gw.url)
    assert report["verdict"] == "FAIL" and report["noise_floor_from"] == "replica"
    by_name = {m["metric"]: m for m in report["metrics"]}
    similarity = by_name["quality.semantic_similarity"]
    assert similarity["verdict"] == "FAIL"
    floor = similarity["statistics"]["noise_floor"]
    assert floor["mean_baseline"] > 0.99 and floor["mean_candidate"] < 0.8
    ttft = by_name["latency.ttft_s"]
    assert ttft["verdict"] == "FAIL", ttft["reasons"]
    assert ttft["statistics"]["relative_shift"] > 1.0
    assert report["samples"]["latency.ttft_s"] == REQUESTS
    # The replica of the primary agrees with it: its quality is at the floor.
    replica_similarity = {m["metric"]: m for m in replica["metrics"]}[
        "quality.semantic_similarity"]
    assert replica_similarity["verdict"] == "PASS"
    assert 'understudy_store_written_rows_total{table="scores"}' in metrics


async def test_sparse_data_is_inconclusive(tmp_path: Any) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'u.db'}"
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=4) as primary, \
            run_sim(ttft_ms=1, itl_ms=1, tokens=4) as candidate, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": candidate.url}],
                        evaluation={"enabled": True, "store": {"url": url}}) as gw, \
            aiohttp.ClientSession() as http:
        await _traffic(gw, 3)
        await eventually(lambda: gw.written_records >= 3, within_s=30)
        async with http.get(gw.admin_url + "/candidates/cand/report") as resp:
            report = await resp.json()
        async with http.get(gw.admin_url + "/candidates/cand/report?window_s=-4") as resp:
            assert resp.status == 422
    assert report["verdict"] == "INCONCLUSIVE"
    assert any("too few samples" in r for r in report["reasons"])
    # The same store read from the terminal.
    printed = (await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway.cli", "report", "cand", "--db", url],
        capture_output=True, text=True, check=True)).stdout
    assert "INCONCLUSIVE" in printed and "latency.ttft_s" in printed


async def test_an_evaluation_that_cannot_start_stops_the_gateway_start(tmp_path: Any) -> None:
    """Scorers load in the evaluation process; its failure is the gateway's startup error."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'u.db'}"
    with pytest.raises(EvaluationProcessError, match="unknown scorers"):
        async with run_gateway("http://127.0.0.1:9", evaluation={
                "enabled": True, "store": {"url": url}, "scorers": ["no_such_scorer"]}):
            pass


async def _metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as resp:
        return await resp.text()
