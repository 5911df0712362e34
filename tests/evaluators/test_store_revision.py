"""A database migrated by a newer understudy (a revision this code does not know) is
refused clearly, before anything runs (``_migrate.py`` rule 3); the gateway serves
anyway and says why its store is not in use."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from sqlalchemy import text

from evaluators.store import (
    StoreRejected,
    create_engine,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from tests.fixtures_db import sqlite_url
from tests.utils import eventually, run_gateway, run_sim

NEWER = "9999_from_a_newer_understudy"


async def _stamp(url: str, revision: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("UPDATE alembic_version SET version_num = :r"),
                                     {"r": revision})
    finally:
        await engine.dispose()


async def test_a_newer_revision_is_refused_naming_both(db_url: str) -> None:
    await upgrade(db_url)
    await _stamp(db_url, NEWER)
    try:
        migrations: list[Callable[[], Awaitable[None]]] = [
            lambda: upgrade(db_url), lambda: downgrade(db_url, "base")]
        for migrate in migrations:
            with pytest.raises(StoreRejected) as refused:
                await migrate()
            message = str(refused.value)
            assert repr(NEWER) in message and repr(head_revision()) in message
            assert "newer understudy" in message
        assert await current_revision(db_url) == NEWER  # nothing was run
    finally:
        await _stamp(db_url, head_revision())
        await downgrade(db_url, "base")


async def test_the_gateway_serves_and_its_health_says_why(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    await upgrade(url)
    await _stamp(url, NEWER)
    store = {"url": url, "retry_base_s": 0.05, "retry_max_s": 0.2}
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_gateway(primary.url, evaluation={"enabled": True, "store": store,
                                                 "scorers": ["exact_match"]}) as gw, \
            aiohttp.ClientSession() as http:
        scorekeeper = gw.state.scorekeeper
        assert scorekeeper is not None
        await eventually(lambda: scorekeeper.store_status.connect_failures >= 1, within_s=15)
        async with http.get(gw.url + "/health") as resp:
            body = await resp.json()
        assert body["status"] == "degraded"
        reason = body["store"]["reason"]
        assert reason.startswith("StoreRejected:") and repr(NEWER) in reason, reason
        async with http.post(gw.base_url + "/chat/completions", json={
                "model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 200  # the proxy never noticed
    assert await current_revision(url) == NEWER
