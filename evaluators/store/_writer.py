"""ScoreWriter: exchanges and their scores into the store, in batches, never blocking.

Theory of operation:
1. ``submit`` never awaits and never blocks. It turns the exchange and its scores into
   rows (plain CPU work, no I/O) and appends them to a queue bounded by
   ``StoreConfig.queue_rows`` rows (and ``queue_text_chars`` of stored text). A record
   that does not fit is dropped and counted (``reason=queue_full|queue_text``); so is
   one that cannot be stored (``invalid``) or that arrives while the writer is not
   running (``not_running``). Submit returns whether the record was accepted.
2. One background task writes. It takes a batch of whole records when the queue holds
   ``batch_rows`` rows or when its oldest record has waited ``flush_interval_s``, and
   writes it in one transaction (see ``_bulk``).
3. When the database is unreachable (connection refused or lost, timeouts) the task
   keeps its batch and retries with exponential backoff from ``retry_base_s`` up to
   ``retry_max_s``, with jitter. Meanwhile submit keeps accepting up to the queue bound
   and dropping past it. When the database returns, writing resumes where it stopped.
   Memory is bounded by the queue plus the one batch in hand.
4. A batch the database rejects (a constraint, bad data) is split in halves until the
   records it refuses are alone; those are dropped (``rejected``), the rest written. A
   record whose exchange retention deleted under its batch (another replica pruning;
   ``_bulk`` rule 6) is left out of it alone and counted (``exchange_pruned``).
5. ``close()`` stops accepting, writes what it holds within ``close_timeout_s``, then
   cancels the task and counts what is left as dropped (``close_timeout``). Cancelling
   a batch on a hung PostgreSQL connection adds SQLAlchemy's bound on closing it (2 s).
6. Held writes: a writer started with ``hold=True`` accepts records (within the same
   bounds) but writes nothing until ``release()``: its owner says when the store is
   reachable and its schema current (a gateway started during a store outage). A writer
   closed while still held writes nothing and counts what it held (``store_unready``).
7. Accounting: every submitted record is refused (counted by reason) or accepted; every
   accepted record is written, dropped after acceptance (counted by reason), or still
   held (``queued_records + held_records``).
8. Retention: with ``retention_days`` > 0 a second task prunes what is older
   (``_retention``): the first pass one ``prune_interval_s`` after writing may begin (not
   at start, when replicas start together; jittered, so they do not prune in step), then
   one every interval. Each batch of deletions holds the lock a batch of inserts takes,
   so in this process the two never interleave and a write waits for one bounded batch
   at most. A failed pass is logged and noted as the last error; the next one resumes.
   The exchanges pruned are counted (``pruned_exchanges``), each pass logged at INFO.

Call ``submit`` from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType, TracebackType
from typing import Literal, get_args

from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators._exchange import Exchange
from evaluators.store._bulk import TABLES, BatchInserter
from evaluators.store._config import StoreConfig
from evaluators.store._errors import (
    StoreError,
    StoreRejected,
    StoreUnavailable,
    WriterStateError,
    translate_store_errors,
)
from evaluators.store._hash_key import load_hash_key
from evaluators.store._retention import Pruned, prune_store, retention_cutoff
from evaluators.store._rows import InvalidRecord, Record, ScoreLike, build_record

__all__ = ["DropReason", "ScoreWriter", "WriterState", "WriterStats"]

log = logging.getLogger("understudy.store")

DropReason = Literal[
    "queue_full", "queue_text", "invalid", "not_running", "rejected", "exchange_pruned",
    "failed", "close_timeout", "store_unready", "process_exit",
]
DROP_REASONS: tuple[DropReason, ...] = get_args(DropReason)
"""``process_exit`` is never counted by a writer itself: the evaluation pipeline counts
what a writer held when its process died."""


class WriterState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class WriterStats:
    """A snapshot of the writer's counters (records unless a name says rows)."""

    state: WriterState
    submitted: int
    accepted: int
    written_records: int
    written_rows: Mapping[str, int]
    dropped: Mapping[DropReason, int]
    batches: int
    retries: int
    queued_records: int
    queued_rows: int
    held_records: int
    last_error: str | None
    last_error_at: float | None
    """Wall-clock time (``time.time()``) of ``last_error``."""
    writing_since: float | None = None
    """Wall-clock time the batch in hand began to be written (retries included); None
    while no write is under way. A store that fails or never answers shows here."""
    pruned_exchanges: int = 0
    """Exchanges deleted by retention (rule 8), their observations and scores with them."""
    prune_passes: int = 0


