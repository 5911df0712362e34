"""Like compared with like: two samples compared within strata, then combined.

A mirrored candidate does not see the primary's conditions (its load, its cache), so a
pooled comparison measures the conditions as much as the backend. Each value carries the
label of the condition it was measured under (a concurrency bin, a cache stratum); the
comparison happens inside each label and only then is combined.

Theory of operation:
1. A stratum is comparable when each backend holds at least ``min_per_stratum``
   (:data:`MIN_STRATUM_SAMPLES`) values in it; the others are reported with their counts
   and medians but take no part in the test. No comparable stratum means no comparison:
   ``comparable`` is False and every statistic is None, never a verdict made up from
   values measured under different conditions.
2. The test is van Elteren's stratified Wilcoxon test. In stratum s, with m_s candidate
   and n_s baseline values, N_s = m_s + n_s, U_s the candidate's Mann-Whitney U
   (pairs candidate > baseline, ties counting one half) and t the sizes of tied groups:
       T   = sum_s (U_s - m_s*n_s/2) / (N_s + 1)
       V   = sum_s m_s*n_s / (12*(N_s + 1)^2) * (N_s + 1 - sum(t^3 - t) / (N_s*(N_s - 1)))
       z   = T / sqrt(V),   p = 2*(1 - Phi(|z|)).
   The weight 1/(N_s + 1) is the locally most powerful one for a common shift; with one
   stratum it is Mann-Whitney's normal approximation without continuity correction.
3. The common shift (candidate - baseline, in the metric's units) is the Hodges-Lehmann
   estimate of that test: the d at which z(d) = 0, z(d) being z computed with the
   candidate's values moved by -d; its interval is {d : |z(d)| <= z(1 - alpha/2)}, the
   test inverted (ties ignored, as in the continuous case). z(d) is a decreasing step
   function, so each end is found by bisection over the range of the differences, to
   ``SHIFT_SEARCH_STEPS`` halvings. Each stratum's own shift is its Hodges-Lehmann
   estimate, the median of its differences (the same search above
   ``EXACT_SHIFT_MAX_PAIRS`` pairs).
4. The stratified effect size is Cliff's delta of each stratum, averaged with the test's
   weights m_s*n_s/(N_s + 1); the relative shift divides by the baseline's medians
   averaged with the same weights.
5. Every shift is candidate - baseline; ``higher_is_better`` only says which side of
   zero is worse, as in ``evaluators/_statistics.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from itertools import pairwise
from typing import Any, Final

import numpy as np
from scipy import stats

from evaluators._statistics import DEFAULT_CONFIDENCE, FloatArray

__all__ = [
    "EXACT_SHIFT_MAX_PAIRS",
    "MIN_STRATUM_SAMPLES",
    "SHIFT_SEARCH_STEPS",
    "StratifiedComparison",
    "Stratum",
    "bin_labels",
    "compare_strata",
]

MIN_STRATUM_SAMPLES: Final = 5
SHIFT_SEARCH_STEPS: Final = 60
EXACT_SHIFT_MAX_PAIRS: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class Stratum:
    """One condition's values of each backend; ``shift`` is candidate - baseline there."""

    label: str
    n_baseline: int
    n_candidate: int
    median_baseline: float | None
    median_candidate: float | None
    comparable: bool
    shift: float | None
    weight: float


@dataclass(frozen=True, slots=True)
class StratifiedComparison:
    """A comparison within strata (the module's rules); None where not comparable.

    ``n_*_matched`` count the values in comparable strata: what the verdict rests on.
    ``statistic`` is van Elteren's z (positive: the candidate's values are larger).
    """

    comparable: bool
    reason: str
    confidence: float
    higher_is_better: bool
    strata: tuple[Stratum, ...]
    n_baseline: int
    n_candidate: int
    n_baseline_matched: int
    n_candidate_matched: int
    statistic: float | None
    p_value: float | None
    shift: float | None
    shift_ci_low: float | None
    shift_ci_high: float | None
    relative_shift: float | None
    relative_ci_low: float | None
    relative_ci_high: float | None
    effect_size: float | None

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    @property
    def significantly_worse(self) -> bool:
        """The whole shift interval lies on the bad side of zero."""
        low, high = self.shift_ci_low, self.shift_ci_high
        if low is None or high is None:
            return False
        return high < 0.0 if self.higher_is_better else low > 0.0

    @property
    def significantly_better(self) -> bool:
        low, high = self.shift_ci_low, self.shift_ci_high
        if low is None or high is None:
            return False
        return low > 0.0 if self.higher_is_better else high < 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["strata"] = [{f.name: getattr(s, f.name) for f in fields(s)} for s in self.strata]
        out["significantly_worse"] = self.significantly_worse
        out["significantly_better"] = self.significantly_better
        return out


