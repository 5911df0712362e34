"""Run Alembic from code: the only way the store's schema is made or changed.

``upgrade``/``downgrade`` open an async engine, and hand Alembic its connection inside
``run_sync``; ``migrations/env.py`` sees the connection in ``config.attributes`` and runs
on it. The plain ``alembic`` CLI (``alembic.ini`` at the repository root) takes the other
branch of env.py and makes its own async engine.

Rules:
1. On PostgreSQL a migration runs inside one transaction that first takes the
   transaction-scoped advisory lock ``MIGRATION_LOCK_KEY`` (``lock_for_migration``, called
   by env.py on both branches). Replicas that start together on a fresh database queue on
   it; each reads the schema's revision only once it holds the lock, so the first one
   migrates and the others find the schema at head. The lock goes with the transaction's
   commit or rollback, or with its connection if the process dies.
2. On SQLite a migration runs in one explicit transaction begun ``BEGIN IMMEDIATE``
   (``lock_for_migration`` again): it takes the file's write lock before Alembic reads the
   revision, so processes that start together queue on it (within the busy timeout) as
   on the advisory lock, and its DDL commits or rolls back whole. Without it the driver
   begins a transaction for DML only: each CREATE TABLE committed alone, two first starts
   raced ("table backends already exists"), and one stopped part-way left tables without
   a revision that every later upgrade failed on.
3. On SQLite foreign keys are off while a migration runs (``PRAGMA foreign_keys`` is set
   before its transaction begins, and set on again on the connection after it ends):
   batch mode alters a table by copying it and dropping the original, and with foreign
   keys on SQLite's DROP TABLE first deletes the table's rows, firing ``ON DELETE
   CASCADE``: downgrading 0003 (it drops two columns of ``exchanges``) deleted every
   observation and score. A migration must therefore not leave rows referring to nothing
   itself (none deletes a row another refers to; PostgreSQL, which keeps its checks on
   while migrating, would refuse one that did).
4. A database at a revision this code does not know (migrated by a newer understudy) is
   refused with :class:`StoreRejected` naming both revisions, before anything is run:
   retrying cannot cure it, and a newer schema is not this code's to write.
5. A target revision Alembic cannot reach (no such revision, a relative one walking past
   either end, an "upgrade" to an older one) is :class:`UnknownRevision`, with Alembic's
   reason: the caller's argument is wrong, nothing was run. An upgrade's target is
   resolved before Alembic runs (``_resolve_upgrade``): a relative one walking past the
   newest revision (``head+1``, ``0004+2``) fails an assertion inside Alembic, not a
   ``CommandError``, and was a traceback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from evaluators.store._engine import create_engine
from evaluators.store._errors import (
    StoreError,
    StoreRejected,
    UnknownRevision,
    translate_store_errors,
)

__all__ = [
    "MIGRATION_LOCK_KEY",
    "current_revision",
    "downgrade",
    "head_revision",
    "lock_for_migration",
    "script_location",
    "upgrade",
]

MIGRATION_LOCK_KEY = 0x756E_6465_7273_7475  # "understu": one key for every replica
"""The PostgreSQL advisory lock (a bigint) that serializes understudy's migrations."""


def lock_for_migration(connection: Connection) -> None:
    """Rules 1 and 2: hold the migration lock until this connection's transaction ends
    (call it before the connection's first write)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                           {"key": MIGRATION_LOCK_KEY})
    elif connection.dialect.name == "sqlite":
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")  # rule 3: outside a transaction
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def script_location() -> Path:
    """``migrations/`` at the repository root, next to the ``evaluators`` package."""
    return Path(__file__).resolve().parents[2] / "migrations"


async def upgrade(url: str | AsyncEngine, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision``."""
    await _run(url, "upgrade", revision)


async def downgrade(url: str | AsyncEngine, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"``: empty)."""
    await _run(url, "downgrade", revision)


async def current_revision(url: str | AsyncEngine) -> str | None:
    """The revision the database is at; None for a database never migrated."""

    def read(connection: Connection) -> str | None:
        return MigrationContext.configure(connection).get_current_revision()

    with translate_store_errors():
        async with _engine_for(url) as engine, engine.connect() as connection:
            return await connection.run_sync(read)


def head_revision() -> str:
    """The newest revision the code knows."""
    head = ScriptDirectory.from_config(_config(None)).get_current_head()
    if head is None:
        raise StoreError(f"no migrations found in {script_location()}")
    return head


async def _run(url: str | AsyncEngine, verb: Literal["upgrade", "downgrade"],
               revision: str) -> None:
    def migrate(connection: Connection) -> None:
        config = _config(connection)
        _refuse_unknown_revision(connection, config)
        try:
            if verb == "upgrade":
                _resolve_upgrade(connection, config, revision)
                command.upgrade(config, revision)
            else:
                command.downgrade(config, revision)
        except CommandError as exc:  # rule 5: Alembic resolves the target before running
            raise UnknownRevision(f"{revision!r}: {exc}") from exc

    with translate_store_errors():
        async with _engine_for(url) as engine, engine.connect() as connection:
            try:
                async with connection.begin():
                    await connection.run_sync(migrate)
            finally:
                if connection.dialect.name == "sqlite":
                    await _foreign_keys_on(connection)


async def _foreign_keys_on(connection: AsyncConnection) -> None:
    """Rule 3: the pooled connection goes back with foreign keys enforced; one that cannot
    be told so is closed, so the pool opens a new one (its connect event turns them on)."""
    try:
        await connection.exec_driver_sql("PRAGMA foreign_keys=ON")
    except Exception:
        await connection.invalidate()


def _refuse_unknown_revision(connection: Connection, config: Config) -> None:
    """Rule 4."""
    script = ScriptDirectory.from_config(config)
    known = {revision.revision for revision in script.walk_revisions()}
    heads = MigrationContext.configure(connection).get_current_heads()
    unknown = sorted(head for head in heads if head not in known)
    if unknown:
        raise StoreRejected(
            f"the database's schema is at revision {', '.join(map(repr, unknown))}, which this "
            f"understudy does not know (its newest is {script.get_current_head()!r}): a newer "
            "understudy migrated it; run that version, or use another database")


def _resolve_upgrade(connection: Connection, config: Config, revision: str) -> None:
    """Rule 5: resolve an upgrade's target as ``command.upgrade`` will, before it runs."""
    script = ScriptDirectory.from_config(config)
    current = MigrationContext.configure(connection).get_current_heads()
    try:
        list(script.revision_map.iterate_revisions(revision, current, implicit_base=True))
    except RevisionError:
        return  # ``command.upgrade`` refuses it with a CommandError, in Alembic's words
    except AssertionError:  # Alembic's ``is_revision`` on a walk that found no revision
        raise UnknownRevision(f"{revision!r}: walks past the newest revision, "
                              f"{script.get_current_head()!r}") from None


def _config(connection: Connection | None) -> Config:
    location = script_location()
    if not (location / "env.py").is_file():
        raise StoreError(f"Alembic environment not found at {location}")
    config = Config()
    config.set_main_option("script_location", str(location))
    config.attributes["connection"] = connection
    return config


@asynccontextmanager
async def _engine_for(url: str | AsyncEngine) -> AsyncIterator[AsyncEngine]:
    """Borrow the caller's engine, or make one for a URL and dispose of it afterwards."""
    if not isinstance(url, str):
        yield url
        return
    engine = create_engine(url)
    try:
        yield engine
    finally:
        await engine.dispose()