class ScoreWriter:
    """Writes exchanges, their observations and scores in batches on a background task.

    Use as ``async with ScoreWriter(engine, config) as writer:`` or call ``start()`` and
    ``close()``. The engine belongs to the caller and outlives the writer.
    """

    def __init__(self, engine: AsyncEngine, config: StoreConfig | None = None, *,
                 hold: bool = False) -> None:
        self._config = config or StoreConfig()
        self._released = asyncio.Event()  # rule 6: set when writes may begin
        if not hold:
            self._released.set()
        self._engine = engine
        self._inserter = BatchInserter(engine)
        self._store_lock = asyncio.Lock()  # rule 8: a batch of inserts or of deletions
        self._prune_task: asyncio.Task[None] | None = None
        self._pruned_exchanges = 0
        self._prune_passes = 0
        self._hash_key = b""  # read at start
        self._queue: deque[Record] = deque()
        self._queued_rows = 0
        self._queued_text = 0
        self._held = 0  # records of the batch in hand not yet written or dropped
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._state = WriterState.NEW
        self._submitted = 0
        self._accepted = 0
        self._written_records = 0
        self._written_rows: Counter[str] = Counter(dict.fromkeys(TABLES, 0))
        self._dropped: Counter[DropReason] = Counter(dict.fromkeys(DROP_REASONS, 0))
        self._batches = 0
        self._retries = 0
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._writing_since: float | None = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def state(self) -> WriterState:
        return self._state

    async def start(self) -> None:
        if self._state is not WriterState.NEW:
            raise WriterStateError(f"cannot start a writer that is {self._state.value}")
        self._hash_key = load_hash_key(self._config)  # may create its file: at start
        self._task = asyncio.create_task(self._run(), name="understudy-score-writer")
        if self._config.retention_days > 0:
            self._prune_task = asyncio.create_task(self._prune_periodically(),
                                                   name="understudy-store-pruner")
        self._state = WriterState.RUNNING

    @property
    def held(self) -> bool:
        """True while writes wait for ``release()`` (rule 6)."""
        return not self._released.is_set()

    def release(self) -> None:
        """Let writing begin (rule 6); a no-op for a writer not held."""
        self._released.set()
        self._wake.set()

    async def close(self) -> None:
        """Stop accepting, write what is held within ``close_timeout_s``, drop the rest."""
        if self._state is WriterState.NEW:
            self._state = WriterState.CLOSED
        if self._state is WriterState.CLOSED:
            return
        task = self._task
        assert task is not None
        if self._state is WriterState.RUNNING:
            self._state = WriterState.CLOSING
            self._wake.set()
        if self._prune_task is not None:  # a batch cut short rolls back; the next pass redoes it
            self._prune_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prune_task
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), self._config.close_timeout_s)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        lost = self._held + len(self._queue)
        if lost:
            log.warning("score writer closed with %d records unwritten", lost)
            self._dropped["store_unready" if self.held else "close_timeout"] += lost
            self._held = 0
            self._queue.clear()
            self._queued_rows = self._queued_text = 0
        self._state = WriterState.CLOSED

    async def __aenter__(self) -> ScoreWriter:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- the caller's side -----------------------------------------------------------

    def submit(self, exchange: Exchange, scores: Sequence[ScoreLike] = (), *,
               prompt: bytes | str | None = None) -> bool:
        """Queue ``exchange`` and ``scores`` for writing; never awaits, never blocks.

        ``prompt`` (the request body) is hashed into ``exchanges.prompt_hash`` and kept
        as text only with ``store_prompts``. Returns False, counted with its reason, when
        the record is refused.
        """
        self._submitted += 1
        if self._state is not WriterState.RUNNING or self._task is None or self._task.done():
            self._dropped["not_running"] += 1
            return False
        config = self._config
        try:
            record = build_record(exchange, scores, prompt=prompt,
                                  store_prompts=config.store_prompts,
                                  store_answers=config.store_answers,
                                  queued_at=time.monotonic(), hash_key=self._hash_key,
                                  store_session_keys=config.store_session_keys)
        except InvalidRecord as exc:
            self._dropped["invalid"] += 1
            self._note_error(f"invalid record: {exc}")
            return False
        if self._queued_rows + record.rows > config.queue_rows:
            self._dropped["queue_full"] += 1
            return False
        if record.text_chars and self._queued_text + record.text_chars > config.queue_text_chars:
            self._dropped["queue_text"] += 1
            return False
        self._queue.append(record)
        self._queued_rows += record.rows
        self._queued_text += record.text_chars
        self._accepted += 1
        if len(self._queue) == 1 or self._queued_rows >= config.batch_rows:
            self._wake.set()
        return True

    @property
    def stats(self) -> WriterStats:
        return WriterStats(
            state=self._state,
            submitted=self._submitted,
            accepted=self._accepted,
            written_records=self._written_records,
            written_rows=MappingProxyType(dict(self._written_rows)),
            dropped=MappingProxyType(dict(self._dropped)),
            batches=self._batches,
            retries=self._retries,
            queued_records=len(self._queue),
            queued_rows=self._queued_rows,
            held_records=self._held,
            last_error=self._last_error,
            last_error_at=self._last_error_at,
            writing_since=self._writing_since,
            pruned_exchanges=self._pruned_exchanges,
            prune_passes=self._prune_passes,
        )

    # -- retention (rule 8) ----------------------------------------------------------

    async def prune(self, now: datetime | None = None) -> Pruned:
        """One pass: delete what is older than ``retention_days`` before ``now`` (none
        with ``retention_days`` 0).

        Runs beside the writing (each batch under the writer's lock), stops between
        batches once the writer closes; raises the store's errors (``StoreError``).
        """
        if self._state is not WriterState.RUNNING:
            raise WriterStateError(f"cannot prune with a writer that is {self._state.value}")
        if not self._config.retention_days:  # 0: kept forever
            return Pruned()
        cutoff = retention_cutoff(self._config.retention_days, now)

        def counted(batch: Pruned) -> None:
            self._pruned_exchanges += batch.exchanges

        pruned = await prune_store(
            self._engine, cutoff, batch=self._config.prune_batch_exchanges,
            lock=self._store_lock, should_stop=lambda: self._state is not WriterState.RUNNING,
            on_batch=counted)
        self._prune_passes += 1
        log.info("store pruned: %d exchanges, %d observations, %d scores, %d traffic counts "
                 "older than %s in %d batches, %.2f s (longest batch %.3f s)",
                 pruned.exchanges, pruned.observations, pruned.scores, pruned.traffic_counts,
                 cutoff.astimezone(UTC).isoformat(timespec="seconds"), pruned.batches,
                 pruned.seconds, pruned.longest_batch_s)
        return pruned

    async def _prune_periodically(self) -> None:
        await self._released.wait()  # rule 6: nothing before the schema is current
        interval = self._config.prune_interval_s
        delay = interval * random.uniform(0.5, 1.0)
        while True:
            await asyncio.sleep(delay)
            delay = interval
            try:
                await self.prune()
            except WriterStateError:  # closing (a StoreError too: caught first)
                return
            except StoreError as exc:  # unavailable or refused: the next pass tries again
                self._note_error(f"pruning: {exc}")
                log.warning("store pruning failed, next pass in %.0f s: %s", interval, exc)
            except Exception as exc:  # a bug: log it, never stop the writer
                log.exception("store pruning failed")
                self._note_error(f"pruning: {type(exc).__name__}: {exc}")

    # -- the background task ---------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._released.is_set():  # rule 6: hold until released or closing
                if self._state is not WriterState.RUNNING:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._queue:
                if self._state is not WriterState.RUNNING:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._state is WriterState.RUNNING and self._queued_rows < self._config.batch_rows:
                deadline = self._queue[0].queued_at + self._config.flush_interval_s
                if time.monotonic() < deadline:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(deadline - time.monotonic()):
                            await self._wake.wait()
                    continue
            batch = self._take_batch()
            self._held = len(batch)
            self._writing_since = time.time()
            try:
                await self._write(batch)
            except Exception as exc:  # a bug, not the database: never stop the writer
                log.exception("score writer dropped a batch")
                self._dropped["failed"] += self._held
                self._note_error(f"{type(exc).__name__}: {exc}")
            finally:
                self._writing_since = None
            self._held = 0

    def _take_batch(self) -> list[Record]:
        batch: list[Record] = []
        rows = 0
        limit = self._config.batch_rows
        queue = self._queue
        while queue and (not batch or rows + queue[0].rows <= limit):
            record = queue.popleft()
            batch.append(record)
            rows += record.rows
            self._queued_text -= record.text_chars
        self._queued_rows -= rows
        return batch

    async def _write(self, batch: list[Record]) -> None:
        """Write ``batch``, retrying while the database is unavailable."""
        delay = self._config.retry_base_s
        while True:
            try:
                async with self._store_lock:  # rule 8
                    with translate_store_errors():
                        written = await self._inserter.write(batch)
            except StoreUnavailable as exc:
                self._retries += 1
                self._note_error(str(exc))
                pause = delay * random.uniform(0.5, 1.0)  # jitter: replicas do not retry in step
                log.warning("store unavailable, retrying in %.2f s: %s", pause, exc)
                await asyncio.sleep(pause)
                delay = min(delay * 2, self._config.retry_max_s)
                continue
            except StoreRejected as exc:
                self._note_error(str(exc))
                self._inserter.forget_backends()
                if len(batch) == 1:
                    log.error("store rejected a record: %s", exc)
                    self._dropped["rejected"] += 1
                    self._held -= 1
                    return
                half = len(batch) // 2
                await self._write(batch[:half])
                await self._write(batch[half:])
                return
            self._batches += 1
            self._held -= len(batch)
            self._written_records += len(batch) - written.exchange_pruned
            self._written_rows.update(written.rows)
            if written.exchange_pruned:
                self._dropped["exchange_pruned"] += written.exchange_pruned
                log.info("store: %d records left out, their exchange pruned meanwhile",
                         written.exchange_pruned)
            return

    def _note_error(self, message: str) -> None:
        self._last_error = message
        self._last_error_at = time.time()
