"""The report's side of the store: samples per metric, verdicts, the audit log.

Each function takes an ``AsyncSession`` and leaves the transaction to the caller
(``async with session.begin(): ...``), so a verdict and the audit entry that acts on it
commit together. Every query is served by an index of the first migration:
scores by (candidate, metric, created_at), verdicts by (candidate, created_at).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeGuard, TypeVar

from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute, aliased

from evaluators.store._config import masked_url
from evaluators.store._errors import StoreRejected, translate_store_errors
from evaluators.store._schema import (
    AuditEntry,
    BackendRole,
    BackendRow,
    ExchangeRow,
    ObservationRow,
    ScoreRow,
    TrafficCountRow,
    VerdictRow,
)

__all__ = [
    "TRAFFIC_SEEN",
    "CandidateSummary",
    "ConditionedSamples",
    "EvaluatedRequests",
    "StoredCounts",
    "StoredSamples",
    "TrafficCount",
    "ValueCounts",
    "append_audit",
    "list_candidates",
    "load_conditioned_samples",
    "load_evaluated_requests",
    "load_samples",
    "load_samples_by_turn_depth",
    "load_traffic",
    "load_value_counts",
    "newest_scores_start",
    "record_traffic",
    "record_verdict",
    "register_backend",
]

TRAFFIC_SEEN = "seen"
"""The outcome of ``traffic_counts`` rows that count all traffic (candidate "")."""


@dataclass(frozen=True, slots=True)
class TrafficCount:
    """One histogram cell of ``traffic_counts``: ``count`` requests in the window that
    starts at ``window_start`` (seconds since the epoch). ``candidate`` is "" for all
    traffic (``outcome`` :data:`TRAFFIC_SEEN`); a drop's outcome is its reason."""

    window_start: int
    candidate: str
    outcome: str
    dimension: str
    value: str
    count: int


@dataclass(frozen=True, slots=True)
class ConditionedSamples:
    """One per-backend metric's values, each with the conditions it was measured under.

    The candidate's lists are aligned with each other, the primary's likewise; a value
    the backend did not report (concurrency, tokens) is None.
    """

    candidate: list[float] = field(default_factory=list)
    candidate_concurrency: list[int | None] = field(default_factory=list)
    candidate_prompt_tokens: list[int | None] = field(default_factory=list)
    candidate_cached_tokens: list[int | None] = field(default_factory=list)
    primary: list[float] = field(default_factory=list)
    primary_concurrency: list[int | None] = field(default_factory=list)
    primary_prompt_tokens: list[int | None] = field(default_factory=list)
    primary_cached_tokens: list[int | None] = field(default_factory=list)
    candidate_prompt_bytes: list[int | None] = field(default_factory=list)
    primary_prompt_bytes: list[int | None] = field(default_factory=list)
    candidate_backend_running: list[int | None] = field(default_factory=list)
    primary_backend_running: list[int | None] = field(default_factory=list)
    """The exchange's request body size, aligned with each side's values: what the
    judge's sample-bias reweighting sizes a value by (the same exchange on both sides)."""

    @property
    def candidate_columns(self) -> tuple[list[Any], ...]:
        """The candidate's aligned lists: value, concurrency, prompt tokens, cached tokens,
        backend running, prompt bytes."""
        return (self.candidate, self.candidate_concurrency, self.candidate_prompt_tokens,
                self.candidate_cached_tokens, self.candidate_backend_running,
                self.candidate_prompt_bytes)

    @property
    def primary_columns(self) -> tuple[list[Any], ...]:
        """The primary's aligned lists, in the order of :attr:`candidate_columns`."""
        return (self.primary, self.primary_concurrency, self.primary_prompt_tokens,
                self.primary_cached_tokens, self.primary_backend_running,
                self.primary_prompt_bytes)


@dataclass(frozen=True, slots=True)
class EvaluatedRequests:
    """The requests scored for a candidate: what the sample-bias check compares with
    all traffic. Aligned lists, one entry per exchange."""

    prompt_bytes: list[int | None] = field(default_factory=list)
    route: list[str] = field(default_factory=list)
    streamed: list[bool] = field(default_factory=list)
    turn_depth: list[int | None] = field(default_factory=list)


