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
   and writes it to the pipe). When the queue is full, or the pipeline is not running
   (nor restarting its child), the exchange is refused and the caller counts it
   (``reason=sink_full``).
2. The child reports its counters and its writer's every ``STATS_INTERVAL_S`` on a pipe
   that a reader on this loop receives; ``stats`` and ``writer_stats`` are the latest,
   summed over every child this pipeline has had (``_pipeline_stats``). The child
   scores in batches of at most ``batch_size`` (what was queued when it took the last
   one); ``stats`` has the batches, the last one's size and the queue's depth, for the
   gateway's metrics.
3. Every accepted exchange is scored and submitted to the ScoreWriter (which stores it or
   counts its own drop) or counted as dropped: ``scoring_error`` or ``store_error`` (by
   the child: it failed to score, or the writer raised on it),
   ``shutdown`` (not scored within ``drain_timeout_s`` at close) or ``process_exit``
   (the child died while running). A child that dies takes with it what it had not
   reported as scored (at most ``STATS_INTERVAL_S`` of work may be counted lost although
   its writer stored it) and what its writer still held (the writer's ``process_exit``).
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
8. A child that dies while running (killed, crashed) is reaped at once (no zombie) and
   replaced: state RESTARTING, a fresh queue (the dead child may have held the old
   one's lock) that accepts within ``max_pending`` meanwhile, a new child after a
   backoff from ``restart_backoff_s`` doubling per restart in the window, up to
   ``MAX_RESTART_BACKOFF_S``. At most ``max_restarts`` restarts within
   ``restart_window_s``: past that the pipeline gives up (FAILED: submit refuses, the
   queue's exchanges count as ``process_exit``). Every restart is counted (``restarts``).
9. Held writes: with ``hold_writes`` the child's writer queues but writes nothing until
   ``release_writes()`` (the owner has reached the store and migrated it); every child
   started after that writes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import multiprocessing
import os
import queue
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

from evaluators._exchange import Exchange
from evaluators._pipeline_stats import ChildReports, PipelineStats
from evaluators._scorers import DEFAULT_SCORERS, ScorerConfig
from evaluators._scoring_process import (
    MAX_BATCH_SIZE,
    Drain,
    Failed,
    ProcessSettings,
    Ready,
    Snapshot,
    StoreReady,
    run_scoring_process,
)
from evaluators.store import StoreConfig
from evaluators.store._writer import WriterStats

__all__ = ["EvaluationPipeline", "EvaluationProcessError", "PipelineState"]

log = logging.getLogger("understudy.evaluation")

DEFAULT_MAX_PENDING = 10_000
DEFAULT_BATCH_SIZE = 64
"""The most exchanges the child scores together (at most ``MAX_BATCH_SIZE``)."""
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
DEFAULT_MAX_RESTARTS = 5
"""Rule 8: restarts of a dead child allowed within ``DEFAULT_RESTART_WINDOW_S``."""
DEFAULT_RESTART_WINDOW_S = 600.0
DEFAULT_RESTART_BACKOFF_S = 0.5
"""Rule 8: the wait before the first restart in a window; doubled for each further one."""
MAX_RESTART_BACKOFF_S = 30.0


class EvaluationProcessError(RuntimeError):
    """The evaluation process could not start (its reason is in the message)."""


class PipelineState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    RESTARTING = "restarting"  # the child died: a new one is on its way, submit queues
    FAILED = "failed"  # the child died past the restart budget: submit refuses
    CLOSING = "closing"
    CLOSED = "closed"


class EvaluationPipeline:
    """Scores exchanges and stores them in a child process; see the module comment."""

    def __init__(self, store: StoreConfig, scorers: Iterable[str] = DEFAULT_SCORERS,
                 scoring: ScorerConfig | None = None, *,
                 max_pending: int = DEFAULT_MAX_PENDING, batch_size: int = DEFAULT_BATCH_SIZE,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 niceness: int = DEFAULT_NICENESS,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 max_restarts: int = DEFAULT_MAX_RESTARTS,
                 restart_window_s: float = DEFAULT_RESTART_WINDOW_S,
                 restart_backoff_s: float = DEFAULT_RESTART_BACKOFF_S,
                 hold_writes: bool = False) -> None:
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be in 1..{MAX_BATCH_SIZE}")
        self._settings = ProcessSettings(
            store=store, scorers=tuple(scorers), scoring=scoring or ScorerConfig(),
            batch_size=batch_size, drain_timeout_s=drain_timeout_s, niceness=niceness,
            log_level=logging.getLogger().getEffectiveLevel())
        self._max_pending = max_pending
        self._start_timeout_s = start_timeout_s
        self._max_restarts = max_restarts
        self._restart_window_s = restart_window_s
        self._restart_backoff_s = restart_backoff_s
        self._writes_released = not hold_writes
        self._context = multiprocessing.get_context("spawn")
        self._state = PipelineState.NEW
        # The current child and its queue (rule 8: both are replaced when it dies).
        self._queue: Queue[Exchange] | None = None
        self._sent = 0  # exchanges put on the current queue
        self._conn: Connection | None = None
        self._process: BaseProcess | None = None
        self._pid: int | None = None  # kept once the child is reaped and released
        self._ready: asyncio.Future[None] | None = None
        self._finished: asyncio.Future[None] | None = None  # the final snapshot, or EOF
        self._reports = ChildReports()  # what the children reported (rules 2 and 3)
        # What is counted here, not by a child.
        self._accepted = 0
        self._dropped: Counter[str] = Counter()
        self._restarts = 0
        self._restart_times: deque[float] = deque()
        self._restarter: asyncio.Task[None] | None = None
        self._last_failure: str | None = None

    @property
    def state(self) -> PipelineState:
        return self._state

    @property
    def pid(self) -> int | None:
        """The current child's process id, once one is started."""
        return self._pid

    @property
    def last_failure(self) -> str | None:
        """Why the last child died or could not be restarted (None: none has)."""
        return self._last_failure

    @property
    def stats(self) -> PipelineStats:
        reports = self._reports
        scored = reports.scored
        dropped = reports.dropped()
        dropped.update(self._dropped)
        pending = max(self._accepted - scored - sum(dropped.values()), 0)
        return PipelineStats(self._accepted, scored, pending, dict(dropped),
                             self._restarts, reports.batches, reports.last_batch_size,
                             self._queue_depth(pending))

    def _queue_depth(self, pending: int) -> int:
        if self._queue is None or self._state in (PipelineState.FAILED, PipelineState.CLOSED):
            return 0
        try:
            return min(self._queue.qsize(), pending)
        except NotImplementedError:  # macOS has no sem_getvalue
            return pending

    @property
    def writer_stats(self) -> WriterStats | None:
        """The children's ScoreWriters as they last reported (every ``STATS_INTERVAL_S``),
        summed over every child this pipeline has had."""
        return self._reports.writer_stats

    def submit(self, exchange: Exchange) -> bool:
        if self._state not in (PipelineState.RUNNING, PipelineState.RESTARTING):
            return False
        assert self._queue is not None
        try:
            self._queue.put_nowait(exchange)
        except queue.Full:
            return False
        self._accepted += 1
        self._sent += 1
        return True

    def release_writes(self) -> None:
        """Rule 9: the store is ready; the child's writer (and every later one's) writes."""
        if self._writes_released:
            return
        self._writes_released = True
        if self._conn is not None and not self._conn.closed:
            with contextlib.suppress(OSError):  # a child that died: its successor is told
                self._conn.send(StoreReady())

    async def start(self) -> None:
        if self._state is not PipelineState.NEW:
            raise RuntimeError(f"cannot start a pipeline that is {self._state.value}")
        self._queue = self._new_queue()
        try:
            await self._spawn()
        except BaseException:
            _close_queue(self._queue)
            self._state = PipelineState.CLOSED
            raise
        self._state = PipelineState.RUNNING
        log.info("evaluation process %d is scoring", self.pid)

    async def close(self) -> None:
        """Stop accepting; let the child drain, flush and exit; kill it past its bounds."""
        if self._state is PipelineState.NEW:
            self._state = PipelineState.CLOSED
        if self._state in (PipelineState.CLOSING, PipelineState.CLOSED):
            return
        running = self._state is PipelineState.RUNNING
        self._state = PipelineState.CLOSING
        restarter, self._restarter = self._restarter, None
        if restarter is not None:  # a child on its way is killed by the cancelled spawn
            restarter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restarter
        if running:
            assert self._conn is not None
            with contextlib.suppress(OSError):  # the child may be gone already
                self._conn.send(Drain(self._sent))
            await self._stop_process(
                wait_s=self._settings.drain_timeout_s + self._settings.store.close_timeout_s)
        if self._queue is not None:
            _close_queue(self._queue)
        lost = self.stats.pending
        if lost:
            log.warning("evaluation closed with %d exchanges not scored", lost)
            self._dropped["shutdown"] += lost
        self._state = PipelineState.CLOSED

    # -- the child -------------------------------------------------------------------

    def _new_queue(self) -> Queue[Exchange]:
        exchanges: Queue[Exchange] = self._context.Queue(self._max_pending)
        # What the feeder thread still holds when the child is gone is counted as dropped
        # (``close``), not waited for at exit, and its broken pipe is no error (as
        # concurrent.futures does with its call queue).
        exchanges.cancel_join_thread()
        exchanges._ignore_epipe = True  # type: ignore[attr-defined]
        self._sent = 0
        return exchanges

    async def _spawn(self) -> None:
        """Start a child on the current queue; return once it is ready, or raise (the
        child stopped, the queue kept for the next one)."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        self._conn, child_conn = self._context.Pipe()
        settings = replace(self._settings, hold_writes=not self._writes_released)
        self._process = self._context.Process(
            target=run_scoring_process, name="understudy-evaluation",
            args=(settings, self._queue, child_conn, os.getpid()),
            # Daemonic: a parent that exits without ``close`` sends it SIGTERM (it drains
            # and exits) before it joins it, instead of waiting on it forever.
            daemon=True)
        self._ready = loop.create_future()
        self._finished = loop.create_future()
        self._reports.new_child()
        self._process.start()
        self._pid = self._process.pid
        child_conn.close()  # the child holds the only other end: its EOF is the child's exit
        loop.add_reader(self._conn.fileno(), self._on_message)
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await self._ready
        except BaseException as exc:
            await self._stop_process(wait_s=0.0,
                                     kill=isinstance(exc, asyncio.CancelledError))
            if isinstance(exc, TimeoutError):
                raise EvaluationProcessError(f"the evaluation process was not ready within "
                                             f"{self._start_timeout_s:g} s") from None
            raise

    async def _stop_process(self, wait_s: float, *, kill: bool = False) -> None:
        """Wait ``wait_s`` for the child's last word and ``EXIT_GRACE_S`` for its exit;
        kill it past that (or at once with ``kill``); release the pipe."""
        assert self._process is not None and self._finished is not None
        process = self._process
        if kill:
            process.kill()
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await asyncio.shield(self._finished)
            await asyncio.to_thread(process.join, EXIT_GRACE_S)
        if process.exitcode is None:
            if not kill:
                log.error("evaluation process %d did not exit in time: killing it",
                          process.pid)
            process.kill()
        await asyncio.to_thread(process.join, JOIN_TIMEOUT_S)
        self._detach()
        if _release(process):
            self._process = None

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
            self._reports.report(message)
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
            self._replace_dead_child()

    def _replace_dead_child(self) -> None:
        """Rule 8: count what the dead child took with it, and start its successor."""
        assert self._process is not None and self._queue is not None
        lost = self.stats.pending
        self._dropped["process_exit"] += lost
        self._last_failure = f"the evaluation process {self._pid} exited unexpectedly"
        log.error("%s; %d exchanges lost; restarting it", self._last_failure, lost)
        self._reports.bury()
        dead, old_queue = self._process, self._queue
        self._queue = self._new_queue()
        self._state = PipelineState.RESTARTING
        self._restarter = asyncio.get_running_loop().create_task(
            self._restart(dead, old_queue), name="understudy-evaluation-restart")

    async def _restart(self, dead: BaseProcess, old_queue: Queue[Exchange]) -> None:
        await asyncio.to_thread(dead.join, JOIN_TIMEOUT_S)  # reap it: no zombie
        if _release(dead) and self._process is dead:
            self._process = None
        _close_queue(old_queue)
        while True:
            now = time.monotonic()
            while self._restart_times and now - self._restart_times[0] >= self._restart_window_s:
                self._restart_times.popleft()
            if len(self._restart_times) >= self._max_restarts:
                self._give_up()
                return
            await asyncio.sleep(min(self._restart_backoff_s * 2 ** len(self._restart_times),
                                    MAX_RESTART_BACKOFF_S))
            self._restart_times.append(time.monotonic())
            self._restarts += 1
            try:
                await self._spawn()
            except Exception as exc:  # any failure to start is retried, within the budget
                self._last_failure = str(exc)
                log.error("restarting the evaluation process failed: %s", exc)
                continue
            assert self._finished is not None
            if self._finished.done():  # it died between its Ready and now
                self._reports.bury()
                continue
            self._state = PipelineState.RUNNING
            self._restarter = None
            log.warning("evaluation process restarted as %d (restart %d)", self.pid,
                        self._restarts)
            return

    def _give_up(self) -> None:
        assert self._queue is not None
        self._state = PipelineState.FAILED
        self._restarter = None
        _close_queue(self._queue)
        lost = self.stats.pending
        self._dropped["process_exit"] += lost
        self._last_failure = (f"{self._max_restarts} restarts within "
                              f"{self._restart_window_s:g} s: not restarting again "
                              f"(last: {self._last_failure})")
        log.error("evaluation process: %s; %d exchanges lost", self._last_failure, lost)


def _release(process: BaseProcess) -> bool:
    """Close an exited child's handles (its sentinel descriptor stays open until then);
    False while it still runs."""
    if process.exitcode is None:
        return False
    process.close()
    return True


def _close_queue(queue: Queue[Exchange]) -> None:
    """Close ``queue`` and both ends of its pipe: its feeder thread closes them once it
    has flushed, but a queue never written to has no feeder thread to do it."""
    queue.close()
    if queue._thread is None:  # type: ignore[attr-defined]
        queue._reader.close()  # type: ignore[attr-defined]
        queue._writer.close()  # type: ignore[attr-defined]


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None] | None, exc: BaseException) -> None:
    if future is not None and not future.done():
        future.set_exception(exc)
