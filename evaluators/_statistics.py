"""Statistics the judge rests on: pure functions of numpy samples, every number exposed.

Theory of operation:
1. A per-backend metric (TTFT, cost) gives two independent samples over a window, the
   baseline (primary) and the candidate. :func:`compare_samples` describes how they
   differ in location (Mann-Whitney U, Hodges-Lehmann shift and its interval, Cliff's
   delta), in spread (Brown-Forsythe test, std ratio), in the bad tail (quantile ratio
   with a bootstrap interval) and in mean (difference with a bootstrap interval).
   Kayenta stops at the location; spread and tail close its known gap.
2. Every shift is candidate - baseline: positive means the candidate's values are
   larger. Whether larger is worse is the caller's ``higher_is_better``; it only picks
   the bad tail (the 99th percentile when lower is better, the 1st when higher is) and
   the ``significantly_worse`` flag.
3. Lehmann-Moses interval. Let D(1) <= ... <= D(M) be the M = m*n differences
   c_i - b_j. A shift d lies in the interval iff the two-sided Mann-Whitney test of
   (c - d, b) does not reject at level alpha = 1 - confidence. With U's normal
   approximation, mean m*n/2 and variance
       s^2 = m*n/12 * (N + 1 - sum(t^3 - t) / (N*(N - 1))),   N = m + n,
   t running over the sizes of groups of tied values, the interval is
       [D(k), D(M + 1 - k)],   k = floor(m*n/2 - z(1 - alpha/2)*s), at least 1.
   Flooring k makes the interval conservative (never narrower than the level claims).
4. Above MAX_PAIRWISE_DIFFERENCES pairs, a seeded random sample of pairs stands in for
   all of them; the estimate is its median and the interval's ranks become the
   quantiles (k - 1)/(M - 1) and (M - k)/(M - 1) of the sample.
5. Randomness (pair sampling, bootstrap) comes from generators seeded by the caller:
   the same input gives the same result.
6. Inputs must be finite. A statistic that is undefined (a ratio over zero) is None,
   never NaN or infinity, so that ``to_dict()`` is JSON-ready.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from scipy import stats

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "DEFAULT_CONFIDENCE",
    "DEFAULT_SEED",
    "MAX_PAIRWISE_DIFFERENCES",
    "MIN_COMPARABLE_SAMPLES",
    "Comparison",
    "PairwiseSummary",
    "Samples",
    "ShiftEstimate",
    "as_probability",
    "check_confidence",
    "compare_samples",
    "hodges_lehmann",
    "holm_rejected",
    "summarize_pairwise",
]

DEFAULT_CONFIDENCE: Final = 0.98
DEFAULT_SEED: Final = 0
MIN_COMPARABLE_SAMPLES: Final = 2
MAX_PAIRWISE_DIFFERENCES: Final = 1 << 20
BOOTSTRAP_RESAMPLES: Final = 2000
# Values resampled at once (resamples per batch x sample size): bounds the bootstrap's
# memory to about 32 MiB of float64 per sample, whatever the window holds.
BOOTSTRAP_MAX_BATCH_VALUES: Final = 1 << 22
BAD_TAIL_WHEN_LOWER_IS_BETTER: Final = 0.99
BAD_TAIL_WHEN_HIGHER_IS_BETTER: Final = 0.01

Samples = Sequence[float] | npt.NDArray[np.floating[Any]]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class ShiftEstimate:
    """Hodges-Lehmann shift (candidate - baseline) with its Lehmann-Moses interval."""

    shift: float
    ci_low: float
    ci_high: float
    confidence: float
    pairs: int
    subsampled: bool


@dataclass(frozen=True, slots=True)
class Comparison:
    """Everything :func:`compare_samples` measured; shifts are candidate - baseline.

    ``u_statistic`` is the candidate's Mann-Whitney U, ``p_value`` its two-sided p.
    ``effect_size`` is Cliff's delta (the rank-biserial correlation),
    P(candidate > baseline) - P(candidate < baseline), in [-1, 1]. ``relative_*`` is
    the Hodges-Lehmann shift and interval over |baseline median|. ``tail_*`` is the
    ``tail_quantile`` (the bad tail) of each sample and their ratio candidate/baseline
    with a percentile-bootstrap interval, like ``mean_shift_*`` and ``mean_ratio_*``.
    ``variance_p_value`` is Brown-Forsythe's (Levene's test about the medians).
    ``slow_side_*`` are the same spread figures over each side's values on the bad side
    of the baseline's median (above it where lower is better): the spread of the answers
    that were slow to begin with, which a candidate that made other answers faster left
    as it was (None where a side has fewer than two such values).
    All intervals are at ``confidence``.
    """

    confidence: float
    higher_is_better: bool
    n_baseline: int
    n_candidate: int
    median_baseline: float
    median_candidate: float
    mean_baseline: float
    mean_candidate: float
    std_baseline: float
    std_candidate: float
    u_statistic: float
    p_value: float
    hl_shift: float
    hl_ci_low: float
    hl_ci_high: float
    hl_pairs: int
    hl_subsampled: bool
    effect_size: float
    relative_shift: float | None
    relative_ci_low: float | None
    relative_ci_high: float | None
    mean_shift: float
    mean_shift_ci_low: float | None
    mean_shift_ci_high: float | None
    mean_ratio: float | None
    mean_ratio_ci_low: float | None
    mean_ratio_ci_high: float | None
    tail_quantile: float
    tail_baseline: float
    tail_candidate: float
    tail_ratio: float | None
    tail_ratio_ci_low: float | None
    tail_ratio_ci_high: float | None
    std_ratio: float | None
    levene_statistic: float | None
    variance_p_value: float
    bootstrap_resamples: int
    slow_side_std_ratio: float | None = None
    slow_side_variance_p_value: float | None = None

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    @property
    def significantly_worse(self) -> bool:
        """The whole shift interval lies on the bad side of zero."""
        if self.higher_is_better:
            return self.hl_ci_high < 0.0
        return self.hl_ci_low > 0.0

    @property
    def significantly_better(self) -> bool:
        if self.higher_is_better:
            return self.hl_ci_low > 0.0
        return self.hl_ci_high < 0.0

    @property
    def variance_increased(self) -> bool:
        """Brown-Forsythe rejects equal spread and the candidate's spread is larger."""
        return self.variance_p_value < self.alpha and self.std_candidate > self.std_baseline

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["significantly_worse"] = self.significantly_worse
        out["significantly_better"] = self.significantly_better
        out["variance_increased"] = self.variance_increased
        return out


