"""The store's typed configuration: where the database is, what text to keep, the bounds
(of the writer's queue, and of how long rows are kept).

Building a StoreConfig has no side effects; ``create_engine`` and ``ScoreWriter`` start
things. Every bound of the writer is named here and exceeding it is a counted drop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

__all__ = ["DEFAULT_RETENTION_DAYS", "DEFAULT_STORE_URL", "RetentionDays", "StoreConfig",
           "masked_url"]

MiB = 1024 * 1024

DEFAULT_STORE_URL = "sqlite+aiosqlite:///understudy.db"
DEFAULT_QUEUE_ROWS = 100_000
"""Rows (exchange + observations + scores) the writer holds while waiting to write."""
DEFAULT_QUEUE_TEXT_CHARS = 64 * MiB
"""Characters of prompt and answer text held for writing; only used when texts are stored."""
DEFAULT_BATCH_ROWS = 10_000
DEFAULT_FLUSH_INTERVAL_S = 0.5
DEFAULT_RETRY_BASE_S = 0.05
DEFAULT_RETRY_MAX_S = 5.0
DEFAULT_CLOSE_TIMEOUT_S = 10.0
DEFAULT_POOL_SIZE = 4
DEFAULT_POOL_OVERFLOW = 4
DEFAULT_POOL_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_STATEMENT_TIMEOUT_S = 60.0
DEFAULT_SQLITE_BUSY_TIMEOUT_S = 5.0
DEFAULT_RETENTION_DAYS = 30.0
"""Exchanges (with their observations and scores) and traffic counts older than this are
deleted (``_retention``); 0 keeps them forever. The judge reads a far shorter window."""
MAX_RETENTION_DAYS = 36_500.0
"""A hundred years: past it a cutoff is no longer a date (and 0 already means forever)."""
DEFAULT_PRUNE_INTERVAL_S = 300.0
"""How often the writer's pruning pass runs (the first one an interval after start)."""
DEFAULT_PRUNE_BATCH_EXCHANGES = 1000
"""Exchanges deleted per transaction, with their observations and scores: what bounds
each statement's size and how long a batch holds its locks."""
MAX_PRUNE_BATCH_EXCHANGES = 10_000
"""Each batch binds its ids as parameters: far below SQLite's (32,766) and asyncpg's
(32,767) bound on a statement's parameters."""

RetentionDays = Annotated[float, Field(ge=0, le=MAX_RETENTION_DAYS, allow_inf_nan=False)]
"""Days of per-exchange data the store keeps; 0: forever."""


class StoreConfig(BaseModel):
    """Where scores go and how the batched writer behaves.

    ``url`` picks the backend: ``postgresql+asyncpg://...`` or ``sqlite+aiosqlite:///path``
    (plain ``postgresql://`` and ``sqlite://`` are accepted and given the async driver).
    The URL may hold a password, so it is left out of ``repr``; log ``masked_url(url)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(DEFAULT_STORE_URL, repr=False)
    store_prompts: bool = False
    store_answers: bool = False
    # Session keys are stored as keyed hashes (_hash_key.py) unless this is set.
    store_session_keys: bool = False
    # The HMAC key for session keys and prompt hashes; else read from (or created in)
    # hash_key_file, by default $XDG_STATE_HOME/understudy/hash.key.
    hash_key: SecretStr | None = Field(None, repr=False)
    hash_key_file: Path | None = None
    queue_rows: int = Field(DEFAULT_QUEUE_ROWS, gt=0)
    queue_text_chars: int = Field(DEFAULT_QUEUE_TEXT_CHARS, ge=0)
    batch_rows: int = Field(DEFAULT_BATCH_ROWS, gt=0)
    flush_interval_s: float = Field(DEFAULT_FLUSH_INTERVAL_S, gt=0)
    retry_base_s: float = Field(DEFAULT_RETRY_BASE_S, gt=0)
    retry_max_s: float = Field(DEFAULT_RETRY_MAX_S, gt=0)
    close_timeout_s: float = Field(DEFAULT_CLOSE_TIMEOUT_S, ge=0)
    pool_size: int = Field(DEFAULT_POOL_SIZE, gt=0)
    pool_overflow: int = Field(DEFAULT_POOL_OVERFLOW, ge=0)
    pool_timeout_s: float = Field(DEFAULT_POOL_TIMEOUT_S, gt=0)
    connect_timeout_s: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    statement_timeout_s: float = Field(DEFAULT_STATEMENT_TIMEOUT_S, gt=0)
    sqlite_busy_timeout_s: float = Field(DEFAULT_SQLITE_BUSY_TIMEOUT_S, ge=0)
    # Retention (``_retention``): what is older goes, in bounded batches, oldest first;
    # verdicts, the audit log, the routing state and backends are kept whatever their age.
    retention_days: RetentionDays = DEFAULT_RETENTION_DAYS
    prune_interval_s: float = Field(DEFAULT_PRUNE_INTERVAL_S, gt=0)
    prune_batch_exchanges: int = Field(DEFAULT_PRUNE_BATCH_EXCHANGES, gt=0,
                                       le=MAX_PRUNE_BATCH_EXCHANGES)

    @field_validator("url")
    @classmethod
    def _async_driver(cls, url: str) -> str:
        return async_url(url)

    @model_validator(mode="after")
    def _retry_bounds(self) -> StoreConfig:
        if self.retry_max_s < self.retry_base_s:
            raise ValueError("retry_max_s must be at least retry_base_s")
        return self


def async_url(url: str) -> str:
    """Give a database URL its async driver; refuse backends the store does not support."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(f"not a database URL: {masked_url(url)}") from exc
    backend = parsed.get_backend_name()
    driver = {"postgresql": "asyncpg", "sqlite": "aiosqlite"}.get(backend)
    if driver is None:
        raise ValueError(f"the store supports postgresql and sqlite, not {backend!r}")
    if parsed.drivername != f"{backend}+{driver}":
        if parsed.drivername != backend:
            raise ValueError(f"use the {backend}+{driver} driver, not {parsed.drivername!r}")
        parsed = parsed.set(drivername=f"{backend}+{driver}")
    return parsed.render_as_string(hide_password=False)


def masked_url(url: str) -> str:
    """The URL with its password replaced by ``***``, for logs and reprs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<invalid url>"
