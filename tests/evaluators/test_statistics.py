"""Statistics on known distributions with fixed seeds: every test is deterministic."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from evaluators._statistics import (
    MAX_PAIRWISE_DIFFERENCES,
    Comparison,
    compare_samples,
    hodges_lehmann,
    summarize_pairwise,
)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _assert_plain_json(value: object) -> None:
    """Only Python's own types, and no NaN or infinity."""
    if isinstance(value, dict):
        for item in value.values():
            _assert_plain_json(item)
    elif isinstance(value, list):
        for item in value:
            _assert_plain_json(item)
    else:
        assert value is None or type(value) in (bool, int, float, str), (value, type(value))
        if isinstance(value, float):
            assert math.isfinite(value)


def test_a_shift_toward_worse_is_detected_with_its_size() -> None:
    rng = _rng(1)
    baseline = rng.normal(10.0, 1.0, 200)
    candidate = rng.normal(11.0, 1.0, 200)
    c = compare_samples(baseline, candidate, higher_is_better=False, seed=7)
    assert c.p_value < 1e-6
    assert c.hl_ci_low <= 1.0 <= c.hl_ci_high
    assert 0.7 < c.hl_shift < 1.3
    assert c.significantly_worse and not c.significantly_better
    assert c.effect_size > 0.4  # candidate values are mostly larger
    assert c.relative_shift == pytest.approx(c.hl_shift / abs(c.median_baseline))


def test_the_same_shift_is_better_when_higher_is_better() -> None:
    rng = _rng(1)
    baseline = rng.normal(10.0, 1.0, 200)
    candidate = rng.normal(11.0, 1.0, 200)
    c = compare_samples(baseline, candidate, higher_is_better=True, seed=7)
    assert c.significantly_better and not c.significantly_worse
    assert c.tail_quantile == pytest.approx(0.01)


def test_equal_distributions_show_no_difference() -> None:
    rng = _rng(2)
    c = compare_samples(rng.normal(5, 1, 300), rng.normal(5, 1, 300), higher_is_better=False)
    assert c.p_value > 0.02
    assert not c.significantly_worse and not c.significantly_better
    assert c.hl_ci_low < 0.0 < c.hl_ci_high
    assert not c.variance_increased
    assert c.tail_ratio_ci_low is not None and c.tail_ratio_ci_high is not None
    assert c.tail_ratio_ci_low < 1.0 < c.tail_ratio_ci_high


def test_hodges_lehmann_is_the_median_of_pairwise_differences() -> None:
    rng = _rng(3)
    baseline, candidate = rng.normal(0, 1, 37), rng.normal(0.3, 1, 41)
    estimate = hodges_lehmann(baseline, candidate)
    diffs = np.subtract.outer(candidate, baseline).ravel()
    assert estimate.shift == pytest.approx(float(np.median(diffs)))
    assert estimate.pairs == diffs.size and not estimate.subsampled


def test_lehmann_interval_is_the_documented_order_statistic() -> None:
    rng = _rng(4)
    m, n = 25, 30  # continuous values: no ties
    baseline, candidate = rng.normal(0, 1, n), rng.normal(0, 1, m)
    estimate = hodges_lehmann(baseline, candidate, confidence=0.95)
    z = stats.norm.ppf(0.975)
    k = math.floor(m * n / 2 - z * math.sqrt(m * n * (m + n + 1) / 12))
    diffs = np.sort(np.subtract.outer(candidate, baseline).ravel())
    assert estimate.ci_low == diffs[k - 1]
    assert estimate.ci_high == diffs[m * n - k]


def test_hodges_lehmann_interval_covers_the_true_shift() -> None:
    covered = 0
    for trial in range(50):
        rng = _rng(100 + trial)
        baseline = rng.exponential(1.0, 30)
        candidate = rng.exponential(1.0, 30) + 0.5
        estimate = hodges_lehmann(baseline, candidate, confidence=0.98)
        covered += estimate.ci_low <= 0.5 <= estimate.ci_high
    assert covered >= 46  # 49 expected at 98%


def test_many_pairs_are_subsampled_deterministically() -> None:
    rng = _rng(5)
    baseline, candidate = rng.normal(0, 1, 1100), rng.normal(0.2, 1, 1000)
    assert baseline.size * candidate.size > MAX_PAIRWISE_DIFFERENCES
    first = hodges_lehmann(baseline, candidate, seed=3)
    assert first.subsampled and first.pairs == MAX_PAIRWISE_DIFFERENCES
    assert hodges_lehmann(baseline, candidate, seed=3) == first
    exact = float(np.median(np.subtract.outer(candidate, baseline)))
    assert first.shift == pytest.approx(exact, abs=0.01)
    assert first.ci_low < exact < first.ci_high


def test_cliffs_delta_counts_wins_minus_losses() -> None:
    rng = _rng(6)
    baseline, candidate = rng.normal(0, 1, 40), rng.normal(0.5, 1, 50)
    c = compare_samples(baseline, candidate, higher_is_better=False)
    brute = float(np.mean(np.sign(np.subtract.outer(candidate, baseline))))
    assert c.effect_size == pytest.approx(brute)


