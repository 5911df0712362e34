"""Alembic environment for understudy's store; async-capable, one URL for both backends.

Two ways in:
1. From code (``evaluators.store.upgrade``/``downgrade``): the caller passes a live
   connection in ``config.attributes["connection"]`` and env.py migrates on it.
2. From the ``alembic`` CLI (``alembic.ini`` at the repository root): the URL comes from
   ``-x url=...``, else ``UNDERSTUDY_STORE__URL``, else ``sqlalchemy.url`` in the ini;
   env.py makes an async engine and runs the migrations inside ``run_sync``.
Offline mode (``alembic upgrade head --sql``) renders SQL for the URL's dialect.
Online, the migration holds a lock so that replicas started together migrate one by one:
on PostgreSQL an advisory lock (``MIGRATION_LOCK_KEY``), on SQLite the file's write lock
of a ``BEGIN IMMEDIATE`` transaction that also makes its DDL all-or-nothing (see
``evaluators/store/_migrate.py``).
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from evaluators.store import Base, create_engine, lock_for_migration

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("UNDERSTUDY_STORE__URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise RuntimeError("no database URL: pass -x url=... or set UNDERSTUDY_STORE__URL")
    return url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters by copying
        compare_type=True,
    )
    with context.begin_transaction():
        # Replicas starting together queue here; the revision is read after the lock.
        lock_for_migration(connection)
        context.run_migrations()


async def _run_online() -> None:
    engine = create_engine(_url())
    try:
        async with engine.begin() as connection:
            await connection.run_sync(_configure)
    finally:
        await engine.dispose()


def _run_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    _run_offline()
elif (shared := config.attributes.get("connection")) is not None:
    _configure(shared)
else:
    asyncio.run(_run_online())
