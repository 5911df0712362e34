"""EvaluationPipeline: the sink that scores joined exchanges and stores them, in a child
process of its own.

Scoring (edit distance, sentence embeddings) and the ScoreWriter's batch building are
CPU work with long stretches that hold the GIL. In the gateway's process they delayed
its event loop: with the writer saturated, TTFT p99 went from 30 to 72 ms and the loop's
lag p99 from 3.5 to 16 ms. So both run in a child process (``evaluators._scoring_process``,
whose module comment tells its side), started with "spawn": the gateway has a running
event loop and threads, which a fork would copy half-way. Like every "spawn" program,
the child imports the parent's ``__main__`` module first: a script that starts a gateway
with evaluation must guard its entry with ``if __name__ == "__main__":`` (the CLI, the
tests and the benchmarks do).

Rules (DESIGN.md invariants 1 and 7):
1. ``submit`` never blocks and never awaits: it puts the exchange on a multiprocessing
   queue bounded by ``max_pending`` exchanges with ``put_nowait`` (about a microsecond
   on the loop; the queue's feeder thread then pickles it, some 30 us of the GIL here,
   and writes it to the pipe). When the queue is full, or the pipeline is not running,
   the exchange is refused and the caller counts it (``reason=sink_full``).
2. The child reports its counters and its writer's every ``STATS_INTERVAL_S`` on a pipe
   that a reader on this loop receives; ``stats`` and ``writer_stats`` are the latest.
3. Every accepted exchange is scored and submitted to the ScoreWriter (which stores it or
   counts its own drop) or counted as dropped: ``scoring_error`` (by the child),
   ``shutdown`` (not scored within ``drain_timeout_s`` at close) or ``process_exit``
   (the child died while running).
4. ``start`` returns when the child is ready (scorers loaded, writer running) and raises
   :class:`EvaluationProcessError` with the child's reason when it cannot start.
5. ``close`` stops accepting and tells the child how many exchanges it was sent; the child
   scores them within ``drain_timeout_s``, flushes its writer within the store's
   ``close_timeout_s``, reports its final counters and exits. One that has not exited
   ``EXIT_GRACE_S`` after those bounds is killed.
6. No orphans: the child also drains and exits when its parent goes away (EOF on the
   pipe, or it finds itself reparented) or exits without ``close`` (multiprocessing
   sends its daemonic children SIGTERM), within the same bounds.
7. The child runs niced (``niceness``): on a busy machine the gateway's threads get the
   cores first.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import multiprocessing
import os
import queue
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from types import MappingProxyType

from evaluators._exchange import Exchange
from evaluators._scorers import DEFAULT_SCORERS, ScorerConfig
from evaluators._scoring_process import (
    Drain,
    Failed,
    ProcessSettings,
    Ready,
    Snapshot,
    run_scoring_process,
)
from evaluators._store import StoreConfig
from evaluators._store._writer import WriterStats

__all__ = ["EvaluationPipeline", "EvaluationProcessError", "PipelineState", "PipelineStats"]

log = logging.getLogger("understudy.evaluation")

DEFAULT_MAX_PENDING = 10_000
DEFAULT_BATCH_SIZE = 64
DEFAULT_DRAIN_TIMEOUT_S = 10.0
DEFAULT_NICENESS = 10
"""Added to the child's nice value: a CPU share about a tenth of the gateway's when they
compete for a core (Linux CFS weights), all of what is idle otherwise."""
DEFAULT_START_TIMEOUT_S = 120.0
"""How long the child may take to be ready (it loads the ~90 MB sentence encoder)."""
EXIT_GRACE_S = 5.0
"""Past the drain and close bounds, how long the child may take to exit before it is
killed (SQLAlchemy's 2 s bound on closing a hung connection, the interpreter's exit)."""
JOIN_TIMEOUT_S = 5.0
"""How long to wait for a killed child to be reaped."""


class EvaluationProcessError(RuntimeError):
    """The evaluation process could not start (its reason is in the message)."""


class PipelineState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    FAILED = "failed"  # the child exited on its own: submit refuses, close cleans up
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class PipelineStats:
    accepted: int
    scored: int
    pending: int
    dropped: dict[str, int]


class EvaluationPipeline:
    """Scores exchanges and stores them in a child process; see the module comment."""

    def __init__(self, store: StoreConfig, scorers: Iterable[str] = DEFAULT_SCORERS,
                 scoring: ScorerConfig | None = None, *,
                 max_pending: int = DEFAULT_MAX_PENDING, batch_size: int = DEFAULT_BATCH_SIZE,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 niceness: int = DEFAULT_NICENESS,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        self._settings = ProcessSettings(
            store=store, scorers=tuple(scorers), scoring=scoring or ScorerConfig(),
            batch_size=batch_size, drain_timeout_s=drain_timeout_s, niceness=niceness,
            log_level=logging.getLogger().getEffectiveLevel())
        self._max_pending = max_pending
        self._start_timeout_s = start_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._state = PipelineState.NEW
        self._queue: Queue[Exchange] | None = None
        self._conn: Connection | None = None
        self._process: BaseProcess | None = None
        self._ready: asyncio.Future[None] | None = None
        self._finished: asyncio.Future[None] | None = None  # the final snapshot, or EOF
        self._accepted = 0
        self._last: Snapshot | None = None
        self._writer_stats: WriterStats | None = None
        self._dropped: Counter[str] = Counter()  # counted here, not by the child

    @property
    def state(self) -> PipelineState:
        return self._state

    @property
    def pid(self) -> int | None:
        """The child's process id, once it is started."""
        return self._process.pid if self._process is not None else None

    @property
    def stats(self) -> PipelineStats:
        last = self._last
        scored = last.scored if last is not None else 0
        dropped = Counter(last.dropped if last is not None else {})
        dropped.update(self._dropped)
        pending = self._accepted - scored - sum(dropped.values())
        return PipelineStats(self._accepted, scored, max(pending, 0), dict(dropped))

    @property
    def writer_stats(self) -> WriterStats | None:
        """The child's ScoreWriter as it last reported (every ``STATS_INTERVAL_S``)."""
        return self._writer_stats

    def submit(self, exchange: Exchange) -> bool:
        if self._state is not PipelineState.RUNNING:
            return False
        assert self._queue is not None
        try:
            self._queue.put_nowait(exchange)
        except queue.Full:
            return False
        self._accepted += 1
        return True

    async def start(self) -> None:
        if self._state is not PipelineState.NEW:
            raise RuntimeError(f"cannot start a pipeline that is {self._state.value}")
        loop = asyncio.get_running_loop()
        self._queue = self._context.Queue(self._max_pending)
        # What the feeder thread still holds when the child is gone is counted as dropped
        # (``close``), not waited for at exit, and its broken pipe is no error (as
        # concurrent.futures does with its call queue).
        self._queue.cancel_join_thread()
        self._queue._ignore_epipe = True  # type: ignore[attr-defined]
        self._conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(
            target=run_scoring_process, name="understudy-evaluation",
            args=(self._settings, self._queue, child_conn, os.getpid()),
            # Daemonic: a parent that exits without ``close`` sends it SIGTERM (it drains
            # and exits) before it joins it, instead of waiting on it forever.
            daemon=True)
        self._ready = loop.create_future()
        self._finished = loop.create_future()
        self._process.start()
        child_conn.close()  # the child holds the only other end: its EOF is the child's exit
        loop.add_reader(self._conn.fileno(), self._on_message)
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await self._ready
        except BaseException as exc:
            await self._stop_process(wait_s=0.0)
            self._state = PipelineState.CLOSED
            if isinstance(exc, TimeoutError):
                raise EvaluationProcessError(f"the evaluation process was not ready within "
                                             f"{self._start_timeout_s:g} s") from None
            raise
        self._state = PipelineState.RUNNING
        log.info("evaluation process %d is scoring", self._process.pid)

    async def close(self) -> None:
        """Stop accepting; let the child drain, flush and exit; kill it past its bounds."""
        if self._state is PipelineState.NEW:
            self._state = PipelineState.CLOSED
        if self._state in (PipelineState.CLOSING, PipelineState.CLOSED):
            return
        self._state = PipelineState.CLOSING
        assert self._conn is not None
        with contextlib.suppress(OSError):  # the child may be gone already
            self._conn.send(Drain(self._accepted))
        await self._stop_process(
            wait_s=self._settings.drain_timeout_s + self._settings.store.close_timeout_s)
        lost = self.stats.pending
        if lost:
            log.warning("evaluation closed with %d exchanges not scored", lost)
            self._dropped["shutdown"] += lost
        self._state = PipelineState.CLOSED

    # -- the child -------------------------------------------------------------------

    async def _stop_process(self, wait_s: float) -> None:
        """Wait ``wait_s`` for the child's last word and ``EXIT_GRACE_S`` for its exit;
        kill it past that; release the pipe and the queue."""
        assert self._process is not None and self._queue is not None
        assert self._finished is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await asyncio.shield(self._finished)
        process = self._process
        await asyncio.to_thread(process.join, EXIT_GRACE_S)
        if process.exitcode is None:
            log.error("evaluation process %d did not exit in time: killing it", process.pid)
            process.kill()
            await asyncio.to_thread(process.join, JOIN_TIMEOUT_S)
        self._detach()
        self._queue.close()

    def _detach(self) -> None:
        assert self._conn is not None
        if not self._conn.closed:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._conn.close()

    def _on_message(self) -> None:
        assert self._conn is not None
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._on_exit()
            return
        if isinstance(message, Snapshot):
            self._last = message
            writer = message.writer
            self._writer_stats = replace(
                writer, written_rows=MappingProxyType(writer.written_rows),
                dropped=MappingProxyType(writer.dropped))
            if message.final:
                _resolve(self._finished)
        elif isinstance(message, Ready):
            _resolve(self._ready)
        elif isinstance(message, Failed):
            _fail(self._ready, EvaluationProcessError(
                f"the evaluation process could not start: {message.reason}"))

    def _on_exit(self) -> None:
        """The pipe reached EOF: the child exited (after its final snapshot, or not)."""
        self._detach()
        _fail(self._ready, EvaluationProcessError(
            "the evaluation process exited before it was ready (its error is above)"))
        _resolve(self._finished)
        if self._state is PipelineState.RUNNING:
            lost = self.stats.pending
            log.error("the evaluation process exited unexpectedly; %d exchanges lost", lost)
            self._dropped["process_exit"] += lost
            self._state = PipelineState.FAILED


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None] | None, exc: BaseException) -> None:
    if future is not None and not future.done():
        future.set_exception(exc)
