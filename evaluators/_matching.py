"""Latency at matched load and within cache strata; each backend's load curve and hit rate.

A candidate mirrored at 10 % of the traffic runs at about a tenth of the primary's
concurrency and with a colder prefix cache; pooled, its latency measures those conditions
as much as the backend. These functions label each value with its condition and hand the
comparison to :func:`evaluators._strata.compare_strata`.

Theory of operation:
1. Load. Each latency value carries the concurrency its backend had when the request was
   sent (the gateway's in-flight count at that backend, the request included, or the
   scraped ``vllm:num_requests_running``). Concurrency is binned by
   :data:`DEFAULT_CONCURRENCY_EDGES`: one bin per value up to 8, above that bins at most
   a quarter wider than their lower edge, so that two requests in one bin saw loads
   within 25 % of each other.
2. Cache. TTFT values are binned by prompt length (:data:`DEFAULT_PROMPT_TOKEN_EDGES`,
   doubling) crossed with the cached share of the prompt (cached / prompt tokens,
   :data:`DEFAULT_CACHED_SHARE_EDGES`). An unknown cached count (the backend does not
   report ``cached_tokens``) is its own share stratum, :data:`UNKNOWN`, never 0; an
   unknown prompt length likewise.
3. The load curve is each backend's median and p90 per concurrency bin and the
   Theil-Sen slope of latency on concurrency (seconds per request in flight) with its
   interval; above :data:`MAX_THEIL_SEN_POINTS` values a seeded random subset is fitted
   (Theil-Sen holds every pair in memory). Fewer than two distinct concurrencies leave
   the slope None.
4. The hit rate is token-weighted: cached tokens over prompt tokens, summed over the
   requests where both are known; the requests where either is unknown are counted,
   not guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

import numpy as np
from scipy import stats

from evaluators._statistics import DEFAULT_CONFIDENCE, DEFAULT_SEED, FloatArray
from evaluators._strata import (
    MIN_STRATUM_SAMPLES,
    StratifiedComparison,
    bin_labels,
    compare_strata,
)

__all__ = [
    "DEFAULT_CACHED_SHARE_EDGES",
    "DEFAULT_CONCURRENCY_EDGES",
    "DEFAULT_PROMPT_TOKEN_EDGES",
    "LOAD_CURVE_QUANTILE",
    "MAX_THEIL_SEN_POINTS",
    "UNKNOWN",
    "CacheHitRate",
    "LoadCurve",
    "LoadPoint",
    "cache_hit_rate",
    "cache_strata",
    "compare_at_matched_load",
    "compare_within_cache_strata",
    "load_curve",
]

DEFAULT_CONCURRENCY_EDGES: Final = (
    1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112,
    128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
)  # fmt: skip
DEFAULT_PROMPT_TOKEN_EDGES: Final = (
    0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip
DEFAULT_CACHED_SHARE_EDGES: Final = (0.0, 0.25, 0.5, 0.75)
LOAD_CURVE_QUANTILE: Final = 0.9
MAX_THEIL_SEN_POINTS: Final = 2000
UNKNOWN: Final = "unknown"

Values = Sequence[float] | FloatArray


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One concurrency bin of a backend: how many values, their median and p90."""

    concurrency: str
    n: int
    median: float
    p90: float


@dataclass(frozen=True, slots=True)
class LoadCurve:
    """Latency against concurrency for one backend (rule 3)."""

    n: int
    points: tuple[LoadPoint, ...]
    slope: float | None
    slope_ci_low: float | None
    slope_ci_high: float | None
    intercept: float | None
    fitted_points: int

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["points"] = [{f.name: getattr(p, f.name) for f in fields(p)} for p in self.points]
        return out


