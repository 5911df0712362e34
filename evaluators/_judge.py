"""The judge: every metric of a candidate checked against the gates, then one verdict.

Rules:
1. A metric is judged only when each side holds at least its gate's minimum number of
   values (the candidate and the primary; for a pairwise metric, its values). Below
   that the metric is INCONCLUSIVE: too little data never passes. Its statistics are
   still computed and exposed from two values a side. A rate (a 0/1 metric, gates rule
   3) is judged from its counts per side (``MetricSamples.rates``, where given: the
   report counts its whole window, so the cap on the values it reads does not bound a
   rate; else its values counted), and its counts are all its statistics
   (``MetricVerdict.rates``; no bootstrap, ``statistics`` is None). It needs more to pass
   than the minimum: values enough that the interval of its change
   rules out a worsening beyond its limit (``Check.bounded``). 0 errors in 30 on both
   sides is still consistent with 15 points more errors (the rule of three at a one-sided
   1 %), so it PASSed a 1-point gate on the estimate alone; short of that bound the rate
   is INCONCLUSIVE, too few samples, with the values per side that would rule it out
   (rule 7). A rate metric holding values other than 0 and 1 is INCONCLUSIVE, not judged
   as a rate, whatever its counts.
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
   - mean_worsening (0/1 rates): the change of the rate toward worse; Fisher's exact test,
     one-sided, rejects "no worse" (``_statistics`` rule 7: a count, not a bootstrap,
     whose interval collapsed at 0 errors and called 5 errors in 30 against 0 significant,
     where Fisher's p is 0.026). Its interval is Newcombe's, and a PASS needs that
     interval's upper end within T as well (rule 1).
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
3. A noise floor with enough values lowers a pairwise minimum (raises a maximum) to the
   floor's mean when the primary's own replica does not reach it: differences count
   beyond the floor only. The floor's mean is itself measured, so the shortfall's
   interval is then the two samples' (candidate against floor), not the candidate's
   against a constant. It relaxes a limit by at most ``Gates.max_noise_floor_miss`` of it
   (a share, so one bound for a similarity minimum and a distance maximum alike): a
   replica that misses the limit by more is no noise floor (a wrong model or route, an
   error page scored), and a broken replica at 0.3 lowered the 0.85 similarity minimum to
   0.3, so almost any candidate passed. Such a replica is broken, or the primary is
   that noisy: the judge cannot tell which, so the limit is graded both ways, as
   configured and as if relaxed, and a FAIL stands only where both give it (a candidate
   beyond the limit and the replica alike). Otherwise the limit's check gives way to an
   INCONCLUSIVE ``noise_floor_bound`` check naming the replica: it never passes, even a
   candidate that keeps the configured limit. Not a limit relaxed as far as the bound:
   that would be a number neither the operator nor the replica gave, still loosened by a
   floor that measures nothing, and the same replica is the floor of the metric's own
   noise-floor check and of every other metric's (rule 11); an operator trusts the
   verdict more when it names the broken replica and waits for it to be fixed (or the
   bound widened, where the primary really is that noisy).
4. A metric's verdict is the worst of its checks. A metric without checks is not gated:
   its verdict and statistics are shown but do not count.
5. The candidate's verdict is the worst over gated metrics, FAIL > INCONCLUSIVE >
   MARGINAL > PASS; with no gated metric it is INCONCLUSIVE. Every reason that is not a
   pass is listed, prefixed with its metric, the worst first (by severity, then in metric
   order): a refused promotion and the demo's scorecard cite the first few, so those are
   the ones that decided the verdict.
6. Like with like (DESIGN.md, "a mirror is not production's conditions"): a per-backend
   metric that carries its :class:`LoadConditions` (the latencies and the decode
   throughput) is compared
   - with the noise-floor replica's own values (``replica``: a replica of the primary
     mirrored at the candidate's rate, so at its load share and cache warmth; a rate with
     its counts) when that replica has the gate's minimum of values and is not shown
     broken (rule 11);
   - else with the primary's, within concurrency bins (van Elteren, ``_matching.py``),
     and for TTFT within concurrency x cache strata (prompt length x cached share): the
     median-shift check reads that stratified shift; the other checks (the tail, the
     spread) read the candidate's values in the strata both sides hold against the
     primary's there resampled to the candidate's mix over them (``_at_candidate_load``:
     ``_reweight`` rules 2-3, each value weighted by its stratum's candidate share over
     its primary share). Pooled, a mirror's lighter load hid a longer tail (5 % of answers
     stalled 60 ms at 10 % of the load: MARGINAL, tail ratio 1.23) and a canary's heavier
     load made one (an identical engine at about twice the load: FAIL, tail ratio 1.3).
     No stratum held by both sides, or fewer matched values (or a resampled primary
     smaller) than the gate's minimum, is INCONCLUSIVE with the reason;
   - pooled as in rule 2 when no concurrency was recorded on either side (old rows).
7. Every INCONCLUSIVE metric carries ``samples_needed`` (``_power.py``): the values per
   side at which the effect seen so far would be significant among the verdict's checks
   (rule 10: at the first of Holm's bars, the level over the number of checks the gated
   metrics make once judged, ``MetricGate.tested_checks``: a metric not judged yet counted
   with every check it can make, a required one without samples as one, so the wait is
   never short of the family's) with probability
   :data:`ESTIMATE_POWER` (the count at which the verdict is as likely as not to turn),
   floored at the gate's minimum; the verdict's ``more_samples_needed`` is the largest of
   the more-needed counts. A rate whose change seen so far is inside its limit's band
   turns instead when its interval rules out the limit (rule 1; ``_power`` rule 4b: the
   interval is not among Holm's family, so alpha is the gates' own). A rate's estimate
   is sized from its counts, so it is a count the window can reach: the report counts a
   rate over its whole window, not the newest values it caps the other metrics at.
8. A sample-bias check (``_sample_bias.py``) that refuses makes the verdict
   INCONCLUSIVE ("sample skew: ..."); a flagged skew is listed among the reasons.
9. Below the refusal bound a flagged skew is corrected where it can be: each per-backend
   metric whose :class:`LoadConditions` carry every value's prompt size is judged on its
   values reweighted to the traffic's prompt sizes (``_reweight.py``: each value weighted
   by its size bucket's traffic share over its evaluated share, resampled with a fixed
   seed to the weights' effective size), with ``reweighted`` added to its basis; its
   ``reweighting`` keeps the weights and the same metric judged unweighted. A metric
   whose baseline is the same-rate replica is not reweighted (the replica's sample has
   its own mix) and says so.
10. Significance holds for the whole verdict, not for each check alone. A verdict runs
   some 25 checks; each alone at the gates' confidence (a one-sided level of (1 -
   confidence) / 2), 5 of 30 windows of an identical candidate were FAILs
   (``tests/evaluators/test_judge_calibration.py``; ``bench/judge_calibration.py``
   counts more). So the gated checks
   that carry a p-value (``Check.p_value``, read from the check's own interval) are
   tested together by Holm's procedure at that same level: the chance that any check of
   an identical candidate is called significant stays at most (1 - confidence) / 2. A
   check significant alone but not among them is graded again as not significant (rule
   2), and its reason says so.
11. A replica shown broken by one metric (rule 3) is no noise floor for any metric of the
   verdict: one replica measures every floor, and one that agrees with the primary on
   10 % of answers, its similarity 0.3, made a candidate as far off "no worse than noise"
   on exact match, which has no limit of its own to catch it. Once every metric is
   judged, each pairwise metric measured against that replica is graded again on the
   same statistics, with the first such metric (in metric order) and its miss named:
   - a noise_floor check that does not FAIL is INCONCLUSIVE, "noise floor not used",
     with what it measured and how it would grade on the replica. It tests nothing the
     verdict relies on, so it carries no p-value into rule 10's family (rule 7's family
     still counts it, so no wait is short); a FAIL keeps its p-value, and where rule 10
     grades it again as not significant it rests on the replica again and is
     INCONCLUSIVE too. A FAIL stands: the candidate is worse even than the broken
     replica.
   - a limit the replica misses within the bound is not relaxed either, and is graded as
     rule 3 grades a limit beyond it: as configured and as if relaxed, a FAIL standing
     only where both give it. A FAIL as configured alone is INCONCLUSIVE (the replica is
     broken or the primary that noisy, and which cannot be told), not the FAIL of the
     limit as configured: the primary's noise on this metric is then unknown, not known
     to be nil. Where the candidate keeps the configured limit it passes it, with no
     ``noise_floor_bound`` check of its own: that PASS rests on no floor, and the
     metric that found the replica broken holds the verdict INCONCLUSIVE already.
   - a per-backend metric (a rate too) whose basis would be that replica (rule 6) is
     judged against the primary instead, as rule 6 judges one without a replica, its
     basis ending "in place of the broken replica" and a passing ``replica`` check (no
     p-value) naming the replica and its miss. A replica answering error pages in 5 ms,
     or a wrong and slower model, made a candidate alike with the primary FAIL its
     latencies (a FAIL outranks the INCONCLUSIVE of rule 3, so a canary rolled back on a
     broken replica) or pass a slower one. The broken replica is found from the pairwise
     metrics first, so each per-backend metric is judged once, on the basis it keeps:
     rule 9 reweights it as any other compared with the primary, and rule 10's family
     holds its checks graded on the primary, not the replica's.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from evaluators._checks import (
    SEVERITY,
    Check,
    Outcome,
    backend_checks,
    broken_floor,
    not_significant_overall,
    on_broken_floor,
    pairwise_checks,
    rate_check,
    stratified_shift_check,
)
from evaluators._gates import Gates, MetricGate
from evaluators._matching import DEFAULT_CONCURRENCY_EDGES, cache_strata
from evaluators._power import (
    PowerQuery,
    SampleSizeEstimate,
    samples_needed_for_location,
    samples_needed_for_mean,
    samples_needed_for_rate,
    samples_needed_to_bound_rate,
)
from evaluators._reweight import REWEIGHT_METHOD, Reweighting, resample_indices, value_weights
from evaluators._sample_bias import SampleBias
from evaluators._score import Direction
from evaluators._statistics import (
    DEFAULT_SEED,
    MIN_COMPARABLE_SAMPLES,
    Comparison,
    PairwiseSummary,
    RateComparison,
    RateCounts,
    Samples,
    compare_rates,
    compare_samples,
    holm_rejected,
    summarize_pairwise,
)
from evaluators._strata import StratifiedComparison, bin_labels, compare_strata

__all__ = [
    "ESTIMATE_POWER",
    "Check",
    "LoadConditions",
    "MetricSamples",
    "MetricVerdict",
    "Outcome",
    "Verdict",
    "judge",
]

ESTIMATE_POWER = 0.5
"""Rule 7: the power ``samples_needed`` is computed for. At 0.5 the estimate is the count
at which the test is as likely as not to show the effect seen so far, the count a
platform engineer should expect the verdict to turn at; about twice it gives power 0.8."""
SAMPLE_BIAS_METRIC = "sample.bias"


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


def judge(
    samples: Mapping[str, MetricSamples],
    gates: Gates,
    directions: Mapping[str, Direction],
    *,
    seed: int = DEFAULT_SEED,
    sample_bias: SampleBias | None = None,
    noise_floor_from: str | None = None,
) -> Verdict:
    """Judge one candidate over one window; see the module's rules. ``noise_floor_from``
    names the replica the noise floors were measured on (rule 3's reasons name it)."""
    names = sorted(set(samples) | set(gates.required_metrics))
    reweigh = sample_bias if sample_bias is not None and sample_bias.skew \
        and not sample_bias.refuse else None
    family = _family_size(names, samples, gates)
    # Rule 11 before rule 6: the pairwise metrics say whether the replica is broken, and
    # a broken replica is the baseline of no per-backend metric, so each per-backend one
    # is judged once, on the basis it keeps. A metric's seed is its name's, in any order.
    pairwise = {name: _judge_metric(name, s, gates, _higher(name, directions),
                                    _metric_seed(seed, name), family, noise_floor_from)
                for name in names if (s := samples.get(name)) is not None and s.pairwise}
    broken = _broken_floor([pairwise[name] for name in names if name in pairwise], gates,
                           noise_floor_from)
    verdicts = []
    not_reweighted: list[str] = []
    for name in names:
        metric_samples = samples.get(name)
        if metric_samples is None:
            verdicts.append(_missing(name))
        elif name in pairwise:
            verdicts.append(pairwise[name])
        else:
            verdicts.append(_judge_backend(name, metric_samples, gates, directions, seed,
                                           family, reweigh, broken, not_reweighted))
    if broken is not None:
        verdicts = _without_floor(verdicts, samples, gates, noise_floor_from, broken)
    verdicts = _significant_overall(verdicts, gates, broken)
    if sample_bias is not None and sample_bias.skew:
        reweighted = [v.metric for v in verdicts if v.reweighting is not None]
        verdicts.append(_sample_bias_verdict(sample_bias, reweighted, not_reweighted))
    gated = [v for v in verdicts if v.gated]
    more = [v.samples_needed.more_needed for v in gated
            if v.outcome is Outcome.INCONCLUSIVE and v.samples_needed is not None
            and v.samples_needed.more_needed is not None]
    more_needed = max(more) if more else None
    if not gated:
        return Verdict(Outcome.INCONCLUSIVE, ("no gated metric to judge",), tuple(verdicts),
                       more_needed)
    overall = max((v.outcome for v in gated), key=SEVERITY.__getitem__)
    failing = [(v.metric, check) for v in gated for check in v.checks
               if check.outcome is not Outcome.PASS]
    failing.sort(key=lambda pair: -SEVERITY[pair[1].outcome])  # stable: metric order kept
    reasons = tuple(f"{metric}: {check.reason}" for metric, check in failing)
    if overall is Outcome.PASS:
        reasons = (f"all {len(gated)} gated metrics pass",)
    if sample_bias is not None and sample_bias.skew and not sample_bias.refuse:
        reasons += tuple(f"{SAMPLE_BIAS_METRIC}: sample skew flagged: {r}"
                         for r in sample_bias.reasons)
        reasons += tuple(f"{SAMPLE_BIAS_METRIC}: {r}" for r in verdicts[-1].reasons[1:])
    return Verdict(overall, reasons, tuple(verdicts), more_needed)


def _higher(name: str, directions: Mapping[str, Direction]) -> bool:
    direction = directions.get(name)
    if direction not in ("higher", "lower"):
        raise ValueError(f"{name}: direction must be 'higher' or 'lower', got {direction!r}")
    return direction == "higher"


def _metric_seed(seed: int, name: str) -> int:
    return seed ^ zlib.crc32(name.encode())


def _judge_backend(
    name: str, samples: MetricSamples, gates: Gates, directions: Mapping[str, Direction],
    seed: int, family: int, reweigh: SampleBias | None, broken: str | None,
    not_reweighted: list[str],
) -> MetricVerdict:
    """Rules 6, 9 and 11 for a per-backend metric: against the replica at the same rate
    where it is the basis and not ``broken``, else against the primary (reweighted where
    rule 9 asks); a metric not reweighted for its replica is added to ``not_reweighted``."""
    higher, metric_seed = _higher(name, directions), _metric_seed(seed, name)
    instead = broken if broken is not None and _replica_is_basis(name, samples, gates) \
        else None
    if instead is not None:
        samples = _without_replica(samples)
    conditions = samples.conditions
    sized = reweigh is not None and conditions is not None and conditions.sized
    if sized and _replica_is_basis(name, samples, gates):
        not_reweighted.append(name)
    elif sized and reweigh is not None and conditions is not None:
        verdict = _judge_reweighted(name, samples, conditions, reweigh, gates, higher,
                                    metric_seed, family)
        return verdict if instead is None else _in_place_of_replica(verdict, instead)
    verdict = _judge_metric(name, samples, gates, higher, metric_seed, family)
    return verdict if instead is None else _in_place_of_replica(verdict, instead)


def _without_replica(samples: MetricSamples) -> MetricSamples:
    """Rule 11: ``samples`` with no replica to be their basis (rule 6)."""
    rates = samples.rates
    if rates is not None:
        rates = dataclasses.replace(rates, replica=None)
    return dataclasses.replace(samples, replica=None, rates=rates)


def _in_place_of_replica(verdict: MetricVerdict, broken: str) -> MetricVerdict:
    """Rule 11: a per-backend metric judged against the primary because its replica is
    broken says so, in its basis and in a note (a passing check, no p-value: it tests
    nothing, so rule 10's family is the checks graded on the primary)."""
    note = (f"replica not used as the baseline: {broken}; compared with the primary "
            "instead")
    basis = f"{verdict.basis}, in place of the broken replica"
    if not verdict.gated:
        return dataclasses.replace(verdict, basis=basis, reasons=(*verdict.reasons, note))
    check = Check("replica", Outcome.PASS, None, None, None, None, False, note)
    return dataclasses.replace(verdict, basis=basis, checks=(*verdict.checks, check),
                               reasons=(*verdict.reasons, note))


def _family_size(names: Sequence[str], samples: Mapping[str, MetricSamples],
                 gates: Gates) -> int:
    """Rule 7: the checks rule 10 will test together once every metric is judged (a
    required metric without samples counted as one)."""
    count = 0
    for name in names:
        metric_samples = samples.get(name)
        if metric_samples is None:
            count += 1
            continue
        pairwise = metric_samples.baseline is None
        gate = gates.gate_for(name, pairwise=pairwise)
        count += gate.tested_checks(noise_floor=pairwise and metric_samples.noise_floor
                                    is not None)
    return max(1, count)


def _broken_floor(verdicts: Sequence[MetricVerdict], gates: Gates,
                  replica: str | None) -> str | None:
    """Rule 11: why the replica is no noise floor, as the first metric (in metric order)
    whose limit it misses beyond rule 3's bound says it (None: no metric does)."""
    for verdict in verdicts:
        s = verdict.statistics
        if not (isinstance(s, PairwiseSummary) and s.noise_floor is not None and any(
                check.name == "noise_floor_bound" for check in verdict.checks)):
            continue
        gate = gates.gate_for(verdict.metric, pairwise=True)
        why = broken_floor(verdict.metric, s.noise_floor, gate, gates.max_noise_floor_miss,
                           replica)
        if why is not None:
            return why
    return None


def _without_floor(verdicts: Sequence[MetricVerdict], samples: Mapping[str, MetricSamples],
                   gates: Gates, replica: str | None, broken: str) -> list[MetricVerdict]:
    """Rule 11: every pairwise metric measured against the replica graded again on the
    same statistics, the replica no noise floor."""
    out = []
    for verdict in verdicts:
        metric_samples = samples.get(verdict.metric)
        if (metric_samples is not None and metric_samples.noise_floor is not None
                and isinstance(verdict.statistics, PairwiseSummary)):
            verdict = _pairwise_verdict(verdict.metric, metric_samples, verdict.statistics,
                                        gates, replica, broken)
        out.append(verdict)
    return out


def _significant_overall(verdicts: list[MetricVerdict], gates: Gates,
                         broken: str | None = None) -> list[MetricVerdict]:
    """Rule 10: every gated check's evidence tested together; ``broken``: rule 11 (a
    noise-floor check's FAIL graded again here rests on that replica again)."""
    alpha = (1.0 - gates.confidence) / 2.0
    tested = [(i, j, check.p_value) for i, verdict in enumerate(verdicts) if verdict.gated
              for j, check in enumerate(verdict.checks) if check.p_value is not None]
    rejected = holm_rejected([p for _, _, p in tested], alpha)
    out = list(verdicts)
    for (i, j, p), holds in zip(tested, rejected, strict=True):
        check = out[i].checks[j]
        if holds or not check.significant or check.margin is None:
            continue
        note = (f"p={p:.2g} alone, not significant among the verdict's {len(tested)} "
                f"checks at {alpha:.1%} (Holm)")
        checks = list(out[i].checks)
        checks[j] = not_significant_overall(check, note)
        if check.name == "noise_floor":
            checks[j] = on_broken_floor(checks[j], broken)
        outcome = max((c.outcome for c in checks), key=SEVERITY.__getitem__)
        out[i] = dataclasses.replace(out[i], outcome=outcome, checks=tuple(checks),
                                     reasons=tuple(c.reason for c in checks))
    # Rule 7: only an INCONCLUSIVE metric says how many samples it waits for.
    return [dataclasses.replace(v, samples_needed=None)
            if v.samples_needed is not None and v.outcome is not Outcome.INCONCLUSIVE else v
            for v in out]


def _replica_is_basis(name: str, samples: MetricSamples, gates: Gates) -> bool:
    """Rule 6: the replica at the same rate has the gate's minimum of values (of counts,
    for a rate), so it is the per-backend metric's baseline."""
    gate = gates.gate_for(name, pairwise=False)
    need = gates.min_samples_for(gate)
    if gate.max_mean_worsening is not None:
        replica = (samples.rates or RateSamples.of(samples)).replica
        return replica is not None and replica.n >= need
    return samples.replica is not None and len(samples.replica) >= need


def _judge_reweighted(
    name: str, samples: MetricSamples, conditions: LoadConditions, bias: SampleBias,
    gates: Gates, higher: bool, seed: int, family: int,
) -> MetricVerdict:
    """Rule 9: the metric judged on its values reweighted to the traffic's prompt sizes."""
    assert samples.baseline is not None
    c_weights, c_unknown = value_weights(conditions.candidate_prompt_size, bias)
    b_weights, b_unknown = value_weights(conditions.baseline_prompt_size, bias)
    c_keep = resample_indices(c_weights, seed)
    b_keep = resample_indices(b_weights, seed ^ 1)

    def pick(values: tuple[Any, ...], keep: Any) -> tuple[Any, ...]:
        return tuple(values[int(i)] for i in keep) if values else values

    c, b = conditions, samples.baseline
    weighted = MetricSamples(
        candidate=[float(samples.candidate[int(i)]) for i in c_keep],
        baseline=[float(b[int(i)]) for i in b_keep],
        replica=samples.replica,
        conditions=LoadConditions(
            pick(c.candidate_concurrency, c_keep), pick(c.baseline_concurrency, b_keep),
            pick(c.candidate_prompt_tokens, c_keep), pick(c.candidate_cached_tokens, c_keep),
            pick(c.baseline_prompt_tokens, b_keep), pick(c.baseline_cached_tokens, b_keep),
            cache=c.cache))
    unweighted = _judge_metric(name, samples, gates, higher, seed, family)
    verdict = _judge_metric(name, weighted, gates, higher, seed, family)
    reweighting = Reweighting(
        method=REWEIGHT_METHOD, seed=seed,
        weights=tuple((bucket.prompt_tokens, bucket.weight) for bucket in bias.buckets
                      if bucket.weight is not None),
        n_candidate=len(samples.candidate), n_baseline=len(b),
        effective_candidate=int(c_keep.size), effective_baseline=int(b_keep.size),
        unknown=c_unknown + b_unknown, unweighted=_shift_summary(unweighted))
    return dataclasses.replace(verdict, basis=f"{verdict.basis}, reweighted to the traffic's "
                               "prompt sizes", reweighting=reweighting)


def _shift_summary(verdict: MetricVerdict) -> dict[str, Any]:
    """What rule 9 shows of the unweighted judgement: the verdict and the shift it read."""
    out: dict[str, Any] = {"verdict": verdict.outcome.value, "basis": verdict.basis}
    m, s = verdict.matched, verdict.statistics
    if m is not None and m.comparable:
        out.update(shift=m.shift, shift_ci_low=m.shift_ci_low, shift_ci_high=m.shift_ci_high,
                   relative_shift=m.relative_shift, p_value=m.p_value)
    elif isinstance(s, Comparison):
        out.update(shift=s.hl_shift, shift_ci_low=s.hl_ci_low, shift_ci_high=s.hl_ci_high,
                   relative_shift=s.relative_shift, p_value=s.p_value)
    if isinstance(s, Comparison):
        out["pooled_shift"] = s.hl_shift
    return out


def _sample_bias_verdict(bias: SampleBias, reweighted: Sequence[str] = (),
                         not_reweighted: Sequence[str] = ()) -> MetricVerdict:
    """Rule 8: a refusal is a gated INCONCLUSIVE; a flag alone is shown, not gated (rule
    9: its later reasons say which metrics were reweighted and which could not be)."""
    if bias.refuse:
        reason = "sample skew: " + "; ".join(bias.reasons)
        check = Check("sample_bias", Outcome.INCONCLUSIVE, bias.ks_statistic, None, None,
                      None, True, reason)
        return MetricVerdict(SAMPLE_BIAS_METRIC, Outcome.INCONCLUSIVE, True, (reason,),
                             (check,), None, basis="all traffic")
    reasons = ["sample skew flagged: " + "; ".join(bias.reasons)]
    if reweighted:
        weights = ", ".join(f"{b.prompt_tokens} x{b.weight:.2f}" for b in bias.buckets
                            if b.weight is not None)
        reasons.append(f"reweighted to the traffic's prompt sizes ({weights}): "
                       + ", ".join(reweighted))
    if not_reweighted:
        reasons.append("not reweighted (the same-rate replica is their baseline): "
                       + ", ".join(not_reweighted))
    return MetricVerdict(SAMPLE_BIAS_METRIC, Outcome.PASS, False, tuple(reasons), (), None,
                         basis="all traffic")


def _judge_metric(
    name: str, samples: MetricSamples, gates: Gates, higher: bool, seed: int, family: int,
    replica_name: str | None = None,
) -> MetricVerdict:
    if samples.baseline is None:
        return _judge_pairwise(name, samples, gates, higher, seed, replica_name)
    gate = gates.gate_for(name, pairwise=False)
    if gate.max_mean_worsening is not None:
        return _judge_rate(name, samples.rates or RateSamples.of(samples), gates, gate, higher,
                           family)
    need = gates.min_samples_for(gate)
    baseline, basis, side = samples.baseline, "primary", "primary"
    replica = samples.replica
    if replica is not None and len(replica) >= need:
        baseline, basis, side = replica, "replica at the same rate", "replica"
    n_c, n_b = len(samples.candidate), len(baseline)
    statistics = None
    if min(n_c, n_b) >= MIN_COMPARABLE_SAMPLES:
        statistics = compare_samples(
            baseline,
            samples.candidate,
            confidence=gates.confidence,
            higher_is_better=higher,
            seed=seed,
        )
    if not gate.has_backend_checks:
        return _ungated(name, statistics, basis)
    conditions = samples.conditions
    if basis == "primary" and conditions is not None and conditions.recorded:
        return _judge_matched(name, samples, conditions, gates, gate, higher, statistics,
                              family, seed)
    asked = PowerQuery(n_b, n_c, gates.confidence, ESTIMATE_POWER, need, family)
    if statistics is None or min(n_c, n_b) < need:
        estimate = _estimate(gate, statistics, None, asked)
        return _inconclusive(name, f"candidate {n_c}, {side} {n_b}", need, statistics,
                             basis=basis, estimate=estimate)
    checks = backend_checks(statistics, gate, gates.marginal_band)
    return _verdict(name, checks, statistics, basis)


def _judge_rate(
    name: str, counts: RateSamples, gates: Gates, gate: MetricGate, higher: bool, family: int,
) -> MetricVerdict:
    """Rules 1, 2 and 7 for a 0/1 metric: its counts compared, no bootstrap."""
    need = gates.min_samples_for(gate)
    baseline, basis, side = counts.baseline, "primary", "primary"
    if counts.replica is not None and counts.replica.n >= need:
        baseline, basis, side = counts.replica, "replica at the same rate", "replica"
    candidate = counts.candidate
    if not (baseline.is_rate and candidate.is_rate):
        reason = "not judged as a rate: it holds values other than 0 and 1 (rate_metrics)"
        check = Check("rate", Outcome.INCONCLUSIVE, None, None, None, None, False, reason)
        return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,), None,
                             basis)
    rates = None
    if min(candidate.n, baseline.n) >= MIN_COMPARABLE_SAMPLES:
        rates = compare_rates(baseline, candidate, confidence=gates.confidence,
                              higher_is_better=higher)
    asked = PowerQuery(baseline.n, candidate.n, gates.confidence, ESTIMATE_POWER, need, family)
    if rates is None or min(candidate.n, baseline.n) < need:
        estimate = _rate_estimate(gate, rates, asked, gates.marginal_band)
        verdict = _inconclusive(name, f"candidate {candidate.n}, {side} {baseline.n}", need,
                                None, basis=basis, estimate=estimate)
        return dataclasses.replace(verdict, rates=rates)
    check = rate_check(rates, gate, gates.marginal_band, scope=counts.scope)
    estimate = None
    if (check.outcome is not Outcome.FAIL and check.ci_high is not None
            and check.threshold is not None and check.ci_high > check.threshold):
        # Rule 7, also where a significant change is MARGINAL now: rule 10 may grade it
        # again as not significant, and then it waits for the bound (the judge drops
        # the estimate of a metric that ends up not INCONCLUSIVE).
        estimate = _rate_estimate(gate, rates, asked, gates.marginal_band)
        if (estimate is not None and estimate.needed_per_side is not None
                and check.outcome is Outcome.INCONCLUSIVE):
            more = f" (about {estimate.needed_per_side} per side at the rates seen so far)"
            check = dataclasses.replace(check, reason=check.reason + more)
    return MetricVerdict(name, check.outcome, True, (check.reason,), (check,), None, basis,
                         samples_needed=estimate, rates=rates)


