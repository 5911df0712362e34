"""The judge's rule 7: how many values per side an INCONCLUSIVE metric waits for.

``_power.py`` holds the power calculations; this module picks the one that decides a
metric's gate (a mean's for a limit on a mean, a rate's for a rate, else the median
shift's, within strata where the metric was compared at matched load) and asks it at
:data:`ESTIMATE_POWER`. Rule numbers are the judge's (``_judge.py``).
"""

from __future__ import annotations

import dataclasses

from evaluators._gates import MetricGate
from evaluators._power import (
    PowerQuery,
    SampleSizeEstimate,
    samples_needed_for_location,
    samples_needed_for_mean,
    samples_needed_for_rate,
    samples_needed_to_bound_rate,
)
from evaluators._rates import RateComparison
from evaluators._statistics import Comparison
from evaluators._strata import StratifiedComparison

__all__ = ["ESTIMATE_POWER", "gate_estimate", "rate_estimate"]

ESTIMATE_POWER = 0.5
"""Rule 7: the power ``samples_needed`` is computed for. At 0.5 the estimate is the count
at which the test is as likely as not to show the effect seen so far, the count a
platform engineer should expect the verdict to turn at; about twice it gives power 0.8."""


def gate_estimate(
    gate: MetricGate, statistics: Comparison | None,
    matched: StratifiedComparison | None, asked: PowerQuery,
) -> SampleSizeEstimate | None:
    """Rule 7 for the test that decides the metric's gate (a rate's: :func:`rate_estimate`)."""
    if statistics is None:
        return None
    if gate.max_mean_ratio is not None:
        return samples_needed_for_mean(
            statistics.mean_candidate - statistics.mean_baseline, statistics.std_baseline,
            statistics.std_candidate, asked)
    effect = statistics.effect_size
    if matched is not None and matched.effect_size is not None:
        effect = matched.effect_size
    return samples_needed_for_location(_unit(effect, -1.0), asked)


def _unit(x: float, low: float = 0.0) -> float:
    return min(1.0, max(low, x))


def rate_estimate(gate: MetricGate, rates: RateComparison | None, asked: PowerQuery,
                  band: float) -> SampleSizeEstimate | None:
    """Rule 7 for a rate: where its change seen so far is inside the limit's band, the
    values per side at which its interval rules the limit out; else those at which the
    change would be significant."""
    limit = gate.max_mean_worsening
    if rates is None or limit is None:
        return None
    rate_b, rate_c = rates.rate_baseline, rates.rate_candidate
    worse = (rate_b - rate_c) if rates.higher_is_better else (rate_c - rate_b)
    if limit > 0.0 and worse <= limit * (1.0 - band):
        # Inside the band the verdict turns when the interval rules the limit out.
        return samples_needed_to_bound_rate(rate_b, rate_c, limit, rates.higher_is_better,
                                            dataclasses.replace(asked, family=1))
    return samples_needed_for_rate(rate_b, rate_c, asked)
