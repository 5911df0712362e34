"""What the judge reads and what it answers: a metric's samples, its verdict, the verdict.

:class:`MetricSamples` holds one metric's values over a window (with the
:class:`LoadConditions` they were measured under, and a rate's :class:`RateSamples`);
:class:`MetricVerdict` is one metric judged and :class:`Verdict` the candidate's. The
builders at the end make a metric's verdict the same way wherever it is judged: from its
checks (the worst of them, the judge's rule 4), too few samples (rule 1), a required
metric without samples, or a metric not gated. Rule numbers are the judge's
(``_judge.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evaluators._checks import SEVERITY, Check, Outcome
from evaluators._power import SampleSizeEstimate
from evaluators._rates import RateComparison, RateCounts
from evaluators._reweight import Reweighting
from evaluators._statistics import Comparison, PairwiseSummary, Samples
from evaluators._strata import StratifiedComparison

__all__ = [
    "NO_NOISE_FLOOR",
    "LoadConditions",
    "MetricSamples",
    "MetricVerdict",
    "RateSamples",
    "Verdict",
    "checked_verdict",
    "inconclusive_verdict",
    "missing_verdict",
    "ungated_verdict",
]


@dataclass(frozen=True, slots=True)
class LoadConditions:
    """What each value of a per-backend metric was measured under (rule 6), aligned with
    ``MetricSamples.candidate`` and ``.baseline``; None where not recorded. ``cache``
    asks for cache strata as well (TTFT)."""

    candidate_concurrency: tuple[int | None, ...]
    baseline_concurrency: tuple[int | None, ...]
    candidate_prompt_tokens: tuple[int | None, ...] = ()
    candidate_cached_tokens: tuple[int | None, ...] = ()
    baseline_prompt_tokens: tuple[int | None, ...] = ()
    baseline_cached_tokens: tuple[int | None, ...] = ()
    cache: bool = False
    candidate_prompt_size: tuple[float | None, ...] = ()
    baseline_prompt_size: tuple[float | None, ...] = ()
    """Each value's prompt size as the sample-bias check measures it (estimated tokens,
    binned as all traffic is): what rule 9 weights by; empty when not known."""

    @property
    def sized(self) -> bool:
        """Rule 9 can weight these values: a prompt size aligned with each of them."""
        return (len(self.candidate_prompt_size) == len(self.candidate_concurrency) > 0
                and len(self.baseline_prompt_size) == len(self.baseline_concurrency) > 0)

    @property
    def recorded(self) -> bool:
        """Concurrency is known for some values of each side."""
        return any(c is not None for c in self.candidate_concurrency) and any(
            c is not None for c in self.baseline_concurrency)


@dataclass(frozen=True, slots=True)
class RateSamples:
    """A rate metric's values counted per side (rule 1): what the judge reads of a 0/1
    metric, however many values they are. ``replica`` as in :class:`MetricSamples`;
    ``scope`` says what the counts cover, in the rate check's reason (the report's:
    ``the whole window``)."""

    candidate: RateCounts
    baseline: RateCounts
    replica: RateCounts | None = None
    scope: str = ""

    @classmethod
    def of(cls, samples: MetricSamples) -> RateSamples:
        """``samples``' values counted, where no counts were given."""
        if samples.baseline is None:
            raise ValueError("a rate is a per-backend metric")
        replica = None if samples.replica is None else RateCounts.of(samples.replica)
        return cls(RateCounts.of(samples.candidate), RateCounts.of(samples.baseline), replica)


@dataclass(frozen=True, slots=True)
class MetricSamples:
    """One metric's values over a window.

    ``baseline`` is the primary's values of a per-backend metric (None: the metric is
    pairwise). ``noise_floor`` is the same pairwise metric measured between a secondary
    replica of the primary and the primary.
    """

    candidate: Samples
    baseline: Samples | None = None
    noise_floor: Samples | None = None
    conditions: LoadConditions | None = None
    replica: Samples | None = None
    """A per-backend metric's values on the noise-floor replica mirrored at the
    candidate's rate (rule 6)."""
    rates: RateSamples | None = None
    """A rate metric's counts (rule 1), which a rate's gate reads in place of the values
    (which may then be empty); None: the values are counted."""

    def __post_init__(self) -> None:
        if self.baseline is not None and self.noise_floor is not None:
            raise ValueError("a noise floor applies to pairwise metrics (baseline=None) only")
        if self.baseline is None and (self.conditions is not None or self.replica is not None
                                      or self.rates is not None):
            raise ValueError("conditions, a replica and rates apply to per-backend metrics "
                             "only")
        c, baseline = self.conditions, self.baseline
        if c is not None and baseline is not None and (
                len(c.candidate_concurrency) != len(self.candidate)
                or len(c.baseline_concurrency) != len(baseline)):
            raise ValueError("conditions must be aligned with the values")

    @property
    def pairwise(self) -> bool:
        return self.baseline is None


