"""Every Prometheus metric the gateway exports, in one place.

Label sets are bounded: ``route`` is one of ROUTES, ``status`` an HTTP status code,
``kind`` one of the UpstreamErrorKind literals. Each app owns its registry (no globals),
so several gateways in one process (tests) do not collide.
"""

from __future__ import annotations

from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ROUTES", "GatewayMetrics", "Route", "route_of"]

Route = Literal[
    "chat_completions", "completions", "embeddings", "models", "other", "health", "metrics"
]
ROUTES: Final = ("chat_completions", "completions", "embeddings", "models", "other")

_ROUTE_BY_PATH: Final[dict[str, Route]] = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/models": "models",
}

LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)


def route_of(path: str) -> Route:
    return _ROUTE_BY_PATH.get(path.rstrip("/"), "other")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "understudy_requests", "Requests answered, by route and status.",
            ["route", "status"], registry=r,
        )
        self.in_flight = Gauge(
            "understudy_requests_in_flight", "Requests being relayed now.", registry=r
        )
        self.ttft = Histogram(
            "understudy_primary_ttft_seconds",
            "Time from request to the first body chunk of the primary's answer.",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "understudy_primary_e2e_seconds", "Time from request to the end of the answer.",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.upstream_errors = Counter(
            "understudy_upstream_errors", "Failures talking to an upstream, by kind.",
            ["upstream", "kind"], registry=r,
        )
        self.rejected = Counter(
            "understudy_requests_rejected", "Requests refused before forwarding, by reason.",
            ["reason"], registry=r,
        )

        # -- mirroring (label ``candidate`` is bounded by the configured candidates) --
        self.mirror_queued = Counter(
            "understudy_mirror_queued", "Requests queued for a candidate.",
            ["candidate"], registry=r,
        )
        self.mirror_dropped = Counter(
            "understudy_mirror_dropped",
            "Requests not mirrored or not evaluated, by candidate and reason.",
            ["candidate", "reason"], registry=r,
        )
        self.mirror_completed = Counter(
            "understudy_mirror_completed", "Candidate replays that answered 2xx.",
            ["candidate"], registry=r,
        )
        self.mirror_failed = Counter(
            "understudy_mirror_failed", "Candidate replays that failed, by kind.",
            ["candidate", "kind"], registry=r,
        )
        self.mirror_joined = Counter(
            "understudy_mirror_joined",
            "Candidate observations joined with the primary's and handed to evaluation.",
            ["candidate"], registry=r,
        )
        self.buffer_items = Gauge(
            "understudy_mirror_buffer_items", "Requests queued per candidate.",
            ["candidate"], registry=r,
        )
        self.buffer_bytes = Gauge(
            "understudy_mirror_buffer_bytes", "Payload bytes queued per candidate.",
            ["candidate"], registry=r,
        )
        self.budget_used = Gauge(
            "understudy_memory_budget_used_bytes", "Bytes held for mirroring and evaluation.",
            registry=r,
        )
        self.budget_limit = Gauge(
            "understudy_memory_budget_limit_bytes", "The process-wide mirroring budget.",
            registry=r,
        )
        self.candidate_ttft = Histogram(
            "understudy_candidate_ttft_seconds", "Candidate time to first body chunk.",
            ["candidate"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.candidate_e2e = Histogram(
            "understudy_candidate_e2e_seconds", "Candidate end-to-end time.",
            ["candidate"], buckets=LATENCY_BUCKETS, registry=r,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
