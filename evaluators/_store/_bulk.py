"""One batch of records into the database: one transaction, one executemany per table.

Rules:
1. A request mirrored to several candidates arrives as several records that share the
   primary's exchange and observation; the exchange row is inserted once (``ON CONFLICT
   (request_id) DO NOTHING``), each observation once (``ON CONFLICT (exchange, backend)
   DO NOTHING``), within the batch and across batches.
2. Scores are unique per (exchange, candidate, metric), inserted ``ON CONFLICT DO
   NOTHING``: writing a batch again after a commit whose answer was lost changes nothing,
   so a retry never counts a score twice.
3. Backends are registered on first sight in their own short transaction (name + role,
   ``ON CONFLICT DO NOTHING``) and their ids cached, up to a named bound.
4. Everything else of a batch commits or rolls back together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Table, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.dml import Insert

from evaluators._store._rows import Record, Row
from evaluators._store._schema import Backend, BackendRole, ExchangeRow, ObservationRow, ScoreRow

__all__ = ["TABLES", "BatchInserter"]

TABLES = ("backends", "exchanges", "observations", "scores")
MAX_CACHED_BACKENDS = 4096
"""Backend ids kept in memory; past it the cache starts over (names are few in practice)."""
LOOKUP_CHUNK = 500
"""Keys per ``IN (...)`` lookup: far below every driver's bound on bind parameters."""


class BatchInserter:
    """Writes batches of records for one engine; keeps the backend-id cache."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        dialect = engine.dialect.name
        self._backends = _insert_ignoring(dialect, _table(Backend), "name")
        self._exchanges = _insert_ignoring(dialect, _table(ExchangeRow), "request_id")
        self._observations = _insert_ignoring(
            dialect, _table(ObservationRow), "exchange_id", "backend_id"
        )
        self._scores = _insert_ignoring(
            dialect, _table(ScoreRow), "exchange_id", "candidate_id", "metric"
        )
        self._backend_ids: dict[str, int] = {}

    async def write(self, batch: Sequence[Record]) -> dict[str, int]:
        """Write ``batch``; return the rows sent per table (existing rows count as sent)."""
        written = dict.fromkeys(TABLES, 0)
        written["backends"] = await self._register_backends(batch)
        backend_ids = self._backend_ids
        exchanges: dict[str, Row] = {}
        for record in batch:
            exchanges.setdefault(record.exchange["request_id"], record.exchange)
        async with self._engine.begin() as connection:
            await connection.execute(self._exchanges, list(exchanges.values()))
            exchange_ids = await _exchange_ids(connection, exchanges)
            observations: dict[tuple[int, int], Row] = {}
            scores: list[Row] = []
            for record in batch:
                exchange_id = exchange_ids[record.exchange["request_id"]]
                for backend, row in ((record.primary_backend, record.primary),
                                     (record.candidate_backend, record.candidate)):
                    key = (exchange_id, backend_ids[backend])
                    if key not in observations:
                        row["exchange_id"], row["backend_id"] = key
                        observations[key] = row
                candidate_id = backend_ids[record.candidate_name]
                created_at = record.created_at
                scores.extend(
                    {"exchange_id": exchange_id, "candidate_id": candidate_id, "metric": metric,
                     "candidate_value": candidate, "primary_value": primary,
                     "created_at": created_at}
                    for metric, candidate, primary in record.scores
                )
            await connection.execute(self._observations, list(observations.values()))
            if scores:
                await connection.execute(self._scores, scores)
        written["exchanges"] = len(exchanges)
        written["observations"] = len(observations)
        written["scores"] = len(scores)
        return written

    def forget_backends(self) -> None:
        """Drop cached backend ids (after a rejected batch: the table may have changed)."""
        self._backend_ids.clear()

    async def _register_backends(self, batch: Iterable[Record]) -> int:
        wanted: dict[str, BackendRole] = {}
        for record in batch:
            seen: tuple[tuple[str, BackendRole], ...] = (
                (record.primary_backend, "primary"),
                (record.candidate_backend, "candidate"),
                (record.candidate_name, "candidate"),
            )
            for name, role in seen:
                if name not in self._backend_ids:
                    wanted.setdefault(name, role)
        if not wanted:
            return 0
        if len(self._backend_ids) + len(wanted) > MAX_CACHED_BACKENDS:
            self._backend_ids.clear()
        table = _table(Backend)
        async with self._engine.begin() as connection:
            await connection.execute(
                self._backends, [{"name": name, "role": role} for name, role in wanted.items()]
            )
            result = await connection.execute(
                select(table.c.name, table.c.id).where(table.c.name.in_(list(wanted)))
            )
            found = {name: backend_id for name, backend_id in result}
        self._backend_ids.update(found)
        return len(wanted)


async def _exchange_ids(connection: AsyncConnection, exchanges: dict[str, Row]) -> dict[str, int]:
    table = _table(ExchangeRow)
    keys = list(exchanges)
    ids: dict[str, int] = {}
    for start in range(0, len(keys), LOOKUP_CHUNK):
        result = await connection.execute(
            select(table.c.request_id, table.c.id).where(
                table.c.request_id.in_(keys[start:start + LOOKUP_CHUNK])
            )
        )
        ids.update((request_id, exchange_id) for request_id, exchange_id in result)
    return ids


def _insert_ignoring(dialect: str, table: Table, *keys: str) -> Insert:
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=list(keys))
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing(index_elements=list(keys))
    raise ValueError(f"unsupported database dialect {dialect!r}")


def _table(model: Any) -> Table:
    table = model.__table__
    assert isinstance(table, Table)
    return table
