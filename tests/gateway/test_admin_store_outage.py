"""Admin changes under a store outage: applied wholly or not at all.

The database sits behind a relay that becomes a black hole (connections held, nothing
answered). Every admin change must answer 503 with an OpenAI-style JSON body within the
admin store timeout, and leave the replica as it was; once the store is back, the same
change goes through (no 409 from a half-applied first try).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from evaluators.store import upgrade
from tests.tcp_relay import QUICK_RETRIES, TcpRelay, relayed_database
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

STORE_TIMEOUT_S = 1.0
ANSWER_WITHIN_S = STORE_TIMEOUT_S + 1.5
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@dataclass
class Outage:
    """A gateway whose store is reached through ``relay``, a client session, and the URL
    of the simulator serving as candidate ``c``."""

    gw: RunningGateway
    relay: TcpRelay
    cand_url: str
    http: aiohttp.ClientSession

    async def admin(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any, float]:
        """The admin API's answer to ``method path``: status, JSON body, seconds taken."""
        started = time.monotonic()
        async with self.http.request(method, self.gw.admin_url + path, **kwargs) as resp:
            assert resp.content_type == "application/json", (resp.status, await resp.text())
            return resp.status, await resp.json(), time.monotonic() - started


@pytest.fixture
async def outage(pg_database: str) -> AsyncIterator[Outage]:
    await upgrade(pg_database)
    async with relayed_database(pg_database) as (relay, through_relay):
        store = {"url": through_relay, **QUICK_RETRIES}
        async with (
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary,
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand,
            run_gateway(
                primary.url,
                candidates=[{"name": "c", "url": cand.url}],
                evaluation={"enabled": True, "store": store, "scorers": ["exact_match"]},
                admin={"store_timeout_s": STORE_TIMEOUT_S, "routing_poll_interval_s": 0.2},
            ) as gw,
            aiohttp.ClientSession() as http,
        ):
            yield Outage(gw, relay, cand.url, http)


def _refused(status: int, body: Any, took_s: float) -> None:
    assert status == 503, body
    assert set(body["error"]) >= {"message", "type", "code"}
    assert body["error"]["type"] == "store_unavailable" and body["error"]["code"] == 503
    assert "nothing" in body["error"]["message"]
    assert took_s < ANSWER_WITHIN_S, took_s


async def _audit(pg_database: str, action: str, target: str) -> int:
    connection = await asyncpg.connect(pg_database.replace("+asyncpg", ""), timeout=5)
    try:
        count: int = await connection.fetchval(
            "SELECT count(*) FROM audit_log WHERE action = $1 AND target = $2", action, target
        )
    finally:
        await connection.close()
    return count


async def test_adding_a_candidate_while_the_store_is_a_black_hole(
    outage: Outage, pg_database: str
) -> None:
    gw, relay = outage.gw, outage.relay
    relay.black_hole()
    late = {"name": "late", "url": outage.cand_url}
    status, body, took = await outage.admin("POST", "/candidates", json=late)
    _refused(status, body, took)
    assert "late" not in gw.state.mirror.candidates  # not applied, not mirrored to
    _, listing, _ = await outage.admin("GET", "/candidates")
    assert [c["name"] for c in listing["candidates"]] == ["c"]
    # The proxy never noticed.
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    await client.chat.completions.create(model="sim-model", messages=CHAT)
    await client.close()
    assert gw.metric("understudy_admin_store_failures_total", reason="timeout") == 1

    await relay.restore()
    status, body, _ = await outage.admin("POST", "/candidates", json=late)
    assert status == 201, body  # the first try left nothing behind: no 409
    assert "late" in gw.state.mirror.candidates
    assert await _audit(pg_database, "candidate_add", "late") == 1


async def test_every_admin_change_is_refused_whole_while_the_store_is_away(
    outage: Outage, pg_database: str
) -> None:
    gw, relay = outage.gw, outage.relay
    # A change stored before the outage, to have a rollback target and a paused flag.
    status, body, _ = await outage.admin(
        "POST", "/candidates", json={"name": "d", "url": outage.cand_url}
    )
    assert status == 201, body
    candidate = gw.state.mirror.candidates["c"]
    before = (
        gw.state.routing,
        candidate.paused,
        candidate.config,
        sorted(gw.state.mirror.candidates),
    )

    relay.black_hole()
    changes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("PATCH", "/candidates/c", {"sample_rate": 0.25}),
        ("POST", "/candidates/c/pause", None),
        ("DELETE", "/candidates/d", None),
        ("POST", "/candidates/c/promote", {"force": True, "reason": "outage test"}),
        ("POST", "/candidates/c/canary", {"steps": [50, 100], "interval_s": 60}),
    ]
    for method, path, json in changes:
        status, body, took = await outage.admin(method, path, json=json)
        _refused(status, body, took)
        assert (
            gw.state.routing,
            candidate.paused,
            candidate.config,
            sorted(gw.state.mirror.candidates),
        ) == before, (method, path)
    assert gw.metric("understudy_admin_store_failures_total", reason="timeout") == len(changes)

    await relay.restore()
    status, body, _ = await outage.admin(
        "POST", "/candidates/c/promote", json={"force": True, "reason": "after the outage"}
    )
    assert status == 200, body
    version = body["routing"]["version"]
    assert gw.state.routing.version == version == before[0].version + 1

    relay.black_hole()
    status, body, took = await outage.admin("POST", "/rollback", json={})
    _refused(status, body, took)
    assert gw.state.routing.primary.name == "c"
    await relay.restore()
    status, body, _ = await outage.admin("POST", "/rollback", json={})
    assert status == 200 and body["routing"]["version"] == version + 1, body
    # Each change that was applied was stored once, with its audit entry; none other was.
    assert await _audit(pg_database, "promote", "c") == 1
    assert await _audit(pg_database, "rollback", "primary") == 1
    for action, target in (
        ("candidate_update", "c"),
        ("candidate_pause", "c"),
        ("candidate_remove", "d"),
        ("canary_start", "c"),
    ):
        assert await _audit(pg_database, action, target) == 0, action


async def test_a_routing_change_whose_answer_is_lost_is_adopted_once_the_store_is_back(
    outage: Outage, pg_database: str
) -> None:
    gw, relay = outage.gw, outage.relay
    version = gw.state.routing.version
    relay.stall_answers_after(b"COMMIT")  # the database commits; the gateway never hears
    status, body, took = await outage.admin(
        "POST", "/candidates/c/canary", json={"steps": [50, 100], "interval_s": 600}
    )
    _refused(status, body, took)
    assert gw.state.routing.version == version  # not applied here, yet
    assert gw.state.routing.canary is None
    await relay.restore()
    # The store has it: this replica adopts it whole, as it adopts any replica's change.
    await eventually(lambda: gw.state.routing.version == version + 1, within_s=10)
    canary = gw.state.routing.canary
    assert canary is not None and (canary.backend.name, canary.percent) == ("c", 50)
    assert await _audit(pg_database, "canary_start", "c") == 1  # committed with it
