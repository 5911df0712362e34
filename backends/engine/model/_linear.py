"""Weight products ``x @ W`` that give a row the same bits for any row count, and are fast for few.

Theory of operation -- why decode does not pay for a copy of every weight
-------------------------------------------------------------------------
Rule 1 of ``_attention`` asks every linear-layer product to give a row the same bits whatever
the number of rows beside it, so that decode writes the K/V and logits a prefill would.  OpenBLAS
(its SkylakeX sgemm) multiplies in one of two ways:

* the packed path, for any shape: ``W`` is first copied into OpenBLAS's panel format, on every
  call, then multiplied.  The inner dimension ``K`` is cut into blocks (``GEMM_Q`` = 448; a ``K``
  between one and two blocks is halved: 576 -> 288 + 288, 1536 -> 448 + 448 + 320 + 320); each
  output is one FMA chain per block, and the blocks' sums are added in order.  For a decode step
  (a handful of rows) the copy costs more than the arithmetic: the weights are read, written and
  read again, about three times the traffic of reading them once.
* the small-matrix path, taken when ``rows * cols * K`` is at most about 1e6: ``W`` is read in
  place, no copy; each output is one FMA chain over all of ``K``.

Over one ``K`` block both paths do the same arithmetic.  So a product with at most
``FEW_ROWS`` rows is done as the packed path would do it, without its copy:

1. ``K`` is cut exactly where the packed path cuts it (``packed_k_blocks``).
2. Each piece is multiplied in column tiles of ``TILE`` columns, a shape the small-matrix path
   takes, reading ``W`` in place (a width that is not a multiple of 16 would end in a tail the
   small-matrix path sums in another order, so weights whose width is not a multiple of
   ``TILE`` always take the packed path).
3. The pieces' products are added in order, as the packed path adds its blocks.

More rows go to the packed path in one plain ``x @ W``, which also keeps the other rules (the
copy is then a small part of the work).  Rules 1-3 rest on OpenBLAS's blocking, so
``LinearPlan.for_weight`` checks them on the weight itself: where a row from the tiled product
differs in any bit from the same row in a large product, the plan sends every row count to the
packed path.  ``_numerics`` then checks that the path kept gives a row the same bits in every
batch; where the kernel's packed path does not (OpenBLAS's Haswell sgemm, also picked on Zen),
every plan maps rows to lanes (``with_lanes``, ``_lanes``): exact on any kernel, at the cost of
padding lanes.

4. The tiles of a tiled product may be shared among the threads of a ``TileWorkers`` (numpy's
   matmul releases the GIL): each thread runs rules 1-3 on its own contiguous run of tiles,
   calling the same small-matrix product on the same tile shapes and strides, so every output
   column is computed by the same operations whichever thread computes it.

The number of threads defaults to what OpenBLAS was started with (``blas_threads``:
``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS``, else the core count), so a process told to use
one BLAS thread decodes on one thread too.  Each product waits for its slowest share, so on a
machine whose other cores are busy a second thread makes decode slower, not faster: start such
processes with ``OPENBLAS_NUM_THREADS=1``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
from threadpoolctl import threadpool_info

from .._arrays import Float32Array
from ._attention import MIN_GEMM_ROWS
from ._lanes import RowLanes

__all__ = [
    "FEW_ROWS",
    "TILE",
    "LinearPath",
    "LinearPlan",
    "TileWorkers",
    "blas_threads",
    "packed_k_blocks",
]

FEW_ROWS = 16
"""Most rows multiplied on the small-matrix path (a decode batch); more take the packed path."""
TILE = 64
"""Columns per small-matrix product: ``FEW_ROWS * 448 * TILE`` stays under OpenBLAS's 1e6."""
_OPENBLAS_SGEMM_Q = 448
_OPENBLAS_SGEMM_UNROLL_M = 16
_CHECK_ROWS = (MIN_GEMM_ROWS, 7, FEW_ROWS)
_CHECK_LARGE = 64
_CHECK_SEED = 20260602


