"""A noise-floor replica relaxes a pairwise limit it misses itself, but only by
``Gates.max_noise_floor_miss`` of the limit: one further off is no noise floor (judge rule
3; gates rule 2), for the similarity minimum and the embedding-distance maximum alike; and
one further off on any metric is no noise floor for the others either (judge rule 11)."""

from __future__ import annotations

import numpy as np

from evaluators._checks import Check, Outcome
from evaluators._gates import (
    DEFAULT_MAX_NOISE_FLOOR_MISS,
    DEFAULT_MAX_NOISE_FLOOR_SHIFT_RATIO,
    EMBEDDING_DISTANCE_METRIC,
    SEMANTIC_SIMILARITY_METRIC,
    Gates,
    MetricGate,
)
from evaluators._judge import MetricSamples, MetricVerdict, Verdict, judge
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


# A replica shown broken by one metric is no noise floor for any metric of the verdict
# (judge rule 11).

EXACT_MATCH = "quality.exact_match"
EDIT_SIMILARITY = "quality.edit_similarity"
WINDOW_DIRECTIONS: dict[str, Direction] = {**DIRECTIONS, EXACT_MATCH: "higher",
                                           EDIT_SIMILARITY: "higher"}


def _agreements(ones: int, n: int, seed: int) -> np.ndarray:
    """``ones`` matches in ``n`` exchanges, in a seeded order: a rate exactly as given."""
    values = np.zeros(n)
    values[:ones] = 1.0
    return np.random.default_rng(seed).permutation(values)


def _beta(mean: float, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).beta(40.0 * mean, 40.0 * (1.0 - mean), n)


def _window(replica_similarity: float, exact_match: tuple[int, int], n: int = 300,
            edit: tuple[float, float] | None = None,
            gates: Gates | None = None) -> Verdict:
    """Semantic similarity 0.95 against a replica at ``replica_similarity``; exact match
    (candidate matches, replica matches) in ``n``; ``edit``: the candidate's and the
    replica's edit similarity, held to a minimum of 0.8."""
    candidate_matches, replica_matches = exact_match
    window = {
        SEMANTIC_SIMILARITY_METRIC: MetricSamples(
            candidate=_beta(0.95, n, 1), noise_floor=_beta(replica_similarity, n, 2)),
        EXACT_MATCH: MetricSamples(candidate=_agreements(candidate_matches, n, 3),
                                   noise_floor=_agreements(replica_matches, n, 4)),
    }
    if edit is not None:
        window[EDIT_SIMILARITY] = MetricSamples(candidate=_beta(edit[0], n, 5),
                                                noise_floor=_beta(edit[1], n, 6))
    if gates is None:
        gates = Gates(metrics={EDIT_SIMILARITY: MetricGate(
            min_mean=0.8, max_noise_floor_shift_ratio=DEFAULT_MAX_NOISE_FLOOR_SHIFT_RATIO)})
    return judge(window, gates, WINDOW_DIRECTIONS, noise_floor_from=REPLICA)


def _check(verdict: Verdict, metric: str, name: str) -> Check:
    (check,) = [c for c in verdict.metric(metric).checks if c.name == name]
    return check


def test_a_replica_broken_on_similarity_is_no_noise_floor_for_exact_match() -> None:
    """A replica at similarity 0.3 agrees with the primary on 10 % of answers; a candidate
    at 11 % was "no worse than noise" on exact match, which has no limit of its own: its
    noise-floor check PASSed. Now it is INCONCLUSIVE, naming the replica and the metric
    that showed it broken, and it keeps what it measured."""
    verdict = _window(0.3, (33, 30))
    check = _check(verdict, EXACT_MATCH, "noise_floor")
    assert check.outcome is Outcome.INCONCLUSIVE, check.reason
    assert verdict.metric(EXACT_MATCH).outcome is Outcome.INCONCLUSIVE
    assert check.reason.startswith("noise floor not used")
    assert repr(REPLICA) in check.reason and SEMANTIC_SIMILARITY_METRIC in check.reason
    assert "minimum 0.85" in check.reason and "within the limit" in check.reason
    assert check.value is not None and check.value < 0.0  # 11 % against the replica's 10 %
    assert check.ci_low is not None and check.ci_high is not None
    # Rule 10: it tests nothing the verdict relies on, so it joins no family.
    assert check.p_value is None and check.margin is None
    assert any(r.startswith(f"{EXACT_MATCH}: noise floor not used") for r in verdict.reasons)


