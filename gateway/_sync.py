"""RoutingSync: every replica of the gateway converges on the same routing.

Rules (DESIGN.md invariant 8):
1. The database holds the routing with a version; the highest version wins. A replica
   that starts adopts the stored routing (a restarted replica keeps a promotion) or,
   on an empty database, stores its configured one as version 1.
2. A change is committed to the database first, from the version this replica last saw
   (compare-and-set); if another replica changed it meanwhile, the change is refused
   (409) and this replica adopts the newer routing.
3. Replicas learn of a change within ``poll_interval_s`` by polling, and at once on
   PostgreSQL through LISTEN/NOTIFY.
4. Without a database (evaluation disabled) the routing is this process's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import StoreError
from evaluators._store._routing import ROUTING_CHANNEL, load_routing, save_routing
from gateway._exceptions import Conflict
from gateway._metrics import GatewayMetrics
from gateway._routing import Routing

__all__ = ["RoutingSync"]

log = logging.getLogger("understudy.routing")


class RoutingSync:
    def __init__(self, initial: Routing, apply: Callable[[Routing], Awaitable[None]],
                 metrics: GatewayMetrics, poll_interval_s: float) -> None:
        self._routing = initial
        self._apply_to_state = apply
        self._metrics = metrics
        self._poll_interval_s = poll_interval_s
        self._engine: AsyncEngine | None = None
        self._poller: asyncio.Task[None] | None = None
        self._listener: Any = None  # an asyncpg connection while LISTENing
        self._commit_lock = asyncio.Lock()
        metrics.routing_version.set(initial.version)

    @property
    def routing(self) -> Routing:
        return self._routing

    async def _apply(self, routing: Routing) -> None:
        self._routing = routing
        await self._apply_to_state(routing)
        self._metrics.routing_version.set(routing.version)
        self._metrics.canary_percent.set(routing.canary.percent if routing.canary else 0)

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
            await self._adopt(engine, Routing.from_dict(stored[1]))
        self._poller = asyncio.create_task(self._poll(), name="routing-poll")
        if engine.dialect.name == "postgresql":
            await self._listen(engine)

    async def _adopt(self, engine: AsyncEngine, stored: Routing) -> None:
        """Rule 1: join the stored history, unless the configured primary changed."""
        configured = self._routing
        if stored.origin != configured.origin:
            log.warning("routing: the configured primary is %s, but the stored routing "
                        "started from %s: starting a new routing history (version %d)",
                        configured.primary.url, stored.origin.url if stored.origin else "?",
                        stored.version + 1)
            new = Routing.configured(configured.primary, stored.version + 1)
            if not await save_routing(engine, new.version, new.to_dict(),
                                      expected=stored.version):
                stored_now = await load_routing(engine)
                new = Routing.from_dict(stored_now[1]) if stored_now else new
            await self._apply(new)
            return
        await self._apply(stored)
        if stored.primary != configured.primary:
            log.warning("routing: serving %s (%s), promoted at version %d, instead of the "
                        "configured primary %s; `understudy rollback` switches back",
                        stored.primary.name, stored.primary.url, stored.version,
                        configured.primary.url)

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()

    async def commit(self, change: Callable[[Routing], Routing]) -> Routing:
        async with self._commit_lock:
            await self.refresh()
            current = self._routing
            new = change(current)
            if self._engine is not None and not await save_routing(
                    self._engine, new.version, new.to_dict(), expected=current.version):
                await self.refresh()
                raise Conflict("the routing was changed by another replica meanwhile; "
                               "look at it again and retry")
            await self._apply(new)
            log.info("routing: version %d, primary %s%s", new.version, new.primary.name,
                     f", canary {new.canary.backend.name} at {new.canary.percent}%"
                     if new.canary else "")
            return new

    async def refresh(self) -> None:
        if self._engine is None:
            return
        stored = await load_routing(self._engine)
        if stored is not None and stored[0] > self._routing.version:
            await self._apply(Routing.from_dict(stored[1]))
            log.info("routing: converged on version %d (primary %s)", self._routing.version,
                     self._routing.primary.name)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                await self.refresh()
            except StoreError as exc:  # the database is away: keep serving what we have
                log.warning("routing: cannot read the routing state: %s", exc)

    async def _listen(self, engine: AsyncEngine) -> None:
        dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            self._listener = await asyncpg.connect(dsn)
            await self._listener.add_listener(ROUTING_CHANNEL, self._notified)
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("routing: LISTEN unavailable (%s); polling every %.1fs", exc,
                        self._poll_interval_s)

    def _notified(self, *_: Any) -> None:
        task = asyncio.get_running_loop().create_task(self.refresh())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
