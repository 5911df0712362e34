"""The judge's rules 1-4 for a pairwise metric: its values summarised, then its checks.

A pairwise metric scores the candidate's answer against the primary's (a similarity, a
distance, exact match); its limits may be relaxed to a noise floor measured on a replica
of the primary (rule 3). :func:`pairwise_verdict` grades a metric on statistics already
computed, so rule 11 grades it again, the replica broken, without recomputing them. Rule
numbers are the judge's (``_judge.py``).
"""

from __future__ import annotations

from evaluators._checks import Check, Outcome, pairwise_checks
from evaluators._gates import Gates
from evaluators._statistics import MIN_COMPARABLE_SAMPLES, PairwiseSummary, summarize_pairwise
from evaluators._verdicts import (
    NO_NOISE_FLOOR,
    MetricSamples,
    MetricVerdict,
    checked_verdict,
    inconclusive_verdict,
    ungated_verdict,
)

__all__ = ["judge_pairwise", "pairwise_verdict"]


def judge_pairwise(
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
    return pairwise_verdict(name, samples, statistics, gates, replica_name)


def pairwise_verdict(
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
        if gate.max_noise_floor_shift_ratio is not None:  # the judge's rule 4: say so
            return ungated_verdict(name, statistics, reason=NO_NOISE_FLOOR)
        return ungated_verdict(name, statistics)
    need = gates.min_samples_for(gate)
    floor_measured = floor is not None and n_floor >= need
    floor_ok = floor_gated and floor_measured
    if statistics is None or n < need or not (gate.has_limit_checks or floor_ok):
        counts = f"{n} values" + (f", noise floor {n_floor}" if floor is not None else "")
        return inconclusive_verdict(name, counts, need, statistics)
    # Rule 3 relaxes a limit to a floor with enough values whether or not the metric is
    # also held to the floor itself (the embeddings' distance is not, gates rule 2).
    comparison = statistics.noise_floor if floor_measured else None
    checks = pairwise_checks(statistics, comparison, gate, gates.marginal_band,
                             max_floor_miss=gates.max_noise_floor_miss, replica=replica_name,
                             broken=broken)
    if floor_gated and not floor_ok:
        note = f"noise floor not used: {n_floor} values, {need} needed"
        checks.append(Check("noise_floor", Outcome.PASS, None, None, None, None, False, note))
    return checked_verdict(name, checks, statistics)