def test_a_healthy_replica_is_still_the_floor_of_exact_match() -> None:
    """No change for a healthy floor (0.93 keeps the 0.85 minimum): the same exact-match
    counts PASS on it, and a candidate far below it FAILs. (A guard: this holds before
    and after rule 11.)"""
    passing = _check(_window(0.93, (33, 30)), EXACT_MATCH, "noise_floor")
    assert passing.outcome is Outcome.PASS, passing.reason
    assert passing.p_value is not None
    failing = _check(_window(0.93, (3, 30)), EXACT_MATCH, "noise_floor")
    assert failing.outcome is Outcome.FAIL, failing.reason


def test_a_candidate_worse_than_even_the_broken_replica_still_fails() -> None:
    """3 % exact matches against the broken replica's 10 %: worse even than a floor that
    measures nothing, a FAIL with its p-value. The same verdict passes nothing else on
    that replica: the candidate's edit similarity, level with the replica's, does not
    PASS its noise-floor check."""
    verdict = _window(0.3, (9, 30), edit=(0.9, 0.9))
    check = _check(verdict, EXACT_MATCH, "noise_floor")
    assert check.outcome is Outcome.FAIL, check.reason
    assert check.p_value is not None
    assert verdict.outcome is Outcome.FAIL
    edit = _check(verdict, EDIT_SIMILARITY, "noise_floor")
    assert edit.outcome is Outcome.INCONCLUSIVE, edit.reason


def test_a_replica_broken_on_one_metric_relaxes_no_other_limit() -> None:
    """Edit similarity held to a minimum of 0.8; the replica's own 0.7 misses it by 0.1,
    within the bound (0.16), so it relaxed the minimum to 0.7 and a candidate at 0.74
    PASSed. The same replica misses the similarity minimum by 0.55: the edit minimum is
    graded as configured and as if relaxed, and a FAIL as configured alone is
    INCONCLUSIVE (the replica is broken or the primary is that noisy)."""
    edit = _window(0.3, (33, 30), edit=(0.74, 0.7)).metric(EDIT_SIMILARITY)
    (limit,) = [c for c in edit.checks if c.name == "mean_limit"]
    assert limit.outcome is Outcome.INCONCLUSIVE, limit.reason
    assert "relaxed from" not in limit.reason
    assert repr(REPLICA) in limit.reason and SEMANTIC_SIMILARITY_METRIC in limit.reason
    assert limit.p_value is None
    # Within the band of the configured minimum: MARGINAL as configured, not a PASS on
    # the replica's 0.7.
    near = _window(0.3, (33, 30), edit=(0.79, 0.7)).metric(EDIT_SIMILARITY)
    (limit,) = [c for c in near.checks if c.name == "mean_limit"]
    assert limit.outcome is Outcome.MARGINAL, limit.reason
    assert "not relaxed" in limit.reason
    # Beyond the configured minimum and the replica's alike: a FAIL stands.
    far = _window(0.3, (33, 30), edit=(0.5, 0.7)).metric(EDIT_SIMILARITY)
    assert far.outcome is Outcome.FAIL, far.reasons
    # A healthy replica still relaxes it.
    healthy = _window(0.93, (33, 30), edit=(0.74, 0.7)).metric(EDIT_SIMILARITY)
    assert "relaxed from 0.8" in healthy.reasons[0]
    assert healthy.outcome is Outcome.PASS, healthy.reasons


def test_a_fail_on_the_broken_replica_that_rule_10_takes_back_is_inconclusive() -> None:
    """37 exact matches in 600 against the broken replica's 60: significant alone (p
    0.0075) but not among the verdict's checks (Holm). Graded again as not significant
    it rests on the broken replica again: INCONCLUSIVE, not the MARGINAL of a check read
    on a floor, and no FAIL stands."""
    verdict = _window(0.3, (37, 60), n=600, gates=Gates())
    check = _check(verdict, EXACT_MATCH, "noise_floor")
    assert check.outcome is Outcome.INCONCLUSIVE, check.reason
    assert "Holm" in check.reason and repr(REPLICA) in check.reason
    assert check.p_value is None
    assert verdict.outcome is Outcome.INCONCLUSIVE
