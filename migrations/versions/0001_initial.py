"""The evaluation store: backends, exchanges, observations, scores, verdicts, audit log."""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the types in evaluators/store/_schema.py as they were at this revision.
big_key = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
name = sa.String(200)
utc = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "backends",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", name, nullable=False),
        sa.Column("url", sa.Text(), nullable=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", utc, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_backends")),
        sa.UniqueConstraint("name", name=op.f("uq_backends_name")),
        sa.CheckConstraint("role IN ('primary', 'candidate', 'secondary')",
                           name=op.f("ck_backends_role")),
    )
    op.create_table(
        "exchanges",
        sa.Column("id", big_key, primary_key=True),
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("session_key", name, nullable=False),
        sa.Column("route", sa.String(64), nullable=False),
        sa.Column("model", name, nullable=True),
        sa.Column("started_at", utc, nullable=False),
        sa.Column("prompt_hash", sa.String(64), nullable=True),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_exchanges")),
        sa.UniqueConstraint("request_id", name=op.f("uq_exchanges_request_id")),
    )
    op.create_index(op.f("ix_exchanges_session_key"), "exchanges", ["session_key"])
    op.create_table(
        "observations",
        sa.Column("id", big_key, primary_key=True),
        sa.Column("exchange_id", big_key, nullable=False),
        sa.Column("backend_id", sa.Integer(), nullable=False),
        sa.Column("started_at", utc, nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("streamed", sa.Boolean(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("e2e_s", sa.Float(), nullable=True),
        sa.Column("itl_mean_s", sa.Float(), nullable=True),
        sa.Column("itl_p99_s", sa.Float(), nullable=True),
        sa.Column("chunks", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.String(64), nullable=True),
        sa.Column("model", name, nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("truncated", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("answer", sa.Text(), nullable=True),
        sa.Column("tool_calls", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_observations")),
        sa.ForeignKeyConstraint(["exchange_id"], ["exchanges.id"], ondelete="CASCADE",
                                name=op.f("fk_observations_exchange_id_exchanges")),
        sa.ForeignKeyConstraint(["backend_id"], ["backends.id"],
                                name=op.f("fk_observations_backend_id_backends")),
        sa.UniqueConstraint("exchange_id", "backend_id",
                            name=op.f("uq_observations_exchange_id_backend_id")),
    )
    op.create_index(op.f("ix_observations_backend_id"), "observations", ["backend_id"])
    op.create_table(
        "scores",
        sa.Column("id", big_key, primary_key=True),
        sa.Column("exchange_id", big_key, nullable=False),
        sa.Column("candidate_id", sa.Integer(), nullable=False),
        sa.Column("metric", name, nullable=False),
        sa.Column("candidate_value", sa.Float(), nullable=True),
        sa.Column("primary_value", sa.Float(), nullable=True),
        sa.Column("created_at", utc, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scores")),
        sa.ForeignKeyConstraint(["exchange_id"], ["exchanges.id"], ondelete="CASCADE",
                                name=op.f("fk_scores_exchange_id_exchanges")),
        sa.ForeignKeyConstraint(["candidate_id"], ["backends.id"],
                                name=op.f("fk_scores_candidate_id_backends")),
        sa.UniqueConstraint("exchange_id", "candidate_id", "metric",
                            name=op.f("uq_scores_exchange_id_candidate_id_metric")),
    )
    op.create_index(op.f("ix_scores_candidate_id_metric_created_at"), "scores",
                    ["candidate_id", "metric", "created_at"])
    op.create_table(
        "verdicts",
        sa.Column("id", big_key, primary_key=True),
        sa.Column("candidate_id", sa.Integer(), nullable=False),
        sa.Column("verdict", sa.String(32), nullable=False),
        sa.Column("reasons", sa.JSON(), nullable=False),
        sa.Column("statistics", sa.JSON(), nullable=False),
        sa.Column("window_start", utc, nullable=True),
        sa.Column("window_end", utc, nullable=True),
        sa.Column("created_at", utc, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_verdicts")),
        sa.ForeignKeyConstraint(["candidate_id"], ["backends.id"],
                                name=op.f("fk_verdicts_candidate_id_backends")),
    )
    op.create_index(op.f("ix_verdicts_candidate_id_created_at"), "verdicts",
                    ["candidate_id", "created_at"])
    op.create_table(
        "audit_log",
        sa.Column("id", big_key, primary_key=True),
        sa.Column("at", utc, server_default=sa.func.now(), nullable=False),
        sa.Column("actor", name, nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", name, nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("verdict_id", big_key, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
        sa.ForeignKeyConstraint(["verdict_id"], ["verdicts.id"],
                                name=op.f("fk_audit_log_verdict_id_verdicts")),
    )
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"])


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("verdicts")
    op.drop_table("scores")
    op.drop_table("observations")
    op.drop_index(op.f("ix_exchanges_session_key"), table_name="exchanges")
    op.drop_table("exchanges")
    op.drop_table("backends")
