"""Everything one gateway app holds, created at start and passed explicitly (no globals)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from aiohttp import web

from evaluators import Capture, Observation, observe
from gateway._config import GatewayConfig
from gateway._metrics import GatewayMetrics
from gateway._mirror import Mirror
from gateway._promotion import Promoter
from gateway._routing import Routing, Upstreams
from gateway._scorekeeper import Scorekeeper
from gateway._scrape import BackendLoad
from gateway._sync import RoutingSync

__all__ = ["GatewayState", "RecentObservations"]


class RecentObservations:
    """The last ``capacity`` primary answers, for tests and operators to look at.

    It keeps the raw captures (bounded by ``[capture]``) and parses them only when read,
    so the relay pays nothing per event for it.
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[tuple[Capture, str, str, float]] = deque(maxlen=capacity)

    def accept(self, capture: Capture, request_id: str, route: str,
               wall_started: float) -> None:
        self._items.append((capture, request_id, route, wall_started))

    def __len__(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[Observation]:
        return [observe(c, request_id=rid, backend=c.backend, route=route, wall_started=wall)
                for c, rid, route, wall in list(self._items)]


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    sync: RoutingSync  # holds the routing: the one place it lives
    upstreams: Upstreams
    observations: RecentObservations
    mirror: Mirror
    scorekeeper: Scorekeeper | None  # None: exchanges go to a sink the caller gave
    promoter: Promoter
    in_flight: Counter[str] = field(default_factory=Counter)
    """Requests the relay has in flight per backend (the load each request is sent under);
    a backend's entry goes when its count returns to 0, so it holds the busy ones only."""

    backend_load: BackendLoad | None = None
    """Each backend's scraped ``vllm:num_requests_running`` (``_scrape.py``); None: off."""

    listeners: list[web.BaseRunner] = field(default_factory=list)
    """The runners serving this gateway: their ports are its own (no candidate there)."""

    @property
    def routing(self) -> Routing:
        """The routing now served (``RoutingSync.routing``): replaced whole, never mutated;
        the relay reads it once per request."""
        return self.sync.routing
