"""A candidate's report while the store is away: a 503 with an OpenAI-style JSON body
within the admin store timeout (``_scorecard.py`` rule 4), never a 500; a report again
once the store is back."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from evaluators.store import upgrade
from tests.tcp_relay import QUICK_RETRIES, TcpRelay, relayed_database
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

STORE_TIMEOUT_S = 1.0
ANSWER_WITHIN_S = STORE_TIMEOUT_S + 1.5


@pytest.fixture
async def gateway(pg_database: str) -> AsyncIterator[tuple[RunningGateway, TcpRelay]]:
    await upgrade(pg_database)
    async with relayed_database(pg_database) as (relay, through_relay):
        store = {"url": through_relay, **QUICK_RETRIES}
        async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
                run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand, \
                run_gateway(primary.url, candidates=[{"name": "c", "url": cand.url}],
                            evaluation={"enabled": True, "store": store,
                                        "scorers": ["exact_match"]},
                            admin={"store_timeout_s": STORE_TIMEOUT_S}) as gw:
            scorekeeper = gw.state.scorekeeper
            assert scorekeeper is not None
            await eventually(lambda: scorekeeper.store_status.state == "up", within_s=30)
            try:
                yield gw, relay
            finally:
                await relay.restore()  # the gateway stops against a store that answers


async def _report(http: aiohttp.ClientSession, gw: RunningGateway) -> tuple[int, Any, float]:
    started = time.monotonic()
    async with http.get(gw.admin_url + "/candidates/c/report") as resp:
        assert resp.content_type == "application/json", (resp.status, await resp.text())
        return resp.status, await resp.json(), time.monotonic() - started


@pytest.mark.parametrize("outage", ["down", "black_hole"])
async def test_a_report_while_the_store_is_away_is_a_503(
        gateway: tuple[RunningGateway, TcpRelay], outage: str) -> None:
    gw, relay = gateway
    async with aiohttp.ClientSession() as http:
        status, body, _ = await _report(http, gw)
        assert status == 200, body
        if outage == "down":
            await relay.cut()
        else:
            relay.black_hole()
        status, body, took = await _report(http, gw)
        assert status == 503, body
        assert body["error"]["type"] == "store_unavailable" and body["error"]["code"] == 503
        assert "reading c's scores" in body["error"]["message"]
        assert "adopts" not in body["error"]["message"]  # a read leaves nothing to adopt
        assert took < ANSWER_WITHIN_S, took
        await relay.restore()
        if outage == "black_hole":  # connections it held are dead: new ones are made
            await relay.cut()
            await relay.restore()

        async def answered() -> bool:
            status, _, _ = await _report(http, gw)
            return status == 200

        deadline = time.monotonic() + 15
        while not await answered():
            assert time.monotonic() < deadline, "no report once the store was back"
