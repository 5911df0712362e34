"""The evaluation side of a running gateway: store, scoring pipeline, and reports.

Scoring and writing scores run in the pipeline's child process (``evaluators._pipeline``),
never in the gateway's: this process keeps only ``submit`` (a bounded, non-blocking put),
the counters the child reports, and an engine of its own for the rare admin work
(reports, audit entries, backend registration, the routing version).

Lifecycle: ``start`` opens the database (running Alembic's upgrade when ``auto_migrate``,
so the schema is current before the gateway serves), registers the configured backends
with their roles, and starts the pipeline, which returns when its process has loaded
the scorers and started its writer (or raises ``EvaluationProcessError`` with the
reason); ``stop`` drains the pipeline (its process scores what is queued and flushes its
writer) and closes the database, in that order. Until ``start`` and after ``stop``,
``submit`` refuses (the mirror counts ``sink_full``).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import (
    EvaluationPipeline,
    Exchange,
    PipelineStats,
    Report,
    build_report,
    create_engine,
    session_factory,
    upgrade,
)
from evaluators._store import WriterStats, append_audit, register_backend
from evaluators._store._config import masked_url
from gateway._config import GatewayConfig

__all__ = ["Evaluation"]

log = logging.getLogger("understudy.evaluation")


class Evaluation:
    def __init__(self, config: GatewayConfig) -> None:
        self._gateway_config = config
        self.config = config.evaluation
        self._engine: AsyncEngine | None = None
        self._pipeline: EvaluationPipeline | None = None

    @property
    def secondary(self) -> str | None:
        """The replica of the primary whose scores are the noise floor, if one is mirrored."""
        return next((c.name for c in self._gateway_config.candidates if c.role == "secondary"),
                    None)

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

    async def audit(self, *, actor: str, action: str, target: str, detail: dict[str, Any],
                    verdict_id: int | None) -> None:
        if self._engine is None:
            return
        async with session_factory(self._engine)() as session, session.begin():
            await append_audit(session, actor=actor, action=action, target=target,
                               detail=detail, verdict_id=verdict_id)

    def submit(self, exchange: Exchange) -> bool:
        return self._pipeline.submit(exchange) if self._pipeline is not None else False

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        config = self.config
        self._engine = create_engine(config.store)
        if config.auto_migrate:
            await upgrade(self._engine)
        async with session_factory(self._engine)() as session, session.begin():
            primary = self._gateway_config.primary
            await register_backend(session, primary.name, role="primary", url=primary.url)
            for candidate in self._gateway_config.candidates:
                await register_backend(session, candidate.name, role=candidate.role,
                                       url=candidate.url)
        self._pipeline = EvaluationPipeline(config.store, config.scorers, config.scoring,
                                            max_pending=config.max_pending,
                                            drain_timeout_s=config.drain_timeout_s)
        await self._pipeline.start()
        log.info("evaluation: scoring into %s", masked_url(config.store.url))

    async def stop(self) -> None:
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

    async def report(self, candidate: str, since: datetime | None = None) -> Report:
        if self._engine is None:
            raise RuntimeError("evaluation is not running")
        async with session_factory(self._engine)() as session, session.begin():
            return await build_report(session, candidate, self.config.gates,
                                      secondary=self.secondary, since=since)
