"""Causal grouped-query attention over query tiles aligned to absolute positions.

Theory of operation -- why prefix reuse is bitwise exact
--------------------------------------------------------
A position's K/V and its logits must come out with the same bits whether the position was
computed in a one-shot prefill, in a chunk that starts after a cached prefix (at any split point,
block-aligned or not), or one token at a time by decode.  Float addition is not associative, so
this holds only if every number is produced by the same sequence of operations each time:

1. Rows are independent.  Each matrix product here is ``rows x k @ k x cols`` and one output row
   depends only on its input row, provided the BLAS takes the same path: at least
   ``MIN_GEMM_ROWS`` rows (OpenBLAS and numpy take other kernels for 1-3 rows, whose sums are
   ordered differently).  ``pad_rows`` is used before every product whose row count varies.
   The weight products take a faster path for few rows that does the same arithmetic as the
   path for many (``_linear``); products over inner sizes up to 448 (one OpenBLAS K-block, as
   here) have the same bits on either path.
2. Query tiles are aligned to absolute positions.  Queries at positions
   ``[t*QUERY_TILE, (t+1)*QUERY_TILE)`` attend over exactly ``(t+1)*QUERY_TILE`` keys, whatever
   subset of the tile a call holds (a decode step holds one query).  Keys after a query are
   masked to ``-inf``; their storage must be finite (it is zero or stale K/V, both finite), so
   their weight is exactly zero.  Every reduction length (softmax max and sum) therefore depends
   only on the tile index.
3. Reductions whose order a BLAS could change with the problem size are cut into fixed pieces.
   Scores are ``q @ K^T`` with K stored transposed, so the product is NN with an inner size of
   ``head_dim`` (one FMA chain per element on every OpenBLAS path, for any number of rows and
   any number of columns that is a multiple of the kernel's column unroll -- so decode makes
   them one KV block of columns at a time where ``blockwise_scores_exact`` allows it; the NT
   path does not have this property).  ``P @ V`` runs over ``KEY_CHUNK`` keys at a time (an
   inner size that fits one OpenBLAS K-block, so no path splits it) and the partial products are
   summed in order.
4. Elementwise ufuncs (exp, subtract, divide, RoPE) are exact per element; every array they see
   is contiguous so the same SIMD loop runs.

Decode writes K/V that equal prefill's because the projections obey rule 1 and the attention
output of its one query obeys rules 2-4.

Rules 1 and 3 are properties of the BLAS kernels, not of this code.  OpenBLAS's SkylakeX kernels
(what it picks on AVX-512 machines) have them; its Haswell kernels (``OPENBLAS_CORETYPE=Haswell``,
also picked on Zen) do not -- a row's bits there depend on the row count and the row's place in
the tile.  ``_numerics`` checks them on the model's own shapes when the model loads; where they
fail, both products here take ``lanes`` (``_lanes``: each row in a lane that reproduces one
reference), which restores rule 1 on any kernel, and decode runs each query through ``attend``.
Processes exchange KV blocks only when their numerics fingerprints agree.

5. With a KV codec (``kv._paged_codec``) the stored keys and values of a complete block are its
   decoded version, and a query reads its OWN block raw (KIVI's full-precision residual).  A
   prefill tile holds queries of several blocks, and the one call must give each row the bits a
   lone decode of it gives, so every row takes the same steps, ``OwnBlocks``: scores over the
   stored keys; its own block's scores recomputed over the raw keys (a product of those 16
   columns alone) and written over theirs; the softmax over the span; the own block's
   probabilities taken out (their columns zeroed, so the stored own-block values add exact
   zeros to ``P @ V``) and multiplied by the raw values in a product of their own, added after
   the ``KEY_CHUNK`` products.  What is stored in the own block therefore never reaches a row,
   raw (decode, its block not yet complete) or decoded (prefill, sealed by this call) alike.
   Without a codec (fp32) none of this runs.  Under a codec with a recent window of ``window``
   blocks the same steps run over the query's window -- its own block and the ``window - 1``
   before it, one product of their columns for the scores and one for ``P @ V`` -- so the
   window's raw rows, not their decoded version, reach the row.  Where the products take
   ``lanes``, these two do not: they are ``_lanes.summed_product`` (no BLAS, rule 6 there), the
   same bits for a row in a prefill segment and alone, at ~10 numpy calls against a padded
   lane-mapped call and a thread hand-off each.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._lanes import RowLanes, summed_product

__all__ = [
    "KEY_CHUNK",
    "MIN_GEMM_ROWS",
    "QUERY_TILE",
    "OwnBlocks",
    "attend",
    "attend_decode",
    "blockwise_scores_exact",
    "key_span",
    "pad_rows",
]

Float32Array = npt.NDArray[np.float32]

QUERY_TILE = 128
"""Queries per attention tile; tile ``t`` attends over ``(t + 1) * QUERY_TILE`` keys."""
KEY_CHUNK = 256
"""Keys per ``P @ V`` product (at most one OpenBLAS K-block, see rule 3)."""
MIN_GEMM_ROWS = 4
"""Fewest rows handed to a BLAS product (see rule 1)."""
SCORE_BLOCK = 1 << 20
"""Most scores ``attend`` holds at once (4 MiB): a tile's rows are taken in blocks of about this
many scores, one KV head at a time, so that the softmax's passes over them run in cache."""
_ROW_ALIGN = 16  # rows of a block are a multiple of OpenBLAS's sgemm row unroll (speed only)
_PROBE_ROWS = (4, 5, 7, 8, 13, 16, 17, 33, 70)
_PROBE_SEED = 20260601


