"""The engine server's Prometheus metrics: vLLM's series (``backends.openai_wire``) fed
from the engine's stats, and the server's own: refusals, the KV codec it serves, and the KV blocks
it pulled from other nodes, served to them and retains for them (disaggregated roles)."""

from __future__ import annotations

from typing import Literal, get_args

from prometheus_client import Gauge

from backends.openai_wire import LABELS, RequestOutcome, VLLMSeries

from ._request import EngineStats

__all__ = ["PULL_OUTCOMES", "EngineMetrics", "PullOutcome", "RefusalReason", "RequestOutcome"]

# Why a valid request was refused before reaching the engine (ours; vLLM has no such series).
RefusalReason = Literal["overloaded", "stopped", "failed"]
_REFUSALS: tuple[RefusalReason, ...] = get_args(RefusalReason)
# How a pull of KV blocks from another node ended; anything but "ok" means recompute
# ("below_threshold": too few blocks were missing to be worth a transfer; "busy": the owner
# was answering as many pulls as it takes at once; "untrusted": the named owner is not one of
# this node's KV peers).
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
    "busy",
    "untrusted",
    "below_threshold",
]
PULL_OUTCOMES: tuple[PullOutcome, ...] = get_args(PullOutcome)
_PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineMetrics(VLLMSeries):
    """vLLM's series for one engine server, plus its refusals (ours; vLLM has none)."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._refusals = self._counters_by(
            "understudy_engine_requests_refused", "Requests refused before the engine saw them.",
            "reason", _REFUSALS,
        )  # fmt: skip
        self._pulls = self._counters_by(
            "understudy_kv_pulls", "Pulls of KV blocks from another node, by outcome.",
            "outcome", PULL_OUTCOMES,
        )  # fmt: skip
        self.pull_seconds = self._histogram(
            "understudy_kv_pull_seconds", "Time to pull and import KV blocks (successful pulls).",
            _PULL_BUCKETS,
        )  # fmt: skip
        self.pulled_blocks = self._counter(
            "understudy_kv_pulled_blocks", "KV blocks pulled from other nodes."
        )
        self.pulled_bytes = self._counter(
            "understudy_kv_pulled_bytes", "Bytes of KV blocks pulled from other nodes."
        )
        self.served_blocks = self._counter(
            "understudy_kv_served_blocks", "KV blocks sent to other nodes."
        )
        self.serves_cut = self._counter(
            "understudy_kv_serves_cut",
            "Pulls of this node's KV cut because the puller did not take them in time.",
        )
        self.serves_refused = self._counter(
            "understudy_kv_serves_refused",
            "Pulls of this node's KV refused because it was answering its bound of pulls.",
        )
        self.retained_blocks = self._gauge(
            "understudy_kv_retained_blocks", "KV blocks held for other nodes to pull."
        )
        self.kv_bytes_per_token = self._gauge(
            "understudy_kv_bytes_per_token",
            "True bytes of KV per cached token (all layers, K and V) under the engine's codec.",
        )
        self.decoded_hits = self._counter(
            "understudy_kv_decoded_cache_hits",
            "Reads of one layer of a KV block served by the decoded-block cache (codec engines).",
        )
        self.decoded_misses = self._counter(
            "understudy_kv_decoded_cache_misses",
            "Reads of one layer of a KV block decoded again from its codes (codec engines).",
        )
        self.decoded_bytes = self._gauge(
            "understudy_kv_decoded_cache_bytes",
            "Bytes of decoded KV blocks held by the decoded-block cache (codec engines).",
        )
        self.decoded_capacity = self._gauge(
            "understudy_kv_decoded_cache_capacity_bytes",
            "The bound of the decoded-block cache in bytes (codec engines).",
        )
        self._kv_codec = Gauge(
            "understudy_engine_kv_codec_info",
            "The KV codec this engine serves (1): its name (a mixed plan's is mixed-<digest>) "
            "and the file name of its --kv-plan ('' without one).",
            (*LABELS, "codec", "plan"),
            registry=self.registry,
        )
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_decoded = (0, 0)

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
        cache = stats.decoded_cache
        if cache is not None:
            hits, misses = self._seen_decoded
            self.decoded_hits.inc(max(0, cache.hits - hits))
            self.decoded_misses.inc(max(0, cache.misses - misses))
            self._seen_decoded = (cache.hits, cache.misses)
            self.decoded_bytes.set(cache.bytes)
            self.decoded_capacity.set(cache.capacity * cache.entry_bytes)

    def serves_kv_codec(self, codec: str, plan: str) -> None:
        """Name the one codec this engine serves (one series: its label set is bounded by the
        server, which serves one codec for its whole life)."""
        self._kv_codec.labels(**self.labels, codec=codec, plan=plan).set(1)

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
