"""Is the evaluated sample like the traffic? Skew, drops, importance weights, refusal.

Bounded buffers drop what is largest first, so the requests that reach the judge can be
shorter than the traffic the gateway served, and a verdict on them says little about
long prompts. This module compares the evaluated requests with all the traffic seen.

Theory of operation:
1. ``seen`` is every request the gateway served in the window (evaluated, dropped and
   never sampled), or a uniform sample of them; ``evaluated`` is the requests whose
   scores the judge uses. Evaluated requests are usually part of ``seen``: the tests
   below then compare a sample with a superset of it, which only makes them more
   conservative (larger p-values), never raises a false flag.
2. Prompt length: the two-sample Kolmogorov-Smirnov test (``scipy.stats.ks_2samp``).
   Its statistic D is the largest gap between the two cumulative shares, the p-value
   says whether D is more than chance.
3. Each categorical feature (route, turn-depth bucket, streamed or not): the chi-square
   test of the 2 x K table of counts (``scipy.stats.chi2_contingency``) and the total
   variation distance, half the sum of the absolute differences of the shares.
4. ``skew`` when any test is significant at :data:`SKEW_P_VALUE` and its distance passes
   the flag bound (KS D > :data:`SKEW_KS_STATISTIC`, TV > :data:`SKEW_TOTAL_VARIATION`).
5. Importance weights per prompt-length bucket (:data:`DEFAULT_SIZE_EDGES`): the
   bucket's share of the seen traffic over its share of the evaluated requests. A judge
   may weight each evaluated value by its bucket's weight to answer for the traffic.
   A bucket with seen traffic and no evaluated request has no weight (None): its share
   of the seen traffic is ``uncovered_share``.
6. ``refuse`` (no verdict: the sample does not answer for the traffic, even reweighted)
   when a significant distance passes the refusal bound (KS D >
   :data:`REFUSE_KS_STATISTIC`, TV > :data:`REFUSE_TOTAL_VARIATION`), a weight exceeds
   :data:`MAX_IMPORTANCE_WEIGHT`, or ``uncovered_share`` exceeds
   :data:`MAX_UNCOVERED_SHARE`. A refusal is also a skew.
7. Below :data:`MIN_BIAS_SAMPLES` evaluated or seen requests no test is run: neither
   skew nor refusal, and the reasons say so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from scipy import stats

from evaluators._strata import bin_labels

__all__ = [
    "DEFAULT_SIZE_EDGES",
    "DEFAULT_TURN_DEPTH_EDGES",
    "MAX_IMPORTANCE_WEIGHT",
    "MAX_UNCOVERED_SHARE",
    "MIN_BIAS_SAMPLES",
    "REFUSE_KS_STATISTIC",
    "REFUSE_TOTAL_VARIATION",
    "SKEW_KS_STATISTIC",
    "SKEW_P_VALUE",
    "SKEW_TOTAL_VARIATION",
    "CategoryShift",
    "SampleBias",
    "SizeBucket",
    "check_sample_bias",
    "turn_depth_bucket",
]

SKEW_KS_STATISTIC: Final = 0.1
SKEW_TOTAL_VARIATION: Final = 0.1
SKEW_P_VALUE: Final = 0.01
REFUSE_KS_STATISTIC: Final = 0.3
REFUSE_TOTAL_VARIATION: Final = 0.3
MAX_IMPORTANCE_WEIGHT: Final = 5.0
MAX_UNCOVERED_SHARE: Final = 0.05
MIN_BIAS_SAMPLES: Final = 20
DEFAULT_SIZE_EDGES: Final = (0, 256, 1024, 4096, 16384, 65536)
DEFAULT_TURN_DEPTH_EDGES: Final = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class SizeBucket:
    """One prompt-length bucket: counts, shares, drops and the importance weight."""

    prompt_tokens: str
    seen: int
    evaluated: int
    dropped: int
    seen_share: float
    evaluated_share: float
    drop_rate: float | None
    weight: float | None


@dataclass(frozen=True, slots=True)
class CategoryShift:
    """One categorical feature's shares in the seen and the evaluated traffic."""

    feature: str
    categories: tuple[str, ...]
    seen_shares: tuple[float, ...]
    evaluated_shares: tuple[float, ...]
    total_variation: float
    chi2: float | None
    p_value: float | None