@dataclass(frozen=True, slots=True)
class CacheHitRate:
    """A backend's prefix-cache hit rate (rule 4) and how many requests it rests on."""

    requests: int
    known: int
    unknown: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None
    requests_with_hit: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def compare_at_matched_load(
    baseline: Values,
    baseline_concurrency: Values,
    candidate: Values,
    candidate_concurrency: Values,
    *,
    higher_is_better: bool = False,
    edges: Sequence[float] = DEFAULT_CONCURRENCY_EDGES,
    min_per_stratum: int = MIN_STRATUM_SAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> StratifiedComparison:
    """Compare a latency metric only between requests that saw the same load (rule 1).

    What a platform engineer reads: whether the candidate is faster or slower than the
    baseline *at equal concurrency* (``shift``, ``relative_shift`` and ``p_value``), at
    which loads both were observed (``strata``), and ``comparable`` False when the
    candidate never ran at a load the baseline saw: then mirror more traffic to it, or
    compare it with a noise-floor replica sampled at the same rate.
    """
    return compare_strata(
        baseline,
        bin_labels(baseline_concurrency, edges),
        candidate,
        bin_labels(candidate_concurrency, edges),
        higher_is_better=higher_is_better,
        order=_bin_order(edges),
        min_per_stratum=min_per_stratum,
        confidence=confidence,
    )


def load_curve(
    values: Values,
    concurrency: Values,
    *,
    edges: Sequence[float] = DEFAULT_CONCURRENCY_EDGES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = DEFAULT_SEED,
) -> LoadCurve:
    """How a backend's latency grows with the requests in flight (rule 3).

    What a platform engineer reads: the median and p90 at each load the backend ran at,
    and ``slope``, the seconds each additional request in flight adds (with its
    interval): a candidate whose slope is steeper will be slower at full production load
    even when it looks fast at the mirror's share.
    """
    v = np.asarray(values, dtype=np.float64)
    x = np.asarray(concurrency, dtype=np.float64)
    if v.shape != x.shape or v.ndim != 1:
        raise ValueError("values and concurrency must be one-dimensional and of equal length")
    if not (np.all(np.isfinite(v)) and np.all(np.isfinite(x))):
        raise ValueError("values and concurrency must be finite")
    labels = np.asarray(bin_labels(x, edges), dtype=object)
    points = []
    for label in _bin_order(edges):
        chosen = v[labels == label]
        if chosen.size:
            points.append(
                LoadPoint(
                    concurrency=label,
                    n=int(chosen.size),
                    median=float(np.median(chosen)),
                    p90=float(np.quantile(chosen, LOAD_CURVE_QUANTILE)),
                )
            )
    fit_x, fit_v = x, v
    if x.size > MAX_THEIL_SEN_POINTS:
        keep = np.random.default_rng(seed).choice(x.size, MAX_THEIL_SEN_POINTS, replace=False)
        fit_x, fit_v = x[keep], v[keep]
    if np.unique(fit_x).size < 2:
        return LoadCurve(int(v.size), tuple(points), None, None, None, None, int(fit_x.size))
    fit = stats.theilslopes(fit_v, fit_x, alpha=confidence)
    return LoadCurve(
        n=int(v.size),
        points=tuple(points),
        slope=float(fit.slope),
        slope_ci_low=float(fit.low_slope),
        slope_ci_high=float(fit.high_slope),
        intercept=float(fit.intercept),
        fitted_points=int(fit_x.size),
    )


def cache_strata(
    prompt_tokens: Sequence[int | None],
    cached_tokens: Sequence[int | None],
    *,
    prompt_edges: Sequence[float] = DEFAULT_PROMPT_TOKEN_EDGES,
    share_edges: Sequence[float] = DEFAULT_CACHED_SHARE_EDGES,
) -> list[str]:
    """Each request's cache stratum (rule 2): ``"prompt [1024, 2048) cached [50%, 75%)"``,
    with ``unknown`` for a length or a cached count the backend did not report."""
    if len(prompt_tokens) != len(cached_tokens):
        raise ValueError("prompt_tokens and cached_tokens must be of equal length")
    prompt_names = _labels_or_unknown(prompt_tokens, prompt_edges)
    shares: list[float | None] = [
        None if p is None or c is None or p <= 0 else c / p
        for p, c in zip(prompt_tokens, cached_tokens, strict=True)
    ]
    percent = [100.0 * e for e in share_edges]
    share_names = _labels_or_unknown(
        [None if s is None else 100.0 * s for s in shares], percent, suffix="%"
    )
    return [f"prompt {p} cached {s}" for p, s in zip(prompt_names, share_names, strict=True)]


def compare_within_cache_strata(
    baseline: Values,
    baseline_prompt_tokens: Sequence[int | None],
    baseline_cached_tokens: Sequence[int | None],
    candidate: Values,
    candidate_prompt_tokens: Sequence[int | None],
    candidate_cached_tokens: Sequence[int | None],
    *,
    higher_is_better: bool = False,
    prompt_edges: Sequence[float] = DEFAULT_PROMPT_TOKEN_EDGES,
    share_edges: Sequence[float] = DEFAULT_CACHED_SHARE_EDGES,
    min_per_stratum: int = MIN_STRATUM_SAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
) -> StratifiedComparison:
    """Compare TTFT only between requests of like prompt length and cache warmth (rule 2).

    What a platform engineer reads: whether the candidate is slower to first token than
    the primary *for the same prompt size and the same share already cached*: a pooled
    "slower" that vanishes here is the mirror's colder cache (sample by session, or
    accept it), not the candidate's engine.
    """
    b_strata = cache_strata(
        baseline_prompt_tokens,
        baseline_cached_tokens,
        prompt_edges=prompt_edges,
        share_edges=share_edges,
    )
    c_strata = cache_strata(
        candidate_prompt_tokens,
        candidate_cached_tokens,
        prompt_edges=prompt_edges,
        share_edges=share_edges,
    )
    shares = [*_bin_order(tuple(100.0 * e for e in share_edges), suffix="%"), UNKNOWN]
    order = [f"prompt {p} cached {s}" for p in [*_bin_order(prompt_edges), UNKNOWN] for s in shares]
    return compare_strata(
        baseline,
        b_strata,
        candidate,
        c_strata,
        higher_is_better=higher_is_better,
        order=order,
        min_per_stratum=min_per_stratum,
        confidence=confidence,
    )


def cache_hit_rate(
    prompt_tokens: Sequence[int | None], cached_tokens: Sequence[int | None]
) -> CacheHitRate:
    """A backend's token-weighted prefix-cache hit rate over the requests that report it.

    What a platform engineer reads, side by side for candidate and primary: how much of
    the prompt each backend served from cache (``hit_rate``), on how many requests that
    rests, and how many did not say (``unknown``: enable the backend's prompt-token
    details, e.g. vLLM's ``--enable-prompt-tokens-details``, to know).
    """
    if len(prompt_tokens) != len(cached_tokens):
        raise ValueError("prompt_tokens and cached_tokens must be of equal length")
    known = [
        (p, c)
        for p, c in zip(prompt_tokens, cached_tokens, strict=True)
        if p is not None and c is not None
    ]
    prompt_sum = sum(p for p, _ in known)
    cached_sum = sum(c for _, c in known)
    return CacheHitRate(
        requests=len(prompt_tokens),
        known=len(known),
        unknown=len(prompt_tokens) - len(known),
        prompt_tokens=prompt_sum,
        cached_tokens=cached_sum,
        hit_rate=cached_sum / prompt_sum if prompt_sum > 0 else None,
        requests_with_hit=sum(1 for _, c in known if c > 0),
    )


def _bin_order(edges: Sequence[float], *, suffix: str = "") -> list[str]:
    """Every label :func:`bin_labels` can give, lowest bin first."""
    probes = [edges[0] - 1.0, *edges]
    return [_suffixed(label, suffix) for label in bin_labels(probes, edges)]


def _labels_or_unknown(
    values: Sequence[float | None], edges: Sequence[float], *, suffix: str = ""
) -> list[str]:
    known = [v for v in values if v is not None]
    names = iter(bin_labels(known, edges) if known else [])
    return [UNKNOWN if v is None else _suffixed(next(names), suffix) for v in values]


def _suffixed(label: str, suffix: str) -> str:
    """Put a unit after each number of a bin label: "[25, 50)" -> "[25%, 50%)"."""
    if not suffix:
        return label
    if label.startswith("["):
        low, high = label[1:-1].split(", ")
        return f"[{low}{suffix}, {high}{suffix})"
    return f"{label}{suffix}"
