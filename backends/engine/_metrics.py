"""The engine server's Prometheus metrics, named and bucketed as vLLM names them.

Each app owns its `CollectorRegistry`, so several engine servers in one process (a primary and
a candidate in a test) never share series.  Label sets are bounded: the served model name,
vLLM's ``engine="0"``, and the finish reasons below.
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ._request import EngineStats

__all__ = ["EngineMetrics", "RefusalReason", "RequestOutcome"]

RequestOutcome = Literal["stop", "length", "abort", "error"]
_OUTCOMES: tuple[RequestOutcome, ...] = ("stop", "length", "abort", "error")
# Why a valid request was refused before reaching the engine (ours; vLLM has no such series).
RefusalReason = Literal["overloaded", "stopped", "failed"]
_REFUSALS: tuple[RefusalReason, ...] = ("overloaded", "stopped", "failed")

# vLLM's own bucket boundaries (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_LABELS = ("model_name", "engine")
_ENGINE = "0"


class EngineMetrics:
    """vLLM-named series for one engine server, in a registry of its own."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model, "engine": _ENGINE}
        reg = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.",
            _LABELS, registry=reg, buckets=_TTFT_BUCKETS,
        ).labels(**labels)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.",
            _LABELS, registry=reg, buckets=_ITL_BUCKETS,
        ).labels(**labels)  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.",
            _LABELS, registry=reg, buckets=_E2E_BUCKETS,
        ).labels(**labels)  # fmt: skip
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the engine's running batch.",
            _LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
            _LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage, 1 means full.", _LABELS, registry=reg
        ).labels(**labels)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            _LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            _LABELS, registry=reg,
        ).labels(**labels)  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", _LABELS, registry=reg
        ).labels(**labels)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", _LABELS, registry=reg
        ).labels(**labels)
        success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            (*_LABELS, "finished_reason"), registry=reg,
        )  # fmt: skip
        self._outcomes = {
            reason: success.labels(**labels, finished_reason=reason) for reason in _OUTCOMES
        }
        refused = Counter(
            "understudy_engine_requests_refused", "Requests refused before the engine saw them.",
            (*_LABELS, "reason"), registry=reg,
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
        self._outcomes[outcome].inc()

    def refused(self, reason: RefusalReason) -> None:
        self._refusals[reason].inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
