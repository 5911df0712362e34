"""The E8 codebook rule and the Hadamard rotation as numpy, the way ``_e8`` and ``_e8_codec``
computed them before their C forms (issue 14).

A reference for tests only, like ``nearest_in_codebook_brute_force``: ``_e8core`` must give
the same codes (``_e8`` rules 1-4) and the same rotated bits (``_e8_codec`` rule 3).  Kept as
it was, numpy's own order of operations included (``einsum``'s loops for the descent's
products), so that a difference in the C is a difference in the rule, not in a rewrite of the
reference.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from backends.engine._arrays import Float32Array, Float64Array
from backends.engine.kv.codecs._e8 import CODEBOOK_NORM2, SHRINK, E8Codebook

__all__ = [
    "reference_codes",
    "reference_hadamard",
    "reference_nearest_d8",
    "reference_nearest_e8",
]

_DESCENT_STEPS = 4
_NORM_SLACK = 1e-9


def reference_hadamard(x: Float32Array) -> Float32Array:
    """``x @ H / sqrt(d)`` along the last axis, one numpy stage per butterfly level."""
    dim = x.shape[-1]
    lead = x.shape[:-1]
    out = np.array(x, dtype=np.float32)
    half = 1
    while half < dim:
        pairs = out.reshape(*lead, dim // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        out = np.stack([low + high, low - high], axis=-2).reshape(*lead, dim)
        half *= 2
    out *= np.float32(1.0 / np.sqrt(dim))
    return out


def reference_nearest_d8(x: Float64Array) -> Float64Array:
    """Rule 1: round; on an odd sum, round the worst coordinate the other way."""
    rounded = np.rint(x)
    odd = np.remainder(rounded.sum(axis=1), 2.0) != 0.0
    if odd.any():
        rows = np.nonzero(odd)[0]
        err = x[rows] - rounded[rows]
        worst = np.abs(err).argmax(axis=1)
        step = np.where(err[np.arange(rows.size), worst] >= 0.0, 1.0, -1.0)
        rounded[rows, worst] += step
    return rounded


def reference_nearest_e8(x: Float64Array) -> Float64Array:
    """Rule 2: the closer of the nearest points of D8 and of D8 + 1/2."""
    whole = reference_nearest_d8(x)
    half = reference_nearest_d8(x - 0.5) + 0.5
    closer = np.square(x - half).sum(axis=1) < np.square(x - whole).sum(axis=1)
    whole[closer] = half[closer]
    return whole


def reference_codes(x: Float64Array, book: E8Codebook) -> npt.NDArray[np.int64]:
    """Rules 2-4: the code of each row of ``x`` [n, 8]."""
    index = book.index_of(reference_nearest_e8(x))
    outside = np.nonzero(index < 0)[0]
    if outside.size:
        index[outside] = _shrunk(x[outside], book)
    return index


def _shrunk(x: Float64Array, book: E8Codebook) -> npt.NDArray[np.int64]:
    norms = np.sqrt(np.square(x).sum(axis=1, keepdims=True))
    radius = np.sqrt(CODEBOOK_NORM2)
    best = np.zeros_like(x)
    best_err = np.full(x.shape[0], np.inf)
    for fraction in SHRINK:
        factor = np.minimum(1.0, fraction * radius / np.maximum(norms, 1e-30))
        candidate = reference_nearest_e8(x * factor)
        inside = np.square(candidate).sum(axis=1) <= CODEBOOK_NORM2 + _NORM_SLACK
        err = np.square(candidate - x).sum(axis=1)
        better = inside & (err < best_err)
        best[better] = candidate[better]
        best_err[better] = err[better]
    assert np.isfinite(best_err).all()
    return book.index_of(_descend(x, best, best_err, book.roots))


def _descend(
    x: Float64Array, point: Float64Array, err: Float64Array, roots: Float64Array
) -> Float64Array:
    point, err = point.copy(), err.copy()
    roots_t = roots.T
    active = np.arange(x.shape[0])
    for _ in range(_DESCENT_STEPS):
        p, e = point[active], err[active]
        dist = e[:, None] + 2.0 - 2.0 * np.einsum("nk,kr->nr", x[active] - p, roots_t)
        norm2 = np.square(p).sum(axis=1, keepdims=True) + 2.0
        norm2 = norm2 + 2.0 * np.einsum("nk,kr->nr", p, roots_t)
        dist[norm2 > CODEBOOK_NORM2 + _NORM_SLACK] = np.inf
        pick = dist.argmin(axis=1)
        picked = dist[np.arange(active.size), pick]
        better = picked < e - 1e-9
        active = active[better]
        if not active.size:
            break
        point[active] += roots[pick[better]]
        err[active] = picked[better]
    return point
