"""A skewed sample reweighted to the traffic's prompt sizes, for the latency metrics.

A byte-bounded buffer drops long prompts first, so the evaluated requests are shorter
than the traffic; a latency that grows with the prompt then looks better (or its change
smaller) than production would see. Below the refusal bound (``_sample_bias.py`` rule 6)
the judge answers for the traffic by weighting each evaluated value.

Theory of operation:
1. A value's weight is the importance weight of its prompt-size bucket (``_sample_bias``
   rule 5: the bucket's share of all traffic over its share of the evaluated requests).
   A value whose prompt size is unknown, or whose bucket has no weight, weighs 1 and is
   counted in ``unknown``.
2. The reweighted sample is drawn by systematic resampling with a fixed seed: m positions
   ``(u + k) / m``, u drawn from the seed, over the cumulative normalised weights; each
   value appears about ``m * w_i / sum(w)`` times (floor or ceiling), so the mix is the
   traffic's with far less noise than independent draws.
3. m is Kish's effective sample size ``sum(w)^2 / sum(w^2)`` (at least 2, at most the
   values held): the statistics downstream see as many values as a weighted sample of
   that spread is worth, so their intervals widen with the weights instead of treating
   the copies as free information.
4. Each side (candidate, primary) is resampled with its own values' weights; every list
   aligned with a side's values (its concurrency, tokens) is carried along by index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from evaluators._sample_bias import SampleBias

__all__ = ["REWEIGHT_METHOD", "Reweighting", "resample_indices", "value_weights"]

REWEIGHT_METHOD: Final = "systematic resampling to Kish's effective size"
MIN_RESAMPLED: Final = 2


@dataclass(frozen=True, slots=True)
class Reweighting:
    """What one metric's reweighting did (the module's rules), for the report."""

    method: str
    seed: int
    weights: tuple[tuple[str, float], ...]
    """Each prompt-size bucket's weight (traffic share over evaluated share)."""
    n_candidate: int
    n_baseline: int
    effective_candidate: int
    effective_baseline: int
    unknown: int
    """Values weighted 1 for want of a prompt size or a bucket weight (rule 1)."""
    unweighted: dict[str, Any] | None = None
    """The same metric judged on the values as evaluated: basis, shift and interval."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["weights"] = dict(self.weights)
        return out


def value_weights(
    prompt_sizes: Sequence[float | None], bias: SampleBias
) -> tuple[npt.NDArray[np.float64], int]:
    """Rule 1: each value's weight, and how many weigh 1 for want of a known bucket."""
    out = np.ones(len(prompt_sizes), dtype=np.float64)
    unknown = 0
    for i, size in enumerate(prompt_sizes):
        weight = None if size is None else bias.weight_for(float(size))
        if weight is None:
            unknown += 1
        else:
            out[i] = weight
    return out, unknown


def resample_indices(weights: npt.NDArray[np.float64], seed: int) -> npt.NDArray[np.intp]:
    """Rules 2-3: the indices of the reweighted sample, in their original order."""
    n = int(weights.size)
    total = float(weights.sum())
    if n == 0 or total <= 0.0:
        return np.arange(n)
    kish = total * total / float(np.square(weights).sum())
    m = min(n, max(MIN_RESAMPLED, round(kish)))
    u = float(np.random.default_rng(seed).random())
    positions = (u + np.arange(m)) / m
    cumulative = np.cumsum(weights) / total
    cumulative[-1] = 1.0  # no position beyond the last value for rounding's sake
    return np.searchsorted(cumulative, positions, side="right").astype(np.intp)
