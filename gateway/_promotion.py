"""The operator's switches: candidates at runtime, promotion, rollback, the canary.

Rules (DESIGN.md invariant 8):
1. Promotion runs the judge and switches only on PASS, unless forced with a reason.
   The switch is one new :class:`Routing` snapshot: atomic for new requests, while
   requests in flight finish where they started. The old primary becomes the rollback
   target; the promoted candidate stops being mirrored to (on every replica: the
   routing change itself removes it). It is decided on the routing served when it was
   asked for: one adopted while the judge ran (another replica's promotion) is a 409.
2. Every change is stored before it is applied, wholly or not at all (``RoutingSync``
   rule 5): its audit entry (who, when, what, and the verdict at that moment) commits
   with it, and when the store cannot take it in time the answer is 503 and this replica
   is as it was. Without a store (evaluation disabled) changes are applied and logged.
   Judging is three steps: the reads and the verdict's write are each one store call
   within ``store_timeout_s``; the statistics between them run in a worker thread, their
   cost bounded by the gates' ``max_judged_exchanges`` (the newest scored exchanges).
3. A canary moves live sessions to a candidate step by step (session-consistent). After
   each interval the judge looks at the candidate: FAIL rolls the canary back at once,
   INCONCLUSIVE holds the step, PASS or MARGINAL moves to the next step. A step the store
   cannot take (503), or that another replica's change overtook (409), is tried again
   next interval, on the routing the replica then serves; the driver ends only when the
   routing has no canary.
   Each step is judged on the scores since it began (``step_started_at``), never on the
   whole stored window: what an earlier step (or a mirror before it) measured does not
   vouch for this one.  The 100 % step serves every session live: the primary answers
   nothing, so nothing is mirrored and no new pair is scored. It is judged on the scores
   since the last step below 100 % began (``Canary.judged_since``), and once that step's
   last replays are scored every judgement of it repeats the one before (same scores,
   fixed seeds). Hence:
   a. the last step below 100 % moves on only on a PASS; MARGINAL holds it, judged again
      on its growing window. Only a PASS promotes, and the 100 % step adds no evidence:
      a MARGINAL there would hold every session on a candidate whose verdict cannot turn;
   b. at 100 % a PASS promotes (rule 1, on that same judgement) and a FAIL rolls back;
      anything else (the replays scored after the step up can turn its PASS) takes the
      canary back to the step below, begun afresh, to measure more. A canary that
      started at 100 % has no step below: it holds (its scores are the mirror's before it).
   c. A held step is judged again every interval on its growing window: each judgement is
      a look at the same evidence, and the gates' error rate is spent over the looks
      (``Canary.look``, ``evaluators._gates`` rule 7), so a candidate as good as the
      primary is rolled back, or a worse one moved on, by one of any number of looks at
      most as often as by one judgement at the gates' confidence.
4. Routing changes go through ``RoutingSync.commit``, which makes them the replicas' state
   too. One lock orders every change of this replica, candidates' included.
5. Every replica drives the canary of the routing it serves (``follow``): the one that
   started it, one that adopts it from another, one that starts on a stored routing that
   holds it. So a canary outlives the restart or the loss of the replica it was started
   on. The drivers share one clock, the store's routing: a step is judged once it is
   ``interval_s`` old (``step_started_at``), a held step again ``interval_s`` after this
   replica's last judgement of it; when two replicas decide the same step, the store's
   compare-and-set lets the first through and the other adopts it (rule 4). Each
   replica's judgement is its own verdict in the store. The canary's backend is in the
   routing, so a replica without that candidate (one added at runtime elsewhere) drives
   it to the end too, promotion included.
   The routing names backends, never their keys: each replica sends a live backend the
   settings it has for it (``_routing`` rule 5), so a candidate added or changed here is
   made known to the live pools (``Upstreams``) too, and forgotten when it is removed
   unless the routing served then still names it (primary, rollback target or canary:
   a routing adopted during the removal's drain may have made it one). A candidate's
   name and URL never change (a change is refused before it is stored), so its settings
   are never left behind at an old address. A candidate added at runtime is
   this replica's alone and only until it restarts: promoted, and this replica
   restarted, its key is gone here (it is in no configuration), and its pool is opened
   without settings (``understudy_live_backend_without_settings_total``). Put a candidate
   meant for promotion in every replica's configuration.
7. A candidate change is checked again after its audit entry is stored: a routing adopted
   meanwhile may have made the candidate the primary (removed here) or the canary. The
   canary's candidate is not removed while the canary runs: its sessions would stay on a
   backend nobody judges or steps (409: stop the canary first).
6. A promotion, rollback or canary stop may name the routing version it was decided on
   (``routing_version``): a 409 when the routing has moved on, nothing applied. A rollback
   toggles primary and previous, so two at once (two operators; a client retrying one whose
   answer it lost) each succeeded and the second undid the first; named, one applies.
8. A backend's Prometheus series (``_metrics`` rules 1-3) are exported while it is a
   candidate here or a backend of the routing served (primary, rollback target, canary),
   and retired when it is neither: a candidate removed (after its drain, so the drops its
   removal counts go with it), a backend a routing change left behind. A candidate added
   is admitted before its series are made; a routing served admits its backends (one a
   replica promoted elsewhere may be a name retired here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, Final

from pydantic import ValidationError

from backends.openai_wire import validation_problems
from evaluators import Outcome
from evaluators.store import AuditNote, BackendRole
from gateway._config import MAX_CANDIDATES, CandidateConfig
from gateway._destinations import masked_url
from gateway._exceptions import ChangeNotStored, Conflict, InvalidBody, NotFound
from gateway._metrics import GatewayMetrics
from gateway._mirror import Candidate, Mirror
from gateway._routing import Backend, Canary, Routing, Upstreams
from gateway._scorekeeper import Scorekeeper
from gateway._sync import RoutingSync

__all__ = ["NO_VERDICT", "Judgement", "Promoter", "RoutingChange", "body_problems"]

log = logging.getLogger("understudy.promotion")

ADMIN_ACTOR = "admin"
"""The actor of candidate changes (their bodies name none)."""
NO_VERDICT: Final = "UNKNOWN"
"""How a judgement without an outcome (evaluation disabled, store not attached) is shown in
answers and audit entries."""


@dataclass(frozen=True, slots=True)
class Judgement:
    """What the judge said of a candidate when a change was decided."""

    outcome: Outcome | None  # None: there was nothing to judge with
    verdict_id: int | None
    reasons: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.outcome.value if self.outcome is not None else NO_VERDICT


@dataclass(frozen=True, slots=True)
class RoutingChange:
    """A routing change as stored and applied, with the judgement that allowed it (if any)."""

    routing: Routing
    judgement: Judgement | None = None


class Promoter:
    """Carries out every admin change on the live gateway: candidates, promotion, rollback,
    the canary (rules 2 and 4)."""

    def __init__(self, sync: RoutingSync, mirror: Mirror, metrics: GatewayMetrics,
                 scorekeeper: Scorekeeper | None, upstreams: Upstreams) -> None:
        self._sync = sync
        self._mirror = mirror
        self._upstreams = upstreams  # the live pools: a candidate's own settings (rule 5)
        self._metrics = metrics
        self._scorekeeper = scorekeeper
        self._canary_task: asyncio.Task[None] | None = None
        self._closed = False
        self._lock = asyncio.Lock()
        self._live = _names(sync.routing)  # of the routing last served (rule 8)

    @property
    def routing(self) -> Routing:
        return self._sync.routing

    # -- candidates ---------------------------------------------------------------------

    def _check_backend_name(self, config: CandidateConfig) -> None:
        """Refuse a candidate named as the primary, or as the rollback target at another
        URL: the store knows a backend by its name, so adding it would rewrite that
        backend's row (its URL and role) under the scores it already has."""
        routing = self.routing
        if config.name == routing.primary.name:
            raise Conflict(f"{config.name!r} is the primary; a primary is not its own "
                           "candidate (pick another name)")
        previous = routing.previous
        if previous is not None and config.name == previous.name and config.url != previous.url:
            raise Conflict(f"{config.name!r} is the rollback target, at another URL; pick "
                           "another name")

    def _candidate(self, name: str) -> Candidate:
        candidate = self._mirror.candidates.get(name)
        if candidate is None:
            raise NotFound(f"no candidate named {name!r}")
        return candidate

    def _still_candidate(self, name: str) -> Candidate:
        """Rule 7: ``name`` is a candidate still, after a store call."""
        candidate = self._mirror.candidates.get(name)
        if candidate is None:
            primary = self.routing.primary.name
            why = " (it was promoted: it is the primary)" if primary == name else ""
            raise Conflict(f"candidate {name!r} went away while the change was stored{why}; "
                           "nothing was changed here")
        return candidate

    def _not_the_canary(self, name: str) -> None:
        """Rule 7: the canary's candidate stays while the canary runs."""
        canary = self.routing.canary
        if canary is not None and canary.backend.name == name:
            raise Conflict(f"{name!r} is the canary at {canary.percent:g} % of sessions; stop "
                           "the canary first (DELETE /admin/v1/canary), then remove it")

    async def add_candidate(self, config: CandidateConfig) -> Candidate:
        async with self._lock:
            if config.name in self._mirror.candidates:
                raise Conflict(f"candidate {config.name!r} exists; PATCH it or DELETE it first")
            self._check_backend_name(config)
            if len(self._mirror.candidates) >= MAX_CANDIDATES:
                raise Conflict(f"there are {MAX_CANDIDATES} candidates, the most a gateway "
                               "holds (MAX_CANDIDATES); remove one first")
            role: BackendRole = "secondary" if config.role == "secondary" else "candidate"
            await self._sync.record(
                f"adding candidate {config.name}",
                AuditNote(ADMIN_ACTOR, "candidate_add", config.name, _settings(config)),
                backend=(config.name, role, config.url))
            self._check_backend_name(config)  # rule 7: promoted meanwhile?
            self._metrics.admit_backend(config.name)  # rule 8
            candidate = await self._mirror.add_candidate(config)
            self._upstreams.know(config)
            self._done("candidate_add", config.name)
            return candidate

    async def update_candidate(self, name: str, changes: dict[str, Any]) -> Candidate:
        """Apply ``changes`` to the candidate's settings as they are once the lock is held:
        two changes at once (two operators) each keep the other's fields, where a config
        built before the lock put back what the first had changed."""
        async with self._lock:
            current = self._candidate(name).config
            try:
                config = CandidateConfig.model_validate({**current.model_dump(), **changes})
            except ValidationError as exc:
                raise InvalidBody(body_problems(exc)) from None
            if (config.name, config.url) != (name, current.url):
                # Refused before anything is stored (the mirror refuses it too): a new
                # address is a new backend, whose settings ``know`` would add beside the
                # old address's, kept there with its key (rule 5). Remove and add it.
                raise InvalidBody(f"candidate {name!r}: its name and URL cannot change; "
                                  "remove it and add it again")
            await self._sync.record(f"changing candidate {name}", AuditNote(
                ADMIN_ACTOR, "candidate_update", name, {"changes": changes}))
            self._still_candidate(name)
            candidate = self._mirror.update_candidate(name, config)
            self._upstreams.know(config)
            self._done("candidate_update", name)
            return candidate

    async def pause_candidate(self, name: str, paused: bool) -> Candidate:
        action = "candidate_pause" if paused else "candidate_resume"
        async with self._lock:
            candidate = self._candidate(name)
            if candidate.paused != paused:
                await self._sync.record(f"{action.removeprefix('candidate_')} of {name}",
                                        AuditNote(ADMIN_ACTOR, action, name))
                candidate = self._still_candidate(name)
                candidate.paused = paused
                self._done(action, name)
            return candidate

    async def remove_candidate(self, name: str) -> None:
        async with self._lock:
            self._candidate(name)
            self._not_the_canary(name)
            await self._sync.record(f"removing candidate {name}",
                                    AuditNote(ADMIN_ACTOR, "candidate_remove", name))
            config = self._still_candidate(name).config
            self._not_the_canary(name)
            await self._mirror.remove_candidate(name)
            # Rule 5, on the routing served now: one adopted during the drain may have made
            # this backend the primary, the rollback target or the canary.
            if (config.name, config.url) not in _addresses(self.routing):
                self._upstreams.forget(config.name, config.url)
            self._settle_series(name)
            self._done("candidate_remove", name)

    def served(self, routing: Routing) -> None:
        """Rule 8 for a routing this replica now serves (its own change or one adopted):
        its backends' series stay, those of a backend it left behind go."""
        live, self._live = self._live, _names(routing)
        self._settle_series(*sorted(live ^ self._live))

    def _settle_series(self, *names: str) -> None:
        """Rule 8: admit or retire each of ``names`` by what it is now."""
        for name in names:
            if name in self._mirror.candidates or name in self._live:
                self._metrics.admit_backend(name)
            else:
                self._metrics.retire_backend(name)

    # -- routing ------------------------------------------------------------------------

    async def _judge(self, name: str, since: float | None = None,
                     look: int | None = None) -> Judgement:
        """The judge on ``name``'s scores (those since ``since``, a wall-clock time), as the
        ``look``-th judgement of that window (rule 3c; None: a judgement of its own)."""
        scorekeeper = self._scorekeeper
        if scorekeeper is None:
            return Judgement(None, None, ("evaluation is disabled: no verdict",))
        window = None if since is None else datetime.fromtimestamp(since, UTC)
        inputs = await self._sync.store_call(f"reading {name}'s scores",
                                             lambda _: scorekeeper.read(name, window),
                                             if_late=None)
        if inputs is None:  # the store is not attached: nothing to judge with
            return Judgement(None, None, ("the store is not attached: no verdict",))
        judged = await scorekeeper.judge(inputs, look)  # statistics: bounded by the gates' cap
        report = await self._sync.store_call(f"recording the verdict on {name}",
                                             lambda _: scorekeeper.record(judged),
                                             if_late=None)
        report = judged if report is None else report
        return Judgement(report.verdict.outcome, report.verdict_id, report.verdict.reasons)

    async def promote(self, name: str, *, actor: str, force: bool,
                      reason: str | None, since: float | None = None,
                      routing_version: int | None = None) -> RoutingChange:
        if force and not (reason and reason.strip()):
            raise InvalidBody("force: true needs a reason")
        async with self._lock:
            self._expect(routing_version)
            candidate = self._candidate(name)
            # The judge awaits the store: a routing adopted meanwhile (another replica's
            # promotion of this very candidate) is not the one this was decided on (rule 1).
            seen = self.routing
            judgement = await self._judge(name, since)
            verdict, reasons = judgement.label, list(judgement.reasons)
            if judgement.outcome is not Outcome.PASS and not force:
                await self._sync.record(f"refusing to promote {name}", AuditNote(
                    actor, "promote_refused", name, {"reasons": reasons, "verdict": verdict},
                    judgement.verdict_id))
                self._done("promote_refused", name, verdict)
                raise Conflict(f"promotion of {name} refused: the judge says {verdict} "
                               f"({'; '.join(reasons[:3])}); pass force with a reason "
                               "to override")
            return await self._promote(_live(candidate), judgement,
                                       actor=actor, force=force, reason=reason, decided_on=seen)

    async def _promote(self, backend: Backend, judgement: Judgement, *, actor: str,
                       force: bool, reason: str | None,
                       decided_on: Routing | None = None) -> RoutingChange:
        """Switch to ``backend`` on ``judgement`` (the lock held, the judge heard), from the
        routing ``decided_on`` (default: the one served now)."""
        name, verdict = backend.name, judgement.label
        routing = await self._sync.commit(
            lambda r: r.promoted(backend),
            audit=lambda new: AuditNote(actor, "promote", name, {
                "force": force, "reason": reason, "routing": _audited(new),
                "verdict": verdict}, judgement.verdict_id), decided_on=decided_on)
        await self._stop_driver()  # the promoted routing has no canary
        self._done("promote", name, verdict)
        return RoutingChange(routing, judgement)

    async def rollback(self, *, actor: str, reason: str | None,
                       routing_version: int | None = None) -> RoutingChange:
        async with self._lock:
            self._expect(routing_version)
            if self.routing.previous is None:
                raise Conflict("there is no previous primary to roll back to")
            routing = await self._sync.commit(
                _rolled_back,
                audit=lambda new: AuditNote(actor, "rollback", new.primary.name, {
                    "reason": reason, "routing": _audited(new), "verdict": None}))
            await self._stop_driver()  # the rolled-back routing has no canary
            self._done("rollback", routing.primary.name)
            return RoutingChange(routing)

    def _expect(self, routing_version: int | None) -> None:
        """Rule 6 (the lock held): refuse a change decided on another routing version."""
        served = self.routing.version
        if routing_version is not None and routing_version != served:
            raise Conflict(f"the routing is at version {served}, not {routing_version}: it "
                           "changed since (GET /routing); nothing was done")

    async def start_canary(self, name: str, *, actor: str, steps: tuple[float, ...],
                           interval_s: float) -> RoutingChange:
        async with self._lock:
            candidate = self._candidate(name)
            if self.routing.canary is not None:
                raise Conflict(f"a canary of {self.routing.canary.backend.name} is running")
            canary = Canary(_live(candidate), steps, 0, interval_s,
                            time.time(), actor=actor)
            routing = await self._sync.commit(
                partial(Routing.with_canary, canary=canary),
                audit=lambda _: AuditNote(actor, "canary_start", name, {
                    "steps": list(steps), "interval_s": interval_s, "verdict": None}))
            self.follow(routing)
            self._done("canary_start", name)
            return RoutingChange(routing)

    async def abort_canary(self, *, actor: str, reason: str | None,
                           routing_version: int | None = None) -> RoutingChange:
        async with self._lock:
            self._expect(routing_version)
            canary = self.routing.canary
            if canary is None:
                raise Conflict("no canary is running")
            routing = await self._sync.commit(
                _without_canary,
                audit=lambda _: AuditNote(actor, "canary_abort", canary.backend.name, {
                    "reason": reason, "percent": canary.percent, "verdict": None}))
            await self._stop_driver()
            self._done("canary_abort", canary.backend.name)
            return RoutingChange(routing)

    def follow(self, routing: Routing) -> None:
        """Rule 5: drive the canary of ``routing``, unless this replica drives it already.

        Called with each routing this replica comes to serve, its own changes and those it
        adopts."""
        if routing.canary is None or self._closed:
            return
        if self._canary_task is None or self._canary_task.done():
            self._canary_task = asyncio.create_task(self._drive(), name="canary-driver")

    async def close(self) -> None:
        self._closed = True
        await self._stop_driver()

    async def _stop_driver(self) -> None:
        task, self._canary_task = self._canary_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _drive(self) -> None:
        """Judge the routing's canary whenever it is due (rules 3 and 5), until the routing
        has none."""
        judged_at = 0.0
        while (canary := self.routing.canary) is not None:
            due = max(canary.step_started_at, judged_at) + canary.interval_s
            await asyncio.sleep(max(0.0, due - time.time()))
            if self.routing.canary != canary:
                continue  # stepped or replaced meanwhile: the new one keeps its own clock
            judged_at = time.time()
            try:
                await self._judge_step(canary)
            except (ChangeNotStored, Conflict, NotFound) as exc:  # 503 or 409: rule 3
                log.warning("canary %s: %s; trying again in %.0f s", canary.backend.name,
                            exc, canary.interval_s)
            except Exception:  # a driver that died would leave its canary where it is
                log.exception("canary %s: judging failed; trying again in %.0f s",
                              canary.backend.name, canary.interval_s)

    async def _judge_step(self, current: Canary) -> None:
        """One step of rule 3, for the canary ``current`` as this replica serves it."""
        name, actor = current.backend.name, current.actor
        look = current.look(time.time())
        judgement = await self._judge(name, current.judged_since, look)
        verdict, verdict_id, reasons = judgement.label, judgement.verdict_id, judgement.reasons
        async with self._lock:
            canary = self.routing.canary
            if canary != current:  # it changed while judged: that window is not its own
                return
            if judgement.outcome is Outcome.FAIL:
                await self._sync.commit(_without_canary, audit=lambda _: AuditNote(
                    actor, "canary_rollback", name, {
                        "step": canary.step, "percent": canary.percent, "look": look,
                        "reasons": list(reasons),
                        "verdict": verdict}, verdict_id))
                self._done("canary_rollback", name, verdict)
                log.warning("canary %s rolled back at %s%%: %s", name, canary.percent,
                            "; ".join(reasons[:3]))
                return
            if judgement.outcome is None:
                return  # nothing to judge with: the step stays as it is
            if canary.step + 1 == len(canary.steps):  # the last step, 100 %: rule 3b
                if judgement.outcome is Outcome.PASS:  # the candidate need not be here
                    await self._promote(canary.backend, judgement, actor=actor,
                                        force=False, reason=None)
                elif canary.step > 0:
                    await self._step_back(canary, judgement)
                return
            if judgement.outcome is Outcome.INCONCLUSIVE:
                return
            if canary.step + 2 == len(canary.steps) and judgement.outcome is not Outcome.PASS:
                return  # rule 3a: MARGINAL holds the last mirrored step
            step = canary.next_step(time.time())
            await self._sync.commit(partial(Routing.with_canary, canary=step),
                                    audit=lambda _: AuditNote(actor, "canary_step", name, {
                                        "step": step.step, "percent": step.percent,
                                        "look": look, "verdict": verdict}, verdict_id))
            self._done("canary_step", name, verdict)

    async def _step_back(self, canary: Canary, judgement: Judgement) -> None:
        """Rule 3b: from 100 % back to the step below, to measure more (the lock held)."""
        name, verdict, reasons = canary.backend.name, judgement.label, judgement.reasons
        back = canary.previous_step(time.time())
        await self._sync.commit(partial(Routing.with_canary, canary=back),
                                audit=lambda _: AuditNote(
                                    canary.actor, "canary_step_back", name, {
                                        "step": back.step, "percent": back.percent,
                                        "reasons": list(reasons), "verdict": verdict},
                                    judgement.verdict_id))
        self._done("canary_step_back", name, verdict)
        log.warning("canary %s back to %s%%: the judge says %s at 100%% (%s), and the 100%% "
                    "step mirrors nothing to change that", name, back.percent, verdict,
                    "; ".join(reasons[:3]))

    def _done(self, action: str, target: str, verdict: str | None = None) -> None:
        log.info("admin: %s %s (verdict %s)", action, target, verdict)
        self._metrics.admin_actions.labels(action).inc()


