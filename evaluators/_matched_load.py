"""The judge's rule 6, like with like: a per-backend metric compared at matched load.

A latency or the decode throughput depends on the load it was measured under, so the
candidate is compared with the noise-floor replica mirrored at its rate where that replica
has enough values (:func:`replica_is_basis`), else with the primary within concurrency
(and, for TTFT, cache) strata: the median shift estimated within them (van Elteren,
``_strata.py``), the other checks on the primary's values resampled to the candidate's
mix over them (:func:`_at_candidate_load`). Rule numbers are the judge's (``_judge.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from evaluators._checks import Check, Outcome, backend_checks, stratified_shift_check
from evaluators._gates import Gates, MetricGate
from evaluators._matching import DEFAULT_CONCURRENCY_EDGES, cache_strata
from evaluators._power import PowerQuery
from evaluators._reweight import resample_indices
from evaluators._samples_needed import ESTIMATE_POWER, gate_estimate
from evaluators._statistics import Comparison, Samples, compare_samples
from evaluators._strata import bin_labels, compare_strata
from evaluators._verdicts import (
    LoadConditions,
    MetricSamples,
    MetricVerdict,
    RateSamples,
    checked_verdict,
    inconclusive_verdict,
)

__all__ = ["judge_matched", "replica_is_basis"]


def replica_is_basis(name: str, samples: MetricSamples, gates: Gates) -> bool:
    """Rule 6: the replica at the same rate has the gate's minimum of values (of counts,
    for a rate), so it is the per-backend metric's baseline."""
    gate = gates.gate_for(name, pairwise=False)
    need = gates.min_samples_for(gate)
    if gate.max_mean_worsening is not None:
        replica = (samples.rates or RateSamples.of(samples)).replica
        return replica is not None and replica.n >= need
    return samples.replica is not None and len(samples.replica) >= need


def judge_matched(
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
        estimate = gate_estimate(gate, statistics, None, PowerQuery(
            n_b, n_c, gates.confidence, ESTIMATE_POWER, need, family))
        check = Check("matched_load", Outcome.INCONCLUSIVE, None, None, None, None, False,
                      reason)
        return MetricVerdict(name, Outcome.INCONCLUSIVE, True, (reason,), (check,),
                             statistics, basis, matched, estimate)
    m_c, m_b = matched.n_candidate_matched, matched.n_baseline_matched
    b_at_load, c_at_load = _at_candidate_load(b_values, b_labels, c_values, c_labels, seed)
    if statistics is None or min(m_c, m_b, b_at_load.size) < need:
        estimate = gate_estimate(gate, statistics, matched, PowerQuery(
            m_b, m_c, gates.confidence, ESTIMATE_POWER, need, family))
        resampled = f" (resampled to its mix: {b_at_load.size})" if b_at_load.size < m_b else ""
        return inconclusive_verdict(name, f"at matched load: candidate {m_c}, primary {m_b}"
                                    f"{resampled}", need, statistics, basis=basis,
                                    matched=matched, estimate=estimate)
    checks = []
    if gate.max_shift_ratio is not None:
        checks.append(stratified_shift_check(matched, gate, gates.marginal_band, basis))
    rest = gate.model_copy(update={"max_shift_ratio": None})
    at_load = compare_samples(b_at_load, c_at_load, confidence=gates.confidence,
                              higher_is_better=higher, seed=seed)
    checks += backend_checks(at_load, rest, gates.marginal_band)
    verdict = checked_verdict(name, checks, statistics, basis)
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
