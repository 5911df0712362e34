"""The evaluation process: scores exchanges and writes them, away from the gateway.

:class:`~evaluators._pipeline.EvaluationPipeline` starts :func:`run_scoring_process` in a
child process. The child has its own interpreter (its own GIL) and its own event loop,
which runs only the ScoreWriter and this module's bookkeeping, so scoring and batch
building never take time from the gateway's loop.

Theory of operation:
1. Start: build the scorers (the semantic similarity's model loads here: the static
   table from its cache file, distilled first if it is missing, ~40 s of CPU, once per
   machine; or MiniLM's weights), open the engine, start
   the writer, send :class:`Ready` — or :class:`Failed` with the reason, and exit.
   The writer also prunes what is past the store's ``retention_days`` (ScoreWriter rule
   8): the process that owns the store's writes owns its deletions, away from the proxy;
   its count rides on the writer's stats in each :class:`Snapshot`.
2. One worker thread drains the queue a batch at a time: it waits for one exchange,
   then takes what else is queued, up to ``batch_size`` (at most ``MAX_BATCH_SIZE``),
   without waiting for more (a batch is what piled up while the last one was scored, so
   a quiet gateway's exchange is scored alone and at once). It scores the batch together
   (``score_batch``: the semantic model runs once over all its texts) and hands the
   scores to the writer on the loop's thread (``call_soon_threadsafe``; the writer is
   not thread-safe). An exchange that fails to score is dropped and counted
   (``scoring_error``); one the writer raises on is dropped and counted
   (``store_error``), and the rest of its batch is still submitted. Batches and the
   size of the last one are counted for the gateway's metrics.
3. Every ``STATS_INTERVAL_S`` the child sends a :class:`Snapshot` of its counters and
   its writer's; the parent keeps the latest.
4. Drain: on :class:`Drain` (``expected`` = how many exchanges the parent put on the
   queue in all) the thread scores until it has taken that many or ``drain_timeout_s``
   has passed (checked between batches, of at most ``DRAIN_BATCH_SIZE`` meanwhile;
   the parent counts what was not scored). If
   the parent is gone instead (EOF on the pipe, or the process was reparented) it
   drains what is already in the queue, within the same bound. Then the writer closes
   (within ``close_timeout_s``), the final :class:`Snapshot` is sent (when the parent
   can still hear it) and the process exits: it never outlives its parent by more than
   those bounds.
5. Signals: SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group, and
   it is the gateway's to turn into a drain); SIGTERM, once the writer runs, drains what
   is queued and exits, as when the parent is gone: it is what a service manager sends
   to every process of the gateway, and what multiprocessing sends its daemonic
   children when the parent exits without closing the pipeline.
6. Held writes: started with ``hold_writes`` (the gateway has not reached its store yet,
   or not migrated it), the writer queues within its bounds and writes nothing until
   the parent sends :class:`StoreReady`.
7. The process runs at a lower CPU priority (``niceness``): where cores are scarce, the
   scheduler gives them to the gateway first, and evaluation takes what is left (when
   that is too little, its queue fills and the gateway counts ``sink_full``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue

from evaluators._exchange import Exchange
from evaluators._score import Score, Scorer, score_batch
from evaluators._scorers import ScorerConfig, build_scorers
from evaluators.store import ScoreWriter, StoreConfig, create_engine
from evaluators.store._writer import WriterStats

__all__ = [
    "MAX_BATCH_SIZE",
    "STATS_INTERVAL_S",
    "Drain",
    "Failed",
    "ProcessSettings",
    "Ready",
    "Snapshot",
    "StoreReady",
    "run_scoring_process",
]

log = logging.getLogger("understudy.evaluation")

STATS_INTERVAL_S = 0.2
"""How often the child reports its counters (and checks that its parent is alive)."""
TAKE_POLL_S = 0.1
"""How long the worker thread waits on an empty queue before it looks at the drain."""
MAX_BATCH_SIZE = 256
"""The most exchanges scored together (rule 2): a batch's scores are held until all of
it is scored, and a drain past its deadline gives up only between batches."""
DRAIN_BATCH_SIZE = 8
"""The most exchanges scored together while draining, so that the deadline is checked
often (with ``semantic_model = "minilm"`` a 200-token exchange takes ~0.12 s of CPU;
~1.3 ms with the static default)."""


@dataclass(frozen=True, slots=True)
class ProcessSettings:
    store: StoreConfig
    scorers: tuple[str, ...]
    scoring: ScorerConfig
    batch_size: int
    drain_timeout_s: float
    niceness: int
    log_level: int
    hold_writes: bool = False
    """Rule 6: write nothing until :class:`StoreReady`."""


# -- messages on the pipe: child -> parent ---------------------------------------------

@dataclass(frozen=True, slots=True)
class Ready:
    pid: int


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    scored: int
    dropped: dict[str, int]
    writer: WriterStats  # its mappings as plain dicts: a mappingproxy does not pickle
    final: bool
    batches: int = 0
    """Batches scored (rule 2)."""
    last_batch_size: int = 0
    """Exchanges in the last batch taken (0 before the first)."""


# -- parent -> child -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Drain:
    expected: int
    """Exchanges the parent put on the queue since the start, all told."""


@dataclass(frozen=True, slots=True)
class StoreReady:
    """Rule 6: the store is reachable and its schema current; writing may begin."""


def run_scoring_process(settings: ProcessSettings, exchanges: Queue[Exchange],
                        conn: Connection, parent_pid: int) -> None:
    """The child's entry point (a spawned process: nothing is inherited but the args)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(settings.niceness)
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s[child] %(message)s")
    asyncio.run(_ScoringProcess(settings, exchanges, conn, parent_pid).serve())