@dataclass(frozen=True, slots=True)
class MetricVerdict:
    metric: str
    outcome: Outcome
    gated: bool
    reasons: tuple[str, ...]
    checks: tuple[Check, ...]
    statistics: Comparison | PairwiseSummary | None
    basis: str = "primary"
    """What the candidate was compared with (rule 6): ``primary``, ``primary at matched
    load``, ``primary at matched load and cache`` or ``replica at the same rate``."""
    matched: StratifiedComparison | None = None
    samples_needed: SampleSizeEstimate | None = None
    reweighting: Reweighting | None = None
    """Rule 9: the weights this metric was judged with, and its unweighted result."""
    rates: RateComparison | None = None
    """A rate's counts compared (rule 2's mean_worsening reads them): a rate's only
    statistics (rule 1)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "verdict": self.outcome.value,
            "gated": self.gated,
            "basis": self.basis,
            "reasons": list(self.reasons),
            "checks": [check.to_dict() for check in self.checks],
            "statistics": None if self.statistics is None else self.statistics.to_dict(),
            "matched": None if self.matched is None else self.matched.to_dict(),
            "samples_needed": (None if self.samples_needed is None
                               else self.samples_needed.to_dict()),
            "reweighting": None if self.reweighting is None else self.reweighting.to_dict(),
            "rates": None if self.rates is None else self.rates.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    reasons: tuple[str, ...]
    metrics: tuple[MetricVerdict, ...]
    more_samples_needed: int | None = None
    """Rule 7: the most further values per side an INCONCLUSIVE metric needs (None: no
    metric is inconclusive for want of samples, or none can tell)."""

    def metric(self, name: str) -> MetricVerdict:
        for verdict in self.metrics:
            if verdict.metric == name:
                return verdict
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.outcome.value,
            "reasons": list(self.reasons),
            "more_samples_needed": self.more_samples_needed,
            "metrics": [metric.to_dict() for metric in self.metrics],
        }


def checked_verdict(
    name: str, checks: list[Check], statistics: Comparison | PairwiseSummary,
    basis: str = "primary",
) -> MetricVerdict:
    """Rule 4: a gated metric's verdict, the worst of its checks."""
    outcome = max((c.outcome for c in checks), key=SEVERITY.__getitem__, default=Outcome.PASS)
    reasons = tuple(c.reason for c in checks)
    return MetricVerdict(name, outcome, True, reasons, tuple(checks), statistics, basis)


def inconclusive_verdict(
    name: str, counts: str, need: int, statistics: Comparison | PairwiseSummary | None,
    *, basis: str = "primary", matched: StratifiedComparison | None = None,
    estimate: SampleSizeEstimate | None = None,
) -> MetricVerdict:
    """Rule 1: too few values to judge (with rule 7's estimate of how many would do)."""
    reason = f"too few samples ({counts}; {need} needed each)"
    if estimate is not None and estimate.needed_per_side is not None:
        reason += f"; about {estimate.needed_per_side} per side for the effect seen so far"
    check = Check("samples", Outcome.INCONCLUSIVE, None, float(need), None, None, False, reason)
    return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,), statistics,
                         basis, matched, estimate)


def missing_verdict(name: str) -> MetricVerdict:
    """A required metric without samples: INCONCLUSIVE, never passed."""
    reason = "required metric has no samples"
    check = Check("samples", Outcome.INCONCLUSIVE, None, None, None, None, False, reason)
    return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,), None)


NO_NOISE_FLOOR = "not gated: no noise floor measured, and the metric has no limit of its own"


def ungated_verdict(name: str, statistics: Comparison | PairwiseSummary | None,
                    basis: str = "primary", reason: str = "not gated: statistics only",
                    ) -> MetricVerdict:
    """Rule 4: a metric without checks, shown but not counted (``reason``: why, where
    :data:`NO_NOISE_FLOOR` says it would be held to a floor that was not measured)."""
    return MetricVerdict(name, Outcome.PASS, False, (reason,), (), statistics, basis)
