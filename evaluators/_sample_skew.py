"""The judge's rules 8 and 9: a sample skew in the verdict, and corrected where it can be.

``_sample_bias.py`` finds the skew (the evaluated requests' prompt sizes against all
traffic's); a refusal is a gated INCONCLUSIVE metric of its own, :data:`SAMPLE_BIAS_METRIC`
(rule 8). Below the refusal bound each per-backend metric whose values carry their prompt
sizes is judged on its values reweighted to the traffic's mix (``_reweight.py``), its
unweighted result kept beside (rule 9). Rule numbers are the judge's (``_judge.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from evaluators._checks import Check, Outcome
from evaluators._reweight import REWEIGHT_METHOD, Reweighting, resample_indices, value_weights
from evaluators._sample_bias import SampleBias
from evaluators._statistics import Comparison
from evaluators._verdicts import LoadConditions, MetricSamples, MetricVerdict

__all__ = ["SAMPLE_BIAS_METRIC", "judge_reweighted", "sample_bias_verdict"]

SAMPLE_BIAS_METRIC = "sample.bias"


def judge_reweighted(
    samples: MetricSamples, conditions: LoadConditions, bias: SampleBias, seed: int,
    judge_metric: Callable[[MetricSamples], MetricVerdict],
) -> MetricVerdict:
    """Rule 9: the metric judged (by ``judge_metric``, the judge's own way) on its values
    reweighted to the traffic's prompt sizes."""
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
    unweighted = judge_metric(samples)
    verdict = judge_metric(weighted)
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


def sample_bias_verdict(bias: SampleBias, reweighted: Sequence[str] = (),
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
