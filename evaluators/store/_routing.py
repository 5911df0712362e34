"""The routing state row that gateway replicas share (one row, id 1, with a version), and
the admin changes written with it.

A replica changes it only from the version it last saw (compare-and-set), so two
replicas never overwrite each other's change unseen. PostgreSQL replicas are told of a
change at once (``NOTIFY`` here, ``listen_for_routing`` on their side); every replica also
polls. A change's audit entry commits in
the same transaction as the change (``save_routing(..., audit=)``, ``record_change``):
the store holds both or neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from evaluators.store._engine import session_factory
from evaluators.store._errors import StoreUnavailable, translate_store_errors
from evaluators.store._queries import append_audit, register_backend
from evaluators.store._schema import AuditEntry, BackendRole, Base

__all__ = [
    "ROUTING_CHANNEL",
    "AuditNote",
    "RoutingListener",
    "listen_for_routing",
    "load_routing",
    "record_change",
    "save_routing",
]


@dataclass(frozen=True, slots=True)
class AuditNote:
    """One audit-log entry: who did what to which target, and why."""

    actor: str
    action: str
    target: str
    detail: dict[str, Any] = field(default_factory=dict)
    verdict_id: int | None = None

ROUTING_CHANNEL = "understudy_routing"
LISTEN_CLOSE_TIMEOUT_S = 2.0
"""How long closing the LISTEN connection may wait for the server before dropping it."""
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
                       expected: int | None, audit: AuditNote | None = None) -> bool:
    """Store ``data`` as ``version`` if the row is still at ``expected`` (None: no row yet),
    with ``audit`` in the same transaction.

    Returns False when another replica got there first (and writes no audit entry).
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
            if audit is not None:
                await _append(connection, audit, now)
            if connection.dialect.name == "postgresql":
                await connection.execute(sa.select(sa.func.pg_notify(ROUTING_CHANNEL,
                                                                     str(version))))
    return True


async def record_change(engine: AsyncEngine, audit: AuditNote,
                        backend: tuple[str, BackendRole, str] | None = None) -> None:
    """Store an admin change that is not a routing change: its audit entry, and the
    backend it registers (name, role, URL), in one transaction."""
    with translate_store_errors():
        async with session_factory(engine)() as session, session.begin():
            if backend is not None:
                name, role, url = backend
                await register_backend(session, name, role=role, url=url)
            await append_audit(session, actor=audit.actor, action=audit.action,
                               target=audit.target, detail=audit.detail,
                               verdict_id=audit.verdict_id)


async def _append(connection: AsyncConnection, audit: AuditNote, at: datetime) -> None:
    await connection.execute(sa.insert(AuditEntry).values(
        at=at, actor=audit.actor, action=audit.action, target=audit.target,
        detail=audit.detail, verdict_id=audit.verdict_id))


class RoutingListener:
    """A connection of its own that LISTENs for stored routing versions; ``close`` ends it."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    async def close(self) -> None:
        """Say goodbye to the server within ``LISTEN_CLOSE_TIMEOUT_S``, else drop the
        socket: a server that no longer answers (a black hole) must not hold a shutdown."""
        try:
            await self._connection.close(timeout=LISTEN_CLOSE_TIMEOUT_S)
        except Exception:  # timed out, or the connection was already broken
            self._connection.terminate()


async def listen_for_routing(engine: AsyncEngine,
                             on_change: Callable[[], None]) -> RoutingListener | None:
    """Call ``on_change`` each time a replica stores a routing version (``NOTIFY``).

    None where the database cannot notify (SQLite: its replicas poll). A LISTEN that cannot
    be set up raises :class:`StoreUnavailable`. The password leaves the engine's URL only
    for the driver's connect, never for a log.
    """
    if engine.dialect.name != "postgresql":
        return None
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        connection = await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError) as exc:
        raise StoreUnavailable(f"LISTEN: {type(exc).__name__}: {exc}"[:300]) from exc
    try:
        await connection.add_listener(ROUTING_CHANNEL, lambda *_: on_change())
    except (OSError, asyncpg.PostgresError) as exc:
        await RoutingListener(connection).close()
        raise StoreUnavailable(f"LISTEN: {type(exc).__name__}: {exc}"[:300]) from exc
    return RoutingListener(connection)
