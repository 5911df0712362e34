"""An Exchange: one mirrored request, as the primary and one candidate answered it.

The gateway joins the two Observations and hands the pair to an :class:`EvaluationSink`.
A sink's ``submit`` never blocks: it takes the exchange or says no, and the caller
counts the refusal (``reason=sink_full``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from evaluators._observation import Observation

__all__ = ["EvaluationSink", "Exchange", "MemorySink"]


@dataclass(frozen=True, slots=True)
class Exchange:
    """``turn_depth``: assistant messages before the request's last (chat; None for other
    routes); ``prompt_bytes``: the size of the request body the gateway forwarded."""

    request_id: str
    session_key: str
    route: str
    candidate: str
    primary: Observation
    candidate_observation: Observation
    turn_depth: int | None = None
    prompt_bytes: int | None = None


class EvaluationSink(Protocol):
    def submit(self, exchange: Exchange) -> bool:
        """Take ``exchange`` without blocking; False if it had to be refused."""
        ...


class MemorySink:
    """A bounded in-memory sink: keeps the newest exchanges, refuses none.

    When full, the oldest exchange is evicted and counted in ``evicted``.
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[Exchange] = deque(maxlen=capacity)
        self.received = 0
        self.evicted = 0

    def submit(self, exchange: Exchange) -> bool:
        if self._items.maxlen is not None and len(self._items) == self._items.maxlen:
            self.evicted += 1
        self._items.append(exchange)
        self.received += 1
        return True

    def __len__(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[Exchange]:
        return list(self._items)
