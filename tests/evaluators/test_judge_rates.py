"""Rates (0/1 metrics) judged as counts: Fisher's exact test for the evidence, Newcombe's
interval, and a PASS only where that interval rules out a worsening beyond the limit
(judge rules 1, 2 and 7; gates rule 3; checks rule 2; ``_rates`` rules 1-3)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from evaluators._checks import Check, Outcome, not_significant_overall
from evaluators._gates import Gates, MetricGate
from evaluators._judge import judge
from evaluators._rates import RateCounts
from evaluators._score import Direction
from evaluators._verdicts import MetricSamples, RateSamples, Verdict

SUCCESS = "reliability.success"
DIRECTIONS: dict[str, Direction] = {SUCCESS: "higher"}


def _successes(n: int, errors: int) -> np.ndarray:
    return np.concatenate([np.ones(n - errors), np.zeros(errors)])


def _judged(candidate_errors: int, primary_errors: int, n: int,
            gates: Gates | None = None) -> Verdict:
    samples = MetricSamples(candidate=_successes(n, candidate_errors),
                            baseline=_successes(n, primary_errors))
    return judge({SUCCESS: samples}, gates or Gates(), DIRECTIONS)


def test_five_errors_in_thirty_against_none_is_not_significant() -> None:
    """The bootstrap resampled the primary's 0 errors to 0 every time and called this
    significant (a FAIL); Fisher's exact one-sided p is 0.026, above the gates' 1 %."""
    verdict = _judged(5, 0, 30)
    (check,) = verdict.metric(SUCCESS).checks
    fisher = stats.fisher_exact(np.array([[25, 30], [5, 0]]), alternative="less").pvalue
    assert check.p_value is not None and abs(check.p_value - fisher) < 1e-12
    assert 0.02 < check.p_value < 0.03
    assert not check.significant
    assert check.ci_low is not None and check.value is not None
    assert check.ci_low < 0.0 < check.value  # Newcombe's interval holds no change too
    assert verdict.outcome is Outcome.MARGINAL, verdict.reasons  # 17 points seen, not shown
    assert "Fisher's exact" in check.reason


def test_many_errors_in_thirty_against_none_still_fails() -> None:
    verdict = _judged(12, 0, 30)
    (check,) = verdict.metric(SUCCESS).checks
    assert check.significant and verdict.outcome is Outcome.FAIL, verdict.reasons


def test_no_errors_in_thirty_on_both_sides_is_too_few_to_pass() -> None:
    """0 errors in 30 is consistent with some 15 % (the rule of three at a one-sided 1 %):
    it does not show the candidate within the 1-point gate. INCONCLUSIVE, with the values
    per side that would."""
    verdict = _judged(0, 0, 30)
    metric = verdict.metric(SUCCESS)
    (check,) = metric.checks
    assert metric.outcome is Outcome.INCONCLUSIVE, metric.reasons
    assert check.bounded and check.ci_high is not None and check.ci_high > 0.1
    assert "too few samples" in check.reason
    assert metric.samples_needed is not None and metric.samples_needed.test == "rate_bound"
    needed = metric.samples_needed.needed_per_side
    assert needed is not None and 500 < needed < 600
    assert f"about {needed} per side" in check.reason
    assert verdict.more_samples_needed == needed - 30
    assert metric.rates is not None and metric.rates.ones_candidate == 30


def test_the_estimate_is_where_the_verdict_turns() -> None:
    """Rule 7 at power 1/2: at the rates seen so far, the estimated count passes and one
    fewer does not."""
    needed = _judged(0, 0, 30).metric(SUCCESS).samples_needed
    assert needed is not None and needed.needed_per_side is not None
    n = needed.needed_per_side
    assert _judged(0, 0, n).outcome is Outcome.PASS
    assert _judged(0, 0, n - 1).outcome is Outcome.INCONCLUSIVE


def test_an_identical_rate_passes_with_enough_values() -> None:
    assert _judged(0, 0, 2000).outcome is Outcome.PASS
    assert _judged(10, 10, 2000).outcome is Outcome.PASS  # 0.5 % on both sides


def test_below_the_minimum_the_estimate_is_the_bound_not_none() -> None:
    """No change seen, so the significance estimate had no effect to size ("no practical
    number"): the wait is for the interval to rule the limit out."""
    metric = _judged(0, 0, 20).metric(SUCCESS)
    assert metric.outcome is Outcome.INCONCLUSIVE
    assert metric.samples_needed is not None
    assert metric.samples_needed.needed_per_side is not None
    assert metric.samples_needed.needed_per_side > 500


def test_a_rate_metric_with_other_values_is_not_judged_as_a_rate() -> None:
    rng = np.random.default_rng(5)
    samples = MetricSamples(candidate=rng.random(100), baseline=rng.random(100))
    metric = judge({SUCCESS: samples}, Gates(), DIRECTIONS).metric(SUCCESS)
    assert metric.outcome is Outcome.INCONCLUSIVE
    assert "not judged as a rate" in metric.reasons[0]
    counted = MetricSamples(candidate=[], baseline=[], rates=RateSamples(
        RateCounts(5000, 4000, others=1000), RateCounts(5000, 5000)))
    metric = judge({SUCCESS: counted}, Gates(), DIRECTIONS).metric(SUCCESS)
    assert metric.outcome is Outcome.INCONCLUSIVE
    assert "not judged as a rate" in metric.reasons[0]


def test_a_rate_is_judged_on_its_counts_not_its_values() -> None:
    """Rule 1: the counts the report gives (its whole window) are all a rate's gate reads,
    however few values came with them; its figures are the counts, no bootstrap."""
    capped = MetricSamples(candidate=np.ones(50), baseline=np.ones(50))
    counted = MetricSamples(candidate=np.ones(50), baseline=np.ones(50), rates=RateSamples(
        RateCounts(2000, 2000), RateCounts(2000, 2000), scope="the whole window"))
    assert judge({SUCCESS: capped}, Gates(), DIRECTIONS).outcome is Outcome.INCONCLUSIVE
    metric = judge({SUCCESS: counted}, Gates(), DIRECTIONS).metric(SUCCESS)
    assert metric.outcome is Outcome.PASS, metric.reasons
    assert metric.rates is not None and metric.rates.n_candidate == 2000
    assert metric.statistics is None and metric.to_dict()["statistics"] is None
    assert "over the whole window (2000/2000 against 2000/2000" in metric.reasons[0]


def test_values_and_their_counts_judge_alike() -> None:
    rng = np.random.default_rng(11)
    for n, candidate_rate in ((40, 0.9), (300, 0.97), (1500, 0.99)):
        candidate = (rng.random(n) < candidate_rate).astype(float)
        primary = (rng.random(n) < 0.98).astype(float)
        values = MetricSamples(candidate=candidate, baseline=primary)
        counts = MetricSamples(candidate=[], baseline=[], rates=RateSamples.of(values))
        by_values = judge({SUCCESS: values}, Gates(), DIRECTIONS).metric(SUCCESS)
        by_counts = judge({SUCCESS: counts}, Gates(), DIRECTIONS).metric(SUCCESS)
        assert by_counts == by_values


def test_the_replicas_counts_are_the_basis_with_enough_of_them() -> None:
    """As for the other per-backend metrics (rule 6): the replica mirrored at the
    candidate's rate, where it has the gate's minimum of values."""
    def judged(replica: RateCounts) -> str:
        samples = MetricSamples(candidate=[], baseline=[], rates=RateSamples(
            RateCounts(900, 891), RateCounts(900, 900), replica))
        return judge({SUCCESS: samples}, Gates(), DIRECTIONS).metric(SUCCESS).basis
    assert judged(RateCounts(900, 890)) == "replica at the same rate"
    assert judged(RateCounts(20, 20)) == "primary"


def test_a_rate_gate_checks_the_rate_alone() -> None:
    """Gates rule 3: its counts are all the judge reads of a rate, so a rate's gate cannot
    also ask for a median, a tail or a spread."""
    with pytest.raises(ValidationError, match="by its rate alone"):
        MetricGate(max_mean_worsening=0.01, max_shift_ratio=0.1)


def test_graded_again_a_bounded_check_still_needs_its_bound() -> None:
    """Rule 10 grades a check significant alone but not among the verdict's again; a rate
    seen inside its limit whose interval reaches past it is then INCONCLUSIVE, not PASS."""
    check = Check("mean_worsening", Outcome.MARGINAL, 0.009, 0.01, 0.0005, 0.017, True,
                  "change of the rate toward worse: 0.009; limit 0.01 +/- 0.0005: "
                  "significant, but not beyond the limit and its band", 0.005, 0.0005,
                  bounded=True)
    again = not_significant_overall(check, "p=0.005 alone")
    assert again.outcome is Outcome.INCONCLUSIVE and "too few samples" in again.reason
    within = not_significant_overall(dataclasses.replace(check, ci_high=0.0099),
                                     "p=0.005 alone")
    assert within.outcome is Outcome.PASS
