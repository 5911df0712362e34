"""How many samples a decision needs: power calculations for the judge's tests.

An INCONCLUSIVE verdict is useful only with the wait it implies. These functions turn
the effect observed so far into the number of values per side at which the judge's test
would show it, at the gates' level, with probability :data:`DEFAULT_POWER`.

Theory of operation:
1. Per side: every mirrored exchange gives one value of each backend, so the two sides
   grow together; ``have_per_side`` is the smaller side, and the estimate is for equal
   sides. alpha = (1 - confidence) / family, two-sided, as the judge's intervals are:
   ``family`` is the number of tests the decision is made among (1 for a test alone; the
   judge's rule 10 tests a verdict's checks together by Holm's procedure, whose first bar
   is this one: a single real effect among unchanged metrics is significant there first).
2. Location (Mann-Whitney, the median shift of per-backend metrics): Noether's formula.
   With p = P(candidate > baseline) + P(tie)/2 = (1 + delta)/2, delta Cliff's delta,
   and equal sides,
       n = (z(1 - alpha/2) + z(power))^2 / (6 * (p - 1/2)^2)
         = 2 * (z(1 - alpha/2) + z(power))^2 / (3 * delta^2)   per side.
3. Rates (0/1 metrics, the judge's ``mean_worsening``): the two-proportion formula with
   the pooled variance under the null,
       n = (z(1 - alpha/2)*sqrt(2*pbar*(1 - pbar)) + z(power)*sqrt(p1*q1 + p2*q2))^2
           / (p1 - p2)^2,   pbar = (p1 + p2)/2.
4. Means (cost's ``mean_ratio``): n = (z(1 - alpha/2) + z(power))^2 * (s1^2 + s2^2) / d^2.
4b. Rates ruled out beyond a limit (the judge's rule 1 for a rate: a PASS needs the
   upper end of the change's interval within the limit): the fewest values per side at
   which Newcombe's interval (``_rates`` rule 3) around the rates seen so far ends
   within ``limit``, found by bisection; the interval is taken at the two-sided level
   whose z is z(1 - alpha/2) + z(power), so at power 1/2 it is the judge's own interval.
   This is the sample size of a non-inferiority test (Blackwelder, 1982), with the score
   interval in place of the normal one, which at 0 errors on both sides would say 0.
   A rate seen beyond the limit, or an interval that stays past it at
   :data:`MAX_SAMPLES_ESTIMATE`, gives ``needed_per_side = None``.
5. The estimate is never below ``min_samples`` (the gate's floor: a decision needs
   that many whatever the effect). No observed effect, or an estimate above
   :data:`MAX_SAMPLES_ESTIMATE`, gives ``needed_per_side = None``: no practical window
   shows the effect, and the gates decide on the floor alone.
6. The estimate assumes the observed effect is the true one; early effects are noisy,
   so it is recomputed at every report, not promised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Final, Literal

from scipy import stats

from evaluators._rates import rate_change_interval
from evaluators._statistics import DEFAULT_CONFIDENCE, MIN_COMPARABLE_SAMPLES

__all__ = [
    "DEFAULT_POWER",
    "MAX_SAMPLES_ESTIMATE",
    "PowerQuery",
    "SampleSizeEstimate",
    "samples_needed_for_location",
    "samples_needed_for_mean",
    "samples_needed_for_rate",
    "samples_needed_to_bound_rate",
]

DEFAULT_POWER: Final = 0.8
MAX_SAMPLES_ESTIMATE: Final = 10_000_000

PowerTest = Literal["mann_whitney", "two_proportions", "two_means", "rate_bound"]


@dataclass(frozen=True, slots=True)
class PowerQuery:
    """What every estimate is asked with: the values each side has so far, the test's
    confidence and the number of tests it is made among (alpha = (1 - confidence) /
    family, rule 1), the power wanted, and the gate's floor (rule 5)."""

    have_baseline: int
    have_candidate: int
    confidence: float = DEFAULT_CONFIDENCE
    power: float = DEFAULT_POWER
    min_samples: int = MIN_COMPARABLE_SAMPLES
    family: int = 1

    def __post_init__(self) -> None:
        if self.have_baseline < 0 or self.have_candidate < 0:
            raise ValueError("sample counts are not negative")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if not 0.0 < self.power < 1.0:
            raise ValueError(f"power must lie in (0, 1), got {self.power}")
        if self.family < 1:
            raise ValueError(f"a test is made among at least itself, got family {self.family}")

    @property
    def alpha(self) -> float:
        """Rule 1: the two-sided level each test must reach."""
        return (1.0 - self.confidence) / self.family


@dataclass(frozen=True, slots=True)
class SampleSizeEstimate:
    """Values per side the observed ``effect`` needs for the test to show it (rules)."""

    test: PowerTest
    effect: float
    alpha: float
    power: float
    have_per_side: int
    needed_per_side: int | None
    more_needed: int | None
    reason: str
    family: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def samples_needed_for_location(effect_size: float, asked: PowerQuery) -> SampleSizeEstimate:
    """Noether's estimate (rule 2) from Cliff's delta, the judge's ``effect_size``.

    What a platform engineer reads: ``more_needed``, the mirrored requests still to
    come before a median shift of the size seen so far would be significant, so an
    INCONCLUSIVE latency verdict says "about N more", not only "not yet".
    """
    if not -1.0 <= effect_size <= 1.0:
        raise ValueError(f"Cliff's delta lies in [-1, 1], got {effect_size}")
    z = _z_sum(asked)
    needed = None if effect_size == 0.0 else 2.0 * z**2 / (3.0 * effect_size**2)
    return _estimate("mann_whitney", effect_size, "Cliff's delta", needed, asked)