def packed_k_blocks(inner: int) -> tuple[int, ...]:
    """Where OpenBLAS's packed sgemm cuts an inner dimension (``driver/level3/level3.c``)."""
    cuts, start = [0], 0
    q, unroll = _OPENBLAS_SGEMM_Q, _OPENBLAS_SGEMM_UNROLL_M
    while start < inner:
        size = inner - start
        if size >= 2 * q:
            size = q
        elif size > q:
            size = (size // 2 + unroll - 1) // unroll * unroll
        start += size
        cuts.append(start)
    return tuple(cuts)


def blas_threads() -> int:
    """Threads OpenBLAS runs with: ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS``, else cores."""
    counts = [
        int(info["num_threads"])
        for info in threadpool_info()
        if info.get("internal_api") == "openblas"
    ]
    return max(1, min(counts)) if counts else 1


def _tiles(matrix: Float32Array, tiles: int) -> Float32Array:
    """[rows, tiles*TILE] (unit column stride) as a [tiles, rows, TILE] view."""
    # Splitting the column axis is always a view (``copy=False`` raises rather than copy);
    # as_strided would do the same in ~10x the time, ~600 times a decode step.
    split = np.reshape(matrix, (matrix.shape[0], tiles, TILE), copy=False)
    view: Float32Array = split.transpose(1, 0, 2)
    return view


TileRun = Callable[[int, int], None]
"""Work on the tiles ``[first, last)`` of one product."""


class TileWorkers:
    """Threads sharing the tiles of a product: the caller and ``threads - 1`` pooled ones.

    The pool is started once and reused by every product (rule 4).  ``close`` stops it; a
    dropped, unclosed pool's idle threads also exit (``ThreadPoolExecutor`` wakes them when it
    is collected), so models that are created and dropped leave no threads behind.
    """

    __slots__ = ("_pool", "threads")

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"decode threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = (
            ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="understudy-tiles")
            if threads > 1
            else None
        )

    def run(self, work: TileRun, tiles: int) -> None:
        """``work`` over ``[0, tiles)`` cut into one contiguous run per thread."""
        pool = self._pool
        shares = min(self.threads, tiles)
        if pool is None or shares < 2:
            work(0, tiles)
            return
        cuts = [tiles * share // shares for share in range(shares + 1)]
        runs = list(itertools.pairwise(cuts))
        pending: list[Future[None]] = [pool.submit(work, *run) for run in runs[:-1]]
        try:
            work(*runs[-1])
        finally:
            for future in pending:
                future.result()

    def close(self) -> None:
        """Stop the pooled threads (waits for products in flight); idempotent.  Later products
        run every share on the caller, in the same parts (the bits do not change)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


LinearPath = Literal["tiled", "packed", "lanes"]
"""How a plan multiplies: few rows tiled and more packed, always packed, or lane-mapped."""


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """How ``x @ W`` is computed for weights [inner, cols] (float32, unit column stride)."""

    k_blocks: tuple[int, ...]
    """Where the packed path cuts the inner dimension; the tiled product cuts it there too."""
    few_rows_tiled: bool
    """Whether few rows take the tiled small-matrix product (checked bitwise equal)."""
    lanes: RowLanes | None = None
    """Lane-mapped products (``_lanes``) where this kernel's own do not keep rows independent."""

    @property
    def path(self) -> LinearPath:
        if self.lanes is not None:
            return "lanes"
        return "tiled" if self.few_rows_tiled else "packed"

    @classmethod
    def for_weight(cls, weight: Float32Array) -> LinearPlan:
        """The kernel's fastest plan for ``weight``: the tiled product for few rows only where
        it is bitwise the packed one (``_numerics`` then checks rows stay independent)."""
        inner, cols = weight.shape
        plan = cls(packed_k_blocks(inner), few_rows_tiled=cols % TILE == 0)
        if not plan.few_rows_tiled:
            return plan
        rng = np.random.default_rng(_CHECK_SEED)
        large = rng.standard_normal((_CHECK_LARGE, inner), dtype=np.float32)
        expected = large @ weight
        for rows in _CHECK_ROWS:
            if not np.array_equal(plan._tiled(large[:rows], weight, None), expected[:rows]):
                return cls(plan.k_blocks, few_rows_tiled=False)
        return plan

    def with_lanes(self, lanes: RowLanes) -> LinearPlan:
        """This plan with every product lane-mapped (``_lanes``)."""
        return LinearPlan(self.k_blocks, few_rows_tiled=False, lanes=lanes)

    def __call__(
        self, x: Float32Array, weight: Float32Array, workers: TileWorkers | None = None
    ) -> Float32Array:
        """``x @ weight`` for ``x`` [rows, inner], C-contiguous, at least ``MIN_GEMM_ROWS`` rows.

        ``workers`` share the tiles of a few-row product (the bits do not depend on them).
        """
        if self.lanes is not None:
            return self.lanes.matmul(x, weight)
        if self.few_rows_tiled and x.shape[0] <= FEW_ROWS:
            return self._tiled(x, weight, workers)
        out: Float32Array = x @ weight
        return out

    def _tiled(
        self, x: Float32Array, weight: Float32Array, workers: TileWorkers | None
    ) -> Float32Array:
        rows, cols = x.shape[0], weight.shape[1]
        out = np.empty((rows, cols), dtype=np.float32)
        part = np.empty_like(out) if len(self.k_blocks) > 2 else out
        k_pieces = list(itertools.pairwise(self.k_blocks))

        def columns(first: int, last: int) -> None:
            lo_col, hi_col, tiles = first * TILE, last * TILE, last - first
            w, total, piece = (
                weight[:, lo_col:hi_col],
                out[:, lo_col:hi_col],
                part[:, lo_col:hi_col],
            )
            for index, (lo, hi) in enumerate(k_pieces):
                dest = total if index == 0 else piece
                np.matmul(x[None, :, lo:hi], _tiles(w[lo:hi], tiles), out=_tiles(dest, tiles))
                if index:
                    total += piece

        if workers is None:
            columns(0, cols // TILE)
        else:
            workers.run(columns, cols // TILE)
        return out
