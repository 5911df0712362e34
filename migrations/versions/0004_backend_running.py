"""Each observation's scraped backend concurrency (``vllm:num_requests_running``)."""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("observations") as batch:
        batch.add_column(sa.Column("backend_running", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("observations") as batch:
        batch.drop_column("backend_running")
