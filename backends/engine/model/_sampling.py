"""Sampling parameters and the sampler: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._arrays import Float32Array

__all__ = ["SamplingParams", "sample_token"]

_NEGLIGIBLE_LOGIT = 40.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy (argmax; ``top_p``/``top_k``/``seed`` are ignored).  With a
    ``seed`` the same request gives the same tokens; without one the sampler draws fresh entropy.
    Generation stops at ``max_tokens``, at the model's eos / ``<|im_end|>`` (unless
    ``ignore_eos``), or at any of ``stop_token_ids``; the stop token is part of the output.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _log_softmax_at(logits64: npt.NDArray[np.float64], token: int) -> float:
    peak = float(logits64.max())
    log_total = peak + math.log(float(np.exp(logits64 - peak).sum()))
    return float(logits64[token]) - log_total


def sample_token(
    logits: Float32Array, params: SamplingParams, rng: np.random.Generator
) -> tuple[int, float]:
    """``(token id, its log-probability under the model's unmodified distribution)``."""
    logits64 = logits.astype(np.float64)
    if params.greedy:
        token = int(np.argmax(logits))
        return token, _log_softmax_at(logits64, token)
    scaled = logits64 / params.temperature
    # Tokens more than _NEGLIGIBLE_LOGIT below the best weigh < 1e-17 of it: beyond float64.
    candidates = np.flatnonzero(scaled >= scaled.max() - _NEGLIGIBLE_LOGIT)
    order = candidates[np.argsort(-scaled[candidates], kind="stable")]
    if params.top_k:
        order = order[: params.top_k]
    ranked = scaled[order]
    probs = np.exp(ranked - ranked[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        keep = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        probs = probs[:keep] / probs[:keep].sum()
    cumulative = np.cumsum(probs)
    choice = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    token = int(order[min(choice, probs.size - 1)])
    return token, _log_softmax_at(logits64, token)
