"""The stored routing is read by every replica, older releases' too (``_routing`` rule 6),
and a stored routing a replica cannot read never stops its polling (``_sync`` rule 3)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store import load_routing, save_routing
from gateway._metrics import GatewayMetrics
from gateway._routing import Backend, Canary, Routing
from gateway._sync import RoutingSync
from tests.fixtures_db import migrated_engine, sqlite_url
from tests.utils import eventually

SECRET = "stored-secret-91c2"


# How the release before 2c2d01a (e7629f1's gateway/_routing.py) reads a stored routing,
# copied verbatim but for the names: replicas still running it during a rolling upgrade,
# or a build downgraded to it, read what this release stores with exactly this.
@dataclass(frozen=True, slots=True)
class _OldBackend:
    name: str
    url: str


def _old_canary_backend(data: dict[str, Any]) -> _OldBackend:
    backend = data["backend"]
    return _OldBackend(backend["name"], backend["url"])


def _old_from_dict(data: dict[str, Any]) -> tuple[int, _OldBackend, _OldBackend | None,
                                                  _OldBackend | None, _OldBackend | None]:
    previous, canary, origin = data.get("previous"), data.get("canary"), data.get("origin")
    return (int(data["version"]), _OldBackend(**data["primary"]),
            _OldBackend(**previous) if previous else None,
            _old_canary_backend(canary) if canary else None,
            _OldBackend(**origin) if origin else None)


def _with_models() -> Routing:
    """A routing whose every role names a backend with a ``model`` rewrite."""
    origin = Backend("primary", "http://127.0.0.1:8")
    routing = Routing.configured(origin).promoted(Backend("a", "http://127.0.0.1:9", "model-a"))
    canary = Canary(Backend("b", "http://127.0.0.1:10", "model-b"), (10.0, 100.0), 0, 60.0, 1.0)
    routing = routing.with_canary(canary)
    return Routing(routing.version, routing.primary, Backend("p", "http://127.0.0.1:11", "m-p"),
                   routing.canary, Backend("o", "http://127.0.0.1:12", "m-o"))


def test_the_previous_release_reads_the_stored_routing() -> None:
    """2c2d01a stored ``model`` inside the backend dicts: the release before it built its
    two-field ``Backend(**dict)`` from them, TypeError, and its replica never adopted the
    routing again. The models are stored apart now, where an older reader never looks."""
    routing = _with_models()
    stored = routing.to_dict()
    version, primary, previous, canary, origin = _old_from_dict(stored)
    assert (version, primary, previous, canary, origin) == (
        routing.version, _OldBackend("a", "http://127.0.0.1:9"),
        _OldBackend("p", "http://127.0.0.1:11"), _OldBackend("b", "http://127.0.0.1:10"),
        _OldBackend("o", "http://127.0.0.1:12"))
    assert Routing.from_dict(stored) == routing  # this release keeps every model
    plain = Routing.configured(Backend("primary", "http://127.0.0.1:8"))
    assert "models" not in plain.to_dict() and Routing.from_dict(plain.to_dict()) == plain


def test_a_routing_stored_by_2c2d01a_or_a_newer_release_is_read() -> None:
    """A ``model`` inside a backend dict (what 2c2d01a's release stored) is still read, and
    keys this release does not know, in a backend dict or at the top, are ignored."""
    stored = {"version": 4, "future": {"x": 1},
              "primary": {"name": "a", "url": "http://127.0.0.1:9", "model": "model-a",
                          "weight": 3},
              "previous": {"name": "primary", "url": "http://127.0.0.1:8", "tls": True},
              "canary": {"backend": {"name": "b", "url": "http://127.0.0.1:10", "model": "mb",
                                     "zone": "eu"},
                         "steps": [10, 100], "step": 0, "interval_s": 60,
                         "step_started_at": 1.0, "percent": 10},
              "origin": None}
    routing = Routing.from_dict(stored)
    assert routing.primary == Backend("a", "http://127.0.0.1:9", "model-a")
    assert routing.previous == Backend("primary", "http://127.0.0.1:8")
    assert routing.canary is not None
    assert routing.canary.backend == Backend("b", "http://127.0.0.1:10", "mb")


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    async with migrated_engine(sqlite_url(tmp_path)) as engine:
        yield engine


async def test_the_poll_survives_a_stored_routing_it_cannot_read(
        engine: AsyncEngine, caplog: pytest.LogCaptureFixture) -> None:
    """A stored routing this release cannot read (here an unreadable version, whose text
    holds a password) killed the poll task, silently: the replica served its routing for
    good. It is logged, without the stored values, and the next readable one is adopted."""
    async def serve(_: Routing) -> None:
        pass

    sync = RoutingSync(Routing.configured(Backend("primary", "http://127.0.0.1:8")), serve,
                       GatewayMetrics(), poll_interval_s=0.02)
    await sync.start(engine)
    try:
        caplog.set_level(logging.WARNING, logger="understudy.routing")
        stored = await load_routing(engine)
        assert stored is not None
        data = {**stored[1], "version": f"http://user:{SECRET}@127.0.0.1:9"}
        assert await save_routing(engine, 2, data, expected=1)
        await eventually(lambda: any("cannot adopt" in r.getMessage() for r in caplog.records))
        await asyncio.sleep(0.1)  # a few more polls
        assert sync.routing.version == 1
        good = Routing.configured(Backend("primary", "http://127.0.0.1:8"), 3).promoted(
            Backend("a", "http://127.0.0.1:9", "model-a"))
        assert await save_routing(engine, good.version, good.to_dict(), expected=2)
        await eventually(lambda: sync.routing.version == good.version)
        assert sync.routing == good
        assert not any(SECRET in r.getMessage() for r in caplog.records)
    finally:
        await sync.stop()


async def test_a_new_routing_history_is_logged_without_a_url_password(
        engine: AsyncEngine, caplog: pytest.LogCaptureFixture) -> None:
    """A replica whose configured primary is not the stored history's origin logged both
    URLs whole, passwords and all."""
    stored = Routing.configured(Backend("primary", f"http://u:{SECRET}@127.0.0.1:8"))
    assert await save_routing(engine, stored.version, stored.to_dict(), expected=None)

    async def serve(_: Routing) -> None:
        pass

    caplog.set_level(logging.WARNING, logger="understudy.routing")
    sync = RoutingSync(Routing.configured(Backend("primary", f"http://u:{SECRET}@127.0.0.1:9")),
                       serve, GatewayMetrics(), poll_interval_s=60.0)
    await sync.start(engine)
    await sync.stop()
    assert sync.routing.version == 2
    assert "new routing history" in caplog.text and "u:***@127.0.0.1:9" in caplog.text
    assert SECRET not in caplog.text