class _ScoringProcess:
    def __init__(self, settings: ProcessSettings, exchanges: Queue[Exchange],
                 conn: Connection, parent_pid: int) -> None:
        self._settings = settings
        self._exchanges = exchanges
        self._conn = conn
        self._parent_pid = parent_pid
        self._parent_alive = True
        self._scored = 0
        self._batches = 0
        self._last_batch_size = 0
        self._dropped: Counter[str] = Counter()
        # Set by the loop's thread, read by the worker thread once ``_draining`` is set.
        self._draining = threading.Event()
        self._expected: int | None = None
        self._deadline = 0.0
        self._writer: ScoreWriter | None = None

    async def serve(self) -> None:
        settings = self._settings
        try:
            scorers = build_scorers(settings.scorers, settings.scoring)
            engine = create_engine(settings.store)
        except Exception as exc:
            log.exception("the evaluation process cannot start")
            self._send(Failed(f"{type(exc).__name__}: {exc}"))
            return
        try:
            async with ScoreWriter(engine, settings.store,
                                   hold=settings.hold_writes) as writer:
                self._writer = writer
                await self._run(scorers, writer)
            self._send(self._snapshot(writer, final=True))
        finally:
            await engine.dispose()

    async def _run(self, scorers: Sequence[Scorer], writer: ScoreWriter) -> None:
        loop = asyncio.get_running_loop()
        drained = asyncio.Event()
        loop.add_reader(self._conn.fileno(), self._on_message, drained)
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm, drained)
        self._send(self._snapshot(writer, final=False))  # so the parent has one from the start
        self._send(Ready(os.getpid()))
        worker = asyncio.create_task(asyncio.to_thread(self._score, loop, scorers, writer))
        try:
            while not drained.is_set() and not worker.done():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STATS_INTERVAL_S):
                        await drained.wait()
                if os.getppid() != self._parent_pid:  # reparented: the parent is gone
                    self._parent_alive = False
                    self._start_drain(None)
                    drained.set()
                self._send(self._snapshot(writer, final=False))
            await worker  # raises what killed the thread, if it died before the drain
        finally:
            loop.remove_reader(self._conn.fileno())

    # -- the pipe ----------------------------------------------------------------------

    def _on_message(self, drained: asyncio.Event) -> None:
        try:
            message = self._conn.recv()
        except (EOFError, OSError):  # the parent is gone, however it went
            self._parent_alive = False
            self._start_drain(None)
        else:
            if isinstance(message, StoreReady):
                if self._writer is not None:
                    self._writer.release()
                return
            if not isinstance(message, Drain):
                return
            self._start_drain(message.expected)
        drained.set()
        asyncio.get_running_loop().remove_reader(self._conn.fileno())

    def _on_sigterm(self, drained: asyncio.Event) -> None:
        self._start_drain(None)
        drained.set()

    def _send(self, message: Ready | Failed | Snapshot) -> None:
        if not self._parent_alive:
            return
        try:
            self._conn.send(message)
        except OSError:  # EPIPE: the parent is gone; the drain notices it too
            self._parent_alive = False

    def _start_drain(self, expected: int | None) -> None:
        if self._draining.is_set():
            return
        self._expected = expected
        self._deadline = time.monotonic() + self._settings.drain_timeout_s
        self._draining.set()

    def _snapshot(self, writer: ScoreWriter, *, final: bool) -> Snapshot:
        stats = writer.stats
        plain = dataclasses.replace(stats, written_rows=dict(stats.written_rows),
                                    dropped=dict(stats.dropped))
        return Snapshot(self._scored, dict(self._dropped), plain, final,
                        self._batches, self._last_batch_size)

    # -- the worker thread -------------------------------------------------------------

    def _score(self, loop: asyncio.AbstractEventLoop, scorers: Sequence[Scorer],
               writer: ScoreWriter) -> None:
        taken = 0
        while not self._drained(taken):
            batch = self._take()
            taken += len(batch)
            if not batch or self._past_deadline():  # the parent counts the rest (``shutdown``)
                continue
            scored: list[tuple[Exchange, list[Score]]] = []
            errors = 0
            for exchange, result in zip(batch, score_batch(batch, scorers), strict=True):
                if isinstance(result, Exception):
                    log.error("scoring exchange %s failed", exchange.request_id,
                              exc_info=result)
                    errors += 1
                else:
                    scored.append((exchange, result))
            loop.call_soon_threadsafe(self._store, writer, scored, errors)

    def _past_deadline(self) -> bool:
        return self._draining.is_set() and time.monotonic() >= self._deadline

    def _drained(self, taken: int) -> bool:
        if not self._draining.is_set():
            return False
        if self._past_deadline():
            return True
        if self._expected is None:  # no parent to say how many: what is queued now
            return self._exchanges.empty()
        return taken >= self._expected

    def _take(self) -> list[Exchange]:
        try:
            batch = [self._exchanges.get(timeout=TAKE_POLL_S)]
        except queue.Empty:
            return []
        with contextlib.suppress(queue.Empty):
            while len(batch) < self._batch_limit():
                batch.append(self._exchanges.get_nowait())
        return batch

    def _batch_limit(self) -> int:
        if self._draining.is_set():
            return min(self._settings.batch_size, DRAIN_BATCH_SIZE)
        return min(self._settings.batch_size, MAX_BATCH_SIZE)

    def _store(self, writer: ScoreWriter, scored: list[tuple[Exchange, list[Score]]],
               errors: int) -> None:
        stored = 0
        for exchange, scores in scored:
            try:
                writer.submit(exchange, scores)
            except Exception:  # one record the writer cannot take costs that one only
                log.exception("storing exchange %s failed", exchange.request_id)
                self._dropped["store_error"] += 1
            else:
                stored += 1
        self._scored += stored
        if errors:
            self._dropped["scoring_error"] += errors
        self._batches += 1
        self._last_batch_size = len(scored) + errors