def samples_needed_for_rate(baseline_rate: float, candidate_rate: float,
                            asked: PowerQuery) -> SampleSizeEstimate:
    """The two-proportion estimate (rule 3) for a 0/1 metric such as success.

    What a platform engineer reads: how many more requests before an error-rate change
    of the size seen so far (``effect``, candidate - baseline) would be significant.
    """
    for rate in (baseline_rate, candidate_rate):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a rate lies in [0, 1], got {rate}")
    z_alpha, z_power = _z_quantiles(asked)
    diff = candidate_rate - baseline_rate
    pbar = (baseline_rate + candidate_rate) / 2.0
    spread = z_alpha * math.sqrt(2.0 * pbar * (1.0 - pbar)) + z_power * math.sqrt(
        baseline_rate * (1.0 - baseline_rate) + candidate_rate * (1.0 - candidate_rate)
    )
    needed = None if diff == 0.0 else spread**2 / diff**2
    return _estimate("two_proportions", diff, "rate change", needed, asked)


def samples_needed_to_bound_rate(baseline_rate: float, candidate_rate: float, limit: float,
                                 higher_is_better: bool,
                                 asked: PowerQuery) -> SampleSizeEstimate:
    """Rule 4b for a 0/1 metric whose rate must be shown no worse than ``limit``.

    What a platform engineer reads: how many more requests before the data can rule out
    an error rate worse than the primary's by more than the gate allows, at the rates seen
    so far (0 errors in 30 on both sides still allows some 15 points more).
    """
    for rate in (baseline_rate, candidate_rate):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a rate lies in [0, 1], got {rate}")
    if limit <= 0.0:
        raise ValueError(f"the limit of a worsening is positive, got {limit}")
    sign = -1.0 if higher_is_better else 1.0
    seen = sign * (candidate_rate - baseline_rate) + 0.0  # no -0
    level = 1.0 - 2.0 * float(stats.norm.sf(_z_sum(asked)))

    def reaches(n: int) -> float:
        """The interval's end toward worse at ``n`` a side, the rates held."""
        ones_b, ones_c = round(baseline_rate * n), round(candidate_rate * n)
        low, high = rate_change_interval(ones_b, n, ones_c, n, level)
        return high if sign > 0.0 else -low

    needed: float | None = None
    if seen < limit and reaches(MAX_SAMPLES_ESTIMATE) <= limit:
        low_n, high_n = 1, MAX_SAMPLES_ESTIMATE
        while low_n < high_n:
            middle = (low_n + high_n) // 2
            if reaches(middle) <= limit:
                high_n = middle
            else:
                low_n = middle + 1
        needed = float(low_n)
    why = (None if needed is not None else
           "the rate seen so far is beyond the limit" if seen >= limit else
           "a change this close to the limit")
    return _estimate("rate_bound", seen, "rate change toward worse", needed, asked,
                     unreachable=why)


def samples_needed_for_mean(mean_shift: float, std_baseline: float, std_candidate: float,
                            asked: PowerQuery) -> SampleSizeEstimate:
    """The two-means estimate (rule 4) for a metric gated on its mean, such as cost.

    What a platform engineer reads: how many more requests before a change of the mean
    of the size seen so far (``effect``, candidate - baseline) would be significant.
    """
    if std_baseline < 0.0 or std_candidate < 0.0:
        raise ValueError("standard deviations are not negative")
    z = _z_sum(asked)
    needed = None
    if mean_shift != 0.0:
        needed = z**2 * (std_baseline**2 + std_candidate**2) / mean_shift**2
    return _estimate("two_means", mean_shift, "mean change", needed, asked)


def _z_quantiles(asked: PowerQuery) -> tuple[float, float]:
    """The two-sided test's critical z and the z of the wanted power."""
    return (float(stats.norm.ppf(1.0 - asked.alpha / 2.0)),
            float(stats.norm.ppf(asked.power)))


def _z_sum(asked: PowerQuery) -> float:
    return sum(_z_quantiles(asked))


def _estimate(test: PowerTest, effect: float, effect_name: str, needed: float | None,
              asked: PowerQuery, *, unreachable: str | None = None) -> SampleSizeEstimate:
    """Rules 1 and 5: round up, floor at ``min_samples``, None when out of reach
    (``unreachable`` says why, where the test has its own words for it)."""
    have = min(asked.have_baseline, asked.have_candidate)
    alpha, family = asked.alpha, asked.family
    power, min_samples = asked.power, asked.min_samples
    if needed is None or not math.isfinite(needed) or needed > MAX_SAMPLES_ESTIMATE:
        why = unreachable or ("no effect observed" if needed is None else
                              "an effect this small")
        reason = (
            f"{why} ({effect_name} {effect:.3g}): no practical number of samples "
            f"shows it; the gates decide once each side has {min_samples}"
        )
        return SampleSizeEstimate(test, float(effect), alpha, power, have, None, None, reason,
                                  family)
    per_side = max(math.ceil(needed - 1e-9), min_samples)
    more = max(0, per_side - have)
    among = "" if family == 1 else f" ({1.0 - asked.confidence:.2g} over {family} tests)"
    reason = (
        f"{effect_name} {effect:.3g} needs about {per_side} values per side for "
        f"power {power:g} at alpha {alpha:.2g}{among}; {have} so far, {more} more"
    )
    return SampleSizeEstimate(test, float(effect), alpha, power, have, per_side, more, reason,
                              family)
