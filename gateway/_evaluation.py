"""The evaluation side of a running gateway: store, scorers, pipeline, and reports.

Lifecycle: ``start`` opens the database (running Alembic's upgrade when ``auto_migrate``),
registers the configured backends with their roles, loads the scorers (the sentence
encoder is loaded in a worker thread) and starts the writer and the pipeline; ``stop``
drains the pipeline, flushes the writer and closes the database, in that order. Until
``start`` and after ``stop``, ``submit`` refuses (the mirror counts ``sink_full``).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import (
    EvaluationPipeline,
    Exchange,
    Report,
    ScoreWriter,
    build_report,
    build_scorers,
    create_engine,
    session_factory,
    upgrade,
)
from evaluators._store import append_audit, register_backend
from evaluators._store._config import masked_url
from gateway._config import GatewayConfig

__all__ = ["Evaluation"]

log = logging.getLogger("understudy.evaluation")


class Evaluation:
    def __init__(self, config: GatewayConfig) -> None:
        self._gateway_config = config
        self.config = config.evaluation
        self._engine: AsyncEngine | None = None
        self._writer: ScoreWriter | None = None
        self.pipeline: EvaluationPipeline | None = None

    @property
    def secondary(self) -> str | None:
        """The replica of the primary whose scores are the noise floor, if one is mirrored."""
        return next((c.name for c in self._gateway_config.candidates if c.role == "secondary"),
                    None)

    @property
    def writer(self) -> ScoreWriter | None:
        return self._writer

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
        return self.pipeline.submit(exchange) if self.pipeline is not None else False

    async def start(self) -> None:
        store = self.config.store
        self._engine = create_engine(store)
        if self.config.auto_migrate:
            await upgrade(self._engine)
        async with session_factory(self._engine)() as session, session.begin():
            primary = self._gateway_config.primary
            await register_backend(session, primary.name, role="primary", url=primary.url)
            for candidate in self._gateway_config.candidates:
                await register_backend(session, candidate.name, role=candidate.role,
                                       url=candidate.url)
        scorers = await asyncio.to_thread(build_scorers, self.config.scorers,
                                          self.config.scoring)
        self._writer = ScoreWriter(self._engine, store)
        await self._writer.start()
        self.pipeline = EvaluationPipeline(scorers, self._writer,
                                           max_pending=self.config.max_pending,
                                           drain_timeout_s=self.config.drain_timeout_s)
        await self.pipeline.start()
        log.info("evaluation: scoring into %s", masked_url(store.url))

    async def stop(self) -> None:
        if self.pipeline is not None:
            await self.pipeline.close()
        if self._writer is not None:
            await self._writer.close()
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
