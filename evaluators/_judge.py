"""The judge: every metric of a candidate checked against the gates, then one verdict.

This module judges each metric by its kind and makes the verdict-wide passes (rules 5,
10 and 11); the rules below are numbered for the whole judge, and the modules beside it
implement some of them under the same numbers: ``_verdicts.py`` (what is judged and the
answers, rules 1 and 4), ``_pairwise_judgement.py`` (rules 1-4 for a pairwise metric),
``_matched_load.py`` (rule 6), ``_samples_needed.py`` (rule 7) and ``_sample_skew.py``
(rules 8-9).

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
     one-sided, rejects "no worse" (``_rates`` rule 2: a count, not a bootstrap,
     whose interval collapsed at 0 errors and called 5 errors in 30 against 0 significant,
     where Fisher's p is 0.026). Its interval is Newcombe's, and a PASS needs that
     interval's upper end within T as well (rule 1).
   - tail_ratio: candidate p99 over primary p99 (p1 when higher is better); the
     interval's lower bound is above T itself: the tail is beyond the gate, not merely
     worse (Kayenta's gap: a longer tail under an unchanged median).
   - std_ratio: Brown-Forsythe rejects equal spread and the candidate's is larger
     (Kayenta's gap: a variance increase under an unchanged median). For a candidate
     significantly better on the median both read the values on the slow side of the
     baseline's median only: answers made faster widen the whole spread, and harm
     nobody (half the answers made twice as fast, the rest unchanged, FAILed in 11 of 12
     windows), while stalls widen that side's (10 % faster with 0.5 % stalled 10x, once
     excused on a p99 no worse, PASSed in 10 of 12).
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
   its verdict and statistics are shown but do not count. One held only to the noise
   floor (exact match, tool-call agreement, ...) is not gated where no floor was
   measured, and a PASS says so in a reason of its own naming those metrics: without a
   replica, tool calls that agreed with the primary's in 60 % of answers PASSed on
   "all 1 gated metrics pass" alone.
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
     primary's there resampled to the candidate's mix over them (``_matched_load.py``:
     ``_reweight`` rules 2-3, each value weighted by its stratum's candidate share over
     its primary share). Pooled, a mirror's lighter load hid a longer tail (5 % of answers
     stalled 60 ms at 10 % of the load: MARGINAL, tail ratio 1.23) and a canary's heavier
     load made one (an identical engine at about twice the load: FAIL, tail ratio 1.3).
     No stratum held by both sides, or fewer matched values (or a resampled primary
     smaller) than the gate's minimum, is INCONCLUSIVE with the reason;
   - pooled as in rule 2 when no concurrency was recorded on either side (old rows).
7. Every INCONCLUSIVE metric carries ``samples_needed`` (``_samples_needed.py`` over
   ``_power.py``): the values per side at which the effect seen so far would be
   significant among the verdict's checks (rule 10: at the first of Holm's bars, the
   level over the number of checks the gated metrics make once judged,
   ``MetricGate.tested_checks``: a metric not judged yet counted with every check it can
   make, a required one without samples as one, so the wait is never short of the
   family's) with probability :data:`ESTIMATE_POWER` (the count at which the verdict is
   as likely as not to turn), floored at the gate's minimum; the verdict's
   ``more_samples_needed`` is the largest of the more-needed counts. A rate whose change
   seen so far is inside its limit's band turns instead when its interval rules out the
   limit (rule 1; ``_power`` rule 4b: the interval is not among Holm's family, so alpha
   is the gates' own). A rate's estimate is sized from its counts, so it is a count the
   window can reach: the report counts a rate over its whole window, not the newest
   values it caps the other metrics at.
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
from collections.abc import Mapping, Sequence

from evaluators._checks import (
    SEVERITY,
    Check,
    Outcome,
    backend_checks,
    broken_floor,
    not_significant_overall,
    on_broken_floor,
    rate_check,
)
from evaluators._gates import Gates, MetricGate
from evaluators._matched_load import judge_matched, replica_is_basis
from evaluators._pairwise_judgement import judge_pairwise, pairwise_verdict
from evaluators._power import PowerQuery
from evaluators._rates import compare_rates
from evaluators._sample_bias import SampleBias
from evaluators._sample_skew import SAMPLE_BIAS_METRIC, judge_reweighted, sample_bias_verdict
from evaluators._samples_needed import ESTIMATE_POWER, gate_estimate, rate_estimate
from evaluators._score import Direction
from evaluators._statistics import (
    DEFAULT_SEED,
    MIN_COMPARABLE_SAMPLES,
    PairwiseSummary,
    compare_samples,
    holm_rejected,
)
from evaluators._verdicts import (
    NO_NOISE_FLOOR,
    MetricSamples,
    MetricVerdict,
    RateSamples,
    Verdict,
    checked_verdict,
    inconclusive_verdict,
    missing_verdict,
    ungated_verdict,
)

__all__ = ["judge"]


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
            verdicts.append(missing_verdict(name))
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
        verdicts.append(sample_bias_verdict(sample_bias, reweighted, not_reweighted))
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
        unheld = [v.metric for v in verdicts if v.reasons == (NO_NOISE_FLOOR,)]
        if unheld:  # rule 4: a PASS says what it did not judge
            reasons += (f"not judged, no noise floor measured: {', '.join(unheld)} (mirror "
                        "a replica of the primary, role = \"secondary\", to hold them to "
                        "it)",)
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
    instead = broken if broken is not None and replica_is_basis(name, samples, gates) \
        else None
    if instead is not None:
        samples = _without_replica(samples)
    conditions = samples.conditions
    sized = reweigh is not None and conditions is not None and conditions.sized
    if sized and replica_is_basis(name, samples, gates):
        not_reweighted.append(name)
    elif sized and reweigh is not None and conditions is not None:
        verdict = judge_reweighted(
            samples, conditions, reweigh, metric_seed,
            lambda values: _judge_metric(name, values, gates, higher, metric_seed, family))
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
            verdict = pairwise_verdict(verdict.metric, metric_samples, verdict.statistics,
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


def _judge_metric(
    name: str, samples: MetricSamples, gates: Gates, higher: bool, seed: int, family: int,
    replica_name: str | None = None,
) -> MetricVerdict:
    if samples.baseline is None:
        return judge_pairwise(name, samples, gates, higher, seed, replica_name)
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
        return ungated_verdict(name, statistics, basis)
    conditions = samples.conditions
    if basis == "primary" and conditions is not None and conditions.recorded:
        return judge_matched(name, samples, conditions, gates, gate, higher, statistics,
                             family, seed)
    asked = PowerQuery(n_b, n_c, gates.confidence, ESTIMATE_POWER, need, family)
    if statistics is None or min(n_c, n_b) < need:
        estimate = gate_estimate(gate, statistics, None, asked)
        return inconclusive_verdict(name, f"candidate {n_c}, {side} {n_b}", need,
                                    statistics, basis=basis, estimate=estimate)
    checks = backend_checks(statistics, gate, gates.marginal_band, baseline=side)
    return checked_verdict(name, checks, statistics, basis)


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
        estimate = rate_estimate(gate, rates, asked, gates.marginal_band)
        verdict = inconclusive_verdict(name, f"candidate {candidate.n}, {side} {baseline.n}",
                                       need, None, basis=basis, estimate=estimate)
        return dataclasses.replace(verdict, rates=rates)
    check = rate_check(rates, gate, gates.marginal_band, scope=counts.scope)
    estimate = None
    if (check.outcome is not Outcome.FAIL and check.ci_high is not None
            and check.threshold is not None and check.ci_high > check.threshold):
        # Rule 7, also where a significant change is MARGINAL now: rule 10 may grade it
        # again as not significant, and then it waits for the bound (the judge drops
        # the estimate of a metric that ends up not INCONCLUSIVE).
        estimate = rate_estimate(gate, rates, asked, gates.marginal_band)
        if (estimate is not None and estimate.needed_per_side is not None
                and check.outcome is Outcome.INCONCLUSIVE):
            more = f" (about {estimate.needed_per_side} per side at the rates seen so far)"
            check = dataclasses.replace(check, reason=check.reason + more)
    return MetricVerdict(name, check.outcome, True, (check.reason,), (check,), None, basis,
                         samples_needed=estimate, rates=rates)

