"""Every Prometheus metric the gateway exports, in one place.

Label sets are bounded: ``route`` is one of ROUTES, ``status`` one of STATUS_LABELS (a
backend's status line may carry any three digits: ``status_label``), ``kind`` one of the
UpstreamErrorKind literals. Each app owns its registry (no globals), so several gateways
in one process (tests) do not collide.

A backend's name (labels ``candidate``, ``backend``, ``upstream``) is bounded by the backends
the gateway knows now, not by every backend it ever knew: an operator may add and remove
candidates at runtime without end. Rules:
1. A backend's series are exported while it is a candidate or a backend of the routing
   served (primary, rollback target, canary): ``Promoter`` rule 8 decides, and calls
   ``retire_backend`` when it is neither, ``admit_backend`` when it is one again.
2. ``retire_backend`` removes every series of that name at once (a counter of a removed
   label set is gone, as Prometheus expects of a deleted object), and until it is admitted
   again a series of that name is never created: what still counts for it (a mirrored
   request's join completing after the removal, a scrape or a live request in flight) goes
   nowhere. So a removal that races with work in flight cannot bring its series back, and
   a candidate added again under the same name starts from zero.
3. The retired names kept are the last ``MAX_RETIRED_BACKENDS``: a name forgotten beyond
   them was removed that many removals ago, long after anything in flight for it ended
   (a join waits ``join_timeout_s``, a replay or a live request its timeouts).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Iterator
from http import HTTPStatus
from typing import Final, Literal, Self, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from evaluators import PipelineState, PipelineStats
from evaluators.store import WriterStats
from gateway._buffer import BufferRefusal
from gateway._config import MirroredRoute
from gateway._scorekeeper import StoreStatus

__all__ = [
    "MAX_RETIRED_BACKENDS",
    "ROUTES",
    "STATUS_LABELS",
    "EvaluationCollector",
    "GatewayMetrics",
    "MirrorDropReason",
    "RecordDropReason",
    "Route",
    "RouteSeries",
    "route_of",
    "status_label",
]

Route = Literal[MirroredRoute, "health", "metrics"]
ROUTES: Final[tuple[MirroredRoute, ...]] = get_args(MirroredRoute)
"""The routes a request can be forwarded on (the gateway's own are not)."""

MirrorDropReason = Literal[
    BufferRefusal, "route", "canary", "not_sampled", "paused", "shutdown", "removed",
    "internal", "join_timeout", "sink_full", "duplicate_id",
]
"""Why a request was not mirrored to, or not evaluated for, a candidate: the ``reason``
label of ``understudy_mirror_dropped``."""

RecordDropReason = Literal["queue_full", "max_bytes", "not_json", "write_error", "shutdown"]
"""Why a request sampled for the ``[record]`` file was not written: the ``reason`` label of
``understudy_record_dropped``."""

_ROUTE_BY_PATH: Final[dict[str, Route]] = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/models": "models",
}

MAX_RETIRED_BACKENDS: Final = 1024
"""Rule 3: the retired backend names remembered, the oldest forgotten first."""

LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)


def route_of(path: str) -> Route:
    return _ROUTE_BY_PATH.get(path.rstrip("/"), "other")


_NAMED_STATUSES: Final = frozenset(int(s) for s in HTTPStatus if s >= 200) | {499}
"""Statuses counted as themselves: the registered ones, and 499 (the answer never came)."""
STATUS_LABELS: Final[frozenset[str]] = frozenset(
    {str(s) for s in _NAMED_STATUSES} | {"2xx", "3xx", "4xx", "5xx", "other"})
"""Every value of ``understudy_requests{status}``."""


def status_label(status: int) -> str:
    """``status`` as a bounded label: a named status itself, another in 200-599 by its
    class (a backend's 529 is "5xx"), the rest (a status line's 042 or 999) "other"."""
    if status in _NAMED_STATUSES:
        return str(status)
    return f"{status // 100}xx" if 200 <= status < 600 else "other"


