"""The evaluation store: schema (made by Alembic only), the batched ScoreWriter, the
report's queries, and the routing state that gateway replicas share. PostgreSQL through
asyncpg or SQLite through aiosqlite; one URL picks.

    engine = create_engine(config)            # the caller owns it: dispose() at shutdown
    await upgrade(config.url)                 # Alembic, programmatically
    async with ScoreWriter(engine, config) as writer:
        writer.submit(exchange, scores)       # never blocks; False = dropped and counted
    async with session_factory(engine)() as session, session.begin():
        samples = await load_samples(session, "candidate-a")
    await save_routing(engine, 2, data, expected=1, audit=note)   # compare-and-set
    listener = await listen_for_routing(engine, on_change)        # PostgreSQL's NOTIFY
    await prune_store(engine, retention_cutoff(30))               # the writer does it too

Everything a caller outside the store needs is exported here; its modules are private.
"""

from evaluators.store._config import DEFAULT_STORE_URL, RetentionDays, StoreConfig, masked_url
from evaluators.store._engine import create_engine, session_factory
from evaluators.store._errors import (
    StoreError,
    StoreRejected,
    StoreUnavailable,
    UnknownRevision,
    WriterStateError,
)
from evaluators.store._migrate import (
    current_revision,
    downgrade,
    head_revision,
    lock_for_migration,
    upgrade,
)
from evaluators.store._queries import (
    TRAFFIC_SEEN,
    CandidateSummary,
    ConditionedSamples,
    EvaluatedRequests,
    StoredCounts,
    StoredSamples,
    TrafficCount,
    ValueCounts,
    append_audit,
    list_candidates,
    load_conditioned_samples,
    load_evaluated_requests,
    load_samples,
    load_samples_by_turn_depth,
    load_traffic,
    load_value_counts,
    newest_scores_start,
    record_traffic,
    record_verdict,
    register_backend,
)
from evaluators.store._retention import Pruned, prune_store, retention_cutoff
from evaluators.store._routing import (
    AuditNote,
    RoutingListener,
    listen_for_routing,
    load_routing,
    record_change,
    save_routing,
)
from evaluators.store._rows import ScoreLike
from evaluators.store._schema import (
    AuditEntry,
    BackendRole,
    BackendRow,
    Base,
    ExchangeRow,
    ObservationRow,
    ScoreRow,
    TrafficCountRow,
    VerdictRow,
)
from evaluators.store._writer import DropReason, ScoreWriter, WriterState, WriterStats

__all__ = [
    "DEFAULT_STORE_URL",
    "TRAFFIC_SEEN",
    "AuditEntry",
    "AuditNote",
    "BackendRole",
    "BackendRow",
    "Base",
    "CandidateSummary",
    "ConditionedSamples",
    "DropReason",
    "EvaluatedRequests",
    "ExchangeRow",
    "ObservationRow",
    "Pruned",
    "RetentionDays",
    "RoutingListener",
    "ScoreLike",
    "ScoreRow",
    "ScoreWriter",
    "StoreConfig",
    "StoreError",
    "StoreRejected",
    "StoreUnavailable",
    "StoredCounts",
    "StoredSamples",
    "TrafficCount",
    "TrafficCountRow",
    "UnknownRevision",
    "ValueCounts",
    "VerdictRow",
    "WriterState",
    "WriterStateError",
    "WriterStats",
    "append_audit",
    "create_engine",
    "current_revision",
    "downgrade",
    "head_revision",
    "list_candidates",
    "listen_for_routing",
    "load_conditioned_samples",
    "load_evaluated_requests",
    "load_routing",
    "load_samples",
    "load_samples_by_turn_depth",
    "load_traffic",
    "load_value_counts",
    "lock_for_migration",
    "masked_url",
    "newest_scores_start",
    "prune_store",
    "record_change",
    "record_traffic",
    "record_verdict",
    "register_backend",
    "retention_cutoff",
    "save_routing",
    "session_factory",
    "upgrade",
]
