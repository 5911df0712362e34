"""Promotion, rollback and the progressive canary: the operator's switches.

Rules (DESIGN.md invariant 8):
1. Promotion runs the judge and switches only on PASS, unless forced with a reason.
   The switch is one new :class:`Routing` snapshot: atomic for new requests, while
   requests in flight finish where they started. The old primary becomes the rollback
   target; the promoted candidate stops being mirrored to (on every replica: the
   routing change itself removes it).
2. Every action is written to the audit log (who, when, what, and the verdict at that
   moment) when the store is on; it is always logged.
3. A canary moves live sessions to a candidate step by step (session-consistent). After
   each interval the judge looks at the candidate: FAIL rolls the canary back at once,
   INCONCLUSIVE holds the step, PASS or MARGINAL moves to the next step; passing the last
   step (100 %) promotes.
4. Changes go through ``RoutingSync.commit``, which makes them the replicas' state too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial
from typing import Any

from gateway._evaluation import Evaluation
from gateway._exceptions import Conflict, InvalidBody, NotFound
from gateway._metrics import GatewayMetrics
from gateway._mirror import Mirror
from gateway._routing import Backend, Canary, Routing
from gateway._sync import RoutingSync

__all__ = ["Operator"]

log = logging.getLogger("understudy.promotion")


class Operator:
    """Carries out promote, rollback and canary on the live gateway."""

    def __init__(self, sync: RoutingSync, mirror: Mirror, metrics: GatewayMetrics,
                 evaluation: Evaluation | None) -> None:
        self._sync = sync
        self._mirror = mirror
        self._metrics = metrics
        self._evaluation = evaluation
        self._canary_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def routing(self) -> Routing:
        return self._sync.routing

    async def _verdict(self, name: str) -> tuple[str, int | None, list[str]]:
        if self._evaluation is None:
            return "UNKNOWN", None, ["evaluation is disabled: no verdict"]
        report = await self._evaluation.report(name)
        return report.verdict.verdict.value, report.verdict_id, list(report.verdict.reasons)

    async def promote(self, name: str, *, actor: str, force: bool,
                      reason: str | None) -> dict[str, Any]:
        if force and not (reason and reason.strip()):
            raise InvalidBody("force: true needs a reason")
        async with self._lock:
            candidate = self._mirror.candidates.get(name)
            if candidate is None:
                raise NotFound(f"no candidate named {name!r}")
            verdict, verdict_id, reasons = await self._verdict(name)
            if verdict != "PASS" and not force:
                await self._audit(actor, "promote_refused", name, verdict, verdict_id,
                                  {"reasons": reasons})
                raise Conflict(f"promotion of {name} refused: the judge says {verdict} "
                               f"({'; '.join(reasons[:3])}); pass force with a reason "
                               "to override")
            await self._stop_canary()
            routing = await self._sync.commit(
                lambda r: r.promoted(Backend(name, candidate.config.url)))
            await self._audit(actor, "promote", name, verdict, verdict_id,
                              {"force": force, "reason": reason, "routing": routing.to_dict()})
            return {"routing": routing.to_dict(), "verdict": verdict, "reasons": reasons}

    async def rollback(self, *, actor: str, reason: str | None) -> dict[str, Any]:
        async with self._lock:
            await self._stop_canary()
            if self.routing.previous is None:
                raise Conflict("there is no previous primary to roll back to")
            routing = await self._sync.commit(Routing.rolled_back)
            await self._audit(actor, "rollback", routing.primary.name, None, None,
                              {"reason": reason, "routing": routing.to_dict()})
            return {"routing": routing.to_dict()}

    async def start_canary(self, name: str, *, actor: str, steps: tuple[float, ...],
                           interval_s: float) -> dict[str, Any]:
        async with self._lock:
            candidate = self._mirror.candidates.get(name)
            if candidate is None:
                raise NotFound(f"no candidate named {name!r}")
            if self.routing.canary is not None:
                raise Conflict(f"a canary of {self.routing.canary.backend.name} is running")
            canary = Canary(Backend(name, candidate.config.url), steps, 0, interval_s,
                            time.time())
            routing = await self._sync.commit(partial(Routing.with_canary, canary=canary))
            await self._audit(actor, "canary_start", name, None, None,
                              {"steps": list(steps), "interval_s": interval_s})
            self._canary_task = asyncio.create_task(self._drive(name, actor),
                                                    name=f"canary-{name}")
            return {"routing": routing.to_dict()}

    async def abort_canary(self, *, actor: str, reason: str | None) -> dict[str, Any]:
        async with self._lock:
            canary = self.routing.canary
            if canary is None:
                raise Conflict("no canary is running")
            await self._stop_canary()
            await self._audit(actor, "canary_abort", canary.backend.name, None, None,
                              {"reason": reason, "percent": canary.percent})
            return {"routing": self.routing.to_dict()}

    async def close(self) -> None:
        await self._stop_canary(clear=False)

    async def _stop_canary(self, clear: bool = True) -> None:
        task, self._canary_task = self._canary_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if clear and self.routing.canary is not None:
            await self._sync.commit(partial(Routing.with_canary, canary=None))

    async def _drive(self, name: str, actor: str) -> None:
        """One judgement per interval; see rule 3."""
        while (canary := self.routing.canary) is not None and canary.backend.name == name:
            await asyncio.sleep(canary.interval_s)
            verdict, verdict_id, reasons = await self._verdict(name)
            async with self._lock:
                canary = self.routing.canary
                if canary is None or canary.backend.name != name:
                    return
                if verdict == "FAIL":
                    await self._sync.commit(partial(Routing.with_canary, canary=None))
                    await self._audit(actor, "canary_rollback", name, verdict, verdict_id,
                                      {"step": canary.step, "percent": canary.percent,
                                       "reasons": reasons})
                    log.warning("canary %s rolled back at %s%%: %s", name, canary.percent,
                                "; ".join(reasons[:3]))
                    return
                if verdict == "INCONCLUSIVE" or verdict == "UNKNOWN":
                    continue
                if canary.step + 1 < len(canary.steps):
                    step = Canary(canary.backend, canary.steps, canary.step + 1,
                                  canary.interval_s, time.time())
                    await self._sync.commit(partial(Routing.with_canary, canary=step))
                    await self._audit(actor, "canary_step", name, verdict, verdict_id,
                                      {"step": step.step, "percent": step.percent})
                    continue
            self._canary_task = None  # promotion below clears the canary itself
            await self.promote(name, actor=actor, force=False, reason=None)
            return

    async def _audit(self, actor: str, action: str, target: str, verdict: str | None,
                     verdict_id: int | None, detail: dict[str, Any]) -> None:
        log.info("admin: %s %s by %s (verdict %s)", action, target, actor, verdict)
        self._metrics.admin_actions.labels(action).inc()
        if self._evaluation is not None:
            await self._evaluation.audit(actor=actor, action=action, target=target,
                                         detail={**detail, "verdict": verdict},
                                         verdict_id=verdict_id)