def _rate_estimate(gate: MetricGate, rates: RateComparison | None, asked: PowerQuery,
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


def _judge_matched(
    name: str, samples: MetricSamples, conditions: LoadConditions, gates: Gates,
    gate: MetricGate, higher: bool, statistics: Comparison | None, family: int, seed: int,
) -> MetricVerdict:
    """Rule 6's second case: the median shift within concurrency (and cache) strata, the
    other checks at the candidate's mix of them."""
    assert samples.baseline is not None
    need = gates.min_samples_for(gate)
    basis = "primary at matched load" + (" and cache" if conditions.cache else "")
    c_labels, c_values = _condition_labels(
        samples.candidate, conditions.candidate_concurrency,
        conditions.candidate_prompt_tokens, conditions.candidate_cached_tokens,
        conditions.cache)
    b_labels, b_values = _condition_labels(
        samples.baseline, conditions.baseline_concurrency,
        conditions.baseline_prompt_tokens, conditions.baseline_cached_tokens,
        conditions.cache)
    matched = None
    if c_values and b_values:
        matched = compare_strata(b_values, b_labels, c_values, c_labels,
                                 higher_is_better=higher, confidence=gates.confidence)
    n_c, n_b = len(samples.candidate), len(samples.baseline)
    if matched is None or not matched.comparable:
        why = matched.reason if matched is not None else "no value with a recorded load"
        reason = f"not comparable at matched load: {why}"
        estimate = _estimate(gate, statistics, None, PowerQuery(
            n_b, n_c, gates.confidence, ESTIMATE_POWER, need, family))
        check = Check("matched_load", Outcome.INCONCLUSIVE, None, None, None, None, False,
                      reason)
        return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,),
                             statistics, basis, matched, estimate)
    m_c, m_b = matched.n_candidate_matched, matched.n_baseline_matched
    b_at_load, c_at_load = _at_candidate_load(b_values, b_labels, c_values, c_labels, seed)
    if statistics is None or min(m_c, m_b, b_at_load.size) < need:
        estimate = _estimate(gate, statistics, matched, PowerQuery(
            m_b, m_c, gates.confidence, ESTIMATE_POWER, need, family))
        resampled = f" (resampled to its mix: {b_at_load.size})" if b_at_load.size < m_b else ""
        return _inconclusive(name, f"at matched load: candidate {m_c}, primary {m_b}"
                             f"{resampled}", need, statistics, basis=basis, matched=matched,
                             estimate=estimate)
    checks = []
    if gate.max_shift_ratio is not None:
        checks.append(stratified_shift_check(matched, gate, gates.marginal_band, basis))
    rest = gate.model_copy(update={"max_shift_ratio": None})
    at_load = compare_samples(b_at_load, c_at_load, confidence=gates.confidence,
                              higher_is_better=higher, seed=seed)
    checks += backend_checks(at_load, rest, gates.marginal_band)
    verdict = _verdict(name, checks, statistics, basis)
    return MetricVerdict(verdict.metric, verdict.outcome, True, verdict.reasons,
                         verdict.checks, statistics, basis, matched)


