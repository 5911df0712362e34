"""The tables evaluation results live in, as SQLAlchemy 2 declarative models.

Rules:
1. Alembic (``migrations/``) is the only way the schema is made or changed. These models
   describe the schema for queries and for ``alembic revision --autogenerate``; a test
   checks that the migrations and these models agree.
2. Types are portable: the same models serve PostgreSQL (asyncpg) and SQLite (aiosqlite).
   JSON, not JSONB; a CHECK, not a native enum.
3. A value an Observation does not know is NULL, never 0 (``cached_tokens`` above all).
4. Times are stored as UTC and come back timezone-aware on every backend.
5. Prompt and answer text are columns, but they stay NULL unless the store is configured
   to keep them (``StoreConfig.store_prompts`` / ``store_answers``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "AuditEntry",
    "BackendRole",
    "BackendRow",
    "Base",
    "ExchangeRow",
    "ObservationRow",
    "ScoreRow",
    "TrafficCountRow",
    "VerdictRow",
]

BackendRole = Literal["primary", "candidate", "secondary"]
BACKEND_ROLES: tuple[BackendRole, ...] = ("primary", "candidate", "secondary")

NAME_LENGTH = 200
"""Backend names, metric names, actors: short identifiers."""
REQUEST_ID_LENGTH = 200

# Constraint names must be stable for Alembic (SQLite alters tables by copying them).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite gives auto-increment keys only to INTEGER PRIMARY KEY columns.
BigIntKey = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC; naive values coming back (SQLite) are marked UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: the store takes timezone-aware times only")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class BackendRow(Base):
    """A deployment answers are compared across; registered on first sight."""

    __tablename__ = "backends"
    __table_args__ = (
        CheckConstraint("role IN ('primary', 'candidate', 'secondary')", name="role"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    url: Mapped[str | None] = mapped_column(Text)
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


class ExchangeRow(Base):
    """One mirrored request. Several candidates' Exchanges share one row."""

    __tablename__ = "exchanges"

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(REQUEST_ID_LENGTH), unique=True)
    session_key: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    route: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    started_at: Mapped[datetime] = mapped_column(index=True)
    """Retention prunes by it, oldest first (``_retention``; migration 0005)."""
    prompt_hash: Mapped[str | None] = mapped_column(String(64))
    prompt: Mapped[str | None] = mapped_column(Text)
    prompt_bytes: Mapped[int | None] = mapped_column(Integer)
    """The request body's size as forwarded (the sample-bias check's prompt size)."""
    turn_depth: Mapped[int | None] = mapped_column(Integer)
    """Assistant messages before the request's last; NULL for other routes than chat."""


class ObservationRow(Base):
    """What one backend did for one exchange: every measured field of an Observation."""

    __tablename__ = "observations"
    __table_args__ = (UniqueConstraint("exchange_id", "backend_id"),)

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    exchange_id: Mapped[int] = mapped_column(
        BigIntKey, ForeignKey("exchanges.id", ondelete="CASCADE")
    )
    backend_id: Mapped[int] = mapped_column(ForeignKey("backends.id"), index=True)
    started_at: Mapped[datetime]
    status: Mapped[int] = mapped_column(Integer)
    streamed: Mapped[bool] = mapped_column(Boolean)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float | None] = mapped_column(Float)
    itl_mean_s: Mapped[float | None] = mapped_column(Float)
    itl_p99_s: Mapped[float | None] = mapped_column(Float)
    chunks: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    bytes: Mapped[int] = mapped_column(BigInteger)
    truncated: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text)
    answer: Mapped[str | None] = mapped_column(Text)
    tool_calls: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    concurrency: Mapped[int | None] = mapped_column(Integer)
    """Requests the gateway had in flight at this backend when it sent this one, this one
    included: the load the latency was measured under (NULL: not counted)."""
    backend_running: Mapped[int | None] = mapped_column(Integer)
    """The backend's own ``vllm:num_requests_running`` as last scraped before this request
    (load the gateway may not see; NULL: not exported or not scraped)."""


class ScoreRow(Base):
    """One metric of one candidate on one exchange; ``primary_value`` NULL when pairwise.

    (exchange, candidate, metric) is unique, so a batch retried after a commit whose
    answer was lost does not count its scores twice.
    """

    __tablename__ = "scores"
    __table_args__ = (
        UniqueConstraint("exchange_id", "candidate_id", "metric"),
        Index("ix_scores_candidate_id_metric_created_at", "candidate_id", "metric", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    exchange_id: Mapped[int] = mapped_column(
        BigIntKey, ForeignKey("exchanges.id", ondelete="CASCADE")
    )
    candidate_id: Mapped[int] = mapped_column(ForeignKey("backends.id"))
    metric: Mapped[str] = mapped_column(String(NAME_LENGTH))
    candidate_value: Mapped[float | None] = mapped_column(Float)
    primary_value: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


class TrafficCountRow(Base):
    """All traffic the gateway saw, and what it dropped, as per-window histograms.

    One row per (window, candidate, outcome, dimension, value) holding a count; replicas
    add to it (an upsert), so its size is bounded by windows x buckets, never by requests.
    ``candidate`` is "" for all traffic (``outcome`` "seen"); a drop names its candidate
    and its reason as the outcome.
    """

    __tablename__ = "traffic_counts"
    __table_args__ = (
        UniqueConstraint("window_start", "candidate", "outcome", "dimension", "value"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    window_start: Mapped[datetime]
    candidate: Mapped[str] = mapped_column(String(NAME_LENGTH))
    outcome: Mapped[str] = mapped_column(String(32))
    dimension: Mapped[str] = mapped_column(String(16))
    value: Mapped[str] = mapped_column(String(64))
    count: Mapped[int] = mapped_column(BigInteger)


class VerdictRow(Base):
    """The judge's decision on a candidate over a window, with the numbers behind it."""

    __tablename__ = "verdicts"
    __table_args__ = (Index("ix_verdicts_candidate_id_created_at", "candidate_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    candidate_id: Mapped[int] = mapped_column(ForeignKey("backends.id"))
    verdict: Mapped[str] = mapped_column(String(32))
    reasons: Mapped[list[Any]] = mapped_column(JSON)
    statistics: Mapped[dict[str, Any]] = mapped_column(JSON)
    window_start: Mapped[datetime | None]
    window_end: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


class AuditEntry(Base):
    """Who did what to which target (promote, rollback, canary, config), and why."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    at: Mapped[datetime] = mapped_column(server_default=func.now(), index=True)
    actor: Mapped[str] = mapped_column(String(NAME_LENGTH))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(NAME_LENGTH))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    verdict_id: Mapped[int | None] = mapped_column(BigIntKey, ForeignKey("verdicts.id"))