def bin_labels(values: Sequence[float] | FloatArray, edges: Sequence[float]) -> list[str]:
    """Label each value with its half-open bin [edge_i, edge_i+1) of increasing ``edges``:
    ``"<e0"`` below the first, ``"[a, b)"`` between, ``">=eK"`` from the last: the
    condition a platform engineer reads in the report ("concurrency [4, 5)")."""
    bounds = np.asarray(edges, dtype=np.float64)
    if bounds.ndim != 1 or bounds.size == 0 or np.any(np.diff(bounds) <= 0):
        raise ValueError("edges must be a non-empty, strictly increasing sequence")
    names = [f"<{_num(bounds[0])}"]
    names += [f"[{_num(lo)}, {_num(hi)})" for lo, hi in pairwise(bounds)]
    names.append(f">={_num(bounds[-1])}")
    index = np.searchsorted(bounds, np.asarray(values, dtype=np.float64), side="right")
    return [names[int(i)] for i in index]


def compare_strata(
    baseline: Sequence[float] | FloatArray,
    baseline_strata: Sequence[str],
    candidate: Sequence[float] | FloatArray,
    candidate_strata: Sequence[str],
    *,
    higher_is_better: bool,
    order: Sequence[str] | None = None,
    min_per_stratum: int = MIN_STRATUM_SAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> StratifiedComparison:
    """Compare candidate with baseline inside each stratum and combine (module rules).

    What a platform engineer reads: whether the candidate differs from the baseline under
    the same conditions (``p_value``, ``shift`` and its interval, ``relative_shift``),
    which conditions both backends were seen under (``strata`` with ``comparable``), and
    how much of each sample the answer rests on (``n_*_matched``). Strata are listed in
    ``order`` when given (labels not in it follow, sorted), else sorted.
    """
    b = _finite(baseline, "baseline")
    c = _finite(candidate, "candidate")
    if len(baseline_strata) != b.size or len(candidate_strata) != c.size:
        raise ValueError("each value needs exactly one stratum label")
    if min_per_stratum < 2:
        raise ValueError("min_per_stratum must be at least 2")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    b_labels = np.asarray(baseline_strata, dtype=object)
    c_labels = np.asarray(candidate_strata, dtype=object)
    present = set(baseline_strata) | set(candidate_strata)
    listed = [s for s in (order or ()) if s in present]
    labels = listed + sorted(present - set(listed))

    groups: list[tuple[str, FloatArray, FloatArray]] = []
    for label in labels:
        groups.append((label, np.sort(b[b_labels == label]), np.sort(c[c_labels == label])))
    usable = [g for g in groups if min(g[1].size, g[2].size) >= min_per_stratum]
    weights = {g[0]: g[1].size * g[2].size / (g[1].size + g[2].size + 1.0) for g in usable}
    total_weight = sum(weights.values())
    strata = tuple(
        Stratum(
            label=label,
            n_baseline=int(bs.size),
            n_candidate=int(cs.size),
            median_baseline=float(np.median(bs)) if bs.size else None,
            median_candidate=float(np.median(cs)) if cs.size else None,
            comparable=label in weights,
            shift=_stratum_shift(bs, cs) if label in weights else None,
            weight=weights.get(label, 0.0) / total_weight if weights else 0.0,
        )
        for label, bs, cs in groups
    )
    n_b_matched = sum(int(g[1].size) for g in usable)
    n_c_matched = sum(int(g[2].size) for g in usable)
    not_comparable = StratifiedComparison(
        comparable=False,
        reason=(
            f"not comparable: no stratum holds {min_per_stratum} values of each backend "
            "(they were measured under different conditions)"
        ),
        confidence=confidence,
        higher_is_better=higher_is_better,
        strata=strata,
        n_baseline=int(b.size),
        n_candidate=int(c.size),
        n_baseline_matched=n_b_matched,
        n_candidate_matched=n_c_matched,
        statistic=None,
        p_value=None,
        shift=None,
        shift_ci_low=None,
        shift_ci_high=None,
        relative_shift=None,
        relative_ci_low=None,
        relative_ci_high=None,
        effect_size=None,
    )
    if not usable:
        return not_comparable

    pairs = [(bs, cs) for _, bs, cs in usable]
    z = _van_elteren_z(pairs, ties=True)
    p = float(2.0 * stats.norm.sf(abs(z))) if math.isfinite(z) else 1.0
    critical = float(stats.norm.ppf(1.0 - (1.0 - confidence) / 2.0))
    shift = _shift(pairs, 0.0)
    low = _shift(pairs, critical)
    high = _shift(pairs, -critical)
    share = [weights[label] / total_weight for label, _, _ in usable]
    delta = sum(
        w * (2.0 * _u(bs, cs, 0.0) / (bs.size * cs.size) - 1.0)
        for w, (bs, cs) in zip(share, pairs, strict=True)
    )
    scale = abs(sum(w * float(np.median(bs)) for w, (bs, _) in zip(share, pairs, strict=True)))
    reason = (
        f"compared within {len(usable)} of {len(strata)} strata ({n_c_matched} of "
        f"{c.size} candidate and {n_b_matched} of {b.size} baseline values)"
    )
    return replace(
        not_comparable,
        comparable=True,
        reason=reason,
        statistic=z if math.isfinite(z) else 0.0,
        p_value=min(max(p, 0.0), 1.0),
        shift=shift,
        shift_ci_low=low,
        shift_ci_high=high,
        relative_shift=shift / scale if scale > 0.0 else None,
        relative_ci_low=low / scale if scale > 0.0 else None,
        relative_ci_high=high / scale if scale > 0.0 else None,
        effect_size=delta,
    )


def _u(b_sorted: FloatArray, c: FloatArray, d: float) -> float:
    """Mann-Whitney U of (c - d) against b: pairs above, ties counting one half."""
    moved = c - d
    below = np.searchsorted(b_sorted, moved, side="left")
    at_or_below = np.searchsorted(b_sorted, moved, side="right")
    return float(np.sum(below + at_or_below)) / 2.0


def _van_elteren_z(
    pairs: list[tuple[FloatArray, FloatArray]], *, ties: bool, d: float = 0.0
) -> float:
    """Rule 2's z for the candidate moved by -d; tie correction only for the test itself."""
    t = v = 0.0
    for bs, cs in pairs:
        m, n = cs.size, bs.size
        big_n = m + n
        t += (_u(bs, cs, d) - m * n / 2.0) / (big_n + 1.0)
        correction = 0.0
        if ties:
            _, counts = np.unique(np.concatenate([bs, cs - d]), return_counts=True)
            correction = float(np.sum(counts.astype(np.float64) ** 3 - counts))
            correction /= big_n * (big_n - 1.0)
        v += m * n / (12.0 * (big_n + 1.0) ** 2) * (big_n + 1.0 - correction)
    if v <= 0.0:
        return math.nan  # every value tied: no evidence either way
    return t / math.sqrt(v)


def _shift(pairs: list[tuple[FloatArray, FloatArray]], level: float) -> float:
    """Rule 3: the d where z(d) crosses ``level`` (at 0: midway through the flat step)."""

    def z(d: float) -> float:
        return _van_elteren_z(pairs, ties=False, d=d)

    low = min(float(cs[0] - bs[-1]) for bs, cs in pairs)
    high = max(float(cs[-1] - bs[0]) for bs, cs in pairs)
    span = max(high - low, 1.0)
    lo, hi = low - span, high + span  # z(lo) is at its maximum, z(hi) at its minimum
    if level == 0.0:
        return (
            _crossing(lambda d: z(d) > 0.0, lo, hi) + _crossing(lambda d: z(d) >= 0.0, lo, hi)
        ) / 2.0
    if level > 0.0:
        return _crossing(lambda d: z(d) > level, lo, hi)
    return _crossing(lambda d: z(d) >= level, lo, hi)


def _stratum_shift(b_sorted: FloatArray, c: FloatArray) -> float:
    """One stratum's Hodges-Lehmann shift: the median of its differences when they fit
    in :data:`EXACT_SHIFT_MAX_PAIRS`, else rule 3's search (the same number)."""
    if b_sorted.size * c.size <= EXACT_SHIFT_MAX_PAIRS:
        return float(np.median(np.subtract.outer(c, b_sorted)))
    return _shift([(b_sorted, np.sort(c))], 0.0)


def _crossing(holds: Callable[[float], bool], lo: float, hi: float) -> float:
    """Where a predicate true at ``lo`` and false at ``hi`` (monotone) turns false."""
    for _ in range(SHIFT_SEARCH_STEPS):
        mid = (lo + hi) / 2.0
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def _finite(values: Sequence[float] | FloatArray, name: str) -> FloatArray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds a value that is not finite")
    return array


def _num(x: float) -> str:
    return f"{x:g}"