class StoredSamples(NamedTuple):
    """One metric's values for a candidate: ``candidate, primary = samples``.

    Each list holds the known (non-NULL) values in the order they were scored; a
    pairwise metric (candidate vs primary in one number) has an empty ``primary``.
    """

    candidate: list[float]
    primary: list[float]


class ValueCounts(NamedTuple):
    """One side's known values of a metric (see :func:`_known`), counted: ``n`` in all,
    ``ones`` of them 1 and ``others`` neither 0 nor 1 (a 0/1 metric, a rate, has none)."""

    n: int
    ones: int
    others: int


class StoredCounts(NamedTuple):
    """One metric's values for a candidate, counted per side: ``candidate, primary``."""

    candidate: ValueCounts
    primary: ValueCounts


_Key = TypeVar("_Key")


@dataclass(frozen=True, slots=True)
class CandidateSummary:
    name: str
    role: str
    url: str | None
    samples: int
    """Score rows, all metrics together."""
    metrics: Mapping[str, int] = field(default_factory=dict)
    """Score rows per metric."""
    last_scored_at: datetime | None = None


async def load_samples(session: AsyncSession, candidate: str,
                       metrics: Collection[str] | None = None,
                       since: datetime | None = None) -> dict[str, StoredSamples]:
    """Every stored value of ``candidate``'s metrics (all, or those named) since ``since``."""
    query = (
        select(ScoreRow.metric, ScoreRow.candidate_value, ScoreRow.primary_value)
        .join(BackendRow, BackendRow.id == ScoreRow.candidate_id)
        .where(BackendRow.name == candidate)
        .order_by(ScoreRow.metric, ScoreRow.created_at, ScoreRow.id)
    )
    if metrics is not None:
        query = query.where(ScoreRow.metric.in_(list(metrics)))
    if since is not None:
        query = query.where(ScoreRow.created_at >= _aware(since))
    with translate_store_errors():
        return _grouped_samples(await session.execute(query))


def _grouped_samples(rows: Iterable[tuple[_Key, float | None, float | None]],
                     ) -> dict[_Key, StoredSamples]:
    """``(key, candidate value, primary value)`` rows as samples by key, in row order,
    unknown values (NULL, or not a finite number: see :func:`_known`) left out."""
    grouped: dict[_Key, StoredSamples] = {}
    for key, candidate_value, primary_value in rows:
        found = grouped.setdefault(key, StoredSamples([], []))
        if _known(candidate_value):
            found.candidate.append(candidate_value)
        if _known(primary_value):
            found.primary.append(primary_value)
    return grouped


async def load_value_counts(session: AsyncSession, candidate: str, metrics: Collection[str],
                            since: datetime | None = None) -> dict[str, StoredCounts]:
    """``candidate``'s values of ``metrics`` since ``since`` counted per metric and side, in
    the store (one grouped read over the scores' (candidate, metric, created_at) index): a
    rate's values however many are stored (the report's rule 6). Unknown values are left
    out as :func:`load_samples` leaves them; a metric without rows is absent."""
    query = (
        select(ScoreRow.metric, *_counted(ScoreRow.candidate_value),
               *_counted(ScoreRow.primary_value))
        .join(BackendRow, BackendRow.id == ScoreRow.candidate_id)
        .where(BackendRow.name == candidate, ScoreRow.metric.in_(list(metrics)))
        .group_by(ScoreRow.metric)
    )
    if since is not None:
        query = query.where(ScoreRow.created_at >= _aware(since))
    with translate_store_errors():
        rows = (await session.execute(query)).all()
    return {metric: StoredCounts(ValueCounts(*map(int, counts[:3])),
                                 ValueCounts(*map(int, counts[3:])))
            for metric, *counts in rows}


def _counted(value: InstrumentedAttribute[float | None]) -> tuple[ColumnElement[int], ...]:
    """A column's known values, those that are 1, and those neither 0 nor 1, as SQL
    counts (``count`` skips the NULL a ``CASE`` without ``ELSE`` gives)."""
    # Finite, as _known asks: PostgreSQL orders NaN above every number, infinity included,
    # and SQLite stores NaN as NULL, so a range holds the finite values on both.
    known = value.between(-sys.float_info.max, sys.float_info.max)
    return (func.count(case((known, 1))),
            func.count(case((value == 1.0, 1))),
            func.count(case((known & (value != 0.0) & (value != 1.0), 1))))


