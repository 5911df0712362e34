"""The E8 lattice: nearest points (Conway & Sloane) and a finite 16-bit codebook.

E8 is the union of D8 and D8 + 1/2 (every coordinate shifted by a half), where D8 is the
integer vectors with an even coordinate sum.  It is the densest packing in 8 dimensions: at the
same number of points per volume its cells hold less squared error than the cube of a scalar
quantizer (normalized second moment 0.0717 against 0.0833), and they are rounder, so a vector's
error is spread over its 8 coordinates.

Theory of operation
-------------------
1. Nearest point of D8 (Conway & Sloane, "Fast quantizing and decoding algorithms for lattice
   quantizers", 1982): round every coordinate; if the sum is odd, round the coordinate with the
   largest rounding error the other way (the cheapest change of parity).
2. Nearest point of E8: the nearest point of D8 and the nearest point of D8 + ½ (found as
   ``nearest_d8(x - ½) + ½``); take the closer.
3. The codebook is every E8 point with squared norm ≤ ``CODEBOOK_NORM2`` (10): shells 0, 2, 4,
   6, 8 and 10 hold 1 + 240 + 2160 + 6720 + 17520 + 30240 = 56,881 points, fewer than 2^16, so
   an index is a uint16 (15.8 bits of 16 used: 2 bits per dimension).  The set is symmetric
   (``-c`` is in it for every ``c``) and contains the origin.  Points are indexed in the order of
   an integer key of their doubled coordinates, so lookup is one ``searchsorted``.
4. A vector whose nearest lattice point lies outside the ball is shrunk towards the origin and
   rounded again, at ``SHRINK`` fractions of the ball's radius down to ``(sqrt(10) - 1) /
   sqrt(10)``: E8's covering radius is 1 (no vector is farther than 1 from the lattice), so at
   that radius the rounded point is always inside the ball and every vector gets a code.  The
   radially shrunk point is often not the nearest codebook point, though (~9% of Gaussian
   vectors at unit scale, +5% squared error), so from the best of them a descent follows: step
   to the nearest of the 240 lattice neighbours (the roots of E8, norm 2) that stays inside
   the ball, while that brings the point closer.  On every test vector this reached the point a
   brute-force search over all 56,881 finds (``nearest_in_codebook_brute_force``, kept as the
   reference the tests compare with); the search itself is never needed on the encoding path.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

__all__ = [
    "CODEBOOK_NORM2",
    "CODEBOOK_SIZE",
    "SHRINK",
    "E8Codebook",
    "e8_codebook",
    "nearest_d8",
    "nearest_e8",
    "nearest_in_codebook_brute_force",
]

Float64Array = npt.NDArray[np.float64]
IndexArray = npt.NDArray[np.uint16]

CODEBOOK_NORM2 = 10
CODEBOOK_SIZE = 56_881
_KEY_BASE = 13  # doubled coordinates lie in [-6, 6] inside the ball (|c| <= sqrt(10) < 3.5)
_KEY_OFFSET = 6
SHRINK = (0.9, 1.0 - 1.0 / np.sqrt(CODEBOOK_NORM2))
"""Rule 4's radii, as fractions of the ball's radius; the last is (sqrt(10) - 1) / sqrt(10)."""
_DESCENT_STEPS = 4
_DESCENT_ROWS = 8192  # rows per descent product: 8192 x 240 float64 = 16 MB
_NORM_SLACK = 1e-9


def nearest_d8(x: Float64Array) -> Float64Array:
    """The nearest point of D8 to each row of ``x`` [n, 8] (rule 1)."""
    rounded = np.rint(x)
    odd = np.remainder(rounded.sum(axis=1), 2.0) != 0.0
    if odd.any():
        rows = np.nonzero(odd)[0]
        err = x[rows] - rounded[rows]
        worst = np.abs(err).argmax(axis=1)
        step = np.where(err[np.arange(rows.size), worst] >= 0.0, 1.0, -1.0)
        rounded[rows, worst] += step
    return rounded


def nearest_e8(x: Float64Array) -> Float64Array:
    """The nearest point of E8 to each row of ``x`` [n, 8] (rule 2)."""
    whole = nearest_d8(x)
    half = nearest_d8(x - 0.5) + 0.5
    closer = np.square(x - half).sum(axis=1) < np.square(x - whole).sum(axis=1)
    whole[closer] = half[closer]
    return whole


def _shells(values: Float64Array) -> Float64Array:
    """All vectors of 8 coordinates from ``values`` with squared norm <= the ball's."""
    points = np.zeros((1, 0))
    squares = np.zeros(1)
    for _ in range(8):
        grown = points[:, None, :].repeat(values.size, axis=1)
        coords = np.broadcast_to(values, (points.shape[0], values.size))[..., None]
        norms = squares[:, None] + np.square(values)[None, :]
        keep = norms <= CODEBOOK_NORM2 + _NORM_SLACK
        points = np.concatenate([grown, coords], axis=2)[keep]
        squares = norms[keep]
    return points


def _keys(points: Float64Array) -> npt.NDArray[np.int64]:
    doubled = np.rint(points * 2.0).astype(np.int64) + _KEY_OFFSET
    powers = _KEY_BASE ** np.arange(8, dtype=np.int64)
    keys: npt.NDArray[np.int64] = doubled @ powers
    return keys


