"""Everything one gateway app holds, created at start and passed explicitly (no globals)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from evaluators import Observation
from gateway._config import GatewayConfig
from gateway._evaluation import Evaluation
from gateway._metrics import GatewayMetrics
from gateway._mirror import Mirror
from gateway._promotion import Operator
from gateway._routing import Routing, Upstreams

__all__ = ["GatewayState", "RecentObservations"]


class RecentObservations:
    """The last ``capacity`` primary observations, for tests and the admin view.

    The mirroring join replaces this as the consumer of observations; this stays the
    bounded record of what the primary did.
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[Observation] = deque(maxlen=capacity)

    def accept(self, observation: Observation) -> None:
        self._items.append(observation)

    def __len__(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[Observation]:
        return list(self._items)

    def find(self, request_id: str) -> Observation | None:
        return next((o for o in reversed(self._items) if o.request_id == request_id), None)


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    routing: Routing  # replaced whole, never mutated: the relay reads it once per request
    upstreams: Upstreams
    observations: RecentObservations
    mirror: Mirror
    evaluation: Evaluation | None  # None: exchanges go to a sink the caller gave
    operator: Operator
