"""Products ``x @ w`` whose rows do not depend on the rows beside them, on any BLAS kernel.

Theory of operation -- the engine owns the bits, not the kernel
---------------------------------------------------------------
1. A BLAS product computes output row ``i`` from input row ``i`` alone, by a sequence of
   operations fixed by the call: its shape, strides and thread count, and the row's place in the
   call (its *lane*).  Nothing else changes a row's bits.
2. Kernels differ in whether every lane runs the same sequence.  OpenBLAS's SkylakeX and
   Sandybridge sgemm do for the model's shapes; its Haswell sgemm (also what it picks on Zen)
   does not: the two halves of its 12-row tiles and the tail tiles sum in other orders, and two
   threads split the rows into more tails.  On such a kernel a row's bits change with the batch
   it happens to be in.
3. So rows are placed only in lanes that reproduce one reference: lane 0 of a call of
   ``REFERENCE_ROWS`` rows.  For a weight shape, a call size's good lanes are found once, by
   putting the same random probe row in every lane and keeping the lanes whose output equals the
   reference (two probes; lanes running another sequence differ on random data).  A product of
   ``n`` rows is then made of calls of exactly those sizes, rows scattered into good lanes and
   gathered back, the other lanes zero.  A row's bits are the reference's, whatever its
   neighbours, its batch position or the size of its chunk.
4. Weights are made contiguous before they are looked up, so a shape (inner, cols) names the
   call completely and the lane maps stay few: the model's five weight shapes, one ``q @ K^T``
   shape per attention tile, one ``P @ V`` shape.
5. The engine's own threads share a product by columns, each thread one fixed part (the cuts
   depend only on the width and the thread count), while OpenBLAS runs each call on one
   thread (``Numerics`` sets it): two OpenBLAS threads would split a call's rows into tails and
   leave few good lanes in small calls (on Haswell none below 48 rows).

The cost is the padding lanes: on Haswell half of each call, and a decode step's few rows ride in
a call of 12 rows.  ``Numerics`` (``_numerics``) takes this path only where the kernel's own
products are not row-independent.

6. Small products need no BLAS at all: ``summed_product`` multiplies elementwise and sums the
   inner axis by halving, a fixed order of float32 adds, each exact per element (IEEE 754), so a
   row's bits depend on nothing but the row -- not its neighbours, the kernel or a SIMD width.
   For the few rows and 16-144 columns of attention's own-block products (``_attention`` rule
   5) it costs ~10 numpy calls where a lane-mapped product pays a padded call and, from 32
   columns, a hand-off to the column threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from threadpoolctl import threadpool_info

from .._arrays import Float32Array, IntArray

__all__ = [
    "CALL_ROWS",
    "REFERENCE_ROWS",
    "ColumnSplitter",
    "Product",
    "RowLanes",
    "rows_are_independent",
    "summed_product",
]

Product = Callable[[Float32Array, Float32Array], Float32Array]
"""``x @ weight`` as some code path computes it."""

CALL_ROWS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 192)
"""Call sizes a lane-mapped product may use, smallest first (probed when first needed)."""
REFERENCE_ROWS = 96
"""Rows of the call whose lane 0 defines a row's bits (rule 3)."""
_COLUMN_ALIGN = 16  # column parts start at multiples of a kernel's column unroll
_PROBES = 2
_PROBE_SEED = 20261202


class _LaneMap:
    """Good lanes of each call size for one weight shape and layout (rule 3).

    Lanes are a property of the call's shape, but the reference bits are those of one weight:
    every call size is probed with the weight the map was made with (held, not copied).
    """

    __slots__ = ("_good", "_probes", "_reference", "_weight")

    def __init__(self, weight: Float32Array) -> None:
        rng = np.random.default_rng(_PROBE_SEED)
        self._weight = weight
        self._probes = rng.standard_normal((_PROBES, weight.shape[0]), dtype=np.float32)
        self._reference = np.stack(
            [(np.tile(probe, (REFERENCE_ROWS, 1)) @ weight)[0] for probe in self._probes]
        )
        self._good: dict[int, IntArray] = {}

    def lanes(self, rows: int) -> IntArray:
        """Lanes of a ``rows``-row call that reproduce the reference bits."""
        good = self._good.get(rows)
        if good is None:
            keep = np.ones(rows, dtype=np.bool_)
            for probe, reference in zip(self._probes, self._reference, strict=True):
                out = np.tile(probe, (rows, 1)) @ self._weight
                keep &= (out == reference).all(axis=1)
            good = np.flatnonzero(keep)
            self._good[rows] = good
        return good

    def call_for(self, count: int) -> tuple[int, IntArray]:
        """The smallest call size with room for ``count`` rows, else the roomiest."""
        best: tuple[int, IntArray] | None = None
        for rows in CALL_ROWS:
            good = self.lanes(rows)
            if good.size >= count:
                return rows, good
            if good.size and (best is None or good.size >= best[1].size):
                best = (rows, good)
        if best is None:
            raise RuntimeError(f"no call size reproduces the reference for {self._weight.shape}")
        return best