def _live(candidate: Candidate) -> Backend:
    """``candidate`` as a backend of live traffic, its model rewrite kept (``_routing``
    rule 2): its live requests name the model its mirrored ones were judged on."""
    config = candidate.config
    return Backend(config.name, config.url, config.model)


def _addresses(routing: Routing) -> set[tuple[str, str]]:
    """(name, URL) of every backend ``routing`` may send live traffic to (rule 5)."""
    return {(backend.name, backend.url) for backend in routing.live_backends()}


def body_problems(exc: ValidationError) -> str:
    """An admin body's validation error as one line: each field and what is wrong with it,
    in the words every ``understudy`` surface uses (``validation_problems``)."""
    return "; ".join(validation_problems(exc, whole="body"))


def _names(routing: Routing) -> frozenset[str]:
    """The names of the backends ``routing`` sends live traffic to (rule 8)."""
    return frozenset(backend.name for backend in routing.live_backends())


def _audited(routing: Routing) -> dict[str, Any]:
    """``routing`` as an audit entry holds it: its URLs' passwords masked (``_routing``
    rule 5; the stored routing keeps them, its replicas connect with them)."""
    data = routing.to_dict()
    for role in ("primary", "previous", "origin"):
        if data[role] is not None:
            data[role] = {**data[role], "url": masked_url(data[role]["url"])}
    if data["canary"] is not None:
        backend = data["canary"]["backend"]
        data["canary"] = {**data["canary"],
                          "backend": {**backend, "url": masked_url(backend["url"])}}
    return data


def _rolled_back(routing: Routing) -> Routing:
    return routing.rolled_back()


def _without_canary(routing: Routing) -> Routing:
    return routing.with_canary(None)


def _settings(config: CandidateConfig) -> dict[str, Any]:
    """A candidate's settings for the audit log: no URL (the backend row has it, and it may
    hold a password), no API key."""
    return config.model_dump(mode="json", exclude={"url", "api_key"})
