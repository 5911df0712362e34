"""The Prometheus series vLLM's OpenAI server exports, named and bucketed as vLLM does.

The simulator and the reference engine both export them (``metrics_response``), so the gateway
and its evaluators read any backend the same way. Each app owns its ``CollectorRegistry``: several
backends in one process (a primary and candidates in a test) never share series. Label sets
are bounded: the one served model name, vLLM's ``engine="0"``, and four finish reasons.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, get_args

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["LABELS", "RequestOutcome", "VLLMSeries", "metrics_response"]

RequestOutcome = Literal["stop", "length", "abort", "error"]

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
LABELS = ("model_name", "engine")
_ENGINE = "0"


class VLLMSeries:
    """vLLM-named series for one backend app, in a registry of its own."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model, "engine": _ENGINE}
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS
        )
        self.running = self._gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = self._gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 means full.")
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Generation tokens processed."
        )
        self._outcomes = self._counters_by(
            "vllm:request_success", "Finished requests by finish reason.",
            "finished_reason", get_args(RequestOutcome),
        )  # fmt: skip
        self.waiting.set(0)

    # One series each, labelled with this backend's model and engine (subclasses add theirs).

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, LABELS, registry=self.registry).labels(**self.labels)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, LABELS, registry=self.registry).labels(**self.labels)

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        histogram = Histogram(name, documentation, LABELS, registry=self.registry, buckets=buckets)
        return histogram.labels(**self.labels)

    def _counters_by(
        self, name: str, documentation: str, label: str, values: Iterable[str]
    ) -> dict[str, Counter]:
        """A counter with one more label, every value of it created up front (bounded set)."""
        counter = Counter(name, documentation, (*LABELS, label), registry=self.registry)
        return {value: counter.labels(**self.labels, **{label: value}) for value in values}

    def count_outcome(self, outcome: RequestOutcome) -> None:
        self._outcomes[outcome].inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """``GET /metrics``: the registry in Prometheus' text format."""
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
