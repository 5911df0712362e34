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
   vectors at unit scale, +5% squared error), so from the best of them a descent follows: up
   to ``DESCENT_STEPS`` times, step to the nearest of the 240 lattice neighbours (the roots of
   E8, norm 2) that stays inside the ball, while that brings the point closer by more than
   1e-9.  On every test vector this reached the point a brute-force search over all 56,881
   finds (``nearest_in_codebook_brute_force``, kept as the reference the tests compare with);
   the search itself is never needed on the encoding path.
5. Rules 1, 2 and 4 and the lookup run in C (``_e8core.c``, in the build this CPU runs best,
   ``_e8builds``; a row of 8 at a time, float64,
   no BLAS and no fused multiply-add, ties to the first candidate; the descent's 240 products
   share their partial sums and only the few that bring the point closer are checked against
   the ball; a point's index is its rank in rule 3's order, counted from small tables rather
   than searched): numpy's per-call overhead on the 384 rows of a 16-token block
   was ~2 ms of encoding per block, layer and role, and every stream seals a block every 16
   tokens in every layer.  The C owns the rule's constants
   (``CODEBOOK_NORM2``, ``SHRINK``, ``DESCENT_STEPS``), exported here; rows must be finite
   (a ``ValueError`` otherwise).  The tests hold the numpy form of rules 1-4 as it was
   (``tests/backends/engine/kv/e8_reference.py``) and check the C gives the same codes.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from ._e8builds import e8core

__all__ = [
    "CODEBOOK_NORM2",
    "CODEBOOK_SIZE",
    "DESCENT_STEPS",
    "SHRINK",
    "E8Codebook",
    "e8_codebook",
    "nearest_d8",
    "nearest_e8",
    "nearest_in_codebook_brute_force",
]

Float64Array = npt.NDArray[np.float64]
IndexArray = npt.NDArray[np.uint16]

CODEBOOK_NORM2 = e8core.CODEBOOK_NORM2
CODEBOOK_SIZE = 56_881
SHRINK = e8core.SHRINK
"""Rule 4's radii, as fractions of the ball's radius; the last is (sqrt(10) - 1) / sqrt(10)."""
DESCENT_STEPS = e8core.DESCENT_STEPS
"""Rule 4's most steps from the shrunk point to a closer neighbour."""
_NORM_SLACK = 1e-9


def _rows(x: Float64Array) -> Float64Array:
    """``x`` as C-contiguous float64 rows of 8, checked."""
    rows = np.ascontiguousarray(x, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != 8:
        raise ValueError(f"E8 rows are [n, 8], got shape {rows.shape}")
    return rows


def nearest_d8(x: Float64Array) -> Float64Array:
    """The nearest point of D8 to each row of ``x`` [n, 8] (rule 1)."""
    rows = _rows(x)
    out = np.empty_like(rows)
    e8core.nearest_d8(rows, out)
    return out


def nearest_e8(x: Float64Array) -> Float64Array:
    """The nearest point of E8 to each row of ``x`` [n, 8] (rule 2)."""
    rows = _rows(x)
    out = np.empty_like(rows)
    e8core.nearest_e8(rows, out)
    return out


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
    """Rule 3's integer key of each lattice point (its doubled coordinates as digits)."""
    rows = _rows(points)
    keys = np.empty(rows.shape[0], dtype=np.int64)
    e8core.keys(rows, keys)
    return keys


class E8Codebook:
    """The ``CODEBOOK_SIZE`` points of E8 in the ball of squared radius 10 (rule 3)."""

    __slots__ = ("_keys", "points", "points32", "roots")

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
        self._keys.flags.writeable = False
        self.roots: Float64Array = np.ascontiguousarray(
            self.points[np.abs(np.square(self.points).sum(axis=1) - 2.0) < 1e-9]
        )
        """The 240 points of norm 2, rule 4's steps, in the codebook's order."""
        self.roots.flags.writeable = False
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
        """The index of a codebook point near each row of ``x`` [n, 8] (rules 2, 4 and 5)."""
        rows = _rows(x)
        codes = np.empty(rows.shape[0], dtype=np.uint16)
        e8core.encode(rows, codes)
        return codes

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
