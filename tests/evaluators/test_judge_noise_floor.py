"""A noise-floor replica relaxes a pairwise limit it misses itself, but only by
``Gates.max_noise_floor_miss`` of the limit: one further off is no noise floor (judge rule
3; gates rule 2), for the similarity minimum and the embedding-distance maximum alike; and
one further off on any metric is no noise floor for the others either, nor the baseline
of the per-backend metrics (judge rule 11)."""

from __future__ import annotations

import numpy as np
from scipy import stats

from evaluators._checks import Check, Outcome
from evaluators._gates import (
    DEFAULT_MAX_NOISE_FLOOR_MISS,
    DEFAULT_MAX_NOISE_FLOOR_SHIFT_RATIO,
    EMBEDDING_DISTANCE_METRIC,
    SEMANTIC_SIMILARITY_METRIC,
    Gates,
    MetricGate,
)
from evaluators._judge import judge
from evaluators._rates import RateCounts
from evaluators._sample_bias import check_sample_bias
from evaluators._score import Direction
from evaluators._verdicts import (
    LoadConditions,
    MetricSamples,
    MetricVerdict,
    RateSamples,
    Verdict,
)

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


# A replica shown broken is no baseline of the per-backend metrics either (judge rules 6
# and 11): they are judged against the primary, and say so.

TTFT = "latency.ttft_s"
E2E = "latency.e2e_s"
SUCCESS = "reliability.success"
LATENCY_DIRECTIONS: dict[str, Direction] = {**DIRECTIONS, TTFT: "lower", E2E: "lower",
                                            SUCCESS: "higher"}


def _latencies(n: int, scale: float = 1.0) -> np.ndarray:
    """n evenly spread quantiles of a lognormal around 50 ms: no sampling noise."""
    return scale * stats.lognorm.ppf((np.arange(n) + 0.5) / n, 0.5) * 0.05


def _latency_window(replica_similarity: float, n: int = 300) -> Verdict:
    """Semantic similarity 0.95 against a replica at ``replica_similarity``; TTFT and E2E
    alike on the candidate and the primary (at the same loads), the replica's 5x faster
    (an error page answered at once, or a smaller model)."""
    loads = tuple(int(x) for x in np.random.default_rng(7).integers(1, 4, n))
    window = {SEMANTIC_SIMILARITY_METRIC: MetricSamples(
        candidate=_beta(0.95, n, 1), noise_floor=_beta(replica_similarity, n, 2))}
    for metric in (TTFT, E2E):
        window[metric] = MetricSamples(
            _latencies(n), _latencies(n), conditions=LoadConditions(loads, loads),
            replica=_latencies(n, 0.2))
    return judge(window, Gates(), LATENCY_DIRECTIONS, noise_floor_from=REPLICA)


def test_a_broken_replica_is_not_the_latency_baseline() -> None:
    """A replica at similarity 0.3 answering 5x faster was the baseline of the latencies:
    a candidate alike with the primary FAILed them, and the verdict was FAIL (a canary
    rolled back on a broken replica). Now they are judged against the primary at matched
    load and PASS, each naming the replica and why it was not used; the verdict is
    INCONCLUSIVE, held by the finding that the replica is broken."""
    verdict = _latency_window(0.3)
    for metric in (TTFT, E2E):
        judged = verdict.metric(metric)
        assert judged.basis == "primary at matched load, in place of the broken replica"
        assert judged.outcome is Outcome.PASS, judged.reasons
        (note,) = [c for c in judged.checks if c.name == "replica"]
        assert note.outcome is Outcome.PASS and note.p_value is None
        assert repr(REPLICA) in note.reason and SEMANTIC_SIMILARITY_METRIC in note.reason
        assert "max_noise_floor_miss" in note.reason
        assert judged.matched is not None and judged.matched.comparable
    assert verdict.outcome is Outcome.INCONCLUSIVE, verdict.reasons
    assert verdict.reasons[0].startswith(SEMANTIC_SIMILARITY_METRIC)
    assert not any(r.startswith(("latency.", "reliability.")) for r in verdict.reasons)