class LatencyHistogram(Histogram):
    """A ``Histogram`` whose children count in plain Python numbers: the same exported
    series (``_bucket``, ``_count``, ``_sum``, ``_created``), without the lock per bucket
    and per sum that ``Histogram.observe`` takes (~2 µs a call; the relay observes two per
    request). No lock: every observation and every scrape runs on the event loop's thread.
    Exemplars are not kept (none is ever given).
    """

    def _metric_init(self) -> None:
        self._created = time.time()
        self._counts = [0] * len(self._upper_bounds)
        self._total = 0.0

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        # The first bucket whose bound is at least ``amount``, as Histogram's own loop.
        self._counts[bisect_left(self._upper_bounds, amount)] += 1
        self._total += amount

    def _child_samples(self) -> Iterable[Sample]:
        samples = []
        acc = 0.0
        for bound, count in zip(self._upper_bounds, self._counts, strict=True):
            acc += count
            le = floatToGoString(bound)  # type: ignore[no-untyped-call]
            samples.append(Sample("_bucket", {"le": le}, acc, None, None))
        samples.append(Sample("_count", {}, acc, None, None))
        if self._upper_bounds[0] >= 0:
            samples.append(Sample("_sum", {}, self._total, None, None))
        if prometheus_metrics._use_created:  # PROMETHEUS_DISABLE_CREATED_SERIES, as Histogram
            samples.append(Sample("_created", {}, self._created, None, None))
        return tuple(samples)


class _ByBackend(MetricWrapperBase):
    """A metric labelled by a backend's name whose retired names get no series (rule 2):
    the child ``labels`` hands out for one is dropped from the metric as it is made, so
    what is counted on it is exported nowhere. The check is one set lookup a call."""

    _retired: Collection[str] = frozenset()
    _backend_index = 0
    _backend_label = ""
    _label_names: tuple[str, ...] = ()

    def watch(self, retired: Collection[str], label_names: tuple[str, ...],
              backend_label: str) -> None:
        """Keep ``retired`` (the caller's, read on each call) for ``backend_label``."""
        self._retired = retired
        self._label_names = label_names
        self._backend_label = backend_label
        self._backend_index = label_names.index(backend_label)

    def labels(self, *labelvalues: object, **labelkwargs: object) -> Self:
        child = super().labels(*labelvalues, **labelkwargs)
        if self._retired:
            name = labelkwargs[self._backend_label] if labelkwargs \
                else labelvalues[self._backend_index]
            if str(name) in self._retired:
                self.remove(*(str(labelkwargs[n]) for n in self._label_names)
                            if labelkwargs else labelvalues)
        return child

    def forget(self, name: str) -> None:
        """Remove every series whose backend label is ``name``."""
        gone = {tuple(sample.labels[n] for n in self._label_names)
                for family in self.collect() for sample in family.samples
                if sample.labels.get(self._backend_label) == name}
        for values in gone:
            self.remove(*values)


class _BackendCounter(_ByBackend, Counter):
    pass


class _BackendGauge(_ByBackend, Gauge):
    pass


class _BackendLatency(_ByBackend, LatencyHistogram):
    pass


