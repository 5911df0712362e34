"""Database fixtures: a fresh PostgreSQL database per test module, and SQLite files.

PostgreSQL must be up at ``UNDERSTUDY_TEST_PG`` (default: the machine's local server,
trust auth; ``scripts/test.sh`` starts it when it is down). A test that needs it and cannot
reach it fails loudly: it never skips.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store import create_engine, downgrade, upgrade

PG_ADMIN_URL = os.environ.get("UNDERSTUDY_TEST_PG", "postgresql://root@127.0.0.1:5432/postgres")


async def _admin(*statements: str) -> None:
    connection = await asyncpg.connect(PG_ADMIN_URL, timeout=5)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


@pytest.fixture(scope="module")
def pg_database() -> Iterator[str]:
    """The async URL of a fresh PostgreSQL database for this module, dropped afterwards."""
    name = f"understudy_test_{secrets.token_hex(6)}"
    try:
        asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL is not usable at {PG_ADMIN_URL}: {exc} "
                    "(scripts/test.sh starts the local server)", pytrace=False)
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def sqlite_url(folder: Path, name: str = "store.db") -> str:
    return f"sqlite+aiosqlite:///{folder / name}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using it runs twice: on a SQLite file and on the real PostgreSQL."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
    url: str = request.getfixturevalue("pg_database")
    return url


@asynccontextmanager
async def migrated_engine(url: str, *, down_after: bool = True) -> AsyncIterator[AsyncEngine]:
    """An engine on ``url`` migrated to the head; disposed (and migrated back down to
    nothing, unless ``down_after`` is false) afterwards."""
    await upgrade(url)
    engine = create_engine(url)
    try:
        yield engine
    finally:
        await engine.dispose()
        if down_after:
            await downgrade(url, "base")


async def audit_log(url: str) -> list[sa.Row[Any]]:
    """Every row of the store's audit log at ``url`` (actor, action, target, detail), oldest
    first."""
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            return list(await connection.execute(sa.text(
                "SELECT actor, action, target, detail FROM audit_log ORDER BY id")))
    finally:
        await engine.dispose()
