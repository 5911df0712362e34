"""Heavy hitters: which rows of a complete block are kept at float16 beside its codes.

H2O keeps the tokens that have received the most attention.  A cached block's content must be a
function of its hash -- of the tokens up to its end, never of what follows (``_blockpool``) -- so
the attention it will receive later cannot decide it.  The evidence is what the block's prefix
determines when the block is sealed.

Rules
-----
1. The evidence is the query of the block's last position -- the query that completes it, all
   query heads of each KV head's group -- scored against the block's own keys (the raw rows the
   block is encoded from).  It is the one query every way of computing the block has at the
   moment of sealing (a prefill chunk, decode token by token, a chunk that starts after a cached
   prefix), it sees every row of the block causally, and prefix reuse makes it bitwise the same
   in all of them (``_attention``'s theory), so the choice is too.  Earlier queries of the block
   are not kept by the engine, and those after the block would make its content depend on what
   follows it.
2. Mass: per query head a softmax over the block's candidate rows, summed over the heads of the
   KV head's group; each KV head chooses its own ``count`` rows (heads attend to different
   tokens).  The softmax is local to the block: its normaliser over the whole context would be
   the same for every row of the block, so the ranking within one query head is that of the
   scores; the local softmax weighs the group's heads equally.
3. The scores are computed with ``np.einsum`` in float64 (numpy's own loops, never BLAS), so the
   choice does not depend on the BLAS kernel; ties go to the earlier position.
4. The sink row (position 0 of a sequence's first block) is kept raw anyway (``_paged_codec``
   rule 3) and is no candidate.
5. Returned positions are sorted ascending per KV head: the layout the block stores.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._arrays import Float32Array

__all__ = ["MAX_BLOCK_ROWS", "heavy_hitters"]

IndexArray = npt.NDArray[np.uint8]
MAX_BLOCK_ROWS = 256
"""Most rows a block may have for its heavy-hitter positions to be stored as uint8."""


def heavy_hitters(
    query: Float32Array, keys: Float32Array, count: int, *, skip_sink: bool
) -> IndexArray:
    """The ``count`` rows of a block with the most attention mass, per KV head (see the rules).

    ``query``: [heads, head_dim], the block's last position's query as attention uses it;
    ``keys``: [tokens, kv_heads, head_dim], the block's raw keys; ``skip_sink``: the block is a
    sequence's first (rule 4).  Returns [kv_heads, count] positions, ascending per head.
    """
    tokens, kv_heads, head_dim = keys.shape
    heads = query.shape[0]
    if query.shape != (heads, head_dim) or heads % kv_heads:
        raise ValueError(
            f"a query of shape {query.shape} for keys of {kv_heads} KV heads of {head_dim}"
        )
    candidates = tokens - int(skip_sink)
    if not 0 < count <= candidates or tokens > MAX_BLOCK_ROWS:
        raise ValueError(
            f"{count} heavy hitters of a {tokens}-row block ({candidates} candidates; "
            f"at most {MAX_BLOCK_ROWS} rows)"
        )
    q = query.reshape(kv_heads, heads // kv_heads, head_dim).astype(np.float64)
    scores = np.einsum("hgd,thd->hgt", q, keys.astype(np.float64))
    if skip_sink:
        scores[..., 0] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    mass = (weights / weights.sum(axis=-1, keepdims=True)).sum(axis=1)  # [kv_heads, tokens]
    positions = np.arange(tokens)
    chosen = np.empty((kv_heads, count), dtype=np.uint8)
    for head in range(kv_heads):
        order = np.lexsort((positions, -mass[head]))  # most mass first, then earliest
        chosen[head] = np.sort(order[:count])
    return chosen
