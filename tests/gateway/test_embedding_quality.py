"""Mirrored embeddings are compared: a candidate whose vectors differ from the primary's
fails on quality, where before it passed on latency alone (no answer text to score).

The simulator plays the primary, a replica of it (the noise floor) and a candidate that
embeds differently (another ``variant``); the real ``openai`` client asks for embeddings
as it does by default (``encoding_format="base64"``) and as floats.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai

from tests.utils import RunningGateway, eventually, judged_candidate

REQUESTS = 16
METRIC = "quality.embedding_distance"


async def _embed(gw: RunningGateway, n: int) -> None:
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
    for i in range(n):
        inputs = [f"document {i}", f"query {i}", "a shared line"]
        if i % 2:
            await client.embeddings.create(model="sim-model", input=inputs)
        else:
            await client.embeddings.create(model="sim-model", input=inputs,
                                           encoding_format="float")
    await client.close()


async def _report(http: aiohttp.ClientSession, gw: RunningGateway, name: str) -> Any:
    async with http.get(f"{gw.admin_url}/candidates/{name}/report") as resp:
        assert resp.status == 200
        return await resp.json()


async def test_a_candidate_with_other_embeddings_fails_on_quality(tmp_path: Any) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'u.db'}"
    async with judged_candidate(url, {"variant": "other"}, ttft_ms=1) as gw, \
            aiohttp.ClientSession() as http:
        await _embed(gw, REQUESTS)
        await eventually(lambda: gw.written_records >= 2 * REQUESTS, within_s=30)
        report = await _report(http, gw, "cand")
        replica = await _report(http, gw, "replica")
    distance = {m["metric"]: m for m in report["metrics"]}[METRIC]
    assert report["samples"][METRIC] == REQUESTS
    assert distance["verdict"] == "FAIL" and report["verdict"] == "FAIL"
    assert abs(distance["statistics"]["mean"] - 1.0) < 0.2  # unrelated unit vectors
    assert any(r.startswith(METRIC) for r in report["reasons"])
    floor = {m["metric"]: m for m in replica["metrics"]}[METRIC]
    print(f"distance: candidate {distance['statistics']['mean']:.4f}, "
          f"replica {floor['statistics']['mean']:.2e}")
    assert floor["verdict"] == "PASS" and floor["statistics"]["mean"] < 1e-4, floor["reasons"]
