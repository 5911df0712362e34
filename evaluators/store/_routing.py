"""The routing state row that gateway replicas share (one row, id 1, with a version), and
the admin changes written with it.

A replica changes it only from the version it last saw (compare-and-set), so two
replicas never overwrite each other's change unseen. PostgreSQL replicas are told of a
change at once (``NOTIFY`` here, ``listen_for_routing`` on their side), over a LISTEN
connection that sets itself up again when it is lost or was never up
(``RoutingListener``); every replica also polls. A change's audit entry commits in
the same transaction as the change (``save_routing(..., audit=)``, ``record_change``):
the store holds both or neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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

log = logging.getLogger("understudy.store")


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
LISTEN_CONNECT_TIMEOUT_S = 5.0
"""How long one connect of the LISTEN connection may take (a black-holed server)."""
LISTEN_RETRY_BASE_S = 0.5
"""The wait before the first try to set a lost LISTEN up again; it doubles per failure..."""
LISTEN_RETRY_MAX_S = 5.0
"""...up to this: a replica hears of changes again within seconds of the store's return."""
LISTEN_PING_INTERVAL_S = 10.0
"""How long the LISTEN connection may stay quiet before it is asked to answer a query..."""
LISTEN_PING_TIMEOUT_S = 5.0
"""...within this, or it is taken for lost: a server behind a dropped route never says so."""
_LISTEN_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)
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
    """A connection of its own that LISTENs for stored routing versions, kept up by a
    task of its own (rules 1-3 below); ``close`` ends both.

    1. The connection's loss (asyncpg's termination listener: a restarted server, a cut
       network) or a connect that fails, at start or later, is retried after a backoff
       that starts at ``LISTEN_RETRY_BASE_S`` and doubles up to ``LISTEN_RETRY_MAX_S``;
       each connect gets ``LISTEN_CONNECT_TIMEOUT_S``. Replicas poll meanwhile.
    2. An outage is logged once, at WARNING, when it begins, and once, at INFO, when it
       ends; never with the password (the DSN holds it; only the driver sees it).
    3. After each LISTEN the task sets up again, ``on_change`` is called once: a version
       stored while this replica was not listening is read at once, not at the next poll.
    4. A connection that stays quiet for ``LISTEN_PING_INTERVAL_S`` is asked ``SELECT 1``;
       no answer within ``LISTEN_PING_TIMEOUT_S`` counts as a loss (rule 1): a server that
       vanished without a reset (a dropped route, a silent firewall) is noticed too.
    """

    connect_timeout_s = LISTEN_CONNECT_TIMEOUT_S
    ping_interval_s = LISTEN_PING_INTERVAL_S
    ping_timeout_s = LISTEN_PING_TIMEOUT_S

    def __init__(self, dsn: str, on_change: Callable[[], None]) -> None:
        self._dsn = dsn
        self._on_change = on_change
        self._connection: asyncpg.Connection | None = None
        self._lost = asyncio.Event()
        self._lost.set()
        self._keeper: asyncio.Task[None] | None = None

    async def _listen(self) -> None:
        """One LISTEN on a new connection, or :class:`StoreUnavailable`."""
        try:
            connection = await asyncpg.connect(self._dsn, timeout=self.connect_timeout_s)
        except _LISTEN_ERRORS as exc:
            raise _unavailable(exc) from exc
        connection.add_termination_listener(self._terminated)
        try:
            await connection.add_listener(ROUTING_CHANNEL, lambda *_: self._on_change())
        except _LISTEN_ERRORS as exc:
            connection.terminate()
            raise _unavailable(exc) from exc
        except asyncio.CancelledError:  # closed while setting up: leave no connection open
            connection.terminate()
            raise
        if connection.is_closed():  # lost before this task saw its LISTEN through
            raise StoreUnavailable("LISTEN: the connection closed as it was set up")
        self._connection = connection
        self._lost.clear()

    def _terminated(self, connection: object) -> None:
        if connection is self._connection:
            self._lost.set()

    async def start(self) -> None:
        """Set up the first LISTEN before returning if the server lets it, then keep one
        up (rule 1): one that cannot be set up now is retried in the background."""
        unavailable = None
        try:
            await self._listen()
        except StoreUnavailable as exc:
            unavailable = exc
        self._keeper = asyncio.get_running_loop().create_task(
            self._keep_listening(unavailable), name="routing-listen")

    async def _keep_listening(self, unavailable: StoreUnavailable | None) -> None:
        """Rules 1-3."""
        while True:
            silent = await self._watch()
            if silent:
                log.warning("routing LISTEN connection stopped answering; reconnecting "
                            "(replicas poll meanwhile)")
            elif unavailable is None:
                log.warning("routing LISTEN connection lost; reconnecting (replicas poll "
                            "meanwhile)")
            else:
                log.warning("routing LISTEN unavailable (%s); retrying (replicas poll "
                            "meanwhile)", unavailable)
            since = time.monotonic()
            delay = LISTEN_RETRY_BASE_S
            while True:
                await asyncio.sleep(delay)
                try:
                    await self._listen()
                    break
                except StoreUnavailable as exc:
                    log.debug("routing LISTEN: still unavailable: %s", exc)
                    delay = min(delay * 2, LISTEN_RETRY_MAX_S)
            log.info("routing LISTEN back after %.1f s", time.monotonic() - since)
            unavailable = None
            self._on_change()

    async def _watch(self) -> bool:
        """Rule 4: return once the connection is lost; True where it stopped answering."""
        while True:
            try:
                await asyncio.wait_for(self._lost.wait(), self.ping_interval_s)
                return False
            except TimeoutError:
                pass
            connection = self._connection
            if connection is None:
                return False
            try:
                await asyncio.wait_for(connection.fetchval("SELECT 1"), self.ping_timeout_s)
            except _LISTEN_ERRORS:
                self._connection = None
                connection.terminate()
                self._lost.set()
                return True

    async def close(self) -> None:
        """Stop reconnecting, then say goodbye to the server within
        ``LISTEN_CLOSE_TIMEOUT_S``, else drop the socket: a server that no longer answers
        (a black hole) must not hold a shutdown."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            await connection.close(timeout=LISTEN_CLOSE_TIMEOUT_S)
        except Exception:  # timed out, or the connection was already broken
            connection.terminate()


async def listen_for_routing(engine: AsyncEngine,
                             on_change: Callable[[], None]) -> RoutingListener | None:
    """Call ``on_change`` each time a replica stores a routing version (``NOTIFY``), and
    each time the LISTEN is set up again after it was lost (:class:`RoutingListener`).

    None where the database cannot notify (SQLite: its replicas poll). The first LISTEN is
    set up before this returns; one that cannot be is retried in the background, as a
    lost one is. The password leaves the engine's URL only for the driver's connect,
    never for a log.
    """
    if engine.dialect.name != "postgresql":
        return None
    listener = RoutingListener(
        engine.url.set(drivername="postgresql").render_as_string(hide_password=False),
        on_change)
    await listener.start()
    return listener


def _unavailable(exc: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"LISTEN: {type(exc).__name__}: {exc}"[:300])
