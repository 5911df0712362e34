"""Two replicas on one PostgreSQL: conflicting admin changes, a lost LISTEN.

Each replica reaches the store through its own relay, so one replica's LISTEN connection
can be cut (a network blip) while the other keeps its own. ``RoutingSync`` rule 2: a
change decided on a routing another replica has since replaced is refused with 409, the
loser adopts the stored routing, and both serve the same version; never is the loser's
change laid over the winner's unseen.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp

from evaluators.store import upgrade
from tests.tcp_relay import QUICK_RETRIES, TcpRelay, relayed_database
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

# No answer here may be a store timeout (a 503 where a 409 or 200 is asserted): a store
# call after a cut reconnects its pool, which a loaded CI machine can stretch past the
# seconds an idle one needs. The bound only catches a hang.
STORE_TIMEOUT_S = 30.0
CONVERGED_WITHIN_S = 30.0  # B's LISTEN is closed: polling, whatever the machine's load


@asynccontextmanager
async def _replica(pg_database: str, primary: str, candidates: list[dict[str, Any]],
                   poll_s: float) -> AsyncIterator[tuple[RunningGateway, TcpRelay]]:
    async with relayed_database(pg_database) as (relay, through_relay):
        store = {"url": through_relay, **QUICK_RETRIES}
        async with run_gateway(
                primary, candidates=candidates,
                evaluation={"enabled": True, "store": store, "scorers": ["exact_match"]},
                admin={"store_timeout_s": STORE_TIMEOUT_S,
                       "routing_poll_interval_s": poll_s}) as gw:
            scorekeeper = gw.state.scorekeeper
            assert scorekeeper is not None
            await eventually(lambda: scorekeeper.store_status.state == "up", within_s=30)
            yield gw, relay


async def _admin(http: aiohttp.ClientSession, gw: RunningGateway, method: str, path: str,
                 json: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with http.request(method, gw.admin_url + path, json=json) as resp:
        assert resp.content_type == "application/json", (resp.status, await resp.text())
        return resp.status, await resp.json()


async def _lose_listen(gw: RunningGateway, relay: TcpRelay) -> None:
    """Cut every connection of ``gw`` to the store (its LISTEN included), then let it
    reconnect: its pool comes back. Its LISTEN would come back too, within a second
    (``RoutingSync`` rule 3): it is closed, so that ``gw`` stays deaf to the other
    replica's changes, however slow this machine, and learns of them only by asking."""
    await relay.cut()
    listener = gw.state.sync._listener
    if listener is not None:
        await listener.close()
    await relay.restore()


async def test_a_change_decided_on_an_old_routing_is_refused_and_the_loser_converges(
        pg_database: str) -> None:
    await upgrade(pg_database)
    async with AsyncExitStack() as stack:
        primary = await stack.enter_async_context(run_sim(ttft_ms=0, itl_ms=0, tokens=2))
        cand = await stack.enter_async_context(run_sim(ttft_ms=0, itl_ms=0, tokens=2))
        candidates = [{"name": "c", "url": cand.url}, {"name": "d", "url": cand.url}]
        # Polls far apart: B learns of A's change only when it asks the store.
        a, _ = await stack.enter_async_context(
            _replica(pg_database, primary.url, candidates, poll_s=60))
        b, b_relay = await stack.enter_async_context(
            _replica(pg_database, primary.url, candidates, poll_s=60))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        assert a.state.routing.version == b.state.routing.version == 1
        await _lose_listen(b, b_relay)

        status, body = await _admin(http, a, "POST", "/candidates/c/canary",
                                    {"steps": [50, 100], "interval_s": 600})
        assert status == 202, body
        assert b.state.routing.version == 1  # B has not heard of it
        # B, deciding on version 1, starts a canary of d: A's canary of c is running.
        status, body = await _admin(http, b, "POST", "/candidates/d/canary",
                                    {"steps": [50, 100], "interval_s": 600})
        assert status == 409, body
        assert body["error"]["code"] == 409
        # The loser adopted the winner's routing at once; both serve version 2.
        assert b.state.routing == a.state.routing
        canary = b.state.routing.canary
        assert b.state.routing.version == 2 and canary is not None
        assert canary.backend.name == "c"

        # The same on a change that needs no canary: A aborts, B (not told) promotes.
        await _lose_listen(b, b_relay)
        status, body = await _admin(http, a, "DELETE", "/canary", {"reason": "test"})
        assert status == 200, body
        status, body = await _admin(http, b, "POST", "/candidates/d/promote",
                                    {"force": True, "reason": "test"})
        assert status == 409, body
        assert b.state.routing == a.state.routing and a.state.routing.version == 3
        assert b.state.routing.primary.name == "primary"
        # Retried on what it now sees, B's change goes through; A converges on it.
        status, body = await _admin(http, b, "POST", "/candidates/d/promote",
                                    {"force": True, "reason": "test, again"})
        assert status == 200, body
        await a.state.sync.refresh()
        assert a.state.routing == b.state.routing and a.state.routing.version == 4


async def test_a_replica_whose_listen_was_lost_converges_by_polling(pg_database: str) -> None:
    await upgrade(pg_database)
    poll_s = 0.5
    async with AsyncExitStack() as stack:
        primary = await stack.enter_async_context(run_sim(ttft_ms=0, itl_ms=0, tokens=2))
        cand = await stack.enter_async_context(run_sim(ttft_ms=0, itl_ms=0, tokens=2))
        candidates = [{"name": "c", "url": cand.url}]
        a, _ = await stack.enter_async_context(
            _replica(pg_database, primary.url, candidates, poll_s=60))
        b, b_relay = await stack.enter_async_context(
            _replica(pg_database, primary.url, candidates, poll_s=poll_s))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await _lose_listen(b, b_relay)
        for path, body in (("/candidates/c/promote", {"force": True, "reason": "t"}),
                           ("/rollback", {})):
            status, answer = await _admin(http, a, "POST", path, body)
            assert status == 200, answer
            started = time.monotonic()
            await eventually(lambda: b.state.routing == a.state.routing,
                             within_s=CONVERGED_WITHIN_S)
            print(f"{path}: B converged by polling in {time.monotonic() - started:.2f} s")