@dataclass(frozen=True, slots=True)
class PairwiseSummary:
    """One value per exchange (e.g. similarity to the primary's answer), summarized.

    ``noise_floor`` compares these values (as the candidate) with the same metric
    measured between a secondary replica and the primary (as the baseline).
    """

    confidence: float
    higher_is_better: bool
    n: int
    mean: float
    mean_ci_low: float | None
    mean_ci_high: float | None
    median: float
    median_ci_low: float | None
    median_ci_high: float | None
    std: float
    bootstrap_resamples: int
    noise_floor: Comparison | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["noise_floor"] = None if self.noise_floor is None else self.noise_floor.to_dict()
        return out


def holm_rejected(p_values: Sequence[float], alpha: float) -> tuple[bool, ...]:
    """Holm's step-down procedure ("A simple sequentially rejective multiple test
    procedure", 1979): which of the hypotheses, one p-value each, are rejected while the
    chance of rejecting any true one stays at most ``alpha``. Written here: the one
    library that has it (statsmodels) is a large dependency for these few lines."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    rejected = [False] * len(p_values)
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - rank):
            break
        rejected[i] = True
    return tuple(rejected)


def hodges_lehmann(
    baseline: Samples,
    candidate: Samples,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = DEFAULT_SEED,
) -> ShiftEstimate:
    """Median of the pairwise differences candidate - baseline, and its interval (rule 3)."""
    b = _as_sample(baseline, "baseline")
    c = _as_sample(candidate, "candidate")
    check_confidence(confidence)
    return _hodges_lehmann(b, c, confidence, np.random.default_rng(seed))


def compare_samples(
    baseline: Samples,
    candidate: Samples,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    higher_is_better: bool,
    seed: int = DEFAULT_SEED,
) -> Comparison:
    """Compare two independent samples of one metric; see the module's rules."""
    b = _as_sample(baseline, "baseline")
    c = _as_sample(candidate, "candidate")
    check_confidence(confidence)
    pair_rng, boot_rng = np.random.default_rng(seed).spawn(2)

    mw = stats.mannwhitneyu(c, b, alternative="two-sided")
    u = float(mw.statistic)
    hl = _hodges_lehmann(b, c, confidence, pair_rng)
    median_b = float(np.median(b))
    scale = abs(median_b)

    q = BAD_TAIL_WHEN_HIGHER_IS_BETTER if higher_is_better else BAD_TAIL_WHEN_LOWER_IS_BETTER
    tail_b = float(np.quantile(b, q))
    tail_c = float(np.quantile(c, q))

    def resampled(cand: FloatArray, base: FloatArray, axis: int) -> FloatArray:
        mean_c, mean_b = np.mean(cand, axis=axis), np.mean(base, axis=axis)
        tail = np.quantile(cand, q, axis=axis) / np.quantile(base, q, axis=axis)
        return np.stack([tail, mean_c - mean_b, mean_c / mean_b])

    tail_ci, shift_ci, ratio_ci = _bootstrap((c, b), resampled, confidence, boot_rng)
    mean_b = float(np.mean(b))
    mean_c = float(np.mean(c))
    tail_defined = tail_b > 0.0
    mean_defined = mean_b > 0.0

    std_b = float(np.std(b, ddof=1))
    std_c = float(np.std(c, ddof=1))
    levene_stat, variance_p = _brown_forsythe(b, c)
    slow_std_ratio, slow_variance_p = _slow_side_spread(b, c, median_b, higher_is_better)

    return Comparison(
        confidence=confidence,
        higher_is_better=higher_is_better,
        n_baseline=int(b.size),
        n_candidate=int(c.size),
        median_baseline=median_b,
        median_candidate=float(np.median(c)),
        mean_baseline=mean_b,
        mean_candidate=mean_c,
        std_baseline=std_b,
        std_candidate=std_c,
        u_statistic=u,
        p_value=as_probability(float(mw.pvalue)),
        hl_shift=hl.shift,
        hl_ci_low=hl.ci_low,
        hl_ci_high=hl.ci_high,
        hl_pairs=hl.pairs,
        hl_subsampled=hl.subsampled,
        effect_size=2.0 * u / (b.size * c.size) - 1.0,
        relative_shift=hl.shift / scale if scale > 0.0 else None,
        relative_ci_low=hl.ci_low / scale if scale > 0.0 else None,
        relative_ci_high=hl.ci_high / scale if scale > 0.0 else None,
        mean_shift=mean_c - mean_b,
        mean_shift_ci_low=shift_ci[0],
        mean_shift_ci_high=shift_ci[1],
        mean_ratio=mean_c / mean_b if mean_defined else None,
        mean_ratio_ci_low=ratio_ci[0] if mean_defined else None,
        mean_ratio_ci_high=ratio_ci[1] if mean_defined else None,
        tail_quantile=q,
        tail_baseline=tail_b,
        tail_candidate=tail_c,
        tail_ratio=tail_c / tail_b if tail_defined else None,
        tail_ratio_ci_low=tail_ci[0] if tail_defined else None,
        tail_ratio_ci_high=tail_ci[1] if tail_defined else None,
        std_ratio=std_c / std_b if std_b > 0.0 else None,
        levene_statistic=levene_stat,
        variance_p_value=variance_p,
        bootstrap_resamples=BOOTSTRAP_RESAMPLES,
        slow_side_std_ratio=slow_std_ratio,
        slow_side_variance_p_value=slow_variance_p,
    )


