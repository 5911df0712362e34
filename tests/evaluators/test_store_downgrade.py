"""Migrating down and up again with data in the store (``_migrate`` rule 3), on a SQLite
file and on the real PostgreSQL (``db_url``, tests/fixtures_db.py).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store import (
    ExchangeRow,
    ObservationRow,
    ScoreRow,
    ScoreWriter,
    create_engine,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from tests.evaluators.test_store import SCORES, count, make_exchange, quick_config, written
from tests.fixtures_db import sqlite_url

RECORDS = 5


async def _counts(engine: AsyncEngine) -> tuple[int, int, int]:
    return (await count(engine, ExchangeRow), await count(engine, ObservationRow),
            await count(engine, ScoreRow))


async def test_a_downgrade_keeps_the_rows_of_the_tables_it_keeps(db_url: str) -> None:
    # 0003's downgrade drops two columns of exchanges; SQLite's batch mode does that by
    # copying the table and dropping the original, and with foreign keys on, that DROP
    # cascaded to every observation and score (they were gone: (5, 0, 0)).
    await upgrade(db_url)
    engine = create_engine(db_url)
    try:
        async with ScoreWriter(engine, quick_config(engine)) as writer:
            for i in range(RECORDS):
                assert writer.submit(make_exchange(f"r{i}"), SCORES)
            await written(writer, RECORDS)
        kept = await _counts(engine)
        assert kept == (RECORDS, 2 * RECORDS, len(SCORES) * RECORDS)
        await engine.dispose()
        await downgrade(db_url, "0002")
        assert await _counts(engine) == kept
        await engine.dispose()
        await upgrade(db_url)
        assert await _counts(engine) == kept
        await engine.dispose()
        await downgrade(db_url, "base")  # drops everything, as it says
        await upgrade(db_url)
        assert await current_revision(db_url) == head_revision()
        assert await _counts(engine) == (0, 0, 0)
    finally:
        await engine.dispose()
        await downgrade(db_url, "base")


async def test_a_migration_on_a_callers_engine_gives_foreign_keys_back(tmp_path: Path) -> None:
    # The migration turns SQLite's foreign keys off on its connection; the pooled
    # connection the caller's engine gets back must enforce them again.
    engine = create_engine(sqlite_url(tmp_path))
    try:
        await upgrade(engine)
        await downgrade(engine, "0002")
        for _ in range(3):  # every pooled connection
            async with engine.connect() as connection:
                enforced = (await connection.exec_driver_sql(
                    "PRAGMA foreign_keys")).scalar_one()
                assert enforced == 1
    finally:
        await engine.dispose()
