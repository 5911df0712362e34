"""Engines and sessions: one URL picks PostgreSQL (asyncpg) or SQLite (aiosqlite).

The engine is made by whoever owns the lifecycle (the gateway's cleanup context, a test
fixture, a benchmark) and passed explicitly; nothing here keeps one.

Rules:
1. PostgreSQL: a bounded pool (size + overflow, a checkout timeout), connections pinged
   on checkout so one cut by an outage is replaced instead of failing a batch, connect
   and statement timeouts so an unreachable server fails fast rather than hangs.
2. SQLite: write-ahead logging (readers do not block the writer), a busy timeout instead
   of an immediate "database is locked", foreign keys enforced. Turning a new file to
   write-ahead logging needs the file's exclusive lock, and SQLite does not wait for it
   while another connection holds the write lock (the busy handler is skipped there, as
   waiting could deadlock): replicas started together on a fresh file failed to connect
   ("database is locked", about one round in fifty of four replicas). That pragma is tried
   again every ``WAL_RETRY_S`` within the busy timeout (``_write_ahead_logging``); the
   write lock it waits for is another replica's migration, tens of milliseconds.
3. SQLite: a file in a folder that does not exist is refused before aiosqlite tries to
   open it, with the same error SQLite gives ("unable to open database file") and the
   folder named. aiosqlite reports a failed open from its worker thread to the event
   loop; when the caller's ``asyncio.run`` has ended by then (``understudy db upgrade
   --db`` with a mistyped path) the thread prints a traceback after the error
   (aiosqlite #389).
4. SQLite: a new database file is made readable and writable by its owner only (0600)
   before SQLite opens it, and SQLite gives its -wal and -shm files the same mode: the
   store holds the routing, whose backend URLs keep their passwords, and texts with
   ``store_prompts``/``store_answers``. Under the usual umask (022) SQLite made all three
   world-readable. An existing file keeps the mode it has (the operator's to set), and
   one others can read or write is logged when the engine is made (``_file_modes``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine
from sqlalchemy.pool import StaticPool

from evaluators.store._config import StoreConfig
from evaluators.store._file_modes import private_new_file, warn_if_shared

__all__ = ["create_engine", "session_factory"]

POOL_RECYCLE_S = 1800
"""Replace pooled connections older than this (servers and middleboxes drop idle ones)."""
WAL_RETRY_S = 0.01
"""Rule 2: how long a connection waits before asking again for write-ahead logging."""


def create_engine(target: str | StoreConfig) -> AsyncEngine:
    """An async engine for a database URL (default settings) or a StoreConfig."""
    config = StoreConfig(url=target) if isinstance(target, str) else target
    url = make_url(config.url)
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(config)
    return _create_async_engine(
        url,
        pool_size=config.pool_size,
        max_overflow=config.pool_overflow,
        pool_timeout=config.pool_timeout_s,
        pool_recycle=POOL_RECYCLE_S,
        pool_pre_ping=True,
        connect_args={
            "timeout": config.connect_timeout_s,
            "command_timeout": config.statement_timeout_s,
            "server_settings": {"application_name": "understudy"},
        },
    )


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions for the read side; objects stay usable after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)


def _sqlite_engine(config: StoreConfig) -> AsyncEngine:
    url = make_url(config.url)
    in_memory = url.database in (None, "", ":memory:")
    options: dict[str, Any] = {"connect_args": {"timeout": config.sqlite_busy_timeout_s}}
    if in_memory:
        # Every connection to ":memory:" is a new, empty database: share one.
        options["poolclass"] = StaticPool
    else:
        options["pool_size"] = config.pool_size
        options["max_overflow"] = config.pool_overflow
        options["pool_timeout"] = config.pool_timeout_s
    engine = _create_async_engine(url, **options)
    if not in_memory and url.database and not url.query.get("uri"):
        warn_if_shared(Path(url.database), "the routing (backend URLs with their passwords) "
                       "and the scores")
    busy_ms = int(config.sqlite_busy_timeout_s * 1000)
    locked = engine.sync_engine.dialect.loaded_dbapi.OperationalError

    @event.listens_for(engine.sync_engine, "do_connect")
    def _refuse_missing_folder(dialect: Any, _record: Any, cargs: list[Any],
                               cparams: dict[str, Any]) -> None:
        """Rules 3 and 4 (a ``file:`` URI is left to SQLite)."""
        if in_memory or cparams.get("uri") or not cargs:
            return
        folder = Path(cargs[0]).parent
        if not folder.is_dir():
            raise dialect.dbapi.OperationalError(
                f"unable to open database file: no folder {str(folder)!r}")
        private_new_file(Path(cargs[0]))

    @event.listens_for(engine.sync_engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            if not in_memory:
                _write_ahead_logging(cursor, locked, config.sqlite_busy_timeout_s)
                cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    return engine


def _write_ahead_logging(cursor: Any, locked: type[Exception], busy_timeout_s: float) -> None:
    """Rule 2: ``PRAGMA journal_mode=WAL``, asked again while the file is locked, within the
    busy timeout. It runs in the connect hook, which cannot await: the wait blocks the
    caller's thread, only while a new file is being made by another connection."""
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except locked as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(WAL_RETRY_S)