class E8Codebook:
    """The ``CODEBOOK_SIZE`` points of E8 in the ball of squared radius 10 (rule 3)."""

    __slots__ = ("_keys", "_roots", "points", "points32")

    def __init__(self) -> None:
        integer = _shells(np.arange(-3.0, 4.0))
        integer = integer[np.remainder(integer.sum(axis=1), 2.0) == 0.0]
        half = _shells(np.arange(-2.5, 3.0))
        half = half[np.remainder(half.sum(axis=1), 2.0) == 0.0]
        points = np.concatenate([integer, half])
        keys = _keys(points)
        order = np.argsort(keys)
        self.points: Float64Array = points[order]
        self.points.flags.writeable = False
        self.points32 = self.points.astype(np.float32)
        self.points32.flags.writeable = False
        self._keys = keys[order]
        self._roots = self.points[np.abs(np.square(self.points).sum(axis=1) - 2.0) < 1e-9]
        if self.points.shape[0] != CODEBOOK_SIZE:
            raise AssertionError(f"E8 codebook has {self.points.shape[0]} points")

    def __len__(self) -> int:
        return int(self.points.shape[0])

    def index_of(self, points: Float64Array) -> npt.NDArray[np.int64]:
        """The index of each row of ``points`` [n, 8] (lattice points), or -1 if not in the book."""
        inside = np.square(points).sum(axis=1) <= CODEBOOK_NORM2 + _NORM_SLACK
        keys = _keys(np.where(inside[:, None], points, 0.0))
        found = np.minimum(np.searchsorted(self._keys, keys), len(self) - 1)
        hit = inside & (self._keys[found] == keys)
        return np.where(hit, found, -1)

    def encode(self, x: Float64Array) -> IndexArray:
        """The index of a codebook point near each row of ``x`` [n, 8] (rules 2 and 4)."""
        index = self.index_of(nearest_e8(x))
        outside = np.nonzero(index < 0)[0]
        if outside.size:
            index[outside] = self._shrunk(x[outside])
        return index.astype(np.uint16)

    def _shrunk(self, x: Float64Array) -> npt.NDArray[np.int64]:
        """Rule 4 for rows of ``x`` whose nearest lattice point is outside the ball."""
        norms = np.sqrt(np.square(x).sum(axis=1, keepdims=True))
        radius = np.sqrt(CODEBOOK_NORM2)
        best = np.zeros_like(x)
        best_err = np.full(x.shape[0], np.inf)
        for fraction in SHRINK:
            factor = np.minimum(1.0, fraction * radius / np.maximum(norms, 1e-30))
            candidate = nearest_e8(x * factor)
            inside = np.square(candidate).sum(axis=1) <= CODEBOOK_NORM2 + _NORM_SLACK
            err = np.square(candidate - x).sum(axis=1)
            better = inside & (err < best_err)
            best[better] = candidate[better]
            best_err[better] = err[better]
        if not np.isfinite(best_err).all():  # impossible by the covering radius (rule 4)
            raise AssertionError("an E8 vector found no codebook point")
        for start in range(0, x.shape[0], _DESCENT_ROWS):
            rows = slice(start, start + _DESCENT_ROWS)
            best[rows] = self._descend(x[rows], best[rows], best_err[rows])
        index = self.index_of(best)
        if (index < 0).any():
            raise AssertionError("the E8 descent left the codebook")
        return index

    def _descend(self, x: Float64Array, point: Float64Array, err: Float64Array) -> Float64Array:
        """Greedy steps to the nearest neighbour inside the ball while it is closer to ``x``.

        For a root ``r`` (|r|^2 = 2): |x - p - r|^2 = err + 2 - 2 r.(x - p), and
        |p + r|^2 = |p|^2 + 2 r.p + 2, so a step is two small products, no candidate arrays.
        The products are ``einsum``'s own loops, not BLAS: an inner size of 8 gains nothing from
        BLAS threads, which on a busy machine cost 10x, and the codes stay independent of the
        BLAS kernel (``_codec`` rule 2).
        """
        point, err = point.copy(), err.copy()
        roots_t = self._roots.T
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
            point[active] += self._roots[pick[better]]
            err[active] = picked[better]
        return point

    def decode(self, index: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
        """The points of ``index`` (any shape), as float32 rows of 8."""
        points: npt.NDArray[np.float32] = self.points32[index.astype(np.intp)]
        return points


@functools.cache
def e8_codebook() -> E8Codebook:
    """The codebook, built once per process (a constant: its arrays are read-only)."""
    return E8Codebook()


def nearest_in_codebook_brute_force(x: Float64Array, codebook: E8Codebook) -> Float64Array:
    """The truly nearest codebook point to each row of ``x`` [n, 8] (a reference for tests)."""
    points = codebook.points
    norms = np.square(points).sum(axis=1)
    out = np.empty_like(x)
    for start in range(0, x.shape[0], 64):
        rows = x[start : start + 64]
        dist = norms[None, :] - 2.0 * rows @ points.T
        out[start : start + 64] = points[dist.argmin(axis=1)]
    return out
