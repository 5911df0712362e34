"""The gateway's scorekeeper: it hands exchanges to scoring, keeps the store, reads reports.

``Scorekeeper`` is the evaluation side of a running gateway (named so as not to clash with
the evaluators' concept of an evaluation): the sink the mirror hands joined exchanges to,
and the admin's handle on the store (reports, audit entries, backend registration).

Scoring and writing scores run in the pipeline's child process (``evaluators._pipeline``),
never in the gateway's: this process keeps only ``submit`` (a bounded, non-blocking put),
the counters the child reports, and an engine of its own for the rare admin work
(reports, audit entries, backend registration, the routing version).

Lifecycle: ``start`` starts the pipeline, which returns when its process has loaded the
scorers and started its writer (or raises ``EvaluationProcessError`` with the reason),
and reaches the store alongside; ``stop`` drains the pipeline (its process scores what
is queued and flushes its writer) and closes the database, in that order. Until
``start`` and after ``stop``, ``submit`` refuses (the mirror counts ``sink_full``).

The store at start (DESIGN.md invariant 7: a store outage never blocks the proxy):
1. Reaching the store is one step, retried until it succeeds: Alembic's upgrade (with
   ``auto_migrate``), registering the configured backends with their roles, then the
   caller's ``on_store`` (the routing: a restarted replica keeps a promotion).
2. ``start`` waits for that step at most ``STORE_START_WAIT_S``, then the gateway serves
   without the store; the step goes on in the background, retried after each failure
   with a backoff from the store's ``retry_base_s`` doubling to ``retry_max_s`` (with
   jitter). Every failed attempt is counted, and its reason kept for ``/health``.
3. Until the step succeeds the scoring child's writer holds what it scores (within its
   bounds, each drop counted) and writes nothing: a schema not yet migrated never sees
   a write. When it succeeds the writer flushes what it held.
4. All traffic seen and dropped (``_traffic.py``'s histograms, attached by the app) is
   added to the store every ``TRAFFIC_FLUSH_INTERVAL_S`` while it is up, before each
   report, and at stop; a flush that fails gives its counts back to the tally.
5. ``health()`` tells the store's state (``connecting``, ``up``, ``unreachable`` with the
   reason; ``failing`` when it was reached but the writer's batch in hand has waited more
   than ``STORE_STALL_S`` to be written: down, black-holed or too slow mid-run) and the
   scoring child's (running, restarting, failed); either not well makes the gateway
   ``degraded``.
6. Which candidate is the noise-floor replica (role ``secondary``), and whether it is
   mirrored at a candidate's rate and unit (then its latencies, throughput and rates are
   that candidate's baseline), is read from the runtime candidates the app attaches (the
   mirror's, as the admin API added or changed them) at each report, never from the
   startup config alone.
   The routing's canary candidate has no replica at its rate, whatever the rates say: it
   serves its share of the sessions live besides the mirror's, at a load no mirrored
   replica shares (at 50 % about twice the primary's), so it is judged against the
   primary at matched load. Judged against a replica at the mirror's load, an identical
   engine read slower and its canary was rolled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import (
    EvaluationPipeline,
    Exchange,
    PipelineState,
    PipelineStats,
    Report,
    ReportInputs,
    judge_inputs,
    load_report_inputs,
    record_report,
)
from evaluators.store import (
    StoreError,
    WriterStats,
    append_audit,
    create_engine,
    masked_url,
    record_traffic,
    register_backend,
    session_factory,
    upgrade,
)
from gateway._config import CandidateConfig, GatewayConfig
from gateway._memory import trim_heaps
from gateway._traffic import TRAFFIC_FLUSH_INTERVAL_S, TrafficTally

__all__ = ["STORE_START_WAIT_S", "Scorekeeper", "StoreStatus"]

log = logging.getLogger("understudy.evaluation")

STORE_START_WAIT_S = 2.0
"""Rule 2: how long ``start`` waits to reach the store before the gateway serves without it
(a migration of a fresh database fits; a closed port fails at once, a black hole is left
to the background)."""
STORE_STALL_S = 5.0
"""Rule 5: how long one batch may take to be written before ``/health`` calls it failing."""

StoreState = Literal["connecting", "up", "unreachable", "failing"]


@dataclass(frozen=True, slots=True)
class StoreStatus:
    state: StoreState
    reason: str | None
    connect_failures: int
    """Attempts to reach the store (rule 1) that failed, since the start."""


class Scorekeeper:
    def __init__(self, config: GatewayConfig) -> None:
        self._gateway_config = config
        self.config = config.evaluation
        self._engine: AsyncEngine | None = None
        self._pipeline: EvaluationPipeline | None = None
        self._connector: asyncio.Task[None] | None = None
        self._store_state: StoreState = "connecting"
        self._store_reason: str | None = None
        self._store_failures = 0
        self._traffic: TrafficTally | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._candidates: Callable[[], Iterable[CandidateConfig]] = lambda: config.candidates
        self._canary: Callable[[], str | None] = lambda: None

    def attach_candidates(self, candidates: Callable[[], Iterable[CandidateConfig]]) -> None:
        """Rule 6: the runtime candidates (the mirror's, as the admin API changed them),
        read whenever a report asks which replica is the noise floor and at what rate."""
        self._candidates = candidates

    def attach_canary(self, canary: Callable[[], str | None]) -> None:
        """Rule 6: the name of the routing's canary candidate now (None: no canary)."""
        self._canary = canary

    def attach_traffic(self, traffic: TrafficTally) -> None:
        """Rule 4: the tally of all traffic whose counts this scorekeeper stores."""
        self._traffic = traffic

    async def flush_traffic(self) -> None:
        """Rule 4: add the tally's counts to the store (given back if that fails)."""
        if self._traffic is None or self._engine is None or self._store_state != "up":
            return
        counts = self._traffic.drain()
        if not counts:
            return
        try:
            async with session_factory(self._engine)() as session, session.begin():
                await record_traffic(session, counts)
        except (StoreError, OSError) as exc:
            self._traffic.restore(counts)
            log.warning("traffic counts not stored, kept for the next flush: %s", exc)

    async def _flush_traffic_periodically(self) -> None:
        while True:
            await asyncio.sleep(TRAFFIC_FLUSH_INTERVAL_S)
            await self.flush_traffic()

    @property
    def secondary(self) -> str | None:
        """The replica of the primary whose scores are the noise floor, if one is mirrored."""
        return next((c.name for c in self._candidates() if c.role == "secondary"), None)

    @property
    def pipeline_stats(self) -> PipelineStats | None:
        return self._pipeline.stats if self._pipeline is not None else None

    @property
    def writer_stats(self) -> WriterStats | None:
        """The score writer's counters as its process last reported them."""
        return self._pipeline.writer_stats if self._pipeline is not None else None

    @property
    def engine(self) -> AsyncEngine | None:
        return self._engine

    @property
    def store_status(self) -> StoreStatus:
        return StoreStatus(self._store_state, self._store_reason, self._store_failures)

    @property
    def scoring_pid(self) -> int | None:
        """The scoring child's process id (it changes when a dead child is replaced)."""
        return self._pipeline.pid if self._pipeline is not None else None

    @property
    def scoring_state(self) -> PipelineState | None:
        return self._pipeline.state if self._pipeline is not None else None

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Rule 4: whether the store and the scoring child are well, and what to show."""
        store = self.store_status
        pipeline = self._pipeline
        scoring: dict[str, Any] = {"state": "stopped"}
        if pipeline is not None:
            scoring = {"state": pipeline.state.value, "restarts": pipeline.stats.restarts}
            if pipeline.last_failure is not None:
                scoring["reason"] = pipeline.last_failure
        state, reason = store.state, store.reason
        writer = self.writer_stats
        if state == "up" and writer is not None and writer.writing_since is not None:
            waited = time.time() - writer.writing_since
            if waited > STORE_STALL_S:  # up at start, failing or silent now
                state, reason = "failing", (f"a batch has waited {waited:.0f} s to be "
                                            f"written: {writer.last_error or 'no answer'}")
        store_body: dict[str, Any] = {"state": state, "connect_failures": store.connect_failures}
        if state != "up":
            store_body["reason"] = reason or "no answer from the store yet"
        well = state == "up" and scoring["state"] == PipelineState.RUNNING.value
        return well, {"store": store_body, "scoring": scoring}

    async def audit(self, *, actor: str, action: str, target: str, detail: dict[str, Any],
                    verdict_id: int | None) -> None:
        if self._engine is None:
            return
        async with session_factory(self._engine)() as session, session.begin():
            await append_audit(session, actor=actor, action=action, target=target,
                               detail=detail, verdict_id=verdict_id)

    def submit(self, exchange: Exchange) -> bool:
        return self._pipeline.submit(exchange) if self._pipeline is not None else False

    async def start(self,
                    on_store: Callable[[AsyncEngine], Awaitable[None]] | None = None) -> None:
        """Start scoring and reach the store (rules 1-2); ``on_store`` runs once it is."""
        try:
            await self._start(on_store)
        except BaseException:
            await self.stop()
            raise

    async def _start(self, on_store: Callable[[AsyncEngine], Awaitable[None]] | None) -> None:
        config = self.config
        deadline = asyncio.get_running_loop().time() + STORE_START_WAIT_S
        self._engine = create_engine(config.store)
        self._pipeline = EvaluationPipeline(config.store, config.scorers, config.scoring,
                                            max_pending=config.max_pending,
                                            drain_timeout_s=config.drain_timeout_s,
                                            hold_writes=True)
        self._connector = asyncio.create_task(self._reach_store(self._engine, on_store),
                                              name="understudy-store-connect")
        self._flusher = asyncio.create_task(self._flush_traffic_periodically(),
                                            name="understudy-traffic-flush")
        await self._pipeline.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(self._connector)
        if self._store_state != "up":
            log.warning("evaluation: serving without the store %s (%s); retrying it in the "
                        "background", masked_url(config.store.url),
                        self._store_reason or "no answer yet")
        log.info("evaluation: scoring into %s", masked_url(config.store.url))

    async def _reach_store(self, engine: AsyncEngine,
                           on_store: Callable[[AsyncEngine], Awaitable[None]] | None) -> None:
        """Rules 1-3: migrate, register, ``on_store``; retried until done; then write."""
        store = self.config.store
        delay = store.retry_base_s
        while True:
            try:
                if self.config.auto_migrate:
                    await upgrade(engine)
                await self._register_configured(engine)
                if on_store is not None:
                    await on_store(engine)
            except Exception as exc:  # StoreError mostly; whatever it is, retried
                self._store_failures += 1
                self._store_state = "unreachable"
                self._store_reason = f"{type(exc).__name__}: {exc}"[:300]
                pause = delay * random.uniform(0.5, 1.0)  # replicas do not retry in step
                log.warning("store %s not ready, retrying in %.2f s: %s",
                            masked_url(store.url), pause, self._store_reason)
                await asyncio.sleep(pause)
                delay = min(delay * 2, store.retry_max_s)
                continue
            break
        if self._store_state == "unreachable":
            log.warning("store %s is back after %d failed attempts: writing what was held",
                        masked_url(store.url), self._store_failures)
        self._store_state, self._store_reason = "up", None
        assert self._pipeline is not None
        self._pipeline.release_writes()

    async def _register_configured(self, engine: AsyncEngine) -> None:
        async with session_factory(engine)() as session, session.begin():
            primary = self._gateway_config.primary
            await register_backend(session, primary.name, role="primary", url=primary.url)
            for candidate in self._gateway_config.candidates:
                await register_backend(session, candidate.name, role=candidate.role,
                                       url=candidate.url)

    async def stop_reaching_store(self) -> None:
        """Cancel the background attempts of rule 2 (before what ``on_store`` started stops)."""
        connector, self._connector = self._connector, None
        if connector is not None and not connector.done():
            connector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connector

    async def stop(self) -> None:
        await self.stop_reaching_store()
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await self.flush_traffic()
        if self._pipeline is not None:
            await self._pipeline.close()
        if self._engine is not None:
            await self._engine.dispose()

    async def register(self, name: str, role: str, url: str) -> None:
        """Make a candidate added at runtime known to the store with its role."""
        if self._engine is None:
            return
        async with session_factory(self._engine)() as session, session.begin():
            await register_backend(session, name, role="secondary" if role == "secondary"
                                   else "candidate", url=url)

    def _replica_at_same_rate(self, candidate: str) -> bool:
        """Whether the noise-floor replica is mirrored as ``candidate`` is (same sample
        rate and unit) and ``candidate`` serves no canary (rule 6): then its latency is
        measured at the candidate's load share."""
        if self._canary() == candidate:
            return False
        by_name = {c.name: c for c in self._candidates()}
        replica, mine = by_name.get(self.secondary or ""), by_name.get(candidate)
        return (replica is not None and mine is not None and replica is not mine
                and (replica.sample_rate, replica.sampling_unit)
                == (mine.sample_rate, mine.sampling_unit))

    async def read(self, candidate: str, since: datetime | None = None) -> ReportInputs:
        """A judgement's store reads (``evaluators._report`` rule 6), traffic flushed first."""
        if self._engine is None:
            raise RuntimeError("evaluation is not running")
        await self.flush_traffic()
        async with session_factory(self._engine)() as session, session.begin():
            return await load_report_inputs(session, candidate, self.config.gates,
                                            secondary=self.secondary, since=since)

    async def judge(self, inputs: ReportInputs, look: int | None = None) -> Report:
        """The statistics over ``inputs``, in a worker thread; nothing is stored. ``look``:
        the how-manyth judgement of one growing window this is (a held canary step), whose
        error rate the gates spend over the looks (``evaluators._gates`` rule 7)."""
        gates = self.config.gates if look is None else self.config.gates.for_look(look)

        def judge_then_trim() -> Report:
            try:
                return judge_inputs(inputs, gates, replica_at_same_rate=same_rate)
            finally:
                trim_heaps()  # its buffers' pages back to the system (``_memory`` rule 2)

        same_rate = self._replica_at_same_rate(inputs.candidate)
        return await asyncio.to_thread(judge_then_trim)

    async def record(self, report: Report) -> Report:
        """``report`` stored as a verdict row."""
        if self._engine is None:
            raise RuntimeError("evaluation is not running")
        async with session_factory(self._engine)() as session, session.begin():
            return await record_report(session, report)

    async def report(self, candidate: str, since: datetime | None = None) -> Report:
        """Read, judge and record, unbounded (the admin report endpoint and the CLI)."""
        return await self.record(await self.judge(await self.read(candidate, since)))
