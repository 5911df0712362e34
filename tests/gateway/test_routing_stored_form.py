"""The stored routing is read by every replica, older releases' too (``_routing`` rule 6),
and a stored routing a replica cannot read never stops its polling (``_sync`` rule 3)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store import load_routing, save_routing
from gateway._config import CandidateConfig, UpstreamConfig
from gateway._headers import CREDENTIAL_HEADERS
from gateway._metrics import GatewayMetrics
from gateway._routing import Backend, Canary, Routing, Upstreams
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
    assert plain.to_dict()["models"] == {}  # always stored (rule 7), and ignored there too
    assert _old_from_dict(plain.to_dict())[1] == _OldBackend("primary", "http://127.0.0.1:8")
    assert Routing.from_dict(plain.to_dict()) == plain


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
        def failed_polls() -> int:
            return sum("cannot adopt" in r.getMessage() for r in caplog.records)

        await eventually(lambda: failed_polls() >= 3)  # the poll goes on past the failure
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


def _old_to_dict(version: int, primary: _OldBackend, previous: _OldBackend | None,
                 canary: dict[str, Any] | None, origin: _OldBackend | None) -> dict[str, Any]:
    """How the release before 2c2d01a stores a routing (e7629f1's ``Routing.to_dict``):
    backend dicts of name and URL, and no ``models`` map."""
    def named(backend: _OldBackend | None) -> dict[str, str] | None:
        return None if backend is None else {"name": backend.name, "url": backend.url}

    return {"version": version, "primary": named(primary), "previous": named(previous),
            "canary": canary, "origin": named(origin)}


def test_a_routing_stored_without_models_keeps_the_models_known_for_its_backends() -> None:
    """A routing stored with no ``models`` map (by a release that does not know it) takes
    each backend's model from the routing this replica knew, by name and URL; one stored
    with the map (even empty) is read as stored."""
    known = _with_models()
    stored = known.to_dict()
    old = _old_to_dict(known.version + 1, *_old_from_dict(stored)[1:3], stored["canary"],
                       _old_from_dict(stored)[4])
    assert Routing.from_dict(old, known=known.models_by_address()) == replace(
        known, version=known.version + 1)
    moved = {**old, "previous": None, "primary": {"name": "b", "url": "http://127.0.0.1:10"}}
    assert Routing.from_dict(moved, known=known.models_by_address()).primary == Backend(
        "b", "http://127.0.0.1:10", "model-b")  # the canary's model follows it to primary
    other_url = {**old, "primary": {"name": "a", "url": "http://127.0.0.1:99"}}
    assert Routing.from_dict(other_url, known=known.models_by_address()).primary.model is None
    plain = Routing.configured(Backend("a", "http://127.0.0.1:9"), known.version + 1)
    assert plain.to_dict()["models"] == {}
    assert Routing.from_dict(plain.to_dict(), known=known.models_by_address()) == plain


async def test_an_older_release_stepping_the_canary_does_not_drop_its_model(
        engine: AsyncEngine) -> None:
    """Replicas of an older release drive the canary too during a rolling upgrade; each
    writes the routing back without the ``models`` map it never read. A replica of this
    release adopted that routing with no models: its canary (and, once promoted, its
    primary) got the client's model name, 404 on a backend serving only its own."""
    async def serve(_: Routing) -> None:
        pass

    origin = Backend("primary", "http://127.0.0.1:8")
    sync = RoutingSync(Routing.configured(origin), serve, GatewayMetrics(),
                       poll_interval_s=0.02)
    await sync.start(engine)
    try:
        canary = Canary(Backend("b", "http://127.0.0.1:10", "model-b"), (10.0, 50.0, 100.0),
                        0, 60.0, 1.0)
        await sync.commit(lambda routing: routing.with_canary(canary))
        stored = await load_routing(engine)
        assert stored is not None and stored[1]["models"] == {"canary": "model-b"}
        # An older replica reads it (models ignored) and steps the canary.
        version, primary, previous, _, old_origin = _old_from_dict(stored[1])
        stepped = {**stored[1]["canary"], "step": 1, "percent": 50.0, "step_started_at": 2.0}
        assert await save_routing(engine, version + 1, _old_to_dict(
            version + 1, primary, previous, stepped, old_origin), expected=version)
        await eventually(lambda: sync.routing.version == version + 1)
        assert sync.routing.canary is not None
        assert sync.routing.canary.percent == 50.0
        assert sync.routing.canary.backend == canary.backend  # model-b kept
        # This replica's next change stores the map again.
        promoted = await sync.commit(lambda routing: routing.promoted(canary.backend))
        assert promoted.primary.model == "model-b"
        stored = await load_routing(engine)
        assert stored is not None and stored[1]["models"] == {"primary": "model-b"}
    finally:
        await sync.stop()


async def test_a_replica_started_on_a_routing_stored_without_models_takes_its_settings(
        engine: AsyncEngine) -> None:
    """A replica of this release that starts while the latest routing is one an older
    release stored (no ``models`` map) had no routing of its own with the canary in it:
    the canary got the client's model name (a 404 from a backend serving only its own)
    until a newer replica wrote the routing again. It now takes the model from the
    candidate's settings it has, by name and URL."""
    async def serve(_: Routing) -> None:
        pass

    origin = Backend("primary", "http://127.0.0.1:8")
    canary = {"backend": {"name": "b", "url": "http://127.0.0.1:10"}, "steps": [10.0, 100.0],
              "step": 0, "percent": 10.0, "interval_s": 60.0, "step_started_at": 1.0}
    old = _old_to_dict(2, _OldBackend(origin.name, origin.url), None, canary,
                       _OldBackend(origin.name, origin.url))
    assert await save_routing(engine, 2, old, expected=None)
    settings = {("b", "http://127.0.0.1:10"): "model-b",
                ("b", "http://127.0.0.1:99"): "model-elsewhere"}
    sync = RoutingSync(Routing.configured(origin), serve, GatewayMetrics(),
                       poll_interval_s=60.0, settings_models=lambda: settings)
    await sync.start(engine)
    await sync.stop()
    assert sync.routing.version == 2 and sync.routing.canary is not None
    assert sync.routing.canary.backend == Backend("b", "http://127.0.0.1:10", "model-b")
    # What the gateway passes as settings_models: its candidates' rewrites, by name and URL.
    upstreams = Upstreams(UpstreamConfig(url=origin.url), (
        CandidateConfig(name="b", url="http://127.0.0.1:10", model="model-b"),
        CandidateConfig(name="c", url="http://127.0.0.1:11")), credentials=CREDENTIAL_HEADERS)
    assert upstreams.models() == {("b", "http://127.0.0.1:10"): "model-b"}
