"""Per-backend scorers: reliability, latency, throughput (and its window), cost, cache."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from evaluators import Exchange, Observation, Usage
from evaluators._price import (
    CostModel,
    CostScorer,
    GpuHourPrice,
    TokenPrice,
    session_costs,
)
from evaluators._score import Score
from evaluators._scorers_timing import (
    CacheScorer,
    LatencyScorer,
    ReliabilityScorer,
    ThroughputScorer,
)
from evaluators._throughput import ThroughputWindow, output_tokens_per_s
from tests.evaluators.test_scorers import make_exchange, make_observation, only


def by_metric(scores: list[Score]) -> dict[str, Score]:
    return {s.metric: s for s in scores}


def test_reliability_is_known_for_every_answer() -> None:
    exchange = make_exchange(status=503)
    assert ReliabilityScorer().score(exchange) == [Score("reliability.success", 0.0, 1.0)]
    exchange = make_exchange(error="reset")
    assert ReliabilityScorer().score(exchange) == [Score("reliability.success", 0.0, 1.0)]


def test_latency_per_backend_and_ratios() -> None:
    primary = make_observation(ttft_s=0.5, e2e_s=2.0, chunk_gaps_s=(0.1, 0.1, 0.1, 0.1))
    exchange = make_exchange(primary, ttft_s=0.25, e2e_s=3.0,
                             chunk_gaps_s=(0.1, 0.2, 0.3, 0.4, 1.4))
    scores = by_metric(LatencyScorer().score(exchange))
    assert scores["latency.ttft_s"] == Score("latency.ttft_s", 0.25, 0.5)
    assert scores["latency.e2e_s"] == Score("latency.e2e_s", 3.0, 2.0)
    assert scores["latency.itl_mean_s"].candidate == pytest.approx(0.48)
    assert scores["latency.itl_mean_s"].primary == pytest.approx(0.1)
    # numpy's linear interpolation: 0.4 + 0.96 * (1.4 - 0.4)
    assert scores["latency.itl_p99_s"].candidate == pytest.approx(1.36)
    assert scores["latency.ttft_ratio"] == Score("latency.ttft_ratio", 0.5, None)
    assert scores["latency.e2e_ratio"] == Score("latency.e2e_ratio", 1.5, None)


@pytest.mark.parametrize(("overrides", "unknown"), [
    ({"chunk_gaps_s": (0.1,)}, {"latency.itl_mean_s", "latency.itl_p99_s"}),
    ({"streamed": False, "chunk_gaps_s": (0.1, 0.1)},
     {"latency.ttft_s", "latency.itl_mean_s", "latency.itl_p99_s", "latency.ttft_ratio"}),
    ({"status": 500}, {"latency.ttft_s", "latency.itl_mean_s", "latency.itl_p99_s",
                       "latency.e2e_s", "latency.ttft_ratio", "latency.e2e_ratio"}),
    ({"ttft_s": None, "e2e_s": None, "chunk_gaps_s": ()},
     {"latency.ttft_s", "latency.itl_mean_s", "latency.itl_p99_s", "latency.e2e_s",
      "latency.ttft_ratio", "latency.e2e_ratio"}),
])
def test_latency_unknowns_of_the_candidate(overrides: dict[str, Any],
                                           unknown: set[str]) -> None:
    scores = LatencyScorer().score(make_exchange(**overrides))
    assert {s.metric for s in scores if s.candidate is None} == unknown
    assert all(s.primary is not None for s in scores
               if s.metric not in ("latency.ttft_ratio", "latency.e2e_ratio"))


def test_latency_ratio_over_a_zero_primary_is_unknown() -> None:
    scores = by_metric(LatencyScorer().score(make_exchange(make_observation(ttft_s=0.0))))
    assert scores["latency.ttft_ratio"].candidate is None


def test_output_rate_is_decode_rate_when_streamed() -> None:
    # 41 tokens: the first at 0.2 s, the other 40 in the next 0.8 s
    assert output_tokens_per_s(make_observation()) == pytest.approx(50.0)
    assert output_tokens_per_s(make_observation(streamed=False)) == pytest.approx(41.0)
    for overrides in ({"usage": None}, {"usage": Usage(prompt_tokens=3)},
                      {"usage": Usage(completion_tokens=1)}, {"ttft_s": None},
                      {"ttft_s": 1.0}, {"e2e_s": None}, {"status": 500},
                      {"streamed": False, "e2e_s": 0.0}):
        assert output_tokens_per_s(make_observation(**overrides)) is None, overrides


def test_throughput_scorer_reports_both_and_feeds_the_window() -> None:
    window = ThroughputWindow()
    exchange = make_exchange(usage=Usage(completion_tokens=81))
    score = only(ThroughputScorer(window).score(exchange))
    assert score.metric == "throughput.output_tps"
    assert (score.candidate, score.primary) == pytest.approx((100.0, 50.0))
    assert window.tokens_per_s("primary") == pytest.approx(41.0)
    assert window.tokens_per_s("cand") == pytest.approx(81.0)


def _finished(request_id: str, start: float, e2e: float, tokens: int,
              backend: str = "b") -> Observation:
    return make_observation(request_id=request_id, backend=backend, started_at=start,
                            e2e_s=e2e, usage=Usage(completion_tokens=tokens))


def test_window_counts_busy_time_once_for_concurrent_requests() -> None:
    window = ThroughputWindow(window_s=100.0)
    window.record(_finished("a", 0.0, 2.0, 100))  # [0, 2]
    window.record(_finished("b", 1.0, 2.0, 100))  # [1, 3]  overlaps a
    window.record(_finished("c", 10.0, 1.0, 100))  # [10, 11] after an idle gap
    assert window.tokens_per_s("b") == pytest.approx(300 / 4)
    assert window.tokens_per_s("b", at=3.0) == pytest.approx(200 / 3)
    assert window.tokens_per_s("other") is None


def test_window_records_a_request_once_and_skips_unusable_ones() -> None:
    window = ThroughputWindow()
    assert window.record(_finished("a", 0.0, 1.0, 10))
    assert not window.record(_finished("a", 0.0, 1.0, 10))
    assert window.record(_finished("a", 0.0, 1.0, 10, backend="other"))
    assert not window.record(make_observation(request_id="x", status=500))
    assert not window.record(make_observation(request_id="y", usage=None))
    assert not window.record(make_observation(request_id="z", e2e_s=None))
    assert window.tokens_per_s("b") == pytest.approx(10.0)


def test_window_is_bounded_in_time_and_in_requests() -> None:
    window = ThroughputWindow(window_s=10.0, max_requests=3)
    window.record(_finished("old", 0.0, 1.0, 1000))
    window.record(_finished("new", 20.0, 1.0, 10))
    assert window.tokens_per_s("b") == pytest.approx(10.0)  # "old" ended > 10 s before
    for i in range(5):
        window.record(_finished(f"r{i}", 30.0 + i, 1.0, 10))
    assert window.evicted == 2
    assert window.tokens_per_s("b", at=35.0) == pytest.approx(30 / 3)
    assert window.record(_finished("r0", 30.0, 1.0, 10))  # forgotten, so new again


def test_window_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        ThroughputWindow(window_s=0)
    with pytest.raises(ValueError):
        ThroughputWindow(max_requests=0)


PER_TOKEN = TokenPrice(prompt_usd_per_mtok=1.0, completion_usd_per_mtok=4.0)
PER_TOKEN_CACHED = TokenPrice(prompt_usd_per_mtok=1.0, completion_usd_per_mtok=4.0,
                              cached_prompt_usd_per_mtok=0.25)


def test_per_token_cost_with_and_without_a_cache_discount() -> None:
    usage = Usage(prompt_tokens=1000, completion_tokens=500, cached_tokens=800)
    primary = make_observation(usage=usage)
    exchange = make_exchange(primary, usage=usage)
    model = CostModel({"primary": PER_TOKEN, "cand": PER_TOKEN_CACHED})
    scores = by_metric(CostScorer(model).score(exchange))
    plain = (1000 * 1.0 + 500 * 4.0) / 1e6
    discounted = (200 * 1.0 + 800 * 0.25 + 500 * 4.0) / 1e6
    assert scores["cost.usd"].primary == pytest.approx(plain)
    assert scores["cost.usd"].candidate == pytest.approx(discounted)
    assert scores["cost.usd_per_mtok"].candidate == pytest.approx(discounted / 500 * 1e6)


def test_cost_is_unknown_rather_than_guessed() -> None:
    model = CostModel({"primary": PER_TOKEN_CACHED, "cand": PER_TOKEN})
    # the discount needs the cached count; the primary did not report it
    unknown_cache = make_exchange(make_observation(
        usage=Usage(prompt_tokens=10, completion_tokens=5)))
    assert by_metric(CostScorer(model).score(unknown_cache))["cost.usd"].primary is None
    for overrides in ({"usage": None}, {"usage": Usage(prompt_tokens=10)}, {"status": 500},
                      {"usage": Usage(prompt_tokens=10, completion_tokens=0)}):
        scores = by_metric(CostScorer(model).score(make_exchange(**overrides)))
        assert scores["cost.usd_per_mtok"].candidate is None, overrides
    unpriced = make_exchange(candidate=make_observation(backend="unpriced"))
    assert by_metric(CostScorer(model).score(unpriced))["cost.usd"].candidate is None


def test_gpu_hour_cost_uses_configured_capacity_or_the_measured_rate() -> None:
    observation = make_observation(backend="gpu", usage=Usage(completion_tokens=100))
    fixed = CostModel({"gpu": GpuHourPrice(gpu_usd_per_hour=3.6, gpu_count=2,
                                           capacity_tokens_per_s=1000.0)})
    # 100 tokens at 1000 tok/s = 0.1 GPU-seconds of a 2 x $0.001/s deployment
    assert fixed.request_usd(observation) == pytest.approx(2 * 0.001 * 0.1)

    window = ThroughputWindow(window_s=60.0)
    measured = CostModel({"gpu": GpuHourPrice(gpu_usd_per_hour=3.6)}, window)
    # this request alone: 100 tokens over its 1 s of busy time
    assert measured.request_usd(observation) == pytest.approx(0.001 * 1.0)
    window.record(make_observation(backend="gpu", request_id="other", started_at=1000.0,
                                   e2e_s=1.0, usage=Usage(completion_tokens=300)))
    # two concurrent requests: 400 tokens in 1 s of GPU, a quarter of it is this one's
    assert measured.request_usd(observation) == pytest.approx(0.001 * 0.25)
    assert CostModel({"gpu": GpuHourPrice(gpu_usd_per_hour=3.6)}).request_usd(
        observation) is None  # no capacity, no window: nothing to divide by


def test_session_cost_sums_per_session_and_candidate() -> None:
    def exchange(session: str, request: str, cand_tokens: int | None) -> Exchange:
        primary = make_observation(request_id=request,
                                   usage=Usage(prompt_tokens=0, completion_tokens=1000))
        cand_usage = (Usage(prompt_tokens=0, completion_tokens=cand_tokens)
                      if cand_tokens is not None else None)
        candidate = dataclasses.replace(primary, backend="cand", usage=cand_usage)
        return dataclasses.replace(make_exchange(primary, candidate), session_key=session)

    model = CostModel({"primary": PER_TOKEN, "cand": PER_TOKEN})
    costs = session_costs([exchange("s1", "a", 500), exchange("s1", "b", 1500),
                           exchange("s2", "c", 1000), exchange("s2", "d", None)], model)
    assert [dataclasses.astuple(cost) for cost in costs] == [
        ("s1", "cand", 2, pytest.approx(0.008), pytest.approx(0.008)),
        ("s2", "cand", 2, None, pytest.approx(0.008)),
    ]


@pytest.mark.parametrize(("usage", "expected"), [
    (Usage(prompt_tokens=1024, completion_tokens=5, cached_tokens=768), 0.75),
    (Usage(prompt_tokens=1024, completion_tokens=5, cached_tokens=0), 0.0),
    (Usage(prompt_tokens=1024, completion_tokens=5, cached_tokens=None), None),
    (Usage(prompt_tokens=0, completion_tokens=5, cached_tokens=0), None),
    (None, None),
])
def test_cache_hit_ratio_treats_unknown_as_unknown(usage: Usage | None,
                                                   expected: float | None) -> None:
    score = only(CacheScorer().score(make_exchange(usage=usage)))
    assert score.candidate == expected
    assert score.primary is None  # the default primary did not report cached tokens