def _at_candidate_load(
    b_values: Sequence[float], b_labels: Sequence[str], c_values: Sequence[float],
    c_labels: Sequence[str], seed: int,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Rule 6: the primary's and the candidate's values in the strata both hold, the
    primary's resampled to the candidate's mix over them (each value weighted by its
    stratum's candidate count over its primary count; ``_reweight`` rules 2-3)."""
    shared = set(b_labels) & set(c_labels)
    c_count = Counter(label for label in c_labels if label in shared)
    b_count = Counter(label for label in b_labels if label in shared)
    keep = [i for i, label in enumerate(b_labels) if label in shared]
    weights = np.array([c_count[b_labels[i]] / b_count[b_labels[i]] for i in keep],
                       dtype=np.float64)
    baseline = np.asarray(b_values, dtype=np.float64)[keep]
    candidate = np.array([v for v, label in zip(c_values, c_labels, strict=True)
                          if label in shared], dtype=np.float64)
    return baseline[resample_indices(weights, seed)], candidate


def _condition_labels(
    values: Samples, concurrency: tuple[int | None, ...], prompt: tuple[int | None, ...],
    cached: tuple[int | None, ...], cache: bool,
) -> tuple[list[str], list[float]]:
    """Each value with a known concurrency, labelled by its bin (and cache stratum)."""
    keep = [i for i, c in enumerate(concurrency) if c is not None]
    loads = bin_labels([float(concurrency[i] or 0) for i in keep], DEFAULT_CONCURRENCY_EDGES)
    labels = [f"concurrency {label}" for label in loads]
    if cache and len(prompt) == len(concurrency) == len(cached):
        strata = cache_strata([prompt[i] for i in keep], [cached[i] for i in keep])
        labels = [f"{a}, {b}" for a, b in zip(labels, strata, strict=True)]
    return labels, [float(values[i]) for i in keep]


def _estimate(
    gate: MetricGate, statistics: Comparison | None,
    matched: StratifiedComparison | None, asked: PowerQuery,
) -> SampleSizeEstimate | None:
    """Rule 7 for the test that decides the metric's gate (a rate's: :func:`_rate_estimate`)."""
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


def _judge_pairwise(
    name: str, samples: MetricSamples, gates: Gates, higher: bool, seed: int,
    replica_name: str | None = None,
) -> MetricVerdict:
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
    return _pairwise_verdict(name, samples, statistics, gates, replica_name)


def _pairwise_verdict(
    name: str, samples: MetricSamples, statistics: PairwiseSummary | None, gates: Gates,
    replica_name: str | None, broken: str | None = None,
) -> MetricVerdict:
    """Rules 1-4 for a pairwise metric on its statistics; ``broken``: rule 11."""
    gate = gates.gate_for(name, pairwise=True)
    floor = samples.noise_floor
    n = len(samples.candidate)
    n_floor = 0 if floor is None else len(floor)
    floor_gated = gate.max_noise_floor_shift_ratio is not None and floor is not None
    if not (gate.has_limit_checks or floor_gated):
        return _ungated(name, statistics)
    need = gates.min_samples_for(gate)
    floor_measured = floor is not None and n_floor >= need
    floor_ok = floor_gated and floor_measured
    if statistics is None or n < need or not (gate.has_limit_checks or floor_ok):
        counts = f"{n} values" + (f", noise floor {n_floor}" if floor is not None else "")
        return _inconclusive(name, counts, need, statistics)
    # Rule 3 relaxes a limit to a floor with enough values whether or not the metric is
    # also held to the floor itself (the embeddings' distance is not, gates rule 2).
    comparison = statistics.noise_floor if floor_measured else None
    checks = pairwise_checks(statistics, comparison, gate, gates.marginal_band,
                             max_floor_miss=gates.max_noise_floor_miss, replica=replica_name,
                             broken=broken)
    if floor_gated and not floor_ok:
        note = f"noise floor not used: {n_floor} values, {need} needed"
        checks.append(Check("noise_floor", Outcome.PASS, None, None, None, None, False, note))
    return _verdict(name, checks, statistics)


def _verdict(
    name: str, checks: list[Check], statistics: Comparison | PairwiseSummary,
    basis: str = "primary",
) -> MetricVerdict:
    outcome = max((c.outcome for c in checks), key=SEVERITY.__getitem__, default=Outcome.PASS)
    reasons = tuple(c.reason for c in checks)
    return MetricVerdict(name, outcome, True, reasons, tuple(checks), statistics, basis)


def _inconclusive(
    name: str, counts: str, need: int, statistics: Comparison | PairwiseSummary | None,
    *, basis: str = "primary", matched: StratifiedComparison | None = None,
    estimate: SampleSizeEstimate | None = None,
) -> MetricVerdict:
    reason = f"too few samples ({counts}; {need} needed each)"
    if estimate is not None and estimate.needed_per_side is not None:
        reason += f"; about {estimate.needed_per_side} per side for the effect seen so far"
    check = Check("samples", Outcome.INCONCLUSIVE, None, float(need), None, None, False, reason)
    return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,), statistics,
                         basis, matched, estimate)


def _missing(name: str) -> MetricVerdict:
    reason = "required metric has no samples"
    check = Check("samples", Outcome.INCONCLUSIVE, None, None, None, None, False, reason)
    return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,), None)


def _ungated(name: str, statistics: Comparison | PairwiseSummary | None,
             basis: str = "primary") -> MetricVerdict:
    reason = "not gated: statistics only"
    return MetricVerdict(name, Outcome.PASS, False, (reason,), (), statistics, basis)