def summarize_pairwise(
    values: Samples,
    *,
    noise_floor: Samples | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    higher_is_better: bool,
    seed: int = DEFAULT_SEED,
) -> PairwiseSummary:
    """Mean and median with bootstrap intervals; against the noise floor when given."""
    v = _as_sample(values, "values")
    check_confidence(confidence)
    boot_rng, floor_rng = np.random.default_rng(seed).spawn(2)
    mean_ci, median_ci = _bootstrap((v,), _mean_and_median, confidence, boot_rng)
    floor = None
    if noise_floor is not None:
        floor = compare_samples(
            noise_floor,
            v,
            confidence=confidence,
            higher_is_better=higher_is_better,
            seed=int(floor_rng.integers(2**31)),
        )
    return PairwiseSummary(
        confidence=confidence,
        higher_is_better=higher_is_better,
        n=int(v.size),
        mean=float(np.mean(v)),
        mean_ci_low=mean_ci[0],
        mean_ci_high=mean_ci[1],
        median=float(np.median(v)),
        median_ci_low=median_ci[0],
        median_ci_high=median_ci[1],
        std=float(np.std(v, ddof=1)),
        bootstrap_resamples=BOOTSTRAP_RESAMPLES,
        noise_floor=floor,
    )


def check_confidence(confidence: float) -> None:
    """Refuse a confidence level outside (0, 1)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")


def as_probability(p: float) -> float:
    """A test's p-value within [0, 1]; an undefined one (NaN: no evidence) is 1 (rule 6)."""
    return 1.0 if math.isnan(p) else min(max(p, 0.0), 1.0)


