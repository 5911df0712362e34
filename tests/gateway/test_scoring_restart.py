"""The scoring child killed under a running gateway: it is reaped, counted, restarted, and
scoring and storing go on; ``/health`` and ``/metrics`` tell it."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai

from evaluators import PipelineState
from tests.fixtures_db import sqlite_url
from tests.utils import RunningGateway, eventually, run_gateway, run_sim


async def _traffic(gw: RunningGateway, n: int, tag: str) -> None:
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    for i in range(n):
        await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": f"{tag} {i}"}])
    await client.close()


def _zombie(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    return False


async def _health(gw: RunningGateway) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/health") as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


async def test_a_killed_scoring_child_is_restarted(tmp_path: Path) -> None:
    store = {"url": sqlite_url(tmp_path), "flush_interval_s": 0.05}
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=4) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=4) as candidate, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": candidate.url}],
                        evaluation={"enabled": True, "store": store,
                                    "scorers": ["exact_match", "latency"]}) as gw:
        evaluation = gw.state.scorekeeper
        assert evaluation is not None
        assert (await _health(gw))["status"] == "ok"
        await _traffic(gw, 5, "before")
        await eventually(lambda: gw.written_records >= 5, within_s=30)

        child = evaluation.scoring_pid
        assert child is not None
        os.kill(child, signal.SIGSTOP)  # hung: what it is sent now stays in flight
        await _traffic(gw, 5, "in flight")
        await eventually(lambda: gw.metric("understudy_mirror_joined_total",
                                           candidate="c") >= 10, within_s=10)
        os.kill(child, signal.SIGKILL)
        await eventually(lambda: evaluation.scoring_state is not PipelineState.RUNNING,
                         within_s=10)
        body = await _health(gw)
        assert body["status"] == "degraded" and body["scoring"]["state"] == "restarting"
        assert "exited unexpectedly" in body["scoring"]["reason"]

        await eventually(lambda: evaluation.scoring_state is PipelineState.RUNNING,
                         within_s=30)
        assert evaluation.scoring_pid not in (None, child)
        assert not _zombie(child)  # reaped
        assert gw.metric("understudy_scoring_restarts_total") == 1
        assert gw.metric("understudy_evaluation_dropped_total", reason="process_exit") == 5
        body = await _health(gw)
        assert body["status"] == "ok" and body["scoring"]["restarts"] == 1

        await _traffic(gw, 5, "after")
        await eventually(lambda: gw.written_records >= 10, within_s=30)
        assert gw.metric("understudy_mirror_dropped_total", candidate="c",
                         reason="sink_full") == 0
