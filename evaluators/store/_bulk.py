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
5. Two ways to send many rows, side by side, picked by dialect: PostgreSQL gets one
   ``INSERT ... SELECT FROM unnest(<one array per column>)`` per table (set-based: the
   server plans and runs one statement, not one per row); SQLite gets an executemany of
   the same ``INSERT ... ON CONFLICT DO NOTHING``.
6. Retention may delete a record's exchange under the batch (another replica pruning, or
   ``understudy db prune``, on PostgreSQL: an exchange that already exists is skipped by
   ``DO NOTHING`` without a lock, and can be pruned and committed before the batch looks
   its id up). Such a record refers to nothing: it alone is left out and counted
   (``Written.exchange_pruned``), the rest of the batch is written. The lookup holds the
   exchanges it finds ``FOR KEY SHARE`` until the batch commits, so from then on a pruner
   skips them (``SKIP LOCKED``) and leaves them to its next pass, rather than deleting them
   from under the batch's observations (a foreign-key violation that would fail the
   batch). SQLite needs neither: a batch's first INSERT takes the database's write lock
   until it commits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from sqlalchemy import JSON, Dialect, Table, TextClause, select, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from evaluators.store._rows import Record, Row
from evaluators.store._schema import BackendRole, BackendRow, ExchangeRow, ObservationRow, ScoreRow

__all__ = ["TABLES", "BatchInserter", "Written"]

TABLES = ("backends", "exchanges", "observations", "scores")
MAX_CACHED_BACKENDS = 4096
"""Backend ids kept in memory; past it the cache starts over (names are few in practice)."""
LOOKUP_CHUNK = 500
"""Keys per ``IN (...)`` lookup: far below every driver's bound on bind parameters."""
STATEMENT_ROWS = 500
"""Rows per INSERT statement. Building and encoding one statement's parameters is a stretch
of CPU with no await in it; this bounds it to a few milliseconds, whatever the batch size,
so the writer's loop (in the scoring process) stays responsive to its stats and drain."""


@dataclass(frozen=True, slots=True)
class Written:
    """What one batch wrote: rows sent per table (existing rows count as sent), and the
    records left out because their exchange was pruned under the batch (rule 6)."""

    rows: Mapping[str, int]
    exchange_pruned: int = 0


