"""The evaluation store: schema (made by Alembic only), the batched ScoreWriter, the
report's queries. PostgreSQL through asyncpg or SQLite through aiosqlite; one URL picks.

    engine = create_engine(config)            # the caller owns it: dispose() at shutdown
    await upgrade(config.url)                 # Alembic, programmatically
    async with ScoreWriter(engine, config) as writer:
        writer.submit(exchange, scores)       # never blocks; False = dropped and counted
    async with session_factory(engine)() as session, session.begin():
        samples = await load_samples(session, "candidate-a")
"""

from evaluators._store._config import DEFAULT_STORE_URL, StoreConfig
from evaluators._store._engine import create_engine, session_factory
from evaluators._store._errors import (
    StoreError,
    StoreRejected,
    StoreUnavailable,
    WriterStateError,
)
from evaluators._store._migrate import current_revision, downgrade, head_revision, upgrade
from evaluators._store._queries import (
    CandidateSummary,
    Samples,
    append_audit,
    list_candidates,
    load_samples,
    record_verdict,
    register_backend,
)
from evaluators._store._rows import ScoreLike
from evaluators._store._schema import (
    AuditEntry,
    Backend,
    BackendRole,
    Base,
    ExchangeRow,
    ObservationRow,
    ScoreRow,
    Verdict,
)
from evaluators._store._writer import DropReason, ScoreWriter, WriterState, WriterStats

__all__ = [
    "DEFAULT_STORE_URL",
    "AuditEntry",
    "Backend",
    "BackendRole",
    "Base",
    "CandidateSummary",
    "DropReason",
    "ExchangeRow",
    "ObservationRow",
    "Samples",
    "ScoreLike",
    "ScoreRow",
    "ScoreWriter",
    "StoreConfig",
    "StoreError",
    "StoreRejected",
    "StoreUnavailable",
    "Verdict",
    "WriterState",
    "WriterStateError",
    "WriterStats",
    "append_audit",
    "create_engine",
    "current_revision",
    "downgrade",
    "head_revision",
    "list_candidates",
    "load_samples",
    "record_verdict",
    "register_backend",
    "session_factory",
    "upgrade",
]