def _known(value: float | None) -> TypeGuard[float]:
    """A stored score is known when it is a finite number. The writer refuses NaN and the
    infinities (``_rows`` rule 2), but PostgreSQL stored them before it did (and SQLite an
    infinity): read as unknown, like NULL, they cannot make the judge raise."""
    return value is not None and math.isfinite(value)


async def newest_scores_start(session: AsyncSession, candidate: str,
                              metrics: Collection[str], newest: int) -> datetime | None:
    """The time from which no metric of ``candidate`` has more than ``newest`` values:
    the latest of each metric's ``newest``-th newest score time; None while every metric
    has fewer (one index range read per metric, however many rows are stored)."""
    starts = []
    with translate_store_errors():
        for metric in metrics:
            query = (
                select(ScoreRow.created_at)
                .join(BackendRow, BackendRow.id == ScoreRow.candidate_id)
                .where(BackendRow.name == candidate, ScoreRow.metric == metric)
                .order_by(ScoreRow.created_at.desc(), ScoreRow.id.desc())
                .offset(newest - 1).limit(1)
            )
            found = (await session.execute(query)).scalar_one_or_none()
            if found is not None:
                starts.append(_aware(found))
    return max(starts) if starts else None


async def load_conditioned_samples(
    session: AsyncSession, candidate: str, metrics: Collection[str],
    since: datetime | None = None,
) -> dict[str, ConditionedSamples]:
    """``metrics`` of ``candidate`` since ``since``, each value with the concurrency and
    the prompt and cached tokens of the observation it came from (the candidate's, or the
    primary's: the exchange's observation by a backend whose role is primary)."""
    cand_obs, prim_obs, prim_backend = (
        aliased(ObservationRow), aliased(ObservationRow), aliased(BackendRow))
    query = (
        select(ScoreRow.metric, ExchangeRow.prompt_bytes,
               ScoreRow.candidate_value, cand_obs.concurrency, cand_obs.prompt_tokens,
               cand_obs.cached_tokens, cand_obs.backend_running,
               ScoreRow.primary_value, prim_obs.concurrency, prim_obs.prompt_tokens,
               prim_obs.cached_tokens, prim_obs.backend_running)
        .join(BackendRow, BackendRow.id == ScoreRow.candidate_id)
        .join(ExchangeRow, ExchangeRow.id == ScoreRow.exchange_id)
        .join(cand_obs, (cand_obs.exchange_id == ScoreRow.exchange_id)
              & (cand_obs.backend_id == ScoreRow.candidate_id))
        .join(prim_obs, (prim_obs.exchange_id == ScoreRow.exchange_id)
              & (prim_obs.backend_id != ScoreRow.candidate_id))
        .join(prim_backend, (prim_backend.id == prim_obs.backend_id)
              & (prim_backend.role == "primary"))
        .where(BackendRow.name == candidate, ScoreRow.metric.in_(list(metrics)))
        .order_by(ScoreRow.metric, ScoreRow.created_at, ScoreRow.id)
    )
    if since is not None:
        query = query.where(ScoreRow.created_at >= _aware(since))
    out: dict[str, ConditionedSamples] = {}
    with translate_store_errors():
        result = await session.execute(query)
        for metric, prompt_bytes, *readings in result:
            found = out.setdefault(metric, ConditionedSamples())
            for columns, reading in ((found.candidate_columns, readings[:5]),
                                     (found.primary_columns, readings[5:])):
                if _known(reading[0]):  # the side's value
                    for column, item in zip(columns, (*reading, prompt_bytes), strict=True):
                        column.append(item)
    return out


async def load_samples_by_turn_depth(session: AsyncSession, candidate: str, metric: str,
                                     since: datetime | None = None,
                                     ) -> dict[int | None, StoredSamples]:
    """``candidate``'s values of ``metric`` grouped by the turn depth of their exchange
    (None where the depth is unknown), in the order they were scored."""
    query = (
        select(ExchangeRow.turn_depth, ScoreRow.candidate_value, ScoreRow.primary_value)
        .join(BackendRow, BackendRow.id == ScoreRow.candidate_id)
        .join(ExchangeRow, ExchangeRow.id == ScoreRow.exchange_id)
        .where(BackendRow.name == candidate, ScoreRow.metric == metric)
        .order_by(ScoreRow.created_at, ScoreRow.id)
    )
    if since is not None:
        query = query.where(ScoreRow.created_at >= _aware(since))
    with translate_store_errors():
        return _grouped_samples(await session.execute(query))