def test_a_variance_increase_under_the_same_median_is_detected() -> None:
    rng = _rng(7)
    baseline = rng.normal(1.0, 0.1, 300)
    candidate = rng.normal(1.0, 0.25, 300)
    c = compare_samples(baseline, candidate, higher_is_better=False)
    assert not c.significantly_worse  # the location test alone would pass it
    assert c.variance_increased
    assert c.std_ratio is not None and 2.0 < c.std_ratio < 3.0
    assert c.variance_p_value < 1e-6


def test_a_heavier_tail_is_detected_by_the_p99_ratio() -> None:
    rng = _rng(8)
    baseline = rng.lognormal(0.0, 0.3, 1000)
    candidate = rng.lognormal(0.0, 0.3, 1000)
    slow = rng.random(1000) < 0.04
    candidate[slow] *= 4.0
    c = compare_samples(baseline, candidate, higher_is_better=False)
    assert c.relative_shift is not None and abs(c.relative_shift) < 0.05
    assert c.tail_ratio is not None and c.tail_ratio > 2.0
    assert c.tail_ratio_ci_low is not None and c.tail_ratio_ci_low > 1.5


def test_the_same_seed_gives_the_same_result() -> None:
    rng = _rng(9)
    baseline, candidate = rng.gamma(2, 1, 120), rng.gamma(2, 1.1, 130)
    first = compare_samples(baseline, candidate, higher_is_better=False, seed=11)
    assert compare_samples(baseline, candidate, higher_is_better=False, seed=11) == first


def test_constant_samples_give_defined_statistics() -> None:
    c = compare_samples(np.ones(40), np.ones(40), higher_is_better=False)
    assert c.p_value == 1.0 and c.hl_shift == 0.0
    assert c.std_ratio is None and c.levene_statistic is None and c.variance_p_value == 1.0
    assert not c.variance_increased
    json.dumps(c.to_dict(), allow_nan=False)


def test_ratios_over_zero_are_none() -> None:
    c = compare_samples(np.zeros(40), np.linspace(0, 1, 40), higher_is_better=False)
    assert c.relative_shift is None and c.tail_ratio is None and c.mean_ratio is None
    assert c.std_ratio is None and c.variance_increased
    _assert_plain_json(c.to_dict())


def test_to_dict_exposes_every_statistic_as_plain_json() -> None:
    rng = _rng(10)
    c = compare_samples(rng.normal(3, 1, 60), rng.normal(3.2, 1, 70), higher_is_better=False)
    out = c.to_dict()
    for name in Comparison.__dataclass_fields__:
        assert name in out
    assert {"significantly_worse", "variance_increased"} <= out.keys()
    _assert_plain_json(out)
    json.dumps(out, allow_nan=False)


@pytest.mark.parametrize(
    "values",
    [[1.0], [1.0, math.nan, 2.0], [1.0, math.inf], [[1.0, 2.0], [3.0, 4.0]]],
)
def test_bad_samples_are_refused(values: object) -> None:
    with pytest.raises(ValueError):
        compare_samples(values, [1.0, 2.0, 3.0], higher_is_better=False)  # type: ignore[arg-type]


def test_confidence_must_be_a_probability() -> None:
    with pytest.raises(ValueError):
        compare_samples([1.0, 2.0], [1.0, 2.0], confidence=1.0, higher_is_better=False)


def test_pairwise_summary_has_bootstrap_intervals() -> None:
    rng = _rng(11)
    values = rng.beta(18, 2, 400)  # mean 0.9
    s = summarize_pairwise(values, higher_is_better=True)
    assert s.n == 400 and s.noise_floor is None
    assert s.mean_ci_low is not None and s.mean_ci_high is not None
    assert s.mean_ci_low < 0.9 < s.mean_ci_high
    assert s.median_ci_low is not None and s.median_ci_high is not None
    assert s.median_ci_low <= s.median <= s.median_ci_high
    _assert_plain_json(s.to_dict())


def test_pairwise_values_below_the_noise_floor_are_flagged() -> None:
    rng = _rng(12)
    floor = rng.beta(40, 2, 200)  # secondary vs primary: mean ~0.95
    candidate = rng.beta(18, 2, 300)  # candidate vs primary: mean ~0.90
    s = summarize_pairwise(candidate, noise_floor=floor, higher_is_better=True)
    assert s.noise_floor is not None
    assert s.noise_floor.significantly_worse
    assert s.noise_floor.mean_shift_ci_high is not None and s.noise_floor.mean_shift_ci_high < 0


def test_pairwise_values_at_the_noise_floor_are_not_flagged() -> None:
    rng = _rng(13)
    floor = rng.beta(40, 2, 200)
    candidate = rng.beta(40, 2, 300)
    s = summarize_pairwise(candidate, noise_floor=floor, higher_is_better=True)
    assert s.noise_floor is not None
    assert not s.noise_floor.significantly_worse
    _assert_plain_json(s.to_dict())