class BatchInserter:
    """Writes batches of records for one engine; keeps the backend-id cache."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        dialect = engine.dialect
        make = _insert_family(dialect.name)
        self._backends = make(dialect, _table(BackendRow), ("name",))
        self._exchanges = make(dialect, _table(ExchangeRow), ("request_id",))
        self._observations = make(dialect, _table(ObservationRow), ("exchange_id", "backend_id"))
        self._scores = make(dialect, _table(ScoreRow), ("exchange_id", "candidate_id", "metric"))
        self._backend_ids: dict[str, int] = {}

    async def write(self, batch: Sequence[Record]) -> Written:
        """Write ``batch``; return what was written and what was left out (rule 6)."""
        written = dict.fromkeys(TABLES, 0)
        written["backends"] = await self._register_backends(batch)
        exchanges: dict[str, Row] = {}
        for record in batch:
            exchanges.setdefault(record.exchange["request_id"], record.exchange)
        gone = 0
        async with self._engine.begin() as connection:
            await self._exchanges.insert(connection, list(exchanges.values()))
            exchange_ids = await _exchange_ids(connection, exchanges)
            seen: set[tuple[int, int]] = set()
            for part in _slices(batch):
                observations, scores, part_gone = self._rows_of(part, exchange_ids, seen)
                await self._observations.insert(connection, observations)
                await self._scores.insert(connection, scores)
                written["observations"] += len(observations)
                written["scores"] += len(scores)
                gone += part_gone
        written["exchanges"] = len(exchange_ids)
        return Written(written, gone)

    def _rows_of(self, records: Sequence[Record], exchange_ids: dict[str, int],
                 seen: set[tuple[int, int]]) -> tuple[list[Row], list[Row], int]:
        """Observation rows (each (exchange, backend) once across the batch), score rows,
        and the records left out because their exchange is gone (rule 6)."""
        backend_ids = self._backend_ids
        observations: list[Row] = []
        scores: list[Row] = []
        gone = 0
        for record in records:
            exchange_id = exchange_ids.get(record.exchange["request_id"])
            if exchange_id is None:
                gone += 1
                continue
            for backend, row in ((record.primary_backend, record.primary),
                                 (record.candidate_backend, record.candidate)):
                key = (exchange_id, backend_ids[backend])
                if key not in seen:
                    seen.add(key)
                    row["exchange_id"], row["backend_id"] = key
                    observations.append(row)
            candidate_id = backend_ids[record.candidate_name]
            created_at = record.created_at
            scores.extend(
                {"exchange_id": exchange_id, "candidate_id": candidate_id, "metric": metric,
                 "candidate_value": candidate, "primary_value": primary,
                 "created_at": created_at}
                for metric, candidate, primary in record.scores
            )
        return observations, scores, gone

    def forget_backends(self) -> None:
        """Drop cached backend ids (after a rejected batch: the table may have changed)."""
        self._backend_ids.clear()

    async def _register_backends(self, batch: Iterable[Record]) -> int:
        needed: dict[str, BackendRole] = {}
        for record in batch:
            seen: tuple[tuple[str, BackendRole], ...] = (
                (record.primary_backend, "primary"),
                (record.candidate_backend, "candidate"),
                (record.candidate_name, "candidate"),
            )
            for name, role in seen:
                needed.setdefault(name, role)
        wanted = {name: role for name, role in needed.items() if name not in self._backend_ids}
        if not wanted:
            return 0
        if len(self._backend_ids) + len(wanted) > MAX_CACHED_BACKENDS:
            self._backend_ids.clear()
            wanted = needed
        table = _table(BackendRow)
        async with self._engine.begin() as connection:
            await self._backends.insert(
                connection, [{"name": name, "role": role} for name, role in wanted.items()]
            )
            result = await connection.execute(
                select(table.c.name, table.c.id).where(table.c.name.in_(list(wanted)))
            )
            found = {name: backend_id for name, backend_id in result}
        self._backend_ids.update(found)
        return len(wanted)


async def _exchange_ids(connection: AsyncConnection, exchanges: dict[str, Row]) -> dict[str, int]:
    """The ids of those of ``exchanges`` that exist, held against deletion (rule 6)."""
    table = _table(ExchangeRow)
    keys = list(exchanges)
    ids: dict[str, int] = {}
    for start in range(0, len(keys), LOOKUP_CHUNK):
        lookup = select(table.c.request_id, table.c.id).where(
            table.c.request_id.in_(keys[start:start + LOOKUP_CHUNK]))
        if connection.dialect.name == "postgresql":
            lookup = lookup.with_for_update(read=True, key_share=True)
        result = await connection.execute(lookup)
        ids.update((request_id, exchange_id) for request_id, exchange_id in result)
    return ids


class _RowInsert(Protocol):
    """``INSERT ... ON CONFLICT (<key>) DO NOTHING`` of many rows (dicts keyed by column),
    STATEMENT_ROWS at a time."""

    async def insert(self, connection: AsyncConnection, rows: list[Row]) -> None: ...


class _ExecutemanyInsert:
    """Portable: one statement, executed once per row by the driver (SQLite)."""

    def __init__(self, dialect: Dialect, table: Table, key: tuple[str, ...]) -> None:
        self._statement = sqlite.insert(table).on_conflict_do_nothing(index_elements=list(key))

    async def insert(self, connection: AsyncConnection, rows: list[Row]) -> None:
        for start in range(0, len(rows), STATEMENT_ROWS):
            await connection.execute(self._statement, rows[start:start + STATEMENT_ROWS])


class _UnnestInsert:
    """PostgreSQL: all rows in one statement, one array parameter per column.

    The columns are those the rows carry, so server defaults (ids, ``created_at``
    when not given) still apply; JSON values are serialised here because a text
    statement bypasses SQLAlchemy's type processing.
    """

    def __init__(self, dialect: Dialect, table: Table, key: tuple[str, ...]) -> None:
        self._table = table
        self._key = key
        self._statements: dict[tuple[str, ...], TextClause] = {}
        self._array_types = {
            column.name: f"{column.type.compile(dialect=dialect)}[]" for column in table.columns
        }
        self._json = {column.name for column in table.columns if isinstance(column.type, JSON)}

    async def insert(self, connection: AsyncConnection, rows: list[Row]) -> None:
        for start in range(0, len(rows), STATEMENT_ROWS):
            await self._insert(connection, rows[start:start + STATEMENT_ROWS])

    async def _insert(self, connection: AsyncConnection, rows: list[Row]) -> None:
        columns = tuple(rows[0])
        statement = self._statements.get(columns)
        if statement is None:
            statement = self._statements[columns] = self._compile(columns)
        params: dict[str, list[Any]] = {}
        for name in columns:
            values = [row[name] for row in rows]
            if name in self._json:
                values = [None if v is None else orjson.dumps(v).decode() for v in values]
            params[name] = values
        await connection.execute(statement, params)

    def _compile(self, columns: tuple[str, ...]) -> TextClause:
        names = ", ".join(columns)
        arrays = ", ".join(f"CAST(:{name} AS {self._array_types[name]})" for name in columns)
        return text(
            f"INSERT INTO {self._table.name} ({names}) SELECT * FROM unnest({arrays}) "
            f"ON CONFLICT ({', '.join(self._key)}) DO NOTHING"
        )


def _slices(batch: Sequence[Record]) -> Iterator[Sequence[Record]]:
    """Consecutive runs of records holding about STATEMENT_ROWS rows each."""
    start, rows = 0, 0
    for index, record in enumerate(batch):
        rows += record.rows
        if rows >= STATEMENT_ROWS:
            yield batch[start:index + 1]
            start, rows = index + 1, 0
    if start < len(batch):
        yield batch[start:]


def _insert_family(dialect: str) -> type[_ExecutemanyInsert] | type[_UnnestInsert]:
    if dialect == "postgresql":
        return _UnnestInsert
    if dialect == "sqlite":
        return _ExecutemanyInsert
    raise ValueError(f"unsupported database dialect {dialect!r}")


def _table(model: Any) -> Table:
    table = model.__table__
    assert isinstance(table, Table)
    return table
