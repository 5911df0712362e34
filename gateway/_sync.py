"""RoutingSync: every replica of the gateway converges on the same routing.

This replica's routing is held here and nowhere else: the relay reads ``routing`` (through
``GatewayState.routing``) once per request, and a change replaces it whole.

Rules (DESIGN.md invariant 8):
1. The database holds the routing with a version; the highest version wins. A replica
   that starts adopts the stored routing (a restarted replica keeps a promotion) or,
   on an empty database, stores its configured one as version 1. A stored routing that
   started from another configured primary (``origin``) is not adopted: a new history
   starts. One stored before routings named their origin is this history where its
   primary or rollback target is the configured primary.
2. A change is committed to the database first, from the version this replica last saw
   (compare-and-set); if another replica changed it meanwhile, the change is refused
   (409) and this replica adopts the newer routing. The change is decided on that version
   (the canary it saw, the primary it saw) and is never laid over a newer one it has not
   seen: a stored version newer than this replica's is a 409 too, even if this replica
   has not heard of it yet (its LISTEN lost, its next poll not due), and so is one this
   replica adopted while the caller awaited between looking and committing (a
   promotion's judge: ``commit(decided_on=)``).
3. Replicas learn of a change within ``poll_interval_s`` by polling, and at once on
   PostgreSQL through LISTEN/NOTIFY. A LISTEN that is lost (the server restarted, the
   network cut) or cannot be set up at start is set up again in the background, within
   seconds of the store's return, and the routing is read once then (a change made
   meanwhile is adopted at once); polling covers the time between. A stored routing this
   release cannot read is logged (its error's type, never its values) and polling goes
   on: the next readable one is adopted. A stored routing is read with the one this
   replica serves and the candidates it has settings for (``_routing`` rule 7): one an
   older release stored without the ``models`` map keeps the model rewrites this replica
   knows for its backends.
4. Without a database (evaluation disabled) the routing is this process's alone. With
   one that is not reachable yet (``attach`` before ``start``: a store outage at start),
   changes go to the database and fail there; none is applied to this replica alone.
5. Every admin change is stored before it is applied, wholly or not at all: a routing
   change by compare-and-set with its audit entry in one transaction (``commit``), any
   other change as its audit entry (``record``). Each store call of a change gets
   ``store_timeout_s`` (``store_call``); a call that fails or overruns raises
   ``ChangeNotStored`` (503, counted by reason) and this replica applies nothing. A call
   that overran is cancelled in the background; if its commit reached the database
   after all, the replicas adopt the change from there, as any other (rule 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store import (
    AuditNote,
    BackendRole,
    RoutingListener,
    StoreError,
    listen_for_routing,
    load_routing,
    record_change,
    save_routing,
)
from gateway._config import DEFAULT_ADMIN_STORE_TIMEOUT_S
from gateway._destinations import masked_url
from gateway._exceptions import ChangeNotStored, Conflict, translate_store_errors
from gateway._metrics import GatewayMetrics
from gateway._routing import Routing

__all__ = ["RoutingSync"]

log = logging.getLogger("understudy.routing")

T = TypeVar("T")

_ROUTING_IF_LATE = ("if the store took it late after all, every replica adopts it from there: "
                    "GET /admin/v1/routing shows it")
_CHANGE_IF_LATE = ("if the store took it late after all, the audit log holds an entry for a "
                   "change no replica applied: look at GET /admin/v1/candidates, and retry")


class RoutingSync:
    """The routing this replica serves (``routing``), and how it changes (the rules above).

    ``on_change`` runs after each new routing is in place (the mirror stops mirroring to a
    backend that became the primary).
    """

    def __init__(self, initial: Routing, on_change: Callable[[Routing], Awaitable[None]],
                 metrics: GatewayMetrics, poll_interval_s: float,
                 store_timeout_s: float = DEFAULT_ADMIN_STORE_TIMEOUT_S,
                 settings_models: Callable[[], Mapping[tuple[str, str], str]] = dict) -> None:
        self._routing = initial
        self._settings_models = settings_models  # _routing rule 7
        self._on_change = on_change
        self._metrics = metrics
        self._poll_interval_s = poll_interval_s
        self._engine: AsyncEngine | None = None
        self._poller: asyncio.Task[None] | None = None
        self._listener: RoutingListener | None = None
        self._commit_lock = asyncio.Lock()
        self._store_timeout_s = store_timeout_s
        self._abandoned: set[asyncio.Task[Any]] = set()  # store calls that overran (rule 5)
        self._refreshing: set[asyncio.Task[None]] = set()  # reads a NOTIFY started
        metrics.routing_version.set(initial.version)

    @property
    def routing(self) -> Routing:
        """The one snapshot this replica serves (replaced whole, never mutated)."""
        return self._routing

    def _known_models(self) -> dict[tuple[str, str], str]:
        """``_routing`` rule 7: the served routing's models first, then the settings'."""
        return {**self._settings_models(), **self._routing.models_by_address()}

    async def _apply(self, routing: Routing) -> None:
        self._routing = routing
        await self._on_change(routing)
        self._metrics.routing_version.set(routing.version)
        self._metrics.canary_percent.set(routing.canary.percent if routing.canary else 0)

    def attach(self, engine: AsyncEngine | None) -> None:
        """Rule 4: send changes to ``engine`` before ``start`` has read from it."""
        self._engine = engine

    async def start(self, engine: AsyncEngine | None) -> None:
        self._engine = engine
        if engine is None:
            return
        stored = await load_routing(engine)
        if stored is None:
            try:
                if await save_routing(engine, self._routing.version, self._routing.to_dict(),
                                      expected=None):
                    stored = None
                else:
                    stored = await load_routing(engine)
            except StoreError:  # another replica inserted it at the same moment
                stored = await load_routing(engine)
        if stored is not None:
            await self._adopt(engine, Routing.from_dict(stored[1], known=self._known_models()))
        self._poller = asyncio.create_task(self._poll(), name="routing-poll")
        self._listener = await listen_for_routing(engine, self._notified)  # rule 3

    async def _adopt(self, engine: AsyncEngine, stored: Routing) -> None:
        """Rule 1: join the stored history, unless the configured primary changed."""
        configured = self._routing
        if stored.origin is None and configured.primary in (stored.primary, stored.previous):
            # Stored before routings named their origin: the configured primary is in its
            # history, so it is this history (starting anew dropped a promotion).
            stored = replace(stored, origin=configured.origin)
        if stored.origin != configured.origin:
            log.warning("routing: the configured primary is %s, but the stored routing "
                        "started from %s: starting a new routing history (version %d)",
                        masked_url(configured.primary.url),
                        masked_url(stored.origin.url) if stored.origin else "?",
                        stored.version + 1)
            new = Routing.configured(configured.primary, stored.version + 1)
            if not await save_routing(engine, new.version, new.to_dict(),
                                      expected=stored.version):
                stored_now = await load_routing(engine)
                new = (Routing.from_dict(stored_now[1], known=self._known_models()) if stored_now
                       else new)
            await self._apply(new)
            return
        await self._apply(stored)
        if stored.primary != configured.primary:
            log.warning("routing: serving %s (%s), promoted at version %d, instead of the "
                        "configured primary %s; `understudy rollback` switches back",
                        stored.primary.name, masked_url(stored.primary.url), stored.version,
                        masked_url(configured.primary.url))

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._listener is not None:
            await self._listener.close()
        for task in list(self._refreshing):
            task.cancel()
        await asyncio.gather(*self._refreshing, return_exceptions=True)
        await asyncio.gather(*self._abandoned, return_exceptions=True)

    async def store_call(self, what: str, work: Callable[[AsyncEngine], Awaitable[T]], *,
                         if_late: str | None = _ROUTING_IF_LATE) -> T | None:
        """Rule 5: one store call of an admin change, within ``store_timeout_s``.

        None without a database (rule 4): the change is this process's alone. ``if_late``
        tells the operator, in the 503 of an overrun, what a late commit would leave; None
        for a call that changes no routing nor candidate (a read, a verdict's record).
        """
        engine = self._engine
        if engine is None:
            return None
        task = asyncio.ensure_future(work(engine))
        try:
            done, _ = await asyncio.wait({task}, timeout=self._store_timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()  # it unwinds in the background; stop() waits for it
            self._abandoned.add(task)
            task.add_done_callback(self._forget)
            self._metrics.admin_store_failures.labels("timeout").inc()
            late = "" if if_late is None else f" ({if_late})"
            raise ChangeNotStored(
                f"{what}: the store did not answer within {self._store_timeout_s:g} s; this "
                f"replica applied nothing{late}", "timeout")
        try:
            with translate_store_errors(what):
                return task.result()
        except ChangeNotStored as exc:
            self._metrics.admin_store_failures.labels(exc.reason).inc()
            raise

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an overrun call's error was answered with 503

    async def record(self, what: str, audit: AuditNote,
                     backend: tuple[str, BackendRole, str] | None = None) -> None:
        """Rule 5: store a change that is not a routing change, before it is applied.

        Such a change lives in this replica only: no replica adopts it from the store, so
        an overrun's 503 does not say one would.
        """
        await self.store_call(what, lambda engine: record_change(engine, audit, backend),
                              if_late=_CHANGE_IF_LATE)

    async def commit(self, change: Callable[[Routing], Routing],
                     audit: Callable[[Routing], AuditNote] | None = None, *,
                     decided_on: Routing | None = None) -> Routing:
        """Rules 2 and 5: store ``change(current)`` with its audit entry, then serve it.

        ``decided_on`` is the routing the caller looked at, where it awaited since (a
        promotion judges first): one this replica adopted meanwhile is a 409 too.
        """
        async with self._commit_lock:
            # The routing the caller decided on (by default: no await since it looked): a
            # change is never laid over a newer routing it has not seen (rule 2).
            current = self._routing if decided_on is None else decided_on
            await self._adopt_newer(await self.store_call("reading the routing", load_routing))
            if self._routing.version != current.version:
                raise _changed_meanwhile(self._routing)
            new = change(current)
            note = audit(new) if audit is not None else None
            saved = await self.store_call(
                f"storing routing version {new.version}",
                lambda engine: save_routing(engine, new.version, new.to_dict(),
                                            expected=current.version, audit=note))
            if saved is False:
                with contextlib.suppress(ChangeNotStored):
                    await self._adopt_newer(
                        await self.store_call("reading the routing", load_routing))
                raise _changed_meanwhile(self._routing)
            if new.version > self._routing.version:  # a poll may have adopted a newer one
                await self._apply(new)
            log.info("routing: version %d, primary %s%s", new.version, new.primary.name,
                     f", canary {new.canary.backend.name} at {new.canary.percent}%"
                     if new.canary else "")
            return new

    async def refresh(self) -> None:
        if self._engine is None:
            return
        await self._adopt_newer(await load_routing(self._engine))

    async def _adopt_newer(self, stored: tuple[int, dict[str, Any]] | None) -> None:
        if stored is not None and stored[0] > self._routing.version:
            await self._apply(Routing.from_dict(stored[1], known=self._known_models()))
            log.info("routing: converged on version %d (primary %s)", self._routing.version,
                     self._routing.primary.name)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                await self.refresh()
            except StoreError as exc:  # the database is away: keep serving what we have
                log.warning("routing: cannot read the routing state: %s", exc)
            except Exception as exc:
                # A stored routing this release cannot read (another release wrote it):
                # keep serving what we have and poll on. A poll that died would leave this
                # replica on its routing for good, silently (rule 3).
                log.error("routing: cannot adopt the stored routing: %s", _why(exc))

    def _notified(self) -> None:
        task = asyncio.get_running_loop().create_task(self.refresh(), name="routing-notified")
        self._refreshing.add(task)
        task.add_done_callback(self._refreshed)

    def _refreshed(self, task: asyncio.Task[None]) -> None:
        self._refreshing.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("routing: cannot read the routing state after a notify: %s", _why(exc))


def _why(exc: BaseException) -> str:
    """What to log of a failed read: a store error's own (safe) text; of any other, its type
    only (a stored value in its text could be a URL with a password)."""
    if isinstance(exc, StoreError):
        return str(exc)
    return f"{type(exc).__name__} (the stored routing is not in a form this release reads)"


def _changed_meanwhile(adopted: Routing) -> Conflict:
    return Conflict(f"the routing was changed by another replica meanwhile (now version "
                    f"{adopted.version}, primary {adopted.primary.name}"
                    f"{f', canary {adopted.canary.backend.name}' if adopted.canary else ''}); "
                    "look at it again and retry")
