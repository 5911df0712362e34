"""Replicas that start together on a fresh PostgreSQL database all migrate it, one by one.

Each replica is a separate process (Alembic keeps its context in module globals, so only
processes are honest replicas); they import everything, wait at a barrier, then run
``upgrade`` at the same moment.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from evaluators.store import current_revision, head_revision
from tests.fixtures_db import PG_ADMIN_URL

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