@dataclass(frozen=True, slots=True)
class SampleBias:
    """How the evaluated requests differ from the traffic, and what the judge may do."""

    size_edges: tuple[float, ...]
    n_seen: int
    n_evaluated: int
    n_dropped: int
    median_seen: float | None
    median_evaluated: float | None
    ks_statistic: float | None
    ks_p_value: float | None
    buckets: tuple[SizeBucket, ...]
    drops_by_reason: tuple[tuple[str, int], ...]
    categories: tuple[CategoryShift, ...]
    max_weight: float | None
    uncovered_share: float
    skew: bool
    refuse: bool
    reasons: tuple[str, ...]

    def weight_for(self, prompt_tokens: float) -> float | None:
        """The importance weight of an evaluated request of this length (rule 5)."""
        label = bin_labels([prompt_tokens], self.size_edges)[0]
        return next((b.weight for b in self.buckets if b.prompt_tokens == label), None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["size_edges"] = list(self.size_edges)
        out["buckets"] = [_plain(b) for b in self.buckets]
        out["categories"] = [_plain(c) for c in self.categories]
        out["drops_by_reason"] = dict(self.drops_by_reason)
        out["reasons"] = list(self.reasons)
        return out


def turn_depth_bucket(
    depth: int | None, edges: Sequence[int] = DEFAULT_TURN_DEPTH_EDGES
) -> str:
    """The categorical turn-depth feature ("[2, 4)" for the 2nd and 3rd user turns);
    ``"none"`` for a request without turns (not a chat)."""
    return "none" if depth is None else bin_labels([depth], edges)[0]


def check_sample_bias(
    seen_prompt_tokens: Sequence[float] | npt.NDArray[np.floating[Any]],
    evaluated_prompt_tokens: Sequence[float] | npt.NDArray[np.floating[Any]],
    *,
    seen_features: Mapping[str, Sequence[str]] | None = None,
    evaluated_features: Mapping[str, Sequence[str]] | None = None,
    drops: Sequence[tuple[str, float]] = (),
    size_edges: Sequence[float] = DEFAULT_SIZE_EDGES,
) -> SampleBias:
    """Compare the evaluated requests with all traffic seen (the module's rules).

    ``drops`` holds (reason, prompt tokens) of each request dropped before scoring; the
    features map a feature's name to one category per request. What a platform engineer
    reads: ``skew`` (the verdict describes a different mix than production: see
    ``reasons``), ``buckets`` (which sizes the buffers dropped, and at what rate: raise
    the byte budget if the largest bucket's drop rate is high), the importance weights a
    judge applies, and ``refuse`` when no weighting can make the sample answer for the
    traffic.
    """
    seen = _tokens(seen_prompt_tokens, "seen_prompt_tokens")
    evaluated = _tokens(evaluated_prompt_tokens, "evaluated_prompt_tokens")
    seen_features = seen_features or {}
    evaluated_features = evaluated_features or {}
    if set(seen_features) != set(evaluated_features):
        raise ValueError("seen and evaluated must describe the same features")

    seen_bins = Counter(bin_labels(seen, size_edges))
    evaluated_bins = Counter(bin_labels(evaluated, size_edges))
    drop_bins = Counter(bin_labels([t for _, t in drops], size_edges)) if drops else Counter()
    order = bin_labels([size_edges[0] - 1.0, *size_edges], size_edges)
    buckets = []
    for label in order:
        s, e, d = seen_bins[label], evaluated_bins[label], drop_bins[label]
        if not (s or e or d):
            continue
        seen_share = s / seen.size if seen.size else 0.0
        evaluated_share = e / evaluated.size if evaluated.size else 0.0
        buckets.append(
            SizeBucket(
                prompt_tokens=label,
                seen=s,
                evaluated=e,
                dropped=d,
                seen_share=seen_share,
                evaluated_share=evaluated_share,
                drop_rate=d / s if s else None,
                weight=seen_share / evaluated_share if e else None,
            )
        )
    weights = [b.weight for b in buckets if b.weight is not None]
    max_weight = max(weights) if weights else None
    uncovered = sum(b.seen_share for b in buckets if b.weight is None)
    categories = tuple(
        _category_shift(name, seen_features[name], evaluated_features[name])
        for name in sorted(seen_features)
    )
    drops_by_reason = tuple(sorted(Counter(reason for reason, _ in drops).items()))

    ks_d = ks_p = None
    reasons: list[str] = []
    skew = refuse = False
    if min(seen.size, evaluated.size) < MIN_BIAS_SAMPLES:
        reasons.append(
            f"too few requests to test for skew ({evaluated.size} evaluated, "
            f"{seen.size} seen; {MIN_BIAS_SAMPLES} needed)"
        )
    else:
        ks = stats.ks_2samp(evaluated, seen)
        ks_d, ks_p = float(ks.statistic), float(ks.pvalue)
        tests: list[tuple[str, float, float | None, float, float]] = [
            ("prompt tokens (KS D)", ks_d, ks_p, SKEW_KS_STATISTIC, REFUSE_KS_STATISTIC)
        ]
        tests += [
            (
                f"{c.feature} (total variation)",
                c.total_variation,
                c.p_value,
                SKEW_TOTAL_VARIATION,
                REFUSE_TOTAL_VARIATION,
            )
            for c in categories
        ]
        for name, distance, p, flag_at, refuse_at in tests:
            if p is None or p >= SKEW_P_VALUE or distance <= flag_at:
                continue
            skew = True
            refused = distance > refuse_at
            refuse |= refused
            bound = refuse_at if refused else flag_at
            action = "refuse" if refused else "skew"
            reasons.append(f"{action}: {name} {distance:.3g} > {bound:g} (p={p:.2g})")
        if max_weight is not None and max_weight > MAX_IMPORTANCE_WEIGHT:
            refuse = True
            reasons.append(
                f"refuse: importance weight {max_weight:.3g} > {MAX_IMPORTANCE_WEIGHT:g}"
            )
        if uncovered > MAX_UNCOVERED_SHARE:
            refuse = True
            reasons.append(
                f"refuse: {uncovered:.1%} of the traffic is in prompt-length "
                f"buckets with no evaluated request (> {MAX_UNCOVERED_SHARE:.0%})"
            )
        skew |= refuse
        if not reasons:
            reasons.append("the evaluated requests look like the traffic")
    return SampleBias(
        size_edges=tuple(float(e) for e in size_edges),
        n_seen=int(seen.size),
        n_evaluated=int(evaluated.size),
        n_dropped=len(drops),
        median_seen=float(np.median(seen)) if seen.size else None,
        median_evaluated=float(np.median(evaluated)) if evaluated.size else None,
        ks_statistic=ks_d,
        ks_p_value=ks_p,
        buckets=tuple(buckets),
        drops_by_reason=drops_by_reason,
        categories=categories,
        max_weight=max_weight,
        uncovered_share=uncovered,
        skew=skew,
        refuse=refuse,
        reasons=tuple(reasons),
    )


def _category_shift(name: str, seen: Sequence[str], evaluated: Sequence[str]) -> CategoryShift:
    """Rule 3 for one feature."""
    seen_counts, evaluated_counts = Counter(seen), Counter(evaluated)
    categories = tuple(sorted(set(seen_counts) | set(evaluated_counts)))
    s = np.array([seen_counts[c] for c in categories], dtype=np.float64)
    e = np.array([evaluated_counts[c] for c in categories], dtype=np.float64)
    s_share = s / s.sum() if s.sum() else s
    e_share = e / e.sum() if e.sum() else e
    chi2 = p = None
    if len(categories) > 1 and min(s.sum(), e.sum()) >= MIN_BIAS_SAMPLES:
        result = stats.chi2_contingency(np.stack([e, s]))
        chi2, p = float(result.statistic), float(result.pvalue)
    return CategoryShift(
        feature=name,
        categories=categories,
        seen_shares=tuple(float(x) for x in s_share),
        evaluated_shares=tuple(float(x) for x in e_share),
        total_variation=float(np.abs(s_share - e_share).sum() / 2.0),
        chi2=chi2,
        p_value=p,
    )


def _tokens(
    values: Sequence[float] | npt.NDArray[np.floating[Any]], name: str
) -> npt.NDArray[np.float64]:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be one-dimensional and finite")
    return array


def _plain(item: SizeBucket | CategoryShift) -> dict[str, Any]:
    """JSON-ready: tuples become lists."""
    out: dict[str, Any] = {}
    for f in fields(item):
        value = getattr(item, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
