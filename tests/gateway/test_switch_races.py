"""The operator's switches racing another replica's, on one PostgreSQL (``Promoter`` rules
1 and 7, ``RoutingSync`` rules 1 and 2), with real gateways and simulators.

A slow store call is the fault injected: one replica's judge (or audit write) is held
until the other replica's promotion has landed and been adopted, which on a loaded store
happens by itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from evaluators.store import create_engine, load_routing, save_routing, upgrade
from tests.fixtures_db import audit_log
from tests.utils import RunningGateway, eventually, run_gateway, run_sim


@asynccontextmanager
async def _replica(db: str, primary: str,
                   candidates: list[dict[str, Any]]) -> AsyncIterator[RunningGateway]:
    async with run_gateway(primary, candidates=candidates,
                           evaluation={"enabled": True, "store": {"url": db},
                                       "scorers": ["exact_match"]},
                           admin={"store_timeout_s": 5, "routing_poll_interval_s": 60}) as gw:
        scorekeeper = gw.state.scorekeeper
        assert scorekeeper is not None
        await eventually(lambda: scorekeeper.store_status.state == "up", within_s=30)
        yield gw


@asynccontextmanager
async def _two_replicas(db: str) -> AsyncIterator[tuple[RunningGateway, RunningGateway,
                                                         aiohttp.ClientSession]]:
    await upgrade(db)
    async with AsyncExitStack() as stack:
        primary = await stack.enter_async_context(run_sim(ttft_ms=0, itl_ms=0, tokens=2))
        cand = await stack.enter_async_context(run_sim(ttft_ms=0, itl_ms=0, tokens=2))
        candidates = [{"name": "x", "url": cand.url}, {"name": "y", "url": cand.url}]
        a = await stack.enter_async_context(_replica(db, primary.url, candidates))
        b = await stack.enter_async_context(_replica(db, primary.url, candidates))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        yield a, b, http


async def _admin(http: aiohttp.ClientSession, gw: RunningGateway, method: str, path: str,
                 json: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with http.request(method, gw.admin_url + path, json=json) as resp:
        assert resp.content_type == "application/json", (resp.status, await resp.text())
        return resp.status, await resp.json()


class _Gate:
    """Holds store calls until opened: a store call slower than another replica."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()  # a held call has started
        self.opened = asyncio.Event()

    def hold(self, call: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        """``call``, held until the gate is opened."""
        async def held(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            await self.opened.wait()
            return await call(*args, **kwargs)

        return held


async def _promote_on_a_while_b_waits(http: aiohttp.ClientSession, a: RunningGateway,
                                      b: RunningGateway, gate: _Gate,
                                      b_call: Coroutine[Any, Any, tuple[int, Any]],
                                      ) -> tuple[int, Any]:
    """Start ``b_call`` (held at ``gate``), promote x on A, let B hear of it, release B."""
    waiting = asyncio.create_task(b_call)
    # B has looked at the routing and is in its store call: waited for, not slept for (a
    # fixed 0.3 s let A promote first on a loaded machine, and B then decided on A's
    # routing). The bound only catches a B that never gets there.
    entered = asyncio.create_task(gate.entered.wait())
    await asyncio.wait((waiting, entered), timeout=30, return_when=asyncio.FIRST_COMPLETED)
    entered.cancel()
    assert gate.entered.is_set() and not waiting.done(), (
        waiting.result() if waiting.done() else "B never reached its store call")
    status, body = await _admin(http, a, "POST", "/candidates/x/promote",
                                {"force": True, "reason": "on A"})
    assert status == 200, body
    await eventually(lambda: b.state.routing.version == a.state.routing.version)  # NOTIFY
    gate.opened.set()
    return await waiting


@pytest.mark.parametrize("name", ["x", "y"])
async def test_a_promotion_judged_while_another_replica_promoted_is_refused(
        pg_database: str, name: str) -> None:
    """B judges a promotion while A promotes x and B adopts it. Before, B's promotion was
    laid over A's unseen: of x again, x became its own rollback target and the old primary
    was lost from the routing (a rollback did nothing); of y, B's operator replaced a
    primary they never saw. Now it is a 409 (``RoutingSync`` rule 2), as it was when B had
    not heard of A's change yet."""
    async with _two_replicas(pg_database) as (a, b, http):
        scorekeeper = b.state.scorekeeper
        assert scorekeeper is not None
        version, entries = b.state.routing.version, len(await audit_log(pg_database))
        gate = _Gate()
        scorekeeper.judge = gate.hold(scorekeeper.judge)  # type: ignore[method-assign]
        status, body = await _promote_on_a_while_b_waits(
            http, a, b, gate, _admin(http, b, "POST", f"/candidates/{name}/promote",
                                     {"force": True, "reason": "on B"}))
        assert status == 409, body
        for replica in (a, b):
            routing = replica.state.routing
            assert routing.version == version + 1 and routing.primary.name == "x"
            assert routing.previous is not None and routing.previous.name == "primary"
        assert [row.action for row in await audit_log(pg_database)][entries:] == ["promote"]


@pytest.mark.parametrize(("method", "path", "body"), [
    ("DELETE", "/candidates/x", None),
    ("PATCH", "/candidates/x", {"sample_rate": 0.5}),
    ("POST", "/candidates/x/pause", None),
])
async def test_a_candidate_change_a_promotion_overtook_is_a_409_not_a_500(
        pg_database: str, method: str, path: str, body: dict[str, Any] | None) -> None:
    """B stores a change of candidate x while A promotes x; B adopts the promotion, which
    takes x off B's candidates. Before, B then changed a candidate that was gone: a 500
    (KeyError) for DELETE and PATCH, a 200 naming a paused candidate no longer there."""
    async with _two_replicas(pg_database) as (a, b, http):
        gate = _Gate()
        b.state.sync.record = gate.hold(b.state.sync.record)  # type: ignore[method-assign]
        status, answer = await _promote_on_a_while_b_waits(
            http, a, b, gate, _admin(http, b, method, path, body))
        assert status == 409, answer
        assert "it is the primary" in answer["error"]["message"]
        assert "x" not in b.state.mirror.candidates and b.state.routing.primary.name == "x"


async def test_a_routing_stored_before_origins_were_named_is_adopted(
        pg_database: str) -> None:
    """A routing stored by a gateway from before routings named their configured origin:
    a replica starting on it dropped its promotion (a new history from the configured
    primary, the rollback target gone, no audit entry). Its configured primary is the
    stored rollback target, so it is this history: adopted."""
    await upgrade(pg_database)
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand:
        engine = create_engine(pg_database)
        try:
            stored = await load_routing(engine)
            version = (stored[0] if stored else 0) + 3
            legacy = {"version": version, "primary": {"name": "x", "url": cand.url},
                      "previous": {"name": "primary", "url": primary.url}, "canary": None}
            assert await save_routing(engine, version, legacy,
                                      expected=stored[0] if stored else None)
        finally:
            await engine.dispose()
        async with _replica(pg_database, primary.url, [{"name": "x", "url": cand.url}]) as gw:
            routing = gw.state.routing
            assert routing.version == version and routing.primary.name == "x"
            assert routing.previous is not None and routing.previous.name == "primary"
            assert "x" not in gw.state.mirror.candidates  # the primary is not mirrored to


@pytest.mark.parametrize(("path", "body"), [
    ("/candidates/x/promote", {"force": True, "reason": "r"}),
    ("/rollback", {}),
    ("/candidates/x/canary", {"steps": [50, 100], "interval_s": 60}),
])
async def test_an_actor_with_a_control_character_is_a_422_not_a_503(
        pg_database: str, path: str, body: dict[str, Any]) -> None:
    """PostgreSQL refuses NUL in the audit log's actor: the answer was a 503 'the store
    refused it', which an operator retries for ever. It is bad input: a 422, nothing
    stored."""
    async with _two_replicas(pg_database) as (a, _, http):
        if path == "/rollback":
            status, answer = await _admin(http, a, "POST", "/candidates/y/promote",
                                          {"force": True, "reason": "r"})
            assert status == 200, answer
        entries = len(await audit_log(pg_database))
        version = a.state.routing.version
        for actor in ("ops\u0000", "ops\nroot"):
            status, answer = await _admin(http, a, "POST", path, {**body, "actor": actor})
            assert status == 422, answer
            assert "actor" in answer["error"]["message"]
        assert len(await audit_log(pg_database)) == entries
        assert a.state.routing.version == version
        status, answer = await _admin(http, a, "POST", path, {**body, "actor": "José 😀"})
        assert status in (200, 202), answer


async def test_the_canarys_candidate_is_not_removed_while_its_canary_runs() -> None:
    """Removing the canary's candidate was a 200 while the canary went on sending its share
    of sessions to that backend, now judged by nobody here and never promoted (the driver
    looked the candidate up). It is a 409 until the canary stops; then it goes."""
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand, \
            run_gateway(primary.url, candidates=[{"name": "x", "url": cand.url}]) as gw, \
            aiohttp.ClientSession() as http:
        status, answer = await _admin(http, gw, "POST", "/candidates/x/canary",
                                      {"steps": [50, 100], "interval_s": 600})
        assert status == 202, answer
        status, answer = await _admin(http, gw, "DELETE", "/candidates/x")
        assert status == 409, answer
        assert "stop the canary first" in answer["error"]["message"]
        assert "x" in gw.state.mirror.candidates and gw.state.routing.canary is not None
        status, answer = await _admin(http, gw, "DELETE", "/canary", {"reason": "done"})
        assert status == 200, answer
        status, answer = await _admin(http, gw, "DELETE", "/candidates/x")
        assert status == 200, answer
        assert "x" not in gw.state.mirror.candidates
