"""The checks: one metric's gate applied to its statistics, each check graded alone.

A :class:`Check` is one limit of a :class:`~evaluators._gates.MetricGate` held against one
metric's statistics. :func:`backend_checks` builds a per-backend metric's (candidate
against primary), :func:`rate_check` a rate's, :func:`stratified_shift_check` a median
shift estimated within strata (the judge's rule 6), :func:`pairwise_checks` a pairwise
metric's (its limits and its noise floor):

1. Every check is oriented so that larger is worse: its value, threshold and interval
   are in the check's units, and a metric where higher is better has its shift negated
   and its ratio inverted (primary/candidate), intervals with it. It is graded by the
   judge's rule 2 (:func:`_graded`), within a band of ``marginal_band`` times its
   threshold (for a limit on a mean, times the limit); a statistic that is undefined (a
   ratio over a zero) leaves the check to its evidence alone.
2. A rate's check (:func:`rate_check`; a gate with ``max_mean_worsening``, ``_gates``
   rule 3) reads counts, not a bootstrap (``_rates`` rules 1-3): its evidence is
   Fisher's exact test, its interval Newcombe's, and it passes only where that interval
   rules out a worsening beyond the limit (:attr:`Check.bounded`; the judge's rule 1).
3. A check that tests something carries a one-sided p-value (:attr:`Check.p_value`): its
   test's where it has one (Fisher's; Brown-Forsythe's, halved, where the spread grew),
   else read from its own interval (:func:`_interval_p`), so that it agrees with the
   check's evidence. The judge's rule 10 tests a verdict's checks together on those
   p-values; a check significant alone but not among them is graded again as not
   significant, with the same band (:func:`not_significant_overall`).
4. A pairwise limit is relaxed to a noise floor's mean, by at most
   ``Gates.max_noise_floor_miss`` of it (the judge's rule 3); a replica that misses it by
   more is no noise floor (:func:`broken_floor`), here or for any other metric
   (:func:`on_broken_floor`, the judge's rule 11).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any, Final

from scipy import stats

from evaluators._gates import DEFAULT_MAX_NOISE_FLOOR_MISS, MetricGate
from evaluators._rates import RATE_TEST, RateComparison
from evaluators._statistics import Comparison, PairwiseSummary
from evaluators._strata import StratifiedComparison

__all__ = [
    "SEVERITY",
    "Check",
    "Outcome",
    "backend_checks",
    "broken_floor",
    "not_significant_overall",
    "on_broken_floor",
    "pairwise_checks",
    "rate_check",
    "stratified_shift_check",
]


class Outcome(StrEnum):
    PASS = "PASS"
    MARGINAL = "MARGINAL"
    INCONCLUSIVE = "INCONCLUSIVE"
    FAIL = "FAIL"


SEVERITY: Final = {Outcome.PASS: 0, Outcome.MARGINAL: 1, Outcome.INCONCLUSIVE: 2, Outcome.FAIL: 3}


@dataclass(frozen=True, slots=True)
class Check:
    """One rule applied to one metric. ``value``, ``threshold`` and the interval are in
    the check's units, oriented so that larger is worse (the judge's rule 2)."""

    name: str
    outcome: Outcome
    value: float | None
    threshold: float | None
    ci_low: float | None
    ci_high: float | None
    significant: bool
    reason: str
    p_value: float | None = None
    """One-sided: how likely a value this far on the bad side of the evidence's null is
    if the candidate is no worse (None: the check tests nothing, or its test gives no p)."""
    margin: float | None = None
    """The band around the threshold this check was graded with (None: not graded by
    the judge's rule 2, so not graded again by its rule 10)."""
    bounded: bool = False
    """A PASS needs the interval's upper end (``ci_high``) within the threshold, not the
    estimate alone (a rate, rule 2: the judge's rule 1); short of it the check is
    INCONCLUSIVE, too few samples to tell."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["outcome"] = self.outcome.value
        for key in ("value", "threshold", "ci_low", "ci_high", "p_value", "margin"):
            if out[key] is not None and not math.isfinite(out[key]):
                out[key] = None  # JSON has no infinity; the reason says "inf"
        return out


@dataclass(frozen=True, slots=True)
class _Evidence:
    """x oriented so that larger is worse, its interval, and whether it is significant."""

    x: float | None
    low: float | None
    high: float | None
    significant: bool
    p_value: float | None = None
    bounded: bool = False


def backend_checks(c: Comparison, gate: MetricGate, band: float, *,
                   baseline: str = "primary") -> list[Check]:
    """The judge's rule 2 for a per-backend metric's enabled checks (a rate's gate is
    :func:`rate_check`'s: rule 2); ``baseline`` names what the candidate was compared
    with in the reasons (the primary, or the replica at the same rate)."""
    if gate.max_mean_worsening is not None:
        raise ValueError("a rate's check reads its counts (rate_check), not a Comparison")
    hib = c.higher_is_better
    ratio = f"{baseline}/candidate" if hib else f"candidate/{baseline}"  # larger is worse
    checks: list[Check] = []
    if gate.max_shift_ratio is not None:
        low, high = _orient_shift(c.relative_ci_low, c.relative_ci_high, hib)
        x = None if c.relative_shift is None else _worse(c.relative_shift, hib)
        evidence = _Evidence(x, low, high, c.significantly_worse,
                             _interval_p(x, low, 0.0, c.confidence))
        label = f"median change toward worse, relative to the {baseline}'s"
        checks.append(_graded("median_shift", label, evidence, gate.max_shift_ratio, band, True))
    if gate.max_mean_ratio is not None:
        low, high = _orient_ratio(c.mean_ratio_ci_low, c.mean_ratio_ci_high, hib)
        x = None if c.mean_ratio is None else _worse_ratio(c.mean_ratio, hib)
        shift_low, _ = _orient_shift(c.mean_shift_ci_low, c.mean_shift_ci_high, hib)
        significant = _above(low, 1.0) if x is not None else _above(shift_low, 0.0)
        p_value = (_interval_p(x, low, 1.0, c.confidence) if x is not None else
                   _interval_p(_worse(c.mean_shift, hib), shift_low, 0.0, c.confidence))
        evidence = _Evidence(x, low, high, significant, p_value)
        label = f"mean ratio {ratio}"
        checks.append(_graded("mean_ratio", label, evidence, gate.max_mean_ratio, band))
    if gate.max_tail_ratio is not None:
        low, high = _orient_ratio(c.tail_ratio_ci_low, c.tail_ratio_ci_high, hib)
        x = None if c.tail_ratio is None else _worse_ratio(c.tail_ratio, hib)
        tail_worse = _worse(c.tail_candidate - c.tail_baseline, hib) > 0.0
        significant = _above(low, gate.max_tail_ratio) if x is not None else tail_worse
        evidence = _Evidence(x, low, high, significant,
                             _interval_p(x, low, gate.max_tail_ratio, c.confidence))
        label = f"p{round(c.tail_quantile * 100)} ratio {ratio} (the bad tail)"
        checks.append(_graded("tail_ratio", label, evidence, gate.max_tail_ratio, band))
    if gate.max_std_ratio is not None:
        if c.significantly_better and c.slow_side_std_ratio is not None \
                and c.slow_side_variance_p_value is not None:
            # A wider spread around a better centre harms nobody where the answers on the
            # slow side of the baseline's median spread no wider: the check guards against
            # hidden tails, so it reads that side. Read whole, a candidate that made half
            # its answers twice as fast and left the rest as they were FAILed in 11 of 12
            # windows; excused on a p99 no worse, one 10 % faster with 0.5 % of its answers
            # stalled 10x PASSed.
            x = c.slow_side_std_ratio
            slow_p = c.slow_side_variance_p_value
            grew = x > 1.0
            label = (f"std ratio candidate/{baseline} on the slow side of the {baseline}'s "
                     f"median, the candidate significantly better (Brown-Forsythe "
                     f"p={slow_p:.3g})")
            evidence = _Evidence(x, None, None, grew and slow_p < c.alpha,
                                 slow_p / 2.0 if grew else 1.0)
            checks.append(_graded("std_ratio", label, evidence, gate.max_std_ratio, band))
        else:
            x = c.std_ratio
            if x is None:
                x = math.inf if c.std_candidate > 0.0 else 1.0
            label = (f"std ratio candidate/{baseline} (Brown-Forsythe "
                     f"p={c.variance_p_value:.3g})")
            # Brown-Forsythe's p is two-sided; the check asks whether the spread grew.
            p_value = c.variance_p_value / 2.0 if c.std_candidate > c.std_baseline else 1.0
            evidence = _Evidence(x, None, None, c.variance_increased, p_value)
            checks.append(_graded("std_ratio", label, evidence, gate.max_std_ratio, band))
    return checks


def rate_check(rates: RateComparison, gate: MetricGate, band: float, *,
               scope: str = "") -> Check:
    """Rule 2: the judge's rule 2 for a rate, on its samples compared as counts; ``scope``
    says what the counts cover (the report's: its whole window), in the reason."""
    if gate.max_mean_worsening is None:
        raise ValueError("the gate has no rate check")
    hib = rates.higher_is_better
    low, high = _orient_shift(rates.change_ci_low, rates.change_ci_high, hib)
    x = _worse(rates.change, hib) + 0.0  # no -0
    one_sided = (1.0 - rates.confidence) / 2.0
    evidence = _Evidence(x, low, high, rates.p_worse < one_sided, rates.p_worse,
                         bounded=True)
    over = f" over {scope}" if scope else ""
    label = (f"change of the rate toward worse{over} ({rates.ones_candidate}/"
             f"{rates.n_candidate} against {rates.ones_baseline}/{rates.n_baseline}, "
             f"{RATE_TEST} p={rates.p_worse:.2g})")
    return _graded("mean_worsening", label, evidence, gate.max_mean_worsening, band)


def stratified_shift_check(
    s: StratifiedComparison, gate: MetricGate, band: float, basis: str
) -> Check:
    """The median-shift check (the judge's rule 2) on a shift estimated within strata (its
    rule 6)."""
    hib = s.higher_is_better
    low, high = _orient_shift(s.relative_ci_low, s.relative_ci_high, hib)
    x = None if s.relative_shift is None else _worse(s.relative_shift, hib)
    evidence = _Evidence(x, low, high, s.significantly_worse,
                         _interval_p(x, low, 0.0, s.confidence))
    p = "n/a" if s.p_value is None else f"{s.p_value:.3g}"
    label = (f"median change toward worse {basis.removeprefix('primary ')}, relative to "
             f"the primary's (van Elteren p={p})")
    if gate.max_shift_ratio is None:
        raise ValueError("the gate has no median-shift check")
    return _graded("median_shift", label, evidence, gate.max_shift_ratio, band, True)


def pairwise_checks(
    s: PairwiseSummary, floor: Comparison | None, gate: MetricGate, band: float, *,
    max_floor_miss: float = DEFAULT_MAX_NOISE_FLOOR_MISS, replica: str | None = None,
    broken: str | None = None,
) -> list[Check]:
    """The judge's rules 2 and 3 for a pairwise metric; ``floor`` compares the values
    (candidate) with the noise floor's (baseline), measured on ``replica`` (its name,
    where known); ``max_floor_miss`` bounds the relaxation (``Gates.max_noise_floor_miss``).
    ``broken`` says which metric showed that replica broken (:func:`broken_floor`): it
    is then no floor here either (the judge's rule 11)."""
    checks: list[Check] = []
    for limit, sign in _mean_limits(gate):
        miss = 0.0 if floor is None else _floor_miss(floor, limit, sign)
        bound = max_floor_miss * abs(limit)
        if floor is None or miss <= 0.0:
            checks.append(_limit_check(s, None, limit, sign, band))
        elif miss <= bound and broken is not None:
            checks.append(_not_relaxed(s, floor, limit, sign, band, broken))
        elif miss <= bound:
            checks.append(_limit_check(s, floor, limit, sign, band))
        else:
            # No noise floor (judge rule 3): graded as configured and as if relaxed; a
            # FAIL stands only where both grades give it.
            configured = _limit_check(s, None, limit, sign, band)
            relaxed = _limit_check(s, floor, limit, sign, band)
            both_fail = configured.outcome is relaxed.outcome is Outcome.FAIL
            if configured.outcome is not Outcome.FAIL or both_fail:
                checks.append(configured)
            checks.append(_no_noise_floor(sign, limit, floor.mean_baseline, miss, bound,
                                          max_floor_miss, replica, configured.outcome,
                                          both_fail))
    tolerance = gate.max_noise_floor_shift_ratio
    if floor is not None and tolerance is not None and gate.noise_floor_statistic == "median":
        hib = floor.higher_is_better
        low, high = _orient_shift(floor.relative_ci_low, floor.relative_ci_high, hib)
        x = None if floor.relative_shift is None else _worse(floor.relative_shift, hib)
        evidence = _Evidence(x, low, high, floor.significantly_worse,
                             _interval_p(x, low, 0.0, floor.confidence))
        label = "median change toward worse beyond the noise floor, relative to the floor's"
        checks.append(on_broken_floor(_graded("noise_floor", label, evidence, tolerance,
                                              band, True), broken))
    elif floor is not None and tolerance is not None:
        scale = abs(floor.mean_baseline)
        hib = floor.higher_is_better
        low, high = _orient_shift(floor.mean_shift_ci_low, floor.mean_shift_ci_high, hib)
        x = _worse(floor.mean_shift, hib) / scale if scale > 0.0 else None
        rel = [None if b is None or scale == 0.0 else b / scale for b in (low, high)]
        evidence = _Evidence(x, rel[0], rel[1], _above(low, 0.0),
                             _interval_p(x, rel[0], 0.0, floor.confidence))
        label = "mean change toward worse beyond the noise floor, relative to the floor"
        checks.append(on_broken_floor(_graded("noise_floor", label, evidence, tolerance,
                                              band, True), broken))
    return checks


def broken_floor(metric: str, floor: Comparison, gate: MetricGate, max_floor_miss: float,
                 replica: str | None = None) -> str | None:
    """Why ``replica`` is no noise floor, as rule 3 of the judge found on ``metric``: the
    first of its limits that the replica's own mean misses by more than
    ``max_floor_miss`` of it (None: it misses none so far)."""
    for limit, sign in _mean_limits(gate):
        miss = _floor_miss(floor, limit, sign)
        if miss > max_floor_miss * abs(limit):
            kind = "minimum" if sign > 0 else "maximum"
            who = "the replica" + (f" {replica!r}" if replica else "")
            return (f"{who} missed {metric}'s {kind} {limit:.4g} by {miss:.4g} (beyond "
                    f"{max_floor_miss:.0%} of it, max_noise_floor_miss)")
    return None


def _mean_limits(gate: MetricGate) -> list[tuple[float, float]]:
    """A pairwise gate's limits on the mean, each with its sense (+1 a minimum, -1 a
    maximum)."""
    return [(limit, sign) for limit, sign in ((gate.min_mean, 1.0), (gate.max_mean, -1.0))
            if limit is not None]


def _floor_miss(floor: Comparison, limit: float, sign: float) -> float:
    """How far the replica's own mean (``floor``'s baseline) misses ``limit`` on its
    wrong side (at most 0: it keeps the limit)."""
    return sign * (limit - floor.mean_baseline)


def on_broken_floor(check: Check, broken: str | None) -> Check:
    """A noise-floor ``check`` read on a replica shown ``broken`` (the judge's rule 11):
    a FAIL stands (worse even than that replica); anything else is INCONCLUSIVE with what
    it measured, and tests nothing among the verdict's checks (no p-value, no band)."""
    if broken is None or check.outcome is Outcome.FAIL:
        return check
    return replace(check, outcome=Outcome.INCONCLUSIVE, p_value=None, margin=None,
                   reason=f"noise floor not used: {broken}; as if it were the floor, "
                          f"{check.outcome.value}: {check.reason}")


def _not_relaxed(s: PairwiseSummary, floor: Comparison, limit: float, sign: float,
                 band: float, broken: str) -> Check:
    """The judge's rule 11 for a limit its replica misses within the bound: graded as
    configured and as if relaxed, as its rule 3 grades a limit beyond it; a FAIL stands
    only where both give it."""
    configured = _limit_check(s, None, limit, sign, band, f" (not relaxed: {broken})")
    if configured.outcome is not Outcome.FAIL:
        return configured
    relaxed = _limit_check(s, floor, limit, sign, band)
    if relaxed.outcome is Outcome.FAIL:
        return configured
    head = configured.reason.rsplit(": ", 1)[0]  # the words after the last ": " say why
    return replace(configured, outcome=Outcome.INCONCLUSIVE, p_value=None, margin=None,
                   reason=f"{head}: FAIL as configured but {relaxed.outcome.value} as if "
                          f"relaxed to the replica's mean {floor.mean_baseline:.4g}; the "
                          "replica is broken or the primary that noisy, and which holds "
                          "cannot be told")


def _limit_check(s: PairwiseSummary, floor: Comparison | None, limit: float, sign: float,
                 band: float, note: str = "") -> Check:
    """The judge's rule 2 mean_limit check of a minimum (``sign`` 1) or maximum (-1);
    relaxed to ``floor``'s mean when given (the judge's rule 3); ``note`` follows the
    limit."""
    kind = "minimum" if sign > 0 else "maximum"
    interval = [sign * (limit - b) for b in (s.mean_ci_low, s.mean_ci_high) if b is not None]
    if floor is not None:
        note = f" (relaxed from {limit:.4g} to the noise floor's mean)"
        limit = floor.mean_baseline
        # The floor's mean is measured too: the shortfall's interval is the two samples'
        # (candidate - floor), not the candidate's alone against a constant.
        interval = [-sign * b for b in (floor.mean_shift_ci_low, floor.mean_shift_ci_high)
                    if b is not None]
    bounds = sorted(interval)
    low, high = (bounds[0], bounds[1]) if len(bounds) == 2 else (None, None)
    shortfall = sign * (limit - s.mean)
    evidence = _Evidence(shortfall, low, high, _above(low, 0.0),
                         _interval_p(shortfall, low, 0.0, s.confidence))
    label = f"mean {s.mean:.4g} against the {kind} {limit:.4g}{note}, shortfall"
    return _graded("mean_limit", label, evidence, 0.0, 0.0, margin=band * abs(limit))


def _no_noise_floor(sign: float, limit: float, floor_mean: float, miss: float, bound: float,
                    share: float, replica: str | None, configured: Outcome,
                    both_fail: bool) -> Check:
    """The judge's rule 3: a replica that misses a limit by more than the bound is no
    noise floor; the limit is not relaxed, and the metric passes on neither grade."""
    kind = "minimum" if sign > 0 else "maximum"
    who = "the noise-floor replica" + (f" {replica!r}" if replica else "")
    if both_fail:
        then = "the candidate FAILs it both as configured and as if relaxed"
    elif configured is Outcome.PASS:
        then = "the candidate keeps it as configured, but no PASS rests on a broken floor"
    else:
        then = (f"the candidate is {configured.value} on it as configured, not a FAIL as "
                "if relaxed, and which holds cannot be told")
    reason = (f"{who} misses the {kind} {limit:.4g} itself by {miss:.4g} (its mean "
              f"{floor_mean:.4g}), beyond the bound {bound:.4g} ({share:.0%} of the limit, "
              f"max_noise_floor_miss): no noise floor, not relaxed; {then}; fix or replace "
              "that replica")
    return Check("noise_floor_bound", Outcome.INCONCLUSIVE, miss, bound, None, None, False,
                 reason)


def _graded(
    name: str,
    label: str,
    e: _Evidence,
    threshold: float,
    band: float,
    percent: bool = False,
    *,
    margin: float | None = None,
) -> Check:
    """Rule 1: the judge's rule 2, with margin = band * |threshold| unless given; an
    undefined x (a ratio over zero) falls back to the evidence alone."""
    fmt = _percent if percent else _number
    margin = band * abs(threshold) if margin is None else margin
    upper = e.high if e.bounded else None
    outcome, why = _grade(e.significant, e.x, threshold, margin, e.bounded, upper)
    if e.x is None:
        reason = f"{label} undefined (a zero denominator): {why}"
        return Check(name, outcome, None, threshold, e.low, e.high, e.significant, reason,
                     e.p_value, margin, e.bounded)
    interval = ""
    if e.low is not None and e.high is not None:
        interval = f" (CI {fmt(e.low)}..{fmt(e.high)})"
    band_text = f"{margin:.1%}" if percent else _number(margin)
    reason = f"{label}: {fmt(e.x)}{interval}; limit {fmt(threshold)} +/- {band_text}: {why}"
    return Check(name, outcome, e.x, threshold, e.low, e.high, e.significant, reason,
                 e.p_value, margin, e.bounded)


def _grade(significant: bool, x: float | None, threshold: float | None,
           margin: float, bounded: bool = False,
           upper: float | None = None) -> tuple[Outcome, str]:
    """The judge's rule 2 outcome and the words that say why (the last part of a check's
    reason); a ``bounded`` check passes only with its interval's ``upper`` end within the
    limit."""
    if x is None or threshold is None:
        if significant:
            return Outcome.MARGINAL, "significantly worse"
        return Outcome.PASS, "no significant worsening"
    if significant and x > threshold + margin:
        return Outcome.FAIL, "significant, and beyond the limit and its band"
    if significant:
        return Outcome.MARGINAL, "significant, but not beyond the limit and its band"
    if x > threshold - margin:
        return Outcome.MARGINAL, "not significant, but in the limit's band or beyond"
    if bounded and (upper is None or upper > threshold):
        return Outcome.INCONCLUSIVE, ("too few samples: the interval does not rule out a "
                                      "worsening beyond the limit")
    return Outcome.PASS, "within the limit"


def not_significant_overall(check: Check, note: str) -> Check:
    """``check``, whose evidence held alone but not among all of a verdict's checks (the
    judge's rule 10), graded again as not significant; ``note`` says why."""
    if check.margin is None:
        raise ValueError(f"{check.name}: not a check graded by the judge's rule 2")
    outcome, why = _grade(False, check.value, check.threshold, check.margin, check.bounded,
                          check.ci_high)
    head = check.reason.rsplit(": ", 1)[0]  # the words after the last ": " say why
    return replace(check, outcome=outcome, significant=False,
                   reason=f"{head}: {why} ({note})")


def _interval_p(x: float | None, low: float | None, null: float,
                confidence: float) -> float | None:
    """One-sided p that x is no worse than ``null``, read from its two-sided interval at
    ``confidence`` by the normal approximation on the interval's lower side (Altman and
    Bland, "How to obtain the P value from a confidence interval", BMJ 2011). It is below
    (1 - confidence) / 2 exactly when the interval lies wholly above ``null``, so it
    agrees with the check's own evidence."""
    if x is None or low is None or not (math.isfinite(x) and math.isfinite(low)):
        return None
    if x <= low:  # a degenerate interval: the estimate is its lower end
        return 0.0 if low > null else 1.0
    z = float(stats.norm.isf((1.0 - confidence) / 2.0))
    return float(stats.norm.sf(z * (x - null) / (x - low)))


def _worse(shift: float, higher_is_better: bool) -> float:
    return -shift if higher_is_better else shift


def _worse_ratio(ratio: float, higher_is_better: bool) -> float:
    if not higher_is_better:
        return ratio
    return 1.0 / ratio if ratio > 0.0 else math.inf


def _orient_shift(
    low: float | None, high: float | None, higher_is_better: bool
) -> tuple[float | None, float | None]:
    if not higher_is_better:
        return low, high
    return (None if high is None else -high), (None if low is None else -low)


def _orient_ratio(
    low: float | None, high: float | None, higher_is_better: bool
) -> tuple[float | None, float | None]:
    if not higher_is_better:
        return low, high
    return (
        None if high is None else _worse_ratio(high, True),
        None if low is None else _worse_ratio(low, True),
    )


def _above(value: float | None, bar: float) -> bool:
    return value is not None and value > bar


def _percent(x: float) -> str:
    return f"{x:+.1%}" if math.isfinite(x) else str(x)


def _number(x: float) -> str:
    return f"{x:.4g}"
