"""Joiner: pairs each candidate's Observation with the primary's for the same request.

Rules (DESIGN.md invariants 2 and 7):
1. ``expect`` is called when a request is queued for a candidate. From then on the
   request ends in exactly one of: an Exchange handed to the sink, or a drop counted
   with a reason (``join_timeout``, ``budget``, ``sink_full``, ``shutdown``, or the
   candidate's own ``abandon``).
2. An observation that has to wait for its partner is charged to the MemoryBudget for
   as long as it waits; if the budget cannot hold it, the join is dropped (``budget``).
3. Entries older than ``timeout_s`` are swept by ``expire`` (called periodically).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from evaluators import EvaluationSink, Exchange, Observation
from gateway._budget import MemoryBudget
from gateway._metrics import MirrorDropReason

__all__ = ["Joiner", "observation_charge"]

# Bookkeeping charged per waiting observation on top of its text and timings.
OBSERVATION_OVERHEAD_BYTES = 1024
BYTES_PER_CHUNK_GAP = 32

DropCallback = Callable[[str, MirrorDropReason, int | None], None]
"""(candidate, reason, the request's prompt bytes)."""
JoinCallback = Callable[[Exchange], None]


def observation_charge(observation: Observation) -> int:
    text = len(observation.text) if observation.text else 0
    vectors = len(observation.embeddings.data) if observation.embeddings is not None else 0
    return (OBSERVATION_OVERHEAD_BYTES + text + vectors
            + BYTES_PER_CHUNK_GAP * len(observation.chunk_gaps_s))


@dataclass(slots=True)
class _Pending:
    created: float
    session_key: str
    route: str
    prompt_bytes: int | None = None
    turn_depth: int | None = None
    requested_choices: int | None = None
    json_requested: bool | None = None
    expected: set[str] = field(default_factory=set)
    primary: Observation | None = None
    primary_charge: int = 0
    waiting: dict[str, tuple[Observation, int]] = field(default_factory=dict)


class Joiner:
    def __init__(self, budget: MemoryBudget, sink: EvaluationSink, timeout_s: float,
                 on_drop: DropCallback, on_join: JoinCallback) -> None:
        self._budget = budget
        self._sink = sink
        self._timeout_s = timeout_s
        self._on_drop = on_drop
        self._on_join = on_join
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def expects(self, request_id: str) -> bool:
        return request_id in self._pending

    def expect(self, request_id: str, candidate: str, session_key: str, route: str,
               now: float, *, prompt_bytes: int | None = None,
               turn_depth: int | None = None, requested_choices: int | None = None,
               json_requested: bool | None = None) -> None:
        entry = self._pending.get(request_id)
        if entry is None:
            entry = self._pending[request_id] = _Pending(now, session_key, route,
                                                         prompt_bytes, turn_depth,
                                                         requested_choices, json_requested)
        entry.expected.add(candidate)

    def primary(self, observation: Observation) -> None:
        entry = self._pending.get(observation.request_id)
        if entry is None or entry.primary is not None:
            return
        entry.primary = observation
        for candidate, (waiting, charge) in list(entry.waiting.items()):
            del entry.waiting[candidate]
            self._budget.release(charge)
            self._emit(entry, observation.request_id, candidate, waiting)
        if entry.expected:
            charge = observation_charge(observation)
            if self._budget.charge(charge):
                entry.primary_charge = charge
            else:
                self._drop_entry(observation.request_id, entry, "budget")
                return
        self._retire_if_done(observation.request_id, entry)

    def candidate(self, candidate: str, observation: Observation) -> None:
        entry = self._pending.get(observation.request_id)
        if entry is None or candidate not in entry.expected:
            return
        if entry.primary is not None:
            entry.expected.discard(candidate)
            self._emit(entry, observation.request_id, candidate, observation)
            self._retire_if_done(observation.request_id, entry)
            return
        charge = observation_charge(observation)
        if not self._budget.charge(charge):
            entry.expected.discard(candidate)
            self._on_drop(candidate, "budget", entry.prompt_bytes)
            self._retire_if_done(observation.request_id, entry)
            return
        entry.waiting[candidate] = (observation, charge)

    def abandon(self, request_id: str, candidate: str, reason: MirrorDropReason) -> None:
        entry = self._pending.get(request_id)
        if entry is None or candidate not in entry.expected:
            return
        entry.expected.discard(candidate)
        if candidate in entry.waiting:
            self._budget.release(entry.waiting.pop(candidate)[1])
        self._on_drop(candidate, reason, entry.prompt_bytes)
        self._retire_if_done(request_id, entry)

    def expire(self, now: float) -> int:
        stale = [rid for rid, e in self._pending.items() if now - e.created > self._timeout_s]
        for request_id in stale:
            self._drop_entry(request_id, self._pending[request_id], "join_timeout")
        return len(stale)

    def close(self) -> None:
        for request_id, entry in list(self._pending.items()):
            self._drop_entry(request_id, entry, "shutdown")

    def _emit(self, entry: _Pending, request_id: str, candidate: str,
              observation: Observation) -> None:
        entry.expected.discard(candidate)
        assert entry.primary is not None
        exchange = Exchange(request_id, entry.session_key, entry.route, candidate,
                            entry.primary, observation, turn_depth=entry.turn_depth,
                            prompt_bytes=entry.prompt_bytes,
                            requested_choices=entry.requested_choices,
                            json_requested=entry.json_requested)
        if self._sink.submit(exchange):
            self._on_join(exchange)
        else:
            self._on_drop(candidate, "sink_full", entry.prompt_bytes)

    def _retire_if_done(self, request_id: str, entry: _Pending) -> None:
        if entry.expected:
            return
        if entry.primary_charge:
            self._budget.release(entry.primary_charge)
        for _, charge in entry.waiting.values():
            self._budget.release(charge)
        del self._pending[request_id]

    def _drop_entry(self, request_id: str, entry: _Pending,
                    reason: MirrorDropReason) -> None:
        for candidate in entry.expected:
            self._on_drop(candidate, reason, entry.prompt_bytes)
        entry.expected.clear()
        self._retire_if_done(request_id, entry)