def test_a_healthy_replica_is_still_the_latency_baseline() -> None:
    """No change for a healthy replica (0.93 keeps the 0.85 minimum): it is the latencies'
    baseline, and a candidate 5x slower than it FAILs. (A guard: this holds before and
    after.)"""
    verdict = _latency_window(0.93)
    for metric in (TTFT, E2E):
        judged = verdict.metric(metric)
        assert judged.basis == "replica at the same rate"
        assert judged.outcome is Outcome.FAIL, judged.reasons
        assert not any(c.name == "replica" for c in judged.checks)
    assert verdict.outcome is Outcome.FAIL


def test_a_broken_replica_is_not_a_rates_baseline() -> None:
    """A rate's counts take the replica as their basis too (rule 6): a broken replica
    answering no errors made the candidate's 2 % errors, the primary's own, a worsening
    of 2 points (a FAIL). On the primary it is no change."""
    def judged(replica_similarity: float) -> MetricVerdict:
        window = {
            SEMANTIC_SIMILARITY_METRIC: MetricSamples(
                candidate=_beta(0.95, 300, 1), noise_floor=_beta(replica_similarity, 300, 2)),
            SUCCESS: MetricSamples(candidate=[], baseline=[], rates=RateSamples(
                RateCounts(3000, 2940), RateCounts(3000, 2940), RateCounts(3000, 3000))),
        }
        verdict = judge(window, Gates(), LATENCY_DIRECTIONS, noise_floor_from=REPLICA)
        return verdict.metric(SUCCESS)

    healthy = judged(0.93)
    assert healthy.basis == "replica at the same rate"
    assert healthy.outcome is Outcome.FAIL, healthy.reasons
    broken = judged(0.3)
    assert broken.basis == "primary, in place of the broken replica"
    assert broken.outcome is not Outcome.FAIL, broken.reasons
    assert broken.rates is not None and broken.rates.ones_baseline == 2940
    assert any(repr(REPLICA) in r for r in broken.reasons)


def test_latencies_judged_on_the_primary_for_a_broken_replica_are_reweighted() -> None:
    """Rule 9 reweights a metric compared with the primary, not one whose baseline is the
    replica (its sample has its own mix): a broken replica no baseline, the latencies are
    reweighted to the traffic's prompt sizes like any compared with the primary."""
    sizes = [50.0] * 100 + [2000.0] * 40
    bias = check_sample_bias([50.0] * 200 + [2000.0] * 200, sizes,
                             drops=[("buffer_full", 2000.0)] * 160)
    assert bias.skew and not bias.refuse
    n, loads, size = len(sizes), (1,) * len(sizes), tuple(sizes)
    prompt = tuple(int(s) for s in sizes)

    def judged(replica_similarity: float) -> Verdict:
        conditions = LoadConditions(loads, loads, prompt, (None,) * n, prompt, (None,) * n,
                                    cache=True, candidate_prompt_size=size,
                                    baseline_prompt_size=size)
        window = {
            SEMANTIC_SIMILARITY_METRIC: MetricSamples(
                candidate=_beta(0.95, n, 1), noise_floor=_beta(replica_similarity, n, 2)),
            TTFT: MetricSamples(_latencies(n), _latencies(n), conditions=conditions,
                                replica=_latencies(n, 0.2)),
        }
        return judge(window, Gates(), LATENCY_DIRECTIONS, sample_bias=bias,
                     noise_floor_from=REPLICA)

    broken = judged(0.3)
    ttft = broken.metric(TTFT)
    assert ttft.reweighting is not None
    assert ttft.basis == ("primary at matched load and cache, reweighted to the traffic's "
                          "prompt sizes, in place of the broken replica")
    assert not any("not reweighted" in r for r in broken.reasons)
    healthy = judged(0.93)  # a guard: the healthy replica's latencies are not reweighted
    assert healthy.metric(TTFT).reweighting is None
    assert healthy.metric(TTFT).basis == "replica at the same rate"
    assert any("not reweighted" in r and TTFT in r for r in healthy.reasons)
