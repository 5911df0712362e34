"""An index on ``exchanges.started_at``: retention deletes the oldest exchanges first, a
bounded batch at a time (``evaluators/store/_retention.py``), and without it each batch
would scan the whole table.

A plain CREATE INDEX, not CONCURRENTLY: on PostgreSQL it holds writes to ``exchanges``
(not reads) while it runs, about 1 s per million rows measured here; only score writers
wait (they retry within their bounded queue), never the proxy. CONCURRENTLY cannot run in
the one transaction that holds the migration's advisory lock (``_migrate`` rule 1), and
holding a session lock instead deadlocks: the build waits for every older snapshot,
including that of a replica queued on the lock. So an operator with a very large table
builds it first, by hand, ``CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_exchanges_started_at
ON exchanges (started_at)``, and this migration finds it (IF NOT EXISTS)."""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_exchanges_started_at", "exchanges", ["started_at"], if_not_exists=True)


def downgrade() -> None:
    op.drop_index("ix_exchanges_started_at", table_name="exchanges")
