"""Replicas that start together on a fresh PostgreSQL database or SQLite file all migrate
it, one by one; a migration that fails part-way leaves nothing behind.

Each replica is a separate process (Alembic keeps its context in module globals, so only
processes are honest replicas); they import everything, wait at a barrier, then run
``upgrade`` at the same moment.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa

from evaluators.store import (
    StoreConfig,
    create_engine,
    current_revision,
    head_revision,
    upgrade,
)
from tests.fixtures_db import PG_ADMIN_URL, sqlite_url

REPLICAS = 4
ROUNDS = 3
RACE_TIMEOUT_S = 90

_REPLICA = """
import asyncio, sys
from evaluators.store import create_engine, register_backend, session_factory, upgrade

async def main(url):
    engine = create_engine(url)
    try:
        async with engine.connect():  # connected before the barrier: only the race is left
            pass
        print("ready", flush=True)
        sys.stdin.readline()
        await upgrade(engine)
        async with session_factory(engine)() as session, session.begin():
            await register_backend(session, "primary", role="primary", url="http://p")
            await register_backend(session, "cand", role="candidate", url="http://c")
    finally:
        await engine.dispose()

asyncio.run(main(sys.argv[1]))
"""


@asynccontextmanager
async def _fresh_database() -> AsyncIterator[str]:
    name = f"understudy_race_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(PG_ADMIN_URL, timeout=5)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
        try:
            yield f"{base}/{name}"
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def _race(url: str) -> list[tuple[int, str]]:
    """Start REPLICAS processes, release them together; their exit codes and stderr."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _REPLICA, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(REPLICAS)
    ]
    try:
        for process in processes:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready", process.communicate()[1]
        for process in processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        return [(process.wait(RACE_TIMEOUT_S), process.communicate()[1]) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


async def test_replicas_started_together_on_a_fresh_database_all_migrate() -> None:
    for _ in range(ROUNDS):
        async with _fresh_database() as url:
            results = await asyncio.to_thread(_race, url)
            failures = [stderr.strip().splitlines()[-1] for code, stderr in results if code]
            assert not failures, failures
            assert await current_revision(url) == head_revision()
            connection = await asyncpg.connect(url.replace("+asyncpg", ""), timeout=5)
            try:
                names = await connection.fetch("SELECT name FROM backends ORDER BY name")
            finally:
                await connection.close()
            assert [row["name"] for row in names] == ["cand", "primary"]


SQLITE_ROUNDS = 8
"""Before SQLite migrations took the file's write lock, about one round in three had a
replica fail ("table backends already exists"): eight rounds catch it but 4 % of the time.
Until a connection asked again for write-ahead logging, about one round in fifty had one
fail to connect ("database is locked"): the next two tests hold that case still."""

_SQLITE_REPLICA = """
import asyncio, sys
from evaluators.store import StoreError, upgrade

async def main(urls):
    print("ready", flush=True)
    for url in urls:  # one fresh file a round, all replicas released together
        sys.stdin.readline()
        try:
            await upgrade(url)
            print("ok", flush=True)
        except StoreError as exc:
            print(f"failed: {exc}", flush=True)

asyncio.run(main(sys.argv[1:]))
"""


def _sqlite_rounds(urls: list[str]) -> list[list[str]]:
    """REPLICAS processes migrate each of ``urls`` together; per round, what each said."""
    processes = [subprocess.Popen([sys.executable, "-c", _SQLITE_REPLICA, *urls],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for _ in range(REPLICAS)]
    try:
        for process in processes:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready"
        rounds = []
        for _ in urls:
            for process in processes:
                assert process.stdin is not None
                process.stdin.write("go\n")
                process.stdin.flush()
            rounds.append([process.stdout.readline().strip()  # type: ignore[union-attr]
                           for process in processes])
        return rounds
    finally:
        for process in processes:
            process.kill()
            process.communicate()  # and closes its pipes


async def test_replicas_started_together_on_a_fresh_sqlite_file_all_migrate(
        tmp_path: Path) -> None:
    urls = [sqlite_url(tmp_path, f"race{n}.db") for n in range(SQLITE_ROUNDS)]
    rounds = await asyncio.to_thread(_sqlite_rounds, urls)
    assert rounds == [["ok"] * REPLICAS] * SQLITE_ROUNDS
    for url in urls:
        assert await current_revision(url) == head_revision()


def _new_file_being_written(tmp_path: Path) -> sqlite3.Connection:
    """A new file whose write lock another connection holds, as a replica's migration
    holds it (``BEGIN IMMEDIATE``) before the file is in write-ahead logging."""
    holder = sqlite3.connect(tmp_path / "new.db", isolation_level=None,
                             check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


async def test_a_connection_to_a_new_file_being_written_waits_for_it(tmp_path: Path) -> None:
    """Engine rule 2: SQLite does not wait for the lock that turns a new file to
    write-ahead logging while another connection holds the write lock; the connection
    failed at once ("database is locked") whatever the busy timeout."""
    holder = _new_file_being_written(tmp_path)
    release = threading.Timer(0.3, holder.execute, ("COMMIT",))
    engine = create_engine(sqlite_url(tmp_path, "new.db"))
    try:
        release.start()
        async with engine.connect() as connection:
            mode = await connection.exec_driver_sql("PRAGMA journal_mode")
            assert mode.scalar() == "wal"
    finally:
        release.join()
        holder.close()
        await engine.dispose()


async def test_a_connection_to_a_new_file_locked_past_the_busy_timeout_fails(
        tmp_path: Path) -> None:
    holder = _new_file_being_written(tmp_path)
    config = StoreConfig(url=sqlite_url(tmp_path, "new.db"), sqlite_busy_timeout_s=0.2)
    engine = create_engine(config)
    try:
        with pytest.raises(sa.exc.OperationalError, match="database is locked"):
            async with engine.connect():
                pass
    finally:
        holder.close()
        await engine.dispose()


async def test_a_sqlite_migration_that_fails_part_way_leaves_nothing_behind(
        tmp_path: Path) -> None:
    # SQLite runs DDL in a transaction only inside an explicit one (the driver begins one
    # for DML alone): without it, a first start stopped part-way (Ctrl-C, a crash, a full
    # disk) left tables and no revision, and every later upgrade failed on
    # "table backends already exists".
    url = sqlite_url(tmp_path)
    engine = create_engine(url)

    @sa.event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _fail_midway(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().startswith("CREATE TABLE observations"):
            raise RuntimeError("stopped part-way")

    try:
        with pytest.raises(RuntimeError, match="stopped part-way"):
            await upgrade(engine)
        async with engine.connect() as connection:
            tables = (await connection.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'table'")).scalars().all()
        assert tables == []
    finally:
        await engine.dispose()
    await upgrade(url)
    assert await current_revision(url) == head_revision()