class RouteSeries:
    """One route's per-request series, their labelled children looked up once.

    ``labels()`` takes the metric's lock and builds a key on every call (2-3 µs; the relay
    records three series per request); a child kept here is a dict lookup. Never removed:
    the label sets are bounded (module docstring), and no series is ever cleared.
    """

    __slots__ = ("_answered", "_requests", "_route", "e2e", "ttft")

    def __init__(self, metrics: GatewayMetrics, route: Route) -> None:
        self._route = route
        self._requests = metrics.requests
        self._answered: dict[int, Counter] = {}
        self.ttft = metrics.ttft.labels(route)
        self.e2e = metrics.e2e.labels(route)

    def answered(self, status: int) -> Counter:
        """The ``understudy_requests{route, status}`` child (a status code, 499 for none;
        ``status_label``). Kept for named statuses only, so this dict is bounded too."""
        child = self._answered.get(status)
        if child is None:
            label = status_label(status)
            child = self._requests.labels(self._route, label)
            if label == str(status):
                self._answered[status] = child
        return child


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._retired: dict[str, None] = {}  # rules 2 and 3: a set in retirement order
        self._by_backend: list[_ByBackend] = []

        # One declaration each: name, help, then the label names (bounded: module docstring).
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def latency(name: str, doc: str, *labels: str) -> Histogram:
            return LatencyHistogram(name, doc, labels, buckets=LATENCY_BUCKETS,
                                    registry=self.registry)

        # Labelled by a backend's name, their first label: rules 1 and 2.
        def by_backend(metric: _ByBackend, labels: tuple[str, ...]) -> None:
            metric.watch(self._retired, labels, labels[0])
            self._by_backend.append(metric)

        def backend_counter(name: str, doc: str, *labels: str) -> Counter:
            metric = _BackendCounter(name, doc, labels, registry=self.registry)
            by_backend(metric, labels)
            return metric

        def backend_gauge(name: str, doc: str, *labels: str) -> Gauge:
            metric = _BackendGauge(name, doc, labels, registry=self.registry)
            by_backend(metric, labels)
            return metric

        def backend_latency(name: str, doc: str, *labels: str) -> Histogram:
            metric = _BackendLatency(name, doc, labels, buckets=LATENCY_BUCKETS,
                                     registry=self.registry)
            by_backend(metric, labels)
            return metric

        self.requests = counter("understudy_requests", "Requests answered, by route and status.",
                                "route", "status")
        self.relaying = 0
        """Requests being relayed now: a plain count, read by its gauge at scrape time (a
        gauge's inc and dec take its lock each: ~1.4 µs per request, timeit)."""
        self.in_flight = gauge("understudy_requests_in_flight", "Requests being relayed now.")
        self.in_flight.set_function(lambda: self.relaying)
        self.ttft = latency(
            "understudy_primary_ttft_seconds",
            "Time from request to the first body chunk of the primary's answer.", "route")
        self.e2e = latency("understudy_primary_e2e_seconds",
                           "Time from request to the end of the answer.", "route")
        self.upstream_errors = backend_counter("understudy_upstream_errors",
                                       "Failures talking to an upstream, by kind.",
                                       "upstream", "kind")
        self.usage_filter_oversized = counter(
            "understudy_usage_filter_oversized_events",
            "SSE events that outgrew MAX_EVENT_BYTES (64 KiB) before their end on a stream "
            "whose usage event the gateway filters out: passed on unheld, as they came.")
        self.connections_closed = counter(
            "understudy_connections_closed",
            "Client connections the gateway closed because a bound was exceeded, by reason "
            "(max_connections, max_connections_per_ip, header_timeout, keepalive_timeout, "
            "headers_too_large, uri_too_long, bad_request, http_version).", "reason")
        self.connections_open = gauge("understudy_connections_open",
                                      "Client connections admitted now.")
        self.event_loop_tasks = gauge(
            "understudy_event_loop_tasks",
            "asyncio tasks alive on the gateway's event loop (requests in flight, mirrored "
            "requests, background loops): flat under steady traffic, or something leaks.")
        self.rejected = counter("understudy_requests_rejected",
                                "Requests refused before forwarding, by reason.", "reason")

        # -- mirroring (label ``candidate``: the candidates there are now, rule 1) --
        self.mirror_queued = backend_counter("understudy_mirror_queued",
                                     "Requests queued for a candidate.", "candidate")
        self.mirror_dropped = backend_counter(
            "understudy_mirror_dropped",
            "Requests not mirrored or not evaluated, by candidate and reason.",
            "candidate", "reason")
        self.mirror_completed = backend_counter("understudy_mirror_completed",
                                        "Candidate replays that answered 2xx.", "candidate")
        self.mirror_failed = backend_counter("understudy_mirror_failed",
                                     "Candidate replays that failed, by kind.",
                                     "candidate", "kind")
        self.backend_scrapes = backend_counter(
            "understudy_backend_scrapes",
            "Scrapes of a backend's vllm:num_requests_running, by outcome "
            "(ok, error, timeout, status, absent, too_large).", "backend", "outcome")
        self.mirror_joined = backend_counter(
            "understudy_mirror_joined",
            "Candidate observations joined with the primary's and handed to evaluation.",
            "candidate")
        self.mirror_truncated = backend_counter(
            "understudy_mirror_truncated",
            "Joined exchanges with an answer that outgrew [capture] max_bytes (its text "
            "lost, the exchange's quality not scored), by candidate and side (candidate, "
            "primary).", "candidate", "side")
        self.mirror_undecoded = counter(
            "understudy_mirror_undecoded",
            "Request bodies with a Content-Encoding the mirror could not read (forwarded and "
            "mirrored as sent, their session key, turn depth and record unknown), by reason "
            "(unsupported, too_large, corrupt).", "reason")
        self.buffer_items = backend_gauge("understudy_mirror_buffer_items",
                                  "Requests queued per candidate.", "candidate")
        self.buffer_bytes = backend_gauge("understudy_mirror_buffer_bytes",
                                  "Payload bytes queued per candidate.", "candidate")
        self.budget_used = gauge("understudy_memory_budget_used_bytes",
                                 "Bytes held for mirroring and evaluation.")
        self.budget_limit = gauge("understudy_memory_budget_limit_bytes",
                                  "The process-wide mirroring budget.")
        self.candidate_ttft = backend_latency("understudy_candidate_ttft_seconds",
                                      "Candidate time to first body chunk.", "candidate")
        self.candidate_e2e = backend_latency("understudy_candidate_e2e_seconds",
                                     "Candidate end-to-end time.", "candidate")

        # -- routing -------------------------------------------------------------------
        self.routing_version = gauge("understudy_routing_version",
                                     "Version of the routing this replica serves.")
        self.canary_percent = gauge("understudy_canary_percent",
                                    "Share of sessions served by the canary (0: none).")
        self.admin_actions = counter("understudy_admin_actions",
                                     "Promotions, rollbacks and canary steps, by action.",
                                     "action")
        self.live_without_settings = backend_counter(
            "understudy_live_backend_without_settings",
            "Pools this replica opened for a live backend (primary, rollback target, canary) "
            "it has no settings for, by backend: sent no API key and no client credentials "
            "(a routing adopted from a replica that has that candidate; a candidate added at "
            "runtime, promoted, then this replica restarted).", "backend")
        self.admin_store_failures = counter(
            "understudy_admin_store_failures",
            "Admin changes refused with 503, unapplied, because the store could not take "
            "them, by reason (timeout, unavailable, rejected).", "reason")
        self.record_written = counter("understudy_record_written",
                                      "Requests written to the [record] file.")
        self.record_dropped = counter(
            "understudy_record_dropped",
            "Requests sampled for the [record] file but not written, by reason (queue_full, "
            "max_bytes, not_json, write_error, shutdown).", "reason")

        self._by_route: dict[Route, RouteSeries] = {}

    def route(self, route: Route) -> RouteSeries:
        """The per-request series of ``route`` (kept: ``RouteSeries``)."""
        series = self._by_route.get(route)
        if series is None:
            series = self._by_route[route] = RouteSeries(self, route)
        return series

    def retire_backend(self, name: str) -> None:
        """Rule 2: remove every series of backend ``name``, and make none until it is
        admitted again."""
        self._retired.pop(name, None)
        self._retired[name] = None
        while len(self._retired) > MAX_RETIRED_BACKENDS:
            del self._retired[next(iter(self._retired))]
        for metric in self._by_backend:
            metric.forget(name)

    def admit_backend(self, name: str) -> None:
        """Rule 1: ``name`` is a candidate or a live backend (again): it may have series."""
        self._retired.pop(name, None)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EvaluationCollector(Collector):
    """Exports the evaluation pipeline's and the store writer's own counters at scrape time.

    They are counted where they happen (in ``evaluators``, which knows nothing of
    Prometheus); this reads their snapshots. Reason labels are the writers' fixed sets.
    """

    def __init__(self, pipeline: Callable[[], PipelineStats | None],
                 writer: Callable[[], WriterStats | None],
                 health: Callable[[], tuple[StoreStatus, PipelineState | None]] | None = None,
                 ) -> None:
        self._pipeline = pipeline
        self._writer = writer
        self._health = health

    def collect(self) -> Iterator[Metric]:
        if self._health is not None:
            store, scoring = self._health()
            yield GaugeMetricFamily("understudy_store_up",
                                    "1 once the store was reached and migrated, else 0.",
                                    value=1 if store.state == "up" else 0)
            yield CounterMetricFamily("understudy_store_connect_failures",
                                      "Failed attempts to reach the store (migrate, register, "
                                      "load the routing).", value=store.connect_failures)
            yield GaugeMetricFamily("understudy_scoring_up",
                                    "1 while the scoring child runs, else 0.",
                                    value=1 if scoring is PipelineState.RUNNING else 0)
        pipeline = self._pipeline()
        if pipeline is not None:
            yield CounterMetricFamily("understudy_scoring_restarts",
                                      "Scoring children started to replace one that died.",
                                      value=pipeline.restarts)
            yield CounterMetricFamily("understudy_evaluation_scored",
                                      "Exchanges scored.", value=pipeline.scored)
            yield CounterMetricFamily("understudy_scoring_exchanges",
                                      "Exchanges the scoring child scored (its throughput: "
                                      "rate() of this).", value=pipeline.scored)
            yield CounterMetricFamily("understudy_scoring_batches",
                                      "Batches the scoring child scored.",
                                      value=pipeline.batches)
            yield GaugeMetricFamily("understudy_scoring_batch_size",
                                    "Exchanges in the batch the scoring child took last.",
                                    value=pipeline.batch_size)
            yield GaugeMetricFamily("understudy_scoring_queue_depth",
                                    "Exchanges queued for the scoring child, not yet taken.",
                                    value=pipeline.queue_depth)
            yield GaugeMetricFamily("understudy_evaluation_pending",
                                    "Exchanges waiting to be scored.", value=pipeline.pending)
            dropped = CounterMetricFamily("understudy_evaluation_dropped",
                                          "Exchanges not scored, by reason.", labels=["reason"])
            for reason, count in pipeline.dropped.items():
                dropped.add_metric([reason], count)
            yield dropped
        writer = self._writer()
        if writer is not None:
            rows = CounterMetricFamily("understudy_store_written_rows",
                                       "Rows written to the store, by table.", labels=["table"])
            for table, count in writer.written_rows.items():
                rows.add_metric([table], count)
            yield rows
            dropped = CounterMetricFamily("understudy_store_dropped",
                                          "Records the store writer dropped, by reason.",
                                          labels=["reason"])
            for reason, count in writer.dropped.items():
                dropped.add_metric([reason], count)
            yield dropped
            yield CounterMetricFamily("understudy_store_pruned_exchanges",
                                      "Exchanges deleted by the store's retention bound "
                                      "(their observations and scores with them).",
                                      value=writer.pruned_exchanges)
            yield CounterMetricFamily("understudy_store_retries",
                                      "Batches retried after a database error.",
                                      value=writer.retries)
            yield GaugeMetricFamily("understudy_store_queued_rows",
                                    "Rows waiting to be written.", value=writer.queued_rows)
