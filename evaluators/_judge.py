"""The judge: every metric of a candidate checked against the gates, then one verdict.

Rules:
1. A metric is judged only when each side holds at least its gate's minimum number of
   values (the candidate and the primary; for a pairwise metric, its values). Below
   that the metric is INCONCLUSIVE: too little data never passes. Its statistics are
   still computed and exposed from two values a side.
2. Each check reduces to a value x oriented so that larger is worse, a threshold T in
   the same units, a band b (``marginal_band`` times the threshold as configured; for
   a limit on a mean, times the limit), and evidence that x is really on the bad side:
       FAIL      the evidence holds and x > T + b
       MARGINAL  the evidence holds (x <= T + b), or x > T - b
       PASS      otherwise
   Check (x; evidence):
   - median_shift: the Hodges-Lehmann shift toward worse over the primary's median;
     the shift's interval lies wholly on the bad side of 0.
   - mean_ratio (cost): candidate mean over primary mean; its interval lies wholly
     above 1 (no change).
   - mean_worsening (0/1 rates): the change of the mean toward worse; its interval lies
     wholly on the bad side of 0.
   - tail_ratio: candidate p99 over primary p99 (p1 when higher is better); the
     interval's lower bound is above T itself: the tail is beyond the gate, not merely
     worse (Kayenta's gap: a longer tail under an unchanged median).
   - std_ratio: Brown-Forsythe rejects equal spread and the candidate's is larger
     (Kayenta's gap: a variance increase under an unchanged median).
   - mean_limit (pairwise): x is the mean's shortfall below a minimum (or excess over a
     maximum), T = 0; the mean's interval lies wholly beyond the limit.
   - noise_floor (pairwise, Diffy): the mean's change toward worse from the floor
     (secondary against primary) over the floor's mean; its interval lies wholly on the
     bad side of 0.
   A statistic that is undefined (a ratio over a zero) degrades its check to the
   evidence alone: MARGINAL when it holds, PASS otherwise.
3. A noise floor with enough values lowers a pairwise minimum to the floor's mean when
   the primary's own replica does not reach it: differences count beyond the floor only.
4. A metric's verdict is the worst of its checks. A metric without checks is not gated:
   its verdict and statistics are shown but do not count.
5. The candidate's verdict is the worst over gated metrics, FAIL > INCONCLUSIVE >
   MARGINAL > PASS; with no gated metric it is INCONCLUSIVE. Every reason that is not a
   pass is listed, prefixed with its metric.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evaluators._gates import (
    SEVERITY,
    Check,
    Gates,
    Outcome,
    backend_checks,
    pairwise_checks,
)
from evaluators._score import Direction
from evaluators._statistics import (
    DEFAULT_SEED,
    MIN_COMPARABLE_SAMPLES,
    Comparison,
    PairwiseSummary,
    Samples,
    compare_samples,
    summarize_pairwise,
)

__all__ = ["Check", "MetricSamples", "MetricVerdict", "Outcome", "Verdict", "judge"]


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

    def __post_init__(self) -> None:
        if self.baseline is not None and self.noise_floor is not None:
            raise ValueError("a noise floor applies to pairwise metrics (baseline=None) only")

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "verdict": self.outcome.value,
            "gated": self.gated,
            "reasons": list(self.reasons),
            "checks": [check.to_dict() for check in self.checks],
            "statistics": None if self.statistics is None else self.statistics.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    reasons: tuple[str, ...]
    metrics: tuple[MetricVerdict, ...]

    def metric(self, name: str) -> MetricVerdict:
        for verdict in self.metrics:
            if verdict.metric == name:
                return verdict
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.outcome.value,
            "reasons": list(self.reasons),
            "metrics": [metric.to_dict() for metric in self.metrics],
        }


def judge(
    samples: Mapping[str, MetricSamples],
    gates: Gates,
    directions: Mapping[str, Direction],
    *,
    seed: int = DEFAULT_SEED,
) -> Verdict:
    """Judge one candidate over one window; see the module's rules."""
    names = sorted(set(samples) | set(gates.required_metrics))
    verdicts = []
    for name in names:
        metric_samples = samples.get(name)
        if metric_samples is None:
            verdicts.append(_missing(name))
            continue
        direction = directions.get(name)
        if direction not in ("higher", "lower"):
            raise ValueError(f"{name}: direction must be 'higher' or 'lower', got {direction!r}")
        metric_seed = seed ^ zlib.crc32(name.encode())
        verdicts.append(
            _judge_metric(name, metric_samples, gates, direction == "higher", metric_seed)
        )
    gated = [v for v in verdicts if v.gated]
    if not gated:
        return Verdict(Outcome.INCONCLUSIVE, ("no gated metric to judge",), tuple(verdicts))
    overall = max((v.outcome for v in gated), key=SEVERITY.__getitem__)
    reasons = tuple(
        f"{v.metric}: {check.reason}"
        for v in gated
        for check in v.checks
        if check.outcome is not Outcome.PASS
    )
    if overall is Outcome.PASS:
        reasons = (f"all {len(gated)} gated metrics pass",)
    return Verdict(overall, reasons, tuple(verdicts))


