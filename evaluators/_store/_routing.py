"""The routing state row that gateway replicas share (one row, id 1, with a version).

A replica changes it only from the version it last saw (compare-and-set), so two
replicas never overwrite each other's change unseen. PostgreSQL replicas are told of a
change at once (``NOTIFY``); every replica also polls.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators._store._errors import translate_store_errors
from evaluators._store._schema import Base

__all__ = ["ROUTING_CHANNEL", "load_routing", "save_routing"]

ROUTING_CHANNEL = "understudy_routing"
_ROW_ID = 1

routing_state = sa.Table(
    "routing_state", Base.metadata,
    sa.Column("id", sa.Integer(), primary_key=True),
    sa.Column("version", sa.BigInteger(), nullable=False),
    sa.Column("data", sa.JSON(), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)


async def load_routing(engine: AsyncEngine) -> tuple[int, dict[str, Any]] | None:
    with translate_store_errors():
        async with engine.connect() as connection:
            row = (await connection.execute(
                sa.select(routing_state.c.version, routing_state.c.data)
                .where(routing_state.c.id == _ROW_ID))).first()
    return (int(row.version), dict(row.data)) if row is not None else None


async def save_routing(engine: AsyncEngine, version: int, data: dict[str, Any],
                       expected: int | None) -> bool:
    """Store ``data`` as ``version`` if the row is still at ``expected`` (None: no row yet).

    Returns False when another replica got there first.
    """
    now = datetime.now(UTC)
    with translate_store_errors():
        async with engine.begin() as connection:
            if expected is None:
                exists = await connection.scalar(
                    sa.select(sa.func.count()).select_from(routing_state))
                if exists:
                    return False
                await connection.execute(routing_state.insert().values(
                    id=_ROW_ID, version=version, data=data, updated_at=now))
            else:
                result = await connection.execute(
                    routing_state.update()
                    .where(routing_state.c.id == _ROW_ID, routing_state.c.version == expected)
                    .values(version=version, data=data, updated_at=now))
                if result.rowcount != 1:
                    return False
            if connection.dialect.name == "postgresql":
                await connection.execute(sa.select(sa.func.pg_notify(ROUTING_CHANNEL,
                                                                     str(version))))
    return True
