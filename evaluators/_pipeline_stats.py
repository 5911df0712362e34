"""What the evaluation pipeline's children reported, summed over every child it has had.

A child reports its counters and its writer's in a :class:`Snapshot` (``_pipeline`` rule
2); a child that dies takes with it what it had not reported, and what its writer still
held counts as the writer's ``process_exit`` (``_pipeline`` rules 3 and 8).
:class:`ChildReports` keeps the current child's latest snapshot and the dead children's
totals; :class:`PipelineStats` is what the pipeline shows of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TypeVar

from evaluators._scoring_process import Snapshot
from evaluators.store._writer import DropReason, WriterState, WriterStats

__all__ = ["ChildReports", "PipelineStats"]

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class PipelineStats:
    accepted: int
    scored: int
    pending: int
    dropped: dict[str, int]
    restarts: int = 0
    """Children started to replace one that died (``_pipeline`` rule 8)."""
    batches: int = 0
    """Batches the children scored (``_pipeline`` rule 2)."""
    batch_size: int = 0
    """Exchanges in the batch the child took last (0 before the first)."""
    queue_depth: int = 0
    """Exchanges on the queue, not yet taken by the child (``pending`` also counts those
    it is scoring)."""


class ChildReports:
    """The current child's latest snapshot and the totals of the children that died."""

    def __init__(self) -> None:
        self._last: Snapshot | None = None
        self._writer_stats: WriterStats | None = None
        self._past_scored = 0
        self._past_batches = 0
        self._past_dropped: Counter[str] = Counter()
        self._past_writer: WriterStats | None = None

    @property
    def scored(self) -> int:
        return self._past_scored + (self._last.scored if self._last is not None else 0)

    @property
    def batches(self) -> int:
        return self._past_batches + (self._last.batches if self._last is not None else 0)

    @property
    def last_batch_size(self) -> int:
        return self._last.last_batch_size if self._last is not None else 0

    def dropped(self) -> Counter[str]:
        """The children's drops by reason (a new counter, the caller's to add to)."""
        dropped = Counter(self._past_dropped)
        dropped.update(self._last.dropped if self._last is not None else {})
        return dropped

    @property
    def writer_stats(self) -> WriterStats | None:
        """The children's ScoreWriters as they last reported, summed."""
        if self._past_writer is None or self._writer_stats is None:
            return self._writer_stats or self._past_writer
        return _sum_writer_stats(self._past_writer, self._writer_stats)

    def new_child(self) -> None:
        """A child is starting: it has reported nothing yet."""
        self._last = None
        self._writer_stats = None

    def report(self, snapshot: Snapshot) -> None:
        """The current child's latest snapshot."""
        self._last = snapshot
        writer = snapshot.writer
        self._writer_stats = replace(
            writer, written_rows=MappingProxyType(writer.written_rows),
            dropped=MappingProxyType(writer.dropped))

    def bury(self) -> None:
        """The current child died: fold its last report into the totals; what its writer
        still held is lost with it."""
        if self._last is not None:
            self._past_scored += self._last.scored
            self._past_batches += self._last.batches
            self._past_dropped.update(self._last.dropped)
        writer = self._writer_stats
        if writer is not None:
            held = writer.queued_records + writer.held_records
            dropped: dict[DropReason, int] = dict(writer.dropped)
            dropped["process_exit"] = dropped.get("process_exit", 0) + held
            writer = replace(writer, state=WriterState.CLOSED, queued_records=0,
                             queued_rows=0, held_records=0,
                             dropped=MappingProxyType(dropped))
            self._past_writer = (writer if self._past_writer is None
                                 else _sum_writer_stats(self._past_writer, writer))
        self.new_child()


def _sum_writer_stats(a: WriterStats, b: WriterStats) -> WriterStats:
    """Counters summed; the state, queue and last error are ``b``'s (the newer writer)."""
    return replace(
        b, submitted=a.submitted + b.submitted, accepted=a.accepted + b.accepted,
        written_records=a.written_records + b.written_records,
        written_rows=MappingProxyType(_sum(a.written_rows, b.written_rows)),
        dropped=MappingProxyType(_sum(a.dropped, b.dropped)),
        batches=a.batches + b.batches, retries=a.retries + b.retries,
        pruned_exchanges=a.pruned_exchanges + b.pruned_exchanges,
        prune_passes=a.prune_passes + b.prune_passes,
        last_error=b.last_error or a.last_error,
        last_error_at=b.last_error_at or a.last_error_at, writing_since=b.writing_since)


def _sum(a: Mapping[K, int], b: Mapping[K, int]) -> dict[K, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in {*a, *b}}