@dataclass(frozen=True, slots=True)
class OwnBlocks:
    """The raw K/V of the blocks a chunk's queries read raw: their own and, with a recent window
    of ``window`` blocks, the ``window - 1`` blocks before each (rule 5).

    ``keys_t``: [kv_heads, head_dim, n * block_size]; ``values``: [kv_heads, n * block_size,
    head_dim]; ``first``: the index of the first of these blocks in the sequence.
    """

    keys_t: Float32Array
    values: Float32Array
    first: int
    block_size: int
    window: int = 1

    def read_raw(self, block: int) -> tuple[slice, slice]:
        """The key columns a query in ``block`` reads raw, in the sequence and in these arrays."""
        bs, lo = self.block_size, max(0, block - self.window + 1)
        if lo < self.first:
            raise ValueError(f"raw blocks from {self.first}, block {block} reads from {lo}")
        return (
            slice(lo * bs, (block + 1) * bs),
            slice((lo - self.first) * bs, (block + 1 - self.first) * bs),
        )


def key_span(end_position: int) -> int:
    """Keys that attention reads for queries up to ``end_position`` (exclusive)."""
    tiles = -(-end_position // QUERY_TILE)
    return tiles * QUERY_TILE


def pad_rows(x: Float32Array, rows: int = MIN_GEMM_ROWS) -> Float32Array:
    """``x`` ([n, ...]) with zero rows appended up to ``rows`` (no copy when already enough)."""
    if x.shape[0] >= rows:
        return x
    padded = np.zeros((rows, *x.shape[1:]), dtype=np.float32)
    padded[: x.shape[0]] = x
    return padded


def _causal_mask(first: int, last: int, group: int, rows: int) -> npt.NDArray[np.bool_]:
    """[rows, QUERY_TILE]: True where a key of the tile's diagonal block lies after the query.

    Row ``i*group + g`` is the query at tile offset ``first + i``; padding rows mask nothing.
    """
    offsets = np.repeat(np.arange(first, last), group)
    mask = np.zeros((rows, QUERY_TILE), dtype=np.bool_)
    np.greater(np.arange(QUERY_TILE)[None, :], offsets[:, None], out=mask[: offsets.size])
    return mask


def attend(
    q: Float32Array,
    start: int,
    keys_t: Float32Array,
    values: Float32Array,
    lanes: RowLanes | None = None,
    own: OwnBlocks | None = None,
) -> Float32Array:
    """Attention output for queries at positions ``start .. start+n``.

    ``q``: [n, kv_heads, group, head_dim], RoPE applied and already scaled by 1/sqrt(head_dim).
    ``keys_t``: [kv_heads, head_dim, >= key_span(start+n)], keys stored transposed.
    ``values``: [kv_heads, >= key_span(start+n), head_dim].
    Returns [n, kv_heads, group, head_dim].

    Each tile's rows are taken one KV head and one block of rows (``_row_blocks``) at a time,
    in one scores buffer reused for every block: at a long context a tile's scores for all heads
    are tens of MiB (19 MiB at 4k keys), which every softmax pass would stream from memory, and a
    fresh array that size would be page-faulted in for every tile.  A row's bits do not depend on
    the block it is computed in (rule 1), so the output is the same as for one product per tile.
    ``lanes``: run both products lane-mapped (``_lanes``), on kernels that break rule 1.
    ``own``: the raw blocks of the queries, read in place of the stored ones (rule 5).
    """
    n, kv_heads, group, head_dim = q.shape
    end = start + n
    # Rows ordered (position, group member) so that a tile is a contiguous row range.
    rows = np.ascontiguousarray(q.transpose(1, 0, 2, 3)).reshape(kv_heads, n * group, head_dim)
    out = np.empty((kv_heads, n * group, head_dim), dtype=np.float32)
    scratch = np.empty(0, dtype=np.float32)
    for tile in range(start // QUERY_TILE, (end - 1) // QUERY_TILE + 1):
        tile_start = tile * QUERY_TILE
        lo = max(start, tile_start)
        hi = min(end, tile_start + QUERY_TILE)
        row_lo, row_hi = (lo - start) * group, (hi - start) * group
        count = row_hi - row_lo
        padded = max(count, MIN_GEMM_ROWS)
        if padded == count:
            q_tile = rows[:, row_lo:row_hi]
        else:
            q_tile = np.zeros((kv_heads, padded, head_dim), dtype=np.float32)
            q_tile[:, :count] = rows[:, row_lo:row_hi]
        span = tile_start + QUERY_TILE
        mask = _causal_mask(lo - tile_start, hi - tile_start, group, padded)
        blocks = _row_blocks(padded, span)
        largest = max(b - a for a, b in itertools.pairwise(blocks))
        if scratch.size < largest * span:
            scratch = np.empty(largest * span, dtype=np.float32)
        for head in range(kv_heads):
            head_keys = keys_t[head, :, :span]
            if lanes is not None:
                head_keys = np.ascontiguousarray(head_keys)
            for first, last in itertools.pairwise(blocks):
                scores = scratch[: (last - first) * span].reshape(last - first, span)
                if lanes is None:
                    np.matmul(q_tile[head, first:last], head_keys, out=scores)
                else:
                    scores[...] = lanes.matmul(q_tile[head, first:last], head_keys)
                correct = None
                if own is not None:
                    segments = _own_segments(own, lo, hi, start, group, row_lo, first, last, count)
                    q_block = q_tile[head, first:last]
                    correct = _own_scores(scores, q_block, own, head, segments, lanes)
                np.copyto(scores[:, tile_start:], -np.inf, where=mask[first:last])
                acc = _softmax_times_values(scores, values[head], span, lanes, correct)
                kept = min(last, count) - first
                if kept > 0:
                    out[head, row_lo + first : row_lo + first + kept] = acc[:kept]
    return out.reshape(kv_heads, n, group, head_dim).transpose(1, 0, 2, 3)


def _row_blocks(rows: int, span: int) -> list[int]:
    """Cuts of ``rows`` (>= ``MIN_GEMM_ROWS``) into near-equal blocks of about ``SCORE_BLOCK``
    scores over ``span`` keys; every block has at least ``MIN_GEMM_ROWS`` rows (rule 1)."""
    count = max(1, -(-rows * span // SCORE_BLOCK))
    step = -(-rows // count)
    step = -(-step // _ROW_ALIGN) * _ROW_ALIGN
    cuts = [*range(0, rows, step), rows]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < MIN_GEMM_ROWS:
        del cuts[-2]
    return cuts


_Segment = tuple[int, int, int]  # rows [a, b) of a row block, and their own block's index


def _own_segments(
    own: OwnBlocks,
    lo: int,
    hi: int,
    start: int,
    group: int,
    row_lo: int,
    first: int,
    last: int,
    count: int,
) -> list[_Segment]:
    """The rows ``[first, min(last, count))`` of a tile (queries ``lo .. hi``) cut by own block."""
    bs = own.block_size
    segments = []
    for block in range(lo // bs, (hi - 1) // bs + 1):
        a = (max(block * bs, lo) - lo) * group
        b = (min((block + 1) * bs, hi) - lo) * group
        a, b = max(a, first), min(b, last, count)
        if a < b:
            segments.append((a - first, b - first, block))
    return segments


def _product(lanes: RowLanes | None) -> Callable[[Float32Array, Float32Array], Float32Array]:
    return np.matmul if lanes is None else lanes.matmul


def _own_product(lanes: RowLanes | None) -> Callable[[Float32Array, Float32Array], Float32Array]:
    """Rule 5's own-block products: BLAS where its rows are independent, else without it
    (``_lanes`` rule 6): a few rows and 16-144 columns, which a lane-mapped call would pad."""
    return np.matmul if lanes is None else summed_product


def _own_scores(
    scores: Float32Array,
    q_rows: Float32Array,
    own: OwnBlocks,
    head: int,
    segments: list[_Segment],
    lanes: RowLanes | None,
) -> Callable[[Float32Array], Float32Array]:
    """Write each segment's scores over its raw own block (rule 5); the correction to apply
    once the scores are exponentiated (``_softmax_times_values``).  ``q_rows``: the queries of
    ``scores``' rows."""
    product = _own_product(lanes)
    for a, b, block in segments:
        columns, local = own.read_raw(block)
        keys = np.ascontiguousarray(own.keys_t[head, :, local])
        scores[a:b, columns] = product(pad_rows(q_rows[a:b]), keys)[: b - a]

    def correct(weights: Float32Array) -> Float32Array:
        out = np.zeros((weights.shape[0], own.values.shape[-1]), dtype=np.float32)
        for a, b, block in segments:
            columns, local = own.read_raw(block)
            taken = weights[a:b, columns].copy()  # a copy even where it spans whole rows
            weights[a:b, columns] = 0.0
            values = np.ascontiguousarray(own.values[head, local])
            out[a:b] = product(pad_rows(taken), values)[: b - a]
        return out

    return correct


def _softmax_times_values(
    scores: Float32Array,
    values: Float32Array,
    span: int,
    lanes: RowLanes | None = None,
    correct: Callable[[Float32Array], Float32Array] | None = None,
) -> Float32Array:
    """softmax(scores) @ values[..., :span, :], rows normalised after the product.

    ``scores``: [..., rows, span] (masked entries -inf), consumed in place; ``values``:
    [..., >= span, head_dim] (2-D where ``lanes`` maps the products).  Every reduction runs over
    exactly ``span`` keys (rules 2 and 3).  ``correct``: takes the own blocks' weights out of
    the exponentiated scores and gives their product with the raw values (rule 5), added last.
    """
    product = _product(lanes)
    peak = scores.max(axis=-1, keepdims=True)
    np.subtract(scores, peak, out=scores)
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)
    own = None if correct is None else correct(scores)
    first = min(KEY_CHUNK, span)
    acc: Float32Array = product(scores[..., :first], values[..., :first, :])
    for chunk in range(KEY_CHUNK, span, KEY_CHUNK):
        stop = min(chunk + KEY_CHUNK, span)
        acc += product(scores[..., chunk:stop], values[..., chunk:stop, :])
    if own is not None:
        acc += own
    np.divide(acc, denom, out=acc)
    return acc


def attend_decode(
    q: Float32Array,
    positions: npt.NDArray[np.intp],
    key_blocks: Float32Array,
    values: Float32Array,
    own: Sequence[OwnBlocks] | None = None,
) -> Float32Array:
    """Attention of one query per sequence, for sequences whose queries share a tile.

    ``q``: [seqs, kv_heads, group, head_dim]; ``positions``: [seqs], all in one query tile;
    ``key_blocks``: [seqs, kv_heads, blocks, head_dim, block_size], ``K^T`` of each block of
    the key span (one block of the whole span where blocks are not ``blockwise_scores_exact``);
    ``values``: [seqs, kv_heads, key_span, head_dim] (strided views are fine).
    The rows are padded to ``MIN_GEMM_ROWS`` as ``attend`` pads a lone query, so the bits are
    the same: the scores are products over ``head_dim`` (one FMA chain per score, rule 3), made
    block by block straight into their columns (no copy of the keys into one ``K^T``), and
    ``P @ V`` has the shapes ``attend`` gives it.
    ``own``: per sequence, the blocks its query reads raw (rule 5), taken as ``attend`` takes
    them.
    """
    seqs, kv_heads, group, head_dim = q.shape
    blocks, block_size = key_blocks.shape[2], key_blocks.shape[4]
    span = blocks * block_size
    tile_start = span - QUERY_TILE
    padded = max(group, MIN_GEMM_ROWS)
    q_tile = np.zeros((seqs, kv_heads, 1, padded, head_dim), dtype=np.float32)
    q_tile[:, :, 0, :group] = q
    scores = np.empty((seqs, kv_heads, padded, span), dtype=np.float32)
    split = np.reshape(scores, (seqs, kv_heads, padded, blocks, block_size), copy=False)
    np.matmul(q_tile, key_blocks, out=split.transpose(0, 1, 3, 2, 4))
    correct = None
    if own is not None:
        correct = _own_decode(scores, q_tile[:, :, 0], positions, own)
    mask = np.zeros((seqs, 1, padded, QUERY_TILE), dtype=np.bool_)
    offsets = (positions - tile_start)[:, None, None, None]
    np.greater(np.arange(QUERY_TILE), offsets, out=mask[:, :, :group])
    np.copyto(scores[..., tile_start:], -np.inf, where=mask)
    acc = _softmax_times_values(scores, values, span, correct=correct)
    return acc[:, :, :group]


def _own_decode(
    scores: Float32Array,
    q_rows: Float32Array,
    positions: npt.NDArray[np.intp],
    own: Sequence[OwnBlocks],
) -> Callable[[Float32Array], Float32Array]:
    """``_own_scores`` for one query per sequence (``scores`` [seqs, kv_heads, rows, span],
    ``q_rows`` [seqs, kv_heads, rows, head_dim]): the same products, one per sequence and head,
    made as one stacked product per width of raw columns (a stack of 2-D products of the same
    shapes, so the same bits as ``_own_scores``' one by one) rather than a call per sequence and
    head."""
    reads = [
        (raw, *raw.read_raw(int(position) // raw.block_size))
        for raw, position in zip(own, positions.tolist(), strict=True)
    ]
    groups: dict[int, list[int]] = {}
    for seq, (_, cols, _) in enumerate(reads):
        groups.setdefault(cols.stop - cols.start, []).append(seq)
    for seqs in groups.values():
        keys = np.stack([reads[seq][0].keys_t[:, :, reads[seq][2]] for seq in seqs])
        made = np.matmul(q_rows[seqs], keys)
        for seq, rows in zip(seqs, made, strict=True):
            scores[seq, :, :, reads[seq][1]] = rows

    def correct(weights: Float32Array) -> Float32Array:
        width = own[0].values.shape[-1]
        out = np.zeros((*weights.shape[:-1], width), dtype=np.float32)
        for seqs in groups.values():
            taken = np.stack([weights[seq, :, :, reads[seq][1]] for seq in seqs])
            for seq in seqs:
                weights[seq, :, :, reads[seq][1]] = 0.0
            values = np.stack([reads[seq][0].values[:, reads[seq][2]] for seq in seqs])
            out[seqs] = np.matmul(taken, values)
        return out

    return correct


def blockwise_scores_exact(head_dim: int, block_size: int) -> bool:
    """Whether scores made ``block_size`` key columns at a time have the bits of one product.

    Rule 3 on this BLAS for one KV block width: a width that is not a multiple of the kernel's
    column unroll (16 for OpenBLAS's SkylakeX sgemm) ends in a tail summed in another order.
    """
    rng = np.random.default_rng(_PROBE_SEED)
    cols = -(-3 * QUERY_TILE // block_size) * block_size
    keys_t = rng.standard_normal((head_dim, cols), dtype=np.float32)
    for rows in _PROBE_ROWS:
        batch = rng.standard_normal((rows, head_dim), dtype=np.float32)
        starts = range(0, cols, block_size)
        pieces = [batch @ keys_t[:, start : start + block_size] for start in starts]
        if not np.array_equal(np.concatenate(pieces, axis=1), batch @ keys_t):
            return False
    return True