async def load_evaluated_requests(session: AsyncSession, candidate: str,
                                  since: datetime | None = None) -> EvaluatedRequests:
    """Each exchange scored for ``candidate`` since ``since``: its prompt size, route,
    turn depth and whether the candidate's answer was streamed."""
    scored = select(ScoreRow.exchange_id).join(
        BackendRow, BackendRow.id == ScoreRow.candidate_id).where(BackendRow.name == candidate)
    if since is not None:
        scored = scored.where(ScoreRow.created_at >= _aware(since))
    query = (
        select(ExchangeRow.prompt_bytes, ExchangeRow.route, ObservationRow.streamed,
               ExchangeRow.turn_depth)
        .join(ObservationRow, ObservationRow.exchange_id == ExchangeRow.id)
        .join(BackendRow, (BackendRow.id == ObservationRow.backend_id)
              & (BackendRow.name == candidate))
        .where(ExchangeRow.id.in_(scored.distinct().scalar_subquery()))
        .order_by(ExchangeRow.id)
    )
    out = EvaluatedRequests()
    with translate_store_errors():
        for prompt_bytes, route, streamed, depth in await session.execute(query):
            out.prompt_bytes.append(prompt_bytes)
            out.route.append(route)
            out.streamed.append(bool(streamed))
            out.turn_depth.append(depth)
    return out


async def record_traffic(session: AsyncSession, counts: Sequence[TrafficCount]) -> None:
    """Add ``counts`` to the ``traffic_counts`` histograms (an upsert that adds)."""
    if not counts:
        return
    dialect = session.get_bind().dialect.name
    rows = [{"window_start": datetime.fromtimestamp(c.window_start, UTC),
             "candidate": c.candidate, "outcome": c.outcome, "dimension": c.dimension,
             "value": c.value, "count": c.count} for c in counts]
    keys = ["window_start", "candidate", "outcome", "dimension", "value"]
    if dialect == "postgresql":
        pg = postgresql.insert(TrafficCountRow)
        statement: Any = pg.on_conflict_do_update(
            index_elements=keys, set_={"count": TrafficCountRow.count + pg.excluded.count})
    elif dialect == "sqlite":
        lite = sqlite.insert(TrafficCountRow)
        statement = lite.on_conflict_do_update(
            index_elements=keys, set_={"count": TrafficCountRow.count + lite.excluded.count})
    else:
        raise StoreRejected(f"no upsert for the {dialect} dialect")
    with translate_store_errors():
        await session.execute(statement, rows)


async def load_traffic(session: AsyncSession, candidate: str,
                       since: datetime | None = None) -> list[TrafficCount]:
    """All traffic seen, and ``candidate``'s drops, in the windows that start at or after
    ``since``'s window (a window is counted whole)."""
    query = select(TrafficCountRow.window_start, TrafficCountRow.candidate,
                   TrafficCountRow.outcome, TrafficCountRow.dimension, TrafficCountRow.value,
                   TrafficCountRow.count).where(
        TrafficCountRow.candidate.in_(["", candidate]))
    if since is not None:
        query = query.where(TrafficCountRow.window_start >= _aware(since).replace(
            second=0, microsecond=0))
    with translate_store_errors():
        rows = (await session.execute(query)).all()
    return [TrafficCount(int(_aware(w).timestamp()) if isinstance(w, datetime)
                         else int(_parse_time(w).timestamp()), c, o, d, v, int(n))
            for w, c, o, d, v, n in rows]


