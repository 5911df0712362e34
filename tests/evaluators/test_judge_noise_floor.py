"""A noise-floor replica relaxes a pairwise limit it misses itself, but only by
``Gates.max_noise_floor_miss`` of the limit: one further off is no noise floor (judge rule
3; gates rule 2), for the similarity minimum and the embedding-distance maximum alike."""

from __future__ import annotations

import numpy as np

from evaluators._gates import (
    DEFAULT_MAX_NOISE_FLOOR_MISS,
    EMBEDDING_DISTANCE_METRIC,
    SEMANTIC_SIMILARITY_METRIC,
    Gates,
    Outcome,
)
from evaluators._judge import MetricSamples, MetricVerdict, judge
from evaluators._score import Direction

DIRECTIONS: dict[str, Direction] = {SEMANTIC_SIMILARITY_METRIC: "higher",
                                    EMBEDDING_DISTANCE_METRIC: "lower"}
REPLICA = "replica-a"


def _similarity(candidate_mean: float, floor_mean: float, gates: Gates | None = None,
                seed: int = 1) -> MetricVerdict:
    rng = np.random.default_rng(seed)

    def draw(mean: float) -> np.ndarray:
        return rng.beta(40.0 * mean, 40.0 * (1.0 - mean), 300)

    samples = MetricSamples(candidate=draw(candidate_mean), noise_floor=draw(floor_mean))
    verdict = judge({SEMANTIC_SIMILARITY_METRIC: samples}, gates or Gates(), DIRECTIONS,
                    noise_floor_from=REPLICA)
    return verdict.metric(SEMANTIC_SIMILARITY_METRIC)


def _distance(candidate_mean: float, floor_mean: float, gates: Gates | None = None,
              seed: int = 2) -> MetricVerdict:
    rng = np.random.default_rng(seed)

    def draw(mean: float) -> np.ndarray:
        return np.abs(rng.normal(mean, mean / 5.0, 300))

    samples = MetricSamples(candidate=draw(candidate_mean), noise_floor=draw(floor_mean))
    verdict = judge({EMBEDDING_DISTANCE_METRIC: samples}, gates or Gates(), DIRECTIONS,
                    noise_floor_from=REPLICA)
    return verdict.metric(EMBEDDING_DISTANCE_METRIC)


def _bound_check(metric: MetricVerdict) -> str:
    (reason,) = [c.reason for c in metric.checks if c.name == "noise_floor_bound"]
    return reason


def test_a_broken_replica_does_not_lower_the_similarity_minimum_to_its_own() -> None:
    """A replica at 0.3 lowered the 0.85 minimum to 0.3: a candidate as far off passed
    the minimum. Now the metric is INCONCLUSIVE, and the reason names the replica."""
    metric = _similarity(0.3, 0.3)
    assert metric.outcome is Outcome.INCONCLUSIVE, metric.reasons
    reason = _bound_check(metric)
    assert repr(REPLICA) in reason and "max_noise_floor_miss" in reason
    assert "not relaxed" in reason
    assert not any("relaxed from" in r for r in metric.reasons)


def test_a_broken_replica_neither_passes_a_good_candidate_nor_spares_a_bad_one() -> None:
    good = _similarity(0.95, 0.3)
    assert good.outcome is Outcome.INCONCLUSIVE, good.reasons  # no PASS on a broken floor
    bad = _similarity(0.1, 0.3)
    assert bad.outcome is Outcome.FAIL, bad.reasons  # beyond the limit and the replica too


def test_a_broken_replica_does_not_raise_the_distance_maximum_to_its_own() -> None:
    metric = _distance(0.05, 0.05)  # five times the 0.01 maximum
    assert metric.outcome is Outcome.INCONCLUSIVE, metric.reasons
    assert repr(REPLICA) in _bound_check(metric)
    assert _distance(0.001, 0.05).outcome is Outcome.INCONCLUSIVE
    assert _distance(0.2, 0.05).outcome is Outcome.FAIL


def test_a_replica_within_the_bound_still_relaxes_both_limits() -> None:
    """0.80 against the 0.85 minimum and 0.0115 against the 0.01 maximum miss by less than
    a fifth of the limit."""
    similarity = _similarity(0.8, 0.8)
    assert similarity.outcome is not Outcome.FAIL, similarity.reasons
    assert "relaxed from 0.85" in similarity.reasons[0]
    distance = _distance(0.0115, 0.0115)
    assert distance.outcome is not Outcome.FAIL, distance.reasons
    assert "relaxed from 0.01" in distance.reasons[0]


def test_one_bound_governs_both_limits() -> None:
    """The bound is a share of the limit, set once: widened, both relax again."""
    assert Gates().max_noise_floor_miss == DEFAULT_MAX_NOISE_FLOOR_MISS
    wide = Gates(max_noise_floor_miss=5.0)
    assert "relaxed from 0.85" in _similarity(0.3, 0.3, wide).reasons[0]
    assert "relaxed from 0.01" in _distance(0.05, 0.05, wide).reasons[0]
    narrow = Gates(max_noise_floor_miss=0.0)
    assert _similarity(0.8, 0.8, narrow).outcome is Outcome.INCONCLUSIVE
    assert _distance(0.0115, 0.0115, narrow).outcome is Outcome.INCONCLUSIVE
