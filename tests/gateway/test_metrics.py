"""The gateway's lock-free latency histogram exports what prometheus_client's own would.

``LatencyHistogram`` builds on ``Histogram``'s internals (its bounds, its child samples), which
a prometheus_client release may change: this test is what says so, by exporting the same
observations through both and comparing the text byte for byte (``_created`` aside: a time).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway._metrics import LATENCY_BUCKETS, LatencyHistogram


def _exported(kind: type[Histogram], observations: list[tuple[str, float]]) -> list[str]:
    registry = CollectorRegistry()
    histogram = kind("understudy_test_seconds", "A test latency.", ["route"],
                     buckets=LATENCY_BUCKETS, registry=registry)
    for route, amount in observations:
        histogram.labels(route).observe(amount)
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_latency_histogram_exports_what_histogram_exports() -> None:
    bounds = [bound for bound in LATENCY_BUCKETS if math.isfinite(bound)]
    observations = [("chat", 0.0), ("chat", 1e9), ("completions", 0.0042)]
    observations += [("chat", bound) for bound in bounds]  # each exactly on a bound: "le"
    observations += [("chat", math.nextafter(bound, math.inf)) for bound in bounds]
    observations += [("completions", 0.001 * k) for k in range(50)]
    exported = _exported(LatencyHistogram, observations)
    assert exported == _exported(Histogram, observations)
    assert any(line.startswith("understudy_test_seconds_bucket") for line in exported)


def test_latency_histogram_exports_created_like_histogram() -> None:
    def created_names(kind: type[Histogram]) -> list[str]:
        registry = CollectorRegistry()
        kind("understudy_test_seconds", "A test latency.", registry=registry).observe(0.1)
        text = generate_latest(registry).decode()
        return [line.split(" ")[0] for line in text.splitlines() if "_created" in line]

    assert created_names(LatencyHistogram) == created_names(Histogram)
