"""The judge's conditions: each observation's concurrency, each exchange's prompt size and
turn depth, and the per-window histograms of all traffic seen and dropped.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

big_key = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
name = sa.String(200)


def upgrade() -> None:
    with op.batch_alter_table("observations") as batch:
        batch.add_column(sa.Column("concurrency", sa.Integer(), nullable=True))
    with op.batch_alter_table("exchanges") as batch:
        batch.add_column(sa.Column("prompt_bytes", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("turn_depth", sa.Integer(), nullable=True))
    op.create_table(
        "traffic_counts",
        sa.Column("id", big_key, primary_key=True),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("candidate", name, nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("dimension", sa.String(16), nullable=False),
        sa.Column("value", sa.String(64), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_traffic_counts")),
        sa.UniqueConstraint("window_start", "candidate", "outcome", "dimension", "value",
                            name=op.f("uq_traffic_counts_window_start_candidate_outcome_"
                                      "dimension_value")),
    )


def downgrade() -> None:
    op.drop_table("traffic_counts")
    with op.batch_alter_table("exchanges") as batch:
        batch.drop_column("turn_depth")
        batch.drop_column("prompt_bytes")
    with op.batch_alter_table("observations") as batch:
        batch.drop_column("concurrency")