def _hodges_lehmann(
    b: FloatArray, c: FloatArray, confidence: float, rng: np.random.Generator
) -> ShiftEstimate:
    m, n = c.size, b.size
    total = m * n
    subsampled = total > MAX_PAIRWISE_DIFFERENCES
    if subsampled:
        i = rng.integers(0, m, size=MAX_PAIRWISE_DIFFERENCES)
        j = rng.integers(0, n, size=MAX_PAIRWISE_DIFFERENCES)
        diffs = c[i] - b[j]
    else:
        diffs = np.subtract.outer(c, b).ravel()

    z = float(stats.norm.ppf(1.0 - (1.0 - confidence) / 2.0))
    k = max(1, math.floor(total / 2.0 - z * _u_std(b, c)))
    k = min(k, (total + 1) // 2)
    if subsampled:
        positions = [(k - 1) / (total - 1), 0.5, (total - k) / (total - 1)]
        low, shift, high = (float(x) for x in np.quantile(diffs, positions))
    else:  # order statistics by selection, not a full sort
        middle = [(total - 1) // 2, total // 2]
        diffs.partition([k - 1, *middle, total - k])
        low, high = float(diffs[k - 1]), float(diffs[total - k])
        shift = float(np.mean(diffs[middle]))
    return ShiftEstimate(
        shift=shift,
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        pairs=int(diffs.size),
        subsampled=subsampled,
    )


def _u_std(b: FloatArray, c: FloatArray) -> float:
    """Standard deviation of U under the null, corrected for ties (rule 3)."""
    m, n = c.size, b.size
    big_n = m + n
    _, counts = np.unique(np.concatenate([b, c]), return_counts=True)
    ties = float(np.sum(counts.astype(np.float64) ** 3 - counts))
    variance = m * n / 12.0 * (big_n + 1 - ties / (big_n * (big_n - 1)))
    return math.sqrt(max(variance, 0.0))


def _bootstrap(
    data: tuple[FloatArray, ...],
    statistic: Callable[..., FloatArray],
    confidence: float,
    rng: np.random.Generator,
) -> list[tuple[float | None, float | None]]:
    """Percentile-bootstrap interval of each output of a vectorized statistic."""
    with _quiet_numerics():
        result = stats.bootstrap(
            data,
            statistic,
            n_resamples=BOOTSTRAP_RESAMPLES,
            batch=_batch(max(x.size for x in data)),
            vectorized=True,
            confidence_level=confidence,
            method="percentile",
            rng=rng,
        )
    low = np.atleast_1d(result.confidence_interval.low)
    high = np.atleast_1d(result.confidence_interval.high)
    return [(_finite_or_none(lo), _finite_or_none(hi)) for lo, hi in zip(low, high, strict=True)]


def _batch(sample_size: int) -> int:
    return max(1, min(BOOTSTRAP_RESAMPLES, BOOTSTRAP_MAX_BATCH_VALUES // sample_size))


def _brown_forsythe(b: FloatArray, c: FloatArray) -> tuple[float | None, float]:
    """Levene's test about the medians; no spread anywhere means no evidence (p = 1)."""
    with _quiet_numerics():
        result = stats.levene(c, b, center="median")
    statistic = float(result.statistic)
    if math.isnan(statistic):
        return None, 1.0
    return _finite_or_none(statistic), as_probability(float(result.pvalue))


def _slow_side_spread(b: FloatArray, c: FloatArray, median_b: float,
                      higher_is_better: bool) -> tuple[float | None, float | None]:
    """The std ratio candidate/baseline and Brown-Forsythe's p over each side's values on
    the bad side of the baseline's median (:class:`Comparison`'s ``slow_side_*``)."""
    slow_b = b[b < median_b] if higher_is_better else b[b > median_b]
    slow_c = c[c < median_b] if higher_is_better else c[c > median_b]
    if min(slow_b.size, slow_c.size) < 2:
        return None, None
    std_b = float(np.std(slow_b, ddof=1))
    ratio = float(np.std(slow_c, ddof=1)) / std_b if std_b > 0.0 else None
    return ratio, _brown_forsythe(slow_b, slow_c)[1]


def _mean_and_median(values: FloatArray, axis: int) -> FloatArray:
    return np.stack([np.mean(values, axis=axis), np.median(values, axis=axis)])


def _as_sample(values: Samples, name: str) -> FloatArray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size < MIN_COMPARABLE_SAMPLES:
        raise ValueError(f"{name} needs at least {MIN_COMPARABLE_SAMPLES} values")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds a value that is not finite")
    return array


def _finite_or_none(value: Any) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None


@contextmanager
def _quiet_numerics() -> Iterator[None]:
    """Division by zero inside a resample yields inf or NaN, reported as None afterwards."""
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        yield