def _judge_metric(
    name: str, samples: MetricSamples, gates: Gates, higher: bool, seed: int
) -> MetricVerdict:
    if samples.baseline is None:
        return _judge_pairwise(name, samples, gates, higher, seed)
    gate = gates.gate_for(name, pairwise=False)
    n_c, n_b = len(samples.candidate), len(samples.baseline)
    statistics = None
    if min(n_c, n_b) >= MIN_COMPARABLE_SAMPLES:
        statistics = compare_samples(
            samples.baseline,
            samples.candidate,
            confidence=gates.confidence,
            higher_is_better=higher,
            seed=seed,
        )
    if not gate.has_backend_checks:
        return _ungated(name, statistics)
    need = gates.min_samples_for(gate)
    if statistics is None or min(n_c, n_b) < need:
        return _inconclusive(name, f"candidate {n_c}, primary {n_b}", need, statistics)
    checks = backend_checks(statistics, gate, gates.marginal_band)
    return _verdict(name, checks, statistics)


def _judge_pairwise(
    name: str, samples: MetricSamples, gates: Gates, higher: bool, seed: int
) -> MetricVerdict:
    gate = gates.gate_for(name, pairwise=True)
    floor = samples.noise_floor
    n = len(samples.candidate)
    n_floor = 0 if floor is None else len(floor)
    statistics = None
    if n >= MIN_COMPARABLE_SAMPLES:
        statistics = summarize_pairwise(
            samples.candidate,
            noise_floor=floor if n_floor >= MIN_COMPARABLE_SAMPLES else None,
            confidence=gates.confidence,
            higher_is_better=higher,
            seed=seed,
        )
    floor_gated = gate.max_noise_floor_shift_ratio is not None and floor is not None
    if not (gate.has_limit_checks or floor_gated):
        return _ungated(name, statistics)
    need = gates.min_samples_for(gate)
    floor_ok = floor_gated and n_floor >= need
    if statistics is None or n < need or not (gate.has_limit_checks or floor_ok):
        counts = f"{n} values" + (f", noise floor {n_floor}" if floor is not None else "")
        return _inconclusive(name, counts, need, statistics)
    comparison = statistics.noise_floor if floor_ok else None
    checks = pairwise_checks(statistics, comparison, gate, gates.marginal_band)
    if floor_gated and not floor_ok:
        note = f"noise floor not used: {n_floor} values, {need} needed"
        checks.append(Check("noise_floor", Outcome.PASS, None, None, None, None, False, note))
    return _verdict(name, checks, statistics)


def _verdict(
    name: str, checks: list[Check], statistics: Comparison | PairwiseSummary
) -> MetricVerdict:
    outcome = max((c.outcome for c in checks), key=SEVERITY.__getitem__, default=Outcome.PASS)
    reasons = tuple(c.reason for c in checks)
    return MetricVerdict(name, outcome, True, reasons, tuple(checks), statistics)


def _inconclusive(
    name: str, counts: str, need: int, statistics: Comparison | PairwiseSummary | None
) -> MetricVerdict:
    reason = f"too few samples ({counts}; {need} needed each)"
    check = Check("samples", Outcome.INCONCLUSIVE, None, float(need), None, None, False, reason)
    return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,), statistics)


def _missing(name: str) -> MetricVerdict:
    reason = "required metric has no samples"
    check = Check("samples", Outcome.INCONCLUSIVE, None, None, None, None, False, reason)
    return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,), None)


def _ungated(name: str, statistics: Comparison | PairwiseSummary | None) -> MetricVerdict:
    reason = "not gated: statistics only"
    return MetricVerdict(name, Outcome.PASS, False, (reason,), (), statistics)
