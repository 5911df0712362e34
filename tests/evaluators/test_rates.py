"""Rates compared as counts, on known counts: every test is deterministic."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from evaluators._rates import RateCounts, compare_rates


def _assert_plain_json(value: dict[str, object]) -> None:
    """Only Python's own types, and no NaN or infinity."""
    for item in value.values():
        assert item is None or type(item) in (bool, int, float, str), (item, type(item))
        if isinstance(item, float):
            assert math.isfinite(item)


def test_a_rate_is_compared_as_counts_with_fishers_exact_test() -> None:
    """Rule 2: the one-sided p is Fisher's, toward worse on either orientation."""
    successes = compare_rates(RateCounts.of(np.ones(30)),
                              RateCounts.of(np.r_[np.ones(25), np.zeros(5)]),
                              higher_is_better=True)
    errors = compare_rates(RateCounts(30, 0), RateCounts(30, 5), higher_is_better=False)
    fisher = stats.fisher_exact(np.array([[5, 0], [25, 30]]), alternative="greater").pvalue
    for r in (successes, errors):
        assert abs(r.p_worse - fisher) < 1e-12  # 0.026
        assert r.change_ci_low < 0.0 < r.change_ci_high  # no change is still in it
    assert (successes.ones_candidate, successes.n_candidate) == (25, 30)
    _assert_plain_json(successes.to_dict())


def test_newcombes_interval_is_wilsons_at_a_rate_of_zero() -> None:
    """Rule 3: against a primary with no errors in 30, the candidate's 0 errors in 30
    still allow its Wilson bound (the rule of three's ~15 % at a one-sided 1 %), where
    the bootstrap's interval was [0, 0]."""
    r = compare_rates(RateCounts(30, 30), RateCounts(30, 30), higher_is_better=True)
    wilson = stats.binomtest(30, 30).proportion_ci(0.98, method="wilson")
    assert r.change == 0.0
    assert abs(r.change_ci_low - (wilson.low - 1.0)) < 1e-12
    assert 0.14 < -r.change_ci_low < 0.16 and r.p_worse == 1.0


def test_a_rate_holds_only_zeros_and_ones() -> None:
    with pytest.raises(ValueError, match="other than 0 and 1"):
        compare_rates(RateCounts.of(np.ones(10)), RateCounts.of(np.full(10, 0.5)),
                      higher_is_better=True)