async def list_candidates(session: AsyncSession) -> list[CandidateSummary]:
    """Every backend that is or was a candidate, with its sample counts, by name."""
    counts = (
        select(ScoreRow.candidate_id, ScoreRow.metric,
               func.count().label("n"), func.max(ScoreRow.created_at).label("last"))
        .group_by(ScoreRow.candidate_id, ScoreRow.metric)
        .subquery()
    )
    query = (
        select(BackendRow.name, BackendRow.role, BackendRow.url, counts.c.metric, counts.c.n,
               counts.c["last"])
        .outerjoin(counts, counts.c.candidate_id == BackendRow.id)
        .where((BackendRow.role != "primary") | counts.c.n.is_not(None))
        .order_by(BackendRow.name, counts.c.metric)
    )
    with translate_store_errors():
        rows = (await session.execute(query)).all()
    summaries: dict[str, tuple[str, str | None, dict[str, int], list[datetime]]] = {}
    for name, role, url, metric, n, last in rows:
        _, _, per_metric, lasts = summaries.setdefault(name, (role, url, {}, []))
        if metric is not None:
            per_metric[metric] = int(n)
            lasts.append(_aware(last) if isinstance(last, datetime) else _parse_time(last))
    return [
        CandidateSummary(name=name, role=role, url=url, samples=sum(per_metric.values()),
                         metrics=per_metric, last_scored_at=max(lasts, default=None))
        for name, (role, url, per_metric, lasts) in summaries.items()
    ]


async def register_backend(session: AsyncSession, name: str, *, role: BackendRole,
                           url: str | None = None) -> int:
    """Create or update the backend ``name``; return its id.

    One upsert, so replicas that register the same backend at the same moment (they all
    start together) neither collide on the unique name nor overwrite a URL with nothing.
    """
    dialect = session.get_bind().dialect.name
    # A URL's password is never stored: the row describes the backend, it routes nothing.
    values = {"name": name, "role": role, "url": masked_url(url) if url else url}
    keep_url = url is not None  # an update that names no URL keeps the stored one
    if dialect == "postgresql":
        pg = postgresql.insert(BackendRow).values(values)
        statement: Any = pg.on_conflict_do_update(
            index_elements=[BackendRow.name], set_=_backend_changes(pg.excluded, keep_url))
    elif dialect == "sqlite":
        lite = sqlite.insert(BackendRow).values(values)
        statement = lite.on_conflict_do_update(
            index_elements=[BackendRow.name], set_=_backend_changes(lite.excluded, keep_url))
    else:
        raise StoreRejected(f"no upsert for the {dialect} dialect")
    with translate_store_errors():
        backend_id = await session.scalar(statement.returning(BackendRow.id))
    if backend_id is None:
        raise StoreRejected(f"backend {name!r} was not registered")
    return int(backend_id)


def _backend_changes(excluded: Any, keep_url: bool) -> dict[str, Any]:
    changes = {"role": excluded.role}
    if keep_url:
        changes["url"] = excluded.url
    return changes


async def record_verdict(session: AsyncSession, *, candidate: str, verdict: str,
                         reasons: Sequence[Any], statistics: Mapping[str, Any],
                         window_start: datetime | None = None,
                         window_end: datetime | None = None) -> int:
    """Store the judge's ``verdict`` on ``candidate`` (a known backend); return its id.

    ``reasons`` and ``statistics`` must be JSON-serialisable.
    """
    with translate_store_errors():
        candidate_id = await session.scalar(
            select(BackendRow.id).where(BackendRow.name == candidate))
        if candidate_id is None:
            raise StoreRejected(f"unknown backend {candidate!r}")
        row = VerdictRow(candidate_id=candidate_id, verdict=verdict, reasons=list(reasons),
                      statistics=dict(statistics), window_start=window_start,
                      window_end=window_end, created_at=datetime.now(UTC))
        session.add(row)
        await session.flush()
    return row.id


async def append_audit(session: AsyncSession, *, actor: str, action: str, target: str,
                       detail: Mapping[str, Any] | None = None, verdict_id: int | None = None,
                       at: datetime | None = None) -> int:
    """Append one entry to the audit log; return its id."""
    with translate_store_errors():
        row = AuditEntry(at=at or datetime.now(UTC), actor=actor, action=action, target=target,
                         detail=dict(detail or {}), verdict_id=verdict_id)
        session.add(row)
        await session.flush()
    return row.id


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _parse_time(value: Any) -> datetime:
    # SQLite returns aggregates of a DATETIME column as text, without the column's type.
    return _aware(datetime.fromisoformat(str(value)))
