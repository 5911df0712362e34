"""Prompt-lookup drafts for greedy decoding, run in rows the forward pass pays for anyway.

Every linear-layer product takes at least ``MIN_GEMM_ROWS`` rows (see ``model._attention``), so a
step that decodes fewer sequences than that computes zero rows for nothing.  The engine fills
those rows with draft tokens: the continuation of the latest earlier occurrence, in the
request's own tokens, of its longest suffix n-gram.  The forward pass verifies them for free.

Because rows are independent and attention tiles are aligned to absolute positions, the logits
of every row equal those a one-token decode would compute, so a greedy request emits exactly the
tokens (and log-probabilities) it would emit without drafts; it only emits several per step when
drafts match.  K/V written for rejected drafts lie beyond the computed length and are
overwritten before any query can see them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_DRAFT_NGRAM", "MIN_DRAFT_NGRAM", "propose_drafts"]

MAX_DRAFT_NGRAM = 4
MIN_DRAFT_NGRAM = 1


def propose_drafts(
    tokens: Sequence[int],
    count: int,
    *,
    max_ngram: int = MAX_DRAFT_NGRAM,
    min_ngram: int = MIN_DRAFT_NGRAM,
) -> list[int]:
    """Up to ``count`` tokens that followed the latest earlier match of the longest suffix."""
    if count <= 0 or len(tokens) < 2:
        return []
    history = np.asarray(tokens, dtype=np.int64)
    for size in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-size:]
        # Windows over history[:-1] start at most at len - 1 - size: never the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], size)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + size
            return [int(t) for t in history[start : start + count]]
    return []
