"""An index on ``exchanges.started_at``: retention deletes the oldest exchanges first, a
bounded batch at a time (``evaluators/store/_retention.py``), and without it each batch
would scan the whole table."""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_exchanges_started_at", "exchanges", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_exchanges_started_at", table_name="exchanges")
