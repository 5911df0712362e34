"""Retention: per-exchange data older than a bound, deleted in bounded batches.

The judge reads a bounded recent window (``max_judged_exchanges``, a canary step's scores);
everything older is dead weight that fills the disk and slows the queries. The ScoreWriter,
which owns the store's writes, runs a pass every ``prune_interval_s``; ``understudy db
prune`` runs one by hand.

Rules:
1. What goes: exchanges whose ``started_at`` is before the cutoff, with their observations
   and scores, and the ``traffic_counts`` windows that start before it. What stays, whatever
   its age: verdicts, the audit log, the routing state and the backends (the history an
   operator audits; none of them refers to an exchange, so nothing dangles).
2. Bounded batches, oldest first: a batch picks at most ``batch`` exchange ids through the
   index on ``exchanges.started_at`` (migration 0005), deletes their scores, observations
   and the exchanges, and commits; so even a first pass over a large backlog holds its
   locks for one batch at a time, and a writer waits at most that long. The children are
   deleted by id, not left to ``ON DELETE CASCADE``, so every table's count is exact and a
   SQLite connection without ``PRAGMA foreign_keys`` leaves nothing dangling either.
   Traffic counts go the same way, by ``window_start`` (the lead column of their unique
   index).
3. On PostgreSQL the pick skips rows another transaction holds (``FOR UPDATE SKIP
   LOCKED``): replicas that prune at once take different rows and never wait on each other.
4. A pass ends when a batch finds fewer rows than its bound, or when ``should_stop`` says
   so between batches (a writer closing); what is left goes on the next pass.
5. ``lock`` (the writer's) is held for each batch, never between them: in one process a
   batch of scores and a batch of deletions never interleave, and writes waiting on the
   lock go first after each batch (asyncio's lock is fair).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store._config import DEFAULT_PRUNE_BATCH_EXCHANGES
from evaluators.store._errors import translate_store_errors
from evaluators.store._schema import ExchangeRow, ObservationRow, ScoreRow, TrafficCountRow

__all__ = ["Pruned", "prune_store", "retention_cutoff"]


@dataclass(frozen=True, slots=True)
class Pruned:
    """Rows one pruning deleted, per table, and how long it took."""

    exchanges: int = 0
    observations: int = 0
    scores: int = 0
    traffic_counts: int = 0
    batches: int = 0
    """Transactions that deleted something (each one bounded, rule 2). The lookup that
    finds nothing more to delete is not one: a pruning of nothing took 0 batches."""
    seconds: float = 0.0
    longest_batch_s: float = 0.0
    """The longest one transaction held its locks."""

    def __add__(self, other: Pruned) -> Pruned:
        return Pruned(
            self.exchanges + other.exchanges, self.observations + other.observations,
            self.scores + other.scores, self.traffic_counts + other.traffic_counts,
            self.batches + other.batches, self.seconds + other.seconds,
            max(self.longest_batch_s, other.longest_batch_s))


def retention_cutoff(days: float, now: datetime | None = None) -> datetime:
    """The time before which rows go, for a retention of ``days`` (> 0)."""
    if not days > 0:
        raise ValueError(f"a retention must be more than 0 days, got {days}")
    return (now or datetime.now(UTC)) - timedelta(days=days)


async def prune_store(engine: AsyncEngine, cutoff: datetime, *,
                      batch: int = DEFAULT_PRUNE_BATCH_EXCHANGES,
                      lock: asyncio.Lock | None = None,
                      should_stop: Callable[[], bool] | None = None,
                      on_batch: Callable[[Pruned], None] | None = None) -> Pruned:
    """Delete what is older than ``cutoff`` (rule 1), ``batch`` exchanges (or traffic
    counts) per transaction, oldest first; return what went. ``on_batch`` sees each
    batch's counts as it commits (so a pass cut short by an error is still counted)."""
    if cutoff.tzinfo is None:
        raise ValueError("naive cutoff: the store takes timezone-aware times only")
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    total = Pruned()
    for step in (_exchanges_batch, _traffic_batch):
        while not (should_stop and should_stop()):
            async with lock if lock is not None else contextlib.nullcontext():
                started = time.monotonic()
                with translate_store_errors():
                    done, found = await step(engine, cutoff, batch)
                elapsed = time.monotonic() - started
            done = Pruned(done.exchanges, done.observations, done.scores, done.traffic_counts,
                          1 if found else 0, elapsed, elapsed)
            total += done
            if on_batch is not None:
                on_batch(done)
            if found < batch:
                break
    return total


def _pick(query: Select[Any], engine: AsyncEngine) -> Select[Any]:
    """Rule 3: on PostgreSQL, rows another transaction holds are left to it."""
    if engine.dialect.name == "postgresql":
        return query.with_for_update(skip_locked=True)
    return query


async def _exchanges_batch(engine: AsyncEngine, cutoff: datetime,
                           batch: int) -> tuple[Pruned, int]:
    picked = _pick(select(ExchangeRow.id).where(ExchangeRow.started_at < cutoff)
                   .order_by(ExchangeRow.started_at).limit(batch), engine)
    async with engine.begin() as connection:
        ids = list((await connection.execute(picked)).scalars())
        if not ids:
            return Pruned(), 0
        scores = await connection.execute(
            delete(ScoreRow).where(ScoreRow.exchange_id.in_(ids)))
        observations = await connection.execute(
            delete(ObservationRow).where(ObservationRow.exchange_id.in_(ids)))
        exchanges = await connection.execute(
            delete(ExchangeRow).where(ExchangeRow.id.in_(ids)))
    return Pruned(exchanges=exchanges.rowcount, observations=observations.rowcount,
                  scores=scores.rowcount), len(ids)


async def _traffic_batch(engine: AsyncEngine, cutoff: datetime,
                         batch: int) -> tuple[Pruned, int]:
    picked = _pick(select(TrafficCountRow.id).where(TrafficCountRow.window_start < cutoff)
                   .order_by(TrafficCountRow.window_start).limit(batch), engine)
    async with engine.begin() as connection:
        ids = list((await connection.execute(picked)).scalars())
        if not ids:
            return Pruned(), 0
        traffic = await connection.execute(
            delete(TrafficCountRow).where(TrafficCountRow.id.in_(ids)))
    return Pruned(traffic_counts=traffic.rowcount), len(ids)
