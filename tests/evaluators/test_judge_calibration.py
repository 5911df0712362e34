"""The judge on windows whose truth is known: an identical candidate is not called worse
more often than the gates' confidence allows, over all of a verdict's checks (judge rule
10), and a latency ratio is held to the latency tolerance (gates rule 2).
``bench/judge_calibration.py`` measures the same over more trials and sizes."""

from __future__ import annotations

import numpy as np
import pytest

from evaluators._checks import Outcome, backend_checks, rate_check
from evaluators._gates import EMBEDDING_DISTANCE_METRIC, Gates
from evaluators._judge import judge
from evaluators._rates import RateCounts, compare_rates
from evaluators._score import METRICS
from evaluators._statistics import compare_samples, holm_rejected
from evaluators._verdicts import MetricSamples

DIRECTIONS = {name: spec.direction for name, spec in METRICS.items()}
A_A_TRIALS = 30
A_A_SIZE = 150


def _identical_window(rng: np.random.Generator, n: int) -> dict[str, MetricSamples]:
    """Every metric, candidate and primary (and replica) drawn alike."""

    def draw(name: str, unit: str) -> np.ndarray:
        if unit == "1/0":
            return (rng.random(n) < 0.9).astype(float)
        if unit in ("0..1", "-1..1"):
            return rng.beta(8.0, 2.0, n)
        return rng.lognormal(np.log(0.2), 0.3, n)

    window = {}
    for name, spec in METRICS.items():
        if name == EMBEDDING_DISTANCE_METRIC:
            continue  # chat traffic: no embeddings answer to compare
        if spec.kind == "per_backend":
            window[name] = MetricSamples(candidate=draw(name, spec.unit),
                                         baseline=draw(name, spec.unit))
        else:
            window[name] = MetricSamples(candidate=draw(name, spec.unit),
                                         noise_floor=draw(name, spec.unit))
    return window


def test_an_identical_candidate_is_rarely_called_significantly_worse_on_any_check() -> None:
    """Each of ~25 checks alone at a one-sided 1 % made ~15 % of these verdicts show a
    significant worsening (half of them FAILs); over the whole verdict it is at most 1 %
    in expectation, so 30 trials should show none (one allowed)."""
    significant = fails = 0
    for trial in range(A_A_TRIALS):
        window = _identical_window(np.random.default_rng(1000 + trial), A_A_SIZE)
        verdict = judge(window, Gates(), DIRECTIONS, seed=trial)
        checks = [c for m in verdict.metrics if m.gated for c in m.checks]
        significant += any(c.significant for c in checks)
        fails += verdict.outcome is Outcome.FAIL
    assert fails == 0
    assert significant <= 1


def test_a_check_significant_alone_but_not_among_the_verdicts_says_so() -> None:
    """A rate 5 points worse over 400 exchanges is significant alone (p ~ 0.001) but not
    among ~25 checks at 1 % (Holm's first bar is 0.04 %): not a FAIL, and the reason
    tells why."""
    rng = np.random.default_rng(7)
    window = _identical_window(rng, 400)
    window["reliability.success"] = MetricSamples(
        candidate=np.r_[np.ones(366), np.zeros(34)], baseline=np.r_[np.ones(386), np.zeros(14)])
    verdict = judge(window, Gates(), DIRECTIONS, seed=3)
    (check,) = verdict.metric("reliability.success").checks
    assert check.p_value is not None and 0.0004 < check.p_value < 0.01
    assert not check.significant
    assert check.outcome is Outcome.MARGINAL  # 5 points is beyond the 1-point limit
    assert "not significant among the verdict's" in check.reason and "(Holm)" in check.reason
    alone = judge({"reliability.success": window["reliability.success"]}, Gates(), DIRECTIONS)
    assert alone.outcome is Outcome.FAIL  # the same check alone: Holm over one is the check


def test_a_latency_ratio_is_held_to_the_latency_tolerance_on_its_median() -> None:
    """4 % slower per exchange is inside the 10 % latency gate: significant (2,000
    exchanges), so MARGINAL, not the FAIL that the agreements' 2 % tolerance gave."""
    rng = np.random.default_rng(11)
    ratio = MetricSamples(candidate=rng.lognormal(np.log(1.04), 0.05, 2000),
                          noise_floor=rng.lognormal(0.0, 0.05, 2000))
    verdict = judge({"latency.ttft_ratio": ratio}, Gates(), DIRECTIONS)
    (check,) = verdict.metric("latency.ttft_ratio").checks
    assert check.threshold == Gates().max_median_shift_ratio
    assert check.significant and check.outcome is Outcome.MARGINAL, check.reason
    assert check.reason.startswith("median change toward worse beyond the noise floor")
    slower = MetricSamples(candidate=rng.lognormal(np.log(1.25), 0.05, 2000),
                           noise_floor=rng.lognormal(0.0, 0.05, 2000))
    assert judge({"latency.ttft_ratio": slower}, Gates(), DIRECTIONS).outcome is Outcome.FAIL


def test_holm_rejects_in_order_of_p_until_one_misses_its_bar() -> None:
    assert holm_rejected([0.01, 0.04, 0.03, 0.005], 0.05) == (True, False, False, True)
    assert holm_rejected([0.04, 0.04], 0.05) == (False, False)  # 0.04 > 0.05 / 2
    assert holm_rejected([0.02], 0.05) == (True,)
    assert holm_rejected([], 0.05) == ()


@pytest.mark.parametrize("seed", range(12))
def test_a_checks_p_value_agrees_with_its_own_interval(seed: int) -> None:
    """p < (1 - confidence) / 2 exactly when the check's evidence holds alone."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.9, 1.3)
    baseline = rng.lognormal(np.log(0.2), 0.3, 120)
    candidate = rng.lognormal(np.log(0.2 * scale), 0.3 * rng.uniform(0.8, 1.5), 120)
    gates = Gates()
    # A rate's check reads counts (checks rule 2): 0/1 values, one rate 0-6 points worse.
    ok = (rng.random(120) < 0.95).astype(float)
    worse = (rng.random(120) < 0.95 - rng.uniform(0.0, 0.06)).astype(float)
    for higher in (False, True):
        c = compare_samples(baseline, candidate, higher_is_better=higher, seed=seed)
        rates = compare_rates(RateCounts.of(ok), RateCounts.of(worse),
                              higher_is_better=higher)
        checks = [rate_check(rates, gates.gate_for("reliability.success", pairwise=False),
                             gates.marginal_band)]
        for metric in ("latency.ttft_s", "cost.usd"):
            gate = gates.gate_for(metric, pairwise=False)
            checks += backend_checks(c, gate, gates.marginal_band)
        for check in checks:
            if check.p_value is not None:
                alone = check.p_value < (1.0 - gates.confidence) / 2.0
                assert alone == check.significant, (check.reason, check.p_value)
