"""The store unreachable when the gateway starts: at a closed port and at a black hole.

The gateway serves at once, counts its attempts, says so in ``/health`` and
``/metrics``, and catches up when the store comes: migrates, loads the routing,
writes what its scoring child held.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from evaluators.store import ExchangeRow, create_engine, load_routing, session_factory, upgrade
from gateway._scorekeeper import STORE_START_WAIT_S
from tests.tcp_relay import TcpRelay
from tests.utils import RunningGateway, eventually, free_port, run_gateway, run_sim, timed_chats

SPAWN_ALLOWANCE_S = 10.0
"""The scoring child's start (a spawned interpreter, cheap scorers) on a busy machine."""


async def _health(gw: RunningGateway) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/health") as resp:
        assert resp.status == 200  # the proxy is alive whatever the store does
        body: dict[str, Any] = await resp.json()
        return body


async def _stored_exchanges(url: str) -> int:
    engine = create_engine(url)
    try:
        async with session_factory(engine)() as session:
            return int((await session.execute(select(func.count()).select_from(ExchangeRow)))
                       .scalar_one())
    finally:
        await engine.dispose()


@pytest.mark.parametrize(("outage", "auto_migrate"),
                         [("closed_port", True), ("black_hole", False)])
async def test_the_gateway_serves_while_its_store_is_unreachable_at_start(
        pg_database: str, outage: str, auto_migrate: bool) -> None:
    url = make_url(pg_database)
    if not auto_migrate:
        await upgrade(pg_database)  # the operator migrated it; the gateway only writes
    before_test = await _stored_exchanges(pg_database) if not auto_migrate else 0
    relay = TcpRelay(url.host or "127.0.0.1", url.port or 5432)
    relay.port = free_port()
    if outage == "black_hole":
        relay.stall_answers_after(b"")  # connections accepted, never answered
        await relay.start()
    through_relay = url.set(port=relay.port).render_as_string(hide_password=False)
    store = {"url": through_relay, "flush_interval_s": 0.05, "retry_base_s": 0.05,
             "retry_max_s": 0.3, "connect_timeout_s": 1}
    try:
        async with run_sim(ttft_ms=1, itl_ms=0, tokens=4) as primary, \
                run_sim(ttft_ms=1, itl_ms=0, tokens=4) as candidate:
            started = time.monotonic()
            async with run_gateway(
                    primary.url, candidates=[{"name": "c", "url": candidate.url}],
                    evaluation={"enabled": True, "store": store, "auto_migrate": auto_migrate,
                                "scorers": ["exact_match", "latency"]}) as gw:
                assert time.monotonic() - started < STORE_START_WAIT_S + SPAWN_ALLOWANCE_S
                during = await timed_chats(gw, 10, "during")
                assert max(during) < 2.0, "the store outage must not reach the client"

                evaluation = gw.state.scorekeeper
                assert evaluation is not None
                await eventually(lambda: evaluation.store_status.state == "unreachable",
                                 within_s=15)
                body = await _health(gw)
                assert body["status"] == "degraded"
                assert body["store"]["state"] == "unreachable"
                assert body["store"]["reason"]
                assert body["store"]["connect_failures"] >= 1
                assert body["scoring"]["state"] == "running"
                assert gw.metric("understudy_store_up") == 0
                assert gw.metric("understudy_store_connect_failures_total") >= 1
                # Scored, held by the writer, not written anywhere yet.
                await eventually(lambda: gw.metric("understudy_evaluation_scored_total") >= 10,
                                 within_s=20)
                assert gw.metric("understudy_scoring_exchanges_total") >= 10
                assert gw.metric("understudy_scoring_batches_total") >= 1
                assert gw.metric("understudy_scoring_batch_size") >= 1
                assert gw.metric("understudy_scoring_queue_depth") >= 0
                assert gw.written_records == 0

                if outage == "black_hole":
                    await relay.cut()
                await relay.restore()  # the store is there now
                await eventually(lambda: gw.metric("understudy_store_up") == 1, within_s=30)
                assert (await _health(gw))["status"] == "ok"
                await timed_chats(gw, 5, "after")
                await eventually(lambda: gw.written_records >= 15, within_s=30)
            assert await _stored_exchanges(pg_database) - before_test == 15
            engine = create_engine(pg_database)
            try:
                assert await load_routing(engine) is not None  # the routing was stored too
            finally:
                await engine.dispose()
    finally:
        await relay.close()
