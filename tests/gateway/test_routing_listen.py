"""A replica's routing LISTEN comes back after it was lost or never set up
(``RoutingSync`` rule 3, ``RoutingListener``).

The replica reaches PostgreSQL through a relay the test cuts (its LISTEN connection dies,
as on a server restart or a network cut) and restores; another replica stores newer
routings straight into the database. Polls are a minute apart, so only a LISTEN set up
again explains a replica that adopts them before the first poll: the waits below are
bounded well under it (they only catch a hang; a loaded machine may take seconds to
reconnect and read), never by how fast an idle machine is. The password in the URL must
show in no log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store import (
    RoutingListener,
    StoreConfig,
    create_engine,
    listen_for_routing,
    load_routing,
    save_routing,
)
from gateway._metrics import GatewayMetrics
from gateway._routing import Backend, Routing
from gateway._sync import RoutingSync
from tests.fixtures_db import migrated_engine
from tests.tcp_relay import QUICK_RETRIES, TcpRelay, relayed_database
from tests.utils import eventually

POLL_S = 60.0  # no poll falls within a test: a LISTEN, or nothing, tells the replica
# Half a poll interval: adopted by then can only be a LISTEN's doing, and a loaded CI
# machine's reconnect (0.5 s retry, connect, LISTEN, read: ~0.6 s idle) fits many times.
ADOPTED_WITHIN_S = POLL_S / 2
PASSWORD = "listen-secret-7f3a"  # trust auth: the server never asks for it; logs never show it


@asynccontextmanager
async def _replica(pg_database: str) -> AsyncIterator[tuple[RoutingSync, TcpRelay]]:
    """A started RoutingSync whose every store connection, its LISTEN's included, runs
    through a relay."""
    async with relayed_database(pg_database) as (relay, through_relay):
        url = make_url(through_relay).set(password=PASSWORD)
        engine = create_engine(StoreConfig(url=url.render_as_string(hide_password=False),
                                           **QUICK_RETRIES))

        async def serve(_: Routing) -> None:
            pass

        sync = RoutingSync(Routing.configured(Backend("primary", "http://127.0.0.1:8")),
                           serve, GatewayMetrics(), poll_interval_s=POLL_S)
        try:
            await sync.start(engine)
            yield sync, relay
        finally:
            await sync.stop()
            await engine.dispose()


async def _store_next(engine: AsyncEngine, primary: str) -> int:
    """Another replica's change: the stored routing, one version on, serving ``primary``."""
    stored = await load_routing(engine)
    assert stored is not None
    version, data = stored
    data = {**data, "version": version + 1, "primary": {"name": primary,
                                                        "url": "http://127.0.0.1:9"}}
    assert await save_routing(engine, version + 1, data, expected=version)
    return version + 1


async def _adopts(sync: RoutingSync, version: int,
                  within_s: float = ADOPTED_WITHIN_S) -> float:
    """Seconds until ``sync`` serves ``version``; fails after ``within_s``."""
    started = time.monotonic()
    await eventually(lambda: sync.routing.version == version, within_s=within_s)
    return time.monotonic() - started


@pytest.fixture
async def direct(pg_database: str) -> AsyncIterator[AsyncEngine]:
    """The other replica's engine, straight to PostgreSQL."""
    async with migrated_engine(pg_database, down_after=False) as engine:
        yield engine


async def test_a_lost_listen_comes_back_and_hears_changes_again(
        pg_database: str, direct: AsyncEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with _replica(pg_database) as (sync, relay):
        assert sync.routing.version == 1
        # A change made while the LISTEN is down: read when it is set up again.
        await relay.cut()
        version = await _store_next(direct, "b")
        await relay.restore()
        print(f"stored while cut: adopted {await _adopts(sync, version):.2f} s after restore")
        # Cut and restored at once (a blip), then changed: heard through the new LISTEN.
        for primary in ("c", "d"):
            await relay.cut()
            await relay.restore()
            version = await _store_next(direct, primary)
            print(f"stored after a blip: adopted in {await _adopts(sync, version):.2f} s")
            assert sync.routing.primary.name == primary
        # Once back, a change is heard at once, as before any loss.
        await _adopts(sync, await _store_next(direct, "e"))
    lost = [r for r in caplog.records if "LISTEN connection lost" in r.getMessage()]
    assert len(lost) == 3 and all(r.levelno == logging.WARNING for r in lost)
    assert not any(PASSWORD in r.getMessage() for r in caplog.records)


async def test_a_listen_that_cannot_be_set_up_at_start_is_retried(
        pg_database: str, direct: AsyncEngine, caplog: pytest.LogCaptureFixture) -> None:
    # The sync's start reads the routing through the same engine as its LISTEN, so a store
    # that is down at start fails the start itself; the listener alone meets it here.
    caplog.set_level(logging.DEBUG)
    changes = 0

    def changed() -> None:
        nonlocal changes
        changes += 1

    async with relayed_database(pg_database) as (relay, through_relay):
        url = make_url(through_relay).set(password=PASSWORD)
        engine = create_engine(url.render_as_string(hide_password=False))
        await relay.cut()
        listener = await listen_for_routing(engine, changed)
        assert listener is not None
        try:
            await _store_next(direct, "b")  # stored while this replica could not listen
            await relay.restore()
            started = time.monotonic()
            await eventually(lambda: changes == 1, within_s=ADOPTED_WITHIN_S)
            print(f"LISTEN set up {time.monotonic() - started:.2f} s after restore")
            await _store_next(direct, "c")
            await eventually(lambda: changes == 2, within_s=ADOPTED_WITHIN_S)
        finally:
            await listener.close()
            await engine.dispose()
    unavailable = [r for r in caplog.records if "LISTEN unavailable" in r.getMessage()]
    assert len(unavailable) == 1 and unavailable[0].levelno == logging.WARNING
    assert not any(PASSWORD in r.getMessage() for r in caplog.records)


async def test_a_listen_whose_server_stops_answering_is_set_up_again(
        pg_database: str, direct: AsyncEngine, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A black hole (a dropped route: no reset, no answer) is noticed by the listener's
    ping (rule 4), not only a closed connection."""
    monkeypatch.setattr(RoutingListener, "ping_interval_s", 0.3)
    monkeypatch.setattr(RoutingListener, "ping_timeout_s", 0.3)
    monkeypatch.setattr(RoutingListener, "connect_timeout_s", 1.0)
    caplog.set_level(logging.DEBUG)

    def silent() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "stopped answering" in r.getMessage()]

    async with _replica(pg_database) as (sync, relay):
        relay.black_hole()
        # Noticed at the first unanswered ping (0.6 s idle); the bound only catches a hang.
        await eventually(lambda: len(silent()) == 1, within_s=ADOPTED_WITHIN_S)
        version = await _store_next(direct, "b")
        await relay.restore()
        print(f"black hole: adopted {await _adopts(sync, version):.2f} s after restore")
        await _adopts(sync, await _store_next(direct, "c"))
    assert silent()[0].levelno == logging.WARNING
    assert not any(PASSWORD in r.getMessage() for r in caplog.records)
