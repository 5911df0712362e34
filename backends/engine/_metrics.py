"""The engine server's Prometheus metrics: vLLM's series (``backends._vllm_metrics``) fed
from the engine's stats, and the server's own refusals."""

from __future__ import annotations

from typing import Literal

from prometheus_client import Counter

from backends._vllm_metrics import LABELS, RequestOutcome, VLLMSeries

from ._request import EngineStats

__all__ = ["EngineMetrics", "RefusalReason", "RequestOutcome"]

# Why a valid request was refused before reaching the engine (ours; vLLM has no such series).
RefusalReason = Literal["overloaded", "stopped", "failed"]
_REFUSALS: tuple[RefusalReason, ...] = ("overloaded", "stopped", "failed")


class EngineMetrics(VLLMSeries):
    """vLLM's series for one engine server, plus its refusals (ours; vLLM has none)."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        labels = self.labels
        refused = Counter(
            "understudy_engine_requests_refused", "Requests refused before the engine saw them.",
            (*LABELS, "reason"), registry=self.registry,
        )  # fmt: skip
        self._refusals = {reason: refused.labels(**labels, reason=reason) for reason in _REFUSALS}
        self._seen_queries = 0
        self._seen_hits = 0

    def observe_stats(self, stats: EngineStats) -> None:
        """Gauges from the engine's latest stats; the cache counters advance by the change."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv.usage)
        if stats.kv.queries >= self._seen_queries:
            self.prefix_queries.inc(stats.kv.queries - self._seen_queries)
            self.prefix_hits.inc(max(0, stats.kv.hits - self._seen_hits))
        self._seen_queries, self._seen_hits = stats.kv.queries, stats.kv.hits

    def finished(self, outcome: RequestOutcome) -> None:
        self.count_outcome(outcome)

    def refused(self, reason: RefusalReason) -> None:
        self._refusals[reason].inc()
