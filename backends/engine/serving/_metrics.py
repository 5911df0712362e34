"""The engine server's Prometheus metrics: vLLM's series (``backends.openai_wire``) fed
from the engine's stats, and the server's own: refusals, and the KV blocks it pulled from other
nodes, served to them and retains for them (disaggregated roles)."""

from __future__ import annotations

from typing import Literal, get_args

from prometheus_client import Counter, Gauge, Histogram

from backends.openai_wire import LABELS, RequestOutcome, VLLMSeries

from ._request import EngineStats

__all__ = ["PULL_OUTCOMES", "EngineMetrics", "PullOutcome", "RefusalReason", "RequestOutcome"]

# Why a valid request was refused before reaching the engine (ours; vLLM has no such series).
RefusalReason = Literal["overloaded", "stopped", "failed"]
_REFUSALS: tuple[RefusalReason, ...] = get_args(RefusalReason)
# How a pull of KV blocks from another node ended; anything but "ok" means recompute
# ("below_threshold": too few blocks were missing to be worth a transfer).
PullOutcome = Literal[
    "ok",
    "unknown_ticket",
    "checksum",
    "protocol",
    "connection",
    "timeout",
    "mismatch",
    "numerics",
    "codec",
    "no_room",
    "below_threshold",
]
PULL_OUTCOMES: tuple[PullOutcome, ...] = get_args(PullOutcome)
_PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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
        reg = self.registry
        pulls = Counter(
            "understudy_kv_pulls", "Pulls of KV blocks from another node, by outcome.",
            (*LABELS, "outcome"), registry=reg,
        )  # fmt: skip
        self._pulls = {o: pulls.labels(**labels, outcome=o) for o in PULL_OUTCOMES}
        self.pull_seconds = Histogram(
            "understudy_kv_pull_seconds", "Time to pull and import KV blocks (successful pulls).",
            LABELS, registry=reg, buckets=_PULL_BUCKETS,
        ).labels(**labels)  # fmt: skip
        self.pulled_blocks = Counter(
            "understudy_kv_pulled_blocks", "KV blocks pulled from other nodes.",
            LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self.pulled_bytes = Counter(
            "understudy_kv_pulled_bytes", "Bytes of KV blocks pulled from other nodes.",
            LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self.served_blocks = Counter(
            "understudy_kv_served_blocks", "KV blocks sent to other nodes.", LABELS, registry=reg
        ).labels(**labels)
        self.retained_blocks = Gauge(
            "understudy_kv_retained_blocks", "KV blocks held for other nodes to pull.",
            LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self.kv_bytes_per_token = Gauge(
            "understudy_kv_bytes_per_token",
            "True bytes of KV per cached token (all layers, K and V) under the engine's codec.",
            LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self._seen_queries = 0
        self._seen_hits = 0

    def observe_stats(self, stats: EngineStats) -> None:
        """Gauges from the engine's latest stats; the cache counters advance by the change."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv.usage)
        self.retained_blocks.set(stats.num_retained_blocks)
        self.kv_bytes_per_token.set(stats.kv_bytes_per_token)
        if stats.kv.queries >= self._seen_queries:
            self.prefix_queries.inc(stats.kv.queries - self._seen_queries)
            self.prefix_hits.inc(max(0, stats.kv.hits - self._seen_hits))
        self._seen_queries, self._seen_hits = stats.kv.queries, stats.kv.hits

    def finished(self, outcome: RequestOutcome) -> None:
        self.count_outcome(outcome)

    def refused(self, reason: RefusalReason) -> None:
        self._refusals[reason].inc()

    def pulled(
        self, outcome: PullOutcome, seconds: float = 0.0, blocks: int = 0, size: int = 0
    ) -> None:
        self._pulls[outcome].inc()
        if outcome == "ok":
            self.pull_seconds.observe(seconds)
            self.pulled_blocks.inc(blocks)
            self.pulled_bytes.inc(size)
