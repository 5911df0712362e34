"""EvaluationPipeline: the sink that scores joined exchanges and hands them to the store.

Rules (DESIGN.md invariant 7):
1. ``submit`` never blocks: a bounded queue (``max_pending`` exchanges); when it is full
   the exchange is refused and the caller counts it (``reason=sink_full``).
2. Scoring is CPU work (edit distance, sentence embeddings): it runs in a worker thread,
   a batch at a time, never on the event loop.
3. Every accepted exchange is either submitted to the ScoreWriter (which stores it or
   counts its own drop) or counted here as dropped with a reason (``shutdown``,
   ``scoring_error``).
4. ``close`` stops accepting, scores what is queued within ``drain_timeout_s`` and counts
   the rest as dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from evaluators._exchange import Exchange
from evaluators._score import Score, Scorer, score_exchange
from evaluators._store import ScoreWriter

__all__ = ["EvaluationPipeline", "PipelineStats"]

log = logging.getLogger("understudy.evaluation")

DEFAULT_MAX_PENDING = 10_000
DEFAULT_BATCH_SIZE = 64
DEFAULT_DRAIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class PipelineStats:
    accepted: int
    scored: int
    pending: int
    dropped: dict[str, int]


class EvaluationPipeline:
    def __init__(self, scorers: Sequence[Scorer], writer: ScoreWriter, *,
                 max_pending: int = DEFAULT_MAX_PENDING, batch_size: int = DEFAULT_BATCH_SIZE,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        self._scorers = list(scorers)
        self._writer = writer
        self._max_pending = max_pending
        self._batch_size = batch_size
        self._drain_timeout_s = drain_timeout_s
        self._queue: deque[Exchange] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._accepting = False
        self._accepted = 0
        self._scored = 0
        self._dropped: Counter[str] = Counter()

    @property
    def writer(self) -> ScoreWriter:
        return self._writer

    @property
    def stats(self) -> PipelineStats:
        return PipelineStats(self._accepted, self._scored, len(self._queue),
                             dict(self._dropped))

    def submit(self, exchange: Exchange) -> bool:
        if not self._accepting or len(self._queue) >= self._max_pending:
            return False
        self._queue.append(exchange)
        self._accepted += 1
        self._wake.set()
        return True

    async def start(self) -> None:
        self._accepting = True
        self._task = asyncio.create_task(self._run(), name="evaluation-pipeline")

    async def close(self) -> None:
        self._accepting = False
        self._wake.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self._drain_timeout_s)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._dropped["shutdown"] += len(self._queue)
        self._queue.clear()

    async def _run(self) -> None:
        while self._accepting or self._queue:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft()
                     for _ in range(min(self._batch_size, len(self._queue)))]
            try:
                scored = await asyncio.to_thread(self._score, batch)
            except Exception:
                log.exception("scoring a batch of %d exchanges failed", len(batch))
                self._dropped["scoring_error"] += len(batch)
                continue
            for exchange, scores in scored:
                self._writer.submit(exchange, scores)
            self._scored += len(batch)

    def _score(self, batch: list[Exchange]) -> list[tuple[Exchange, list[Score]]]:
        return [(exchange, score_exchange(exchange, self._scorers)) for exchange in batch]