class ColumnSplitter(Protocol):
    """Threads that share a product's column parts (``_linear.TileWorkers``)."""

    threads: int

    def run(self, work: Callable[[int, int], None], tiles: int) -> None: ...


class RowLanes:
    """Lane-mapped products (rule 3); one per model, used from the engine thread.

    ``workers`` share each product by columns: the columns are cut into one fixed part per
    thread (rule 5), each part a product of its own with its own lane maps.
    """

    __slots__ = ("_maps", "_workers")

    def __init__(self, workers: ColumnSplitter | None = None) -> None:
        if workers is not None and workers.threads > 1 and _openblas_threads() > 1:
            # Concurrent calls into a multi-threaded OpenBLAS share its buffers (rule 5).
            raise ValueError("columns are shared among threads only with OpenBLAS on one thread")
        self._maps: dict[tuple[int, int, tuple[int, ...]], _LaneMap] = {}
        self._workers = workers

    def matmul(self, x: Float32Array, weight: Float32Array) -> Float32Array:
        """``x @ weight`` for ``x`` [rows, inner], each row in a lane of the reference."""
        weight = np.ascontiguousarray(weight)
        count, cols = x.shape[0], weight.shape[1]
        out = np.empty((count, cols), dtype=np.float32)
        cuts = _column_cuts(cols, 1 if self._workers is None else self._workers.threads)

        def parts(first: int, last: int) -> None:
            for part in range(first, last):
                lo, hi = cuts[part], cuts[part + 1]
                self._part(x, weight[:, lo:hi], out[:, lo:hi])

        if self._workers is None or len(cuts) < 3:
            parts(0, len(cuts) - 1)
        else:
            self._workers.run(parts, len(cuts) - 1)
        return out

    def _part(self, x: Float32Array, weight: Float32Array, out: Float32Array) -> None:
        inner, cols = weight.shape
        key = (inner, cols, weight.strides)
        lane_map = self._maps.get(key)
        if lane_map is None:
            lane_map = self._maps[key] = _LaneMap(weight)
        count, done = x.shape[0], 0
        while done < count:
            rows, good = lane_map.call_for(count - done)
            take = good[: min(good.size, count - done)]
            call = np.zeros((rows, inner), dtype=np.float32)
            call[take] = x[done : done + take.size]
            out[done : done + take.size] = (call @ weight)[take]
            done += take.size


def summed_product(x: Float32Array, weight: Float32Array) -> Float32Array:
    """``x @ weight`` ([rows, inner] @ [inner, cols]) without BLAS (rule 6): the products
    ``x[r, k] * weight[k, c]`` summed over ``k`` by adding halves, an odd last term carried."""
    terms = x[:, :, None] * weight[None]
    while terms.shape[1] > 1:
        count = terms.shape[1]
        half = count // 2
        if count % 2:
            terms = np.concatenate([terms[:, :half] + terms[:, half:-1], terms[:, -1:]], axis=1)
        else:  # in place: the halves do not overlap
            terms = np.add(terms[:, :half], terms[:, half:], out=terms[:, :half])
    out: Float32Array = np.ascontiguousarray(terms[:, 0])
    return out


def _openblas_threads() -> int:
    counts = [
        int(info["num_threads"])
        for info in threadpool_info()
        if info.get("internal_api") == "openblas"
    ]
    return max(counts, default=1)


def _column_cuts(cols: int, threads: int) -> list[int]:
    """Cuts of ``cols`` into up to ``threads`` parts, at multiples of ``_COLUMN_ALIGN``."""
    parts = max(1, min(threads, cols // _COLUMN_ALIGN))
    cuts = [cols * part // parts // _COLUMN_ALIGN * _COLUMN_ALIGN for part in range(parts)]
    return [*cuts, cols]


_CHECK_ROWS = (4, 5, 7, 8, 13, 16, 17, 33, 70, 130)
_CHECK_SEED = 20260601


def rows_are_independent(product: Product, weight: Float32Array) -> bool:
    """Whether ``product(batch, weight)`` gives a row the same bits wherever it sits.

    One probe row is placed at the start, middle and end of batches of ``_CHECK_ROWS`` rows
    (decode batches, prefill chunks, both sides of every call size); every placement must give
    the bits of the first.
    """
    rng = np.random.default_rng(_CHECK_SEED)
    inner = weight.shape[0]
    filler = rng.standard_normal((max(_CHECK_ROWS), inner), dtype=np.float32)
    probe = rng.standard_normal(inner, dtype=np.float32)
    expected: Float32Array | None = None
    for rows in _CHECK_ROWS:
        for offset in sorted({0, rows // 2, rows - 1}):
            batch = filler[:rows].copy()
            batch[offset] = probe
            got = product(batch, weight)[offset]
            if expected is None:
                expected = got
            elif not np.array_equal(got, expected):
                return False
    return True
