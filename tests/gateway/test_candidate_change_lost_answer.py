"""A candidate change whose commit reaches the store while its answer is lost.

Unlike a routing change (which every replica adopts from the store), a candidate change
lives only in the replica that applies it: the 503 must not promise that the store's copy
will be adopted, and it is not: this replica runs nothing it did not answer for.
"""

from __future__ import annotations

import aiohttp
import asyncpg

from evaluators.store import upgrade
from tests.tcp_relay import QUICK_RETRIES, relayed_database
from tests.utils import run_gateway, run_sim

STORE_TIMEOUT_S = 1.0


async def test_a_lost_answer_to_a_candidate_change_says_what_it_leaves(
        pg_database: str) -> None:
    await upgrade(pg_database)
    async with relayed_database(pg_database) as (relay, through_relay):
        store = {"url": through_relay, **QUICK_RETRIES}
        async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
                run_gateway(primary.url,
                            evaluation={"enabled": True, "store": store,
                                        "scorers": ["exact_match"]},
                            admin={"store_timeout_s": STORE_TIMEOUT_S}) as gw, \
                aiohttp.ClientSession() as http:
            relay.stall_answers_after(b"COMMIT")  # the store commits; the gateway never hears
            async with http.post(gw.admin_url + "/candidates",
                                 json={"name": "late", "url": primary.url}) as resp:
                assert resp.content_type == "application/json"
                status, body = resp.status, await resp.json()
            assert status == 503, body
            message = body["error"]["message"]
            assert "applied nothing" in message
            assert "routing" not in message and "adopts" not in message, message
            assert "GET /admin/v1/candidates" in message
            assert "late" not in gw.state.mirror.candidates
            await relay.restore()
    connection = await asyncpg.connect(pg_database.replace("+asyncpg", ""), timeout=5)
    try:
        stored = await connection.fetchval(
            "SELECT count(*) FROM audit_log WHERE action = 'candidate_add' AND target = 'late'")
    finally:
        await connection.close()
    assert stored == 1  # it landed: an audit entry for a change no replica applied
