"""The simulator's "model": deterministic words and vectors derived from hashes.

Rules:
1. An answer is a function of a digest of (model, prompt, variant, seed[, nonce]); the
   i-th token depends only on the digest and i, so a shorter answer (a lower max_tokens)
   is a prefix of a longer one, as with greedy decoding.
2. A token is one word from a fixed vocabulary; every token after the first carries its
   leading space (BPE style), so concatenated stream deltas equal the full text.
3. Token counts are whitespace words plus a fixed per-message overhead, the same on
   every call, so usage numbers are reproducible.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

from backends.openai_wire import encode_body

__all__ = [
    "EMBEDDING_DIM",
    "answer_digest",
    "answer_tokens",
    "count_words",
    "embedding_vector",
]

EMBEDDING_DIM = 384
_DIGEST_SIZE = 32
_VOCABULARY: tuple[str, ...] = (
    "the", "a", "model", "answer", "token", "cache", "prefix", "stream", "latency",
    "gateway", "mirror", "candidate", "primary", "request", "response", "value",
    "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "river", "mountain",
    "signal", "noise", "memory", "budget", "buffer", "queue", "worker", "score",
    "judge", "shadow", "traffic", "sample", "batch", "layer", "head", "vector",
    "matrix", "kernel", "block", "page", "hash", "route", "node", "decode", "prefill",
    "is", "was", "and", "of", "to", "in", "for", "with", "on", "by", "this", "that",
    "it", "we",
)  # fmt: skip


def answer_digest(
    *, model: str, prompt: object, variant: str, seed: int | None, nonce: int | None
) -> bytes:
    """A stable digest of everything an answer is allowed to depend on."""
    key = encode_body(
        {"model": model, "prompt": prompt, "variant": variant, "seed": seed, "nonce": nonce},
        sort_keys=True,
    )
    return hashlib.blake2b(key, digest_size=_DIGEST_SIZE).digest()


def answer_tokens(digest: bytes, count: int) -> list[str]:
    """The first `count` tokens of the answer named by `digest`."""
    tokens: list[str] = []
    for index in range(count):
        word_hash = hashlib.blake2b(digest + index.to_bytes(8, "little"), digest_size=8).digest()
        word = _VOCABULARY[int.from_bytes(word_hash, "little") % len(_VOCABULARY)]
        tokens.append(word if index == 0 else " " + word)
    return tokens


def count_words(texts: Sequence[str]) -> int:
    """Whitespace-separated words over all texts: the simulator's tokenizer."""
    return sum(len(text.split()) for text in texts)


def embedding_vector(text_key: object, *, model: str, variant: str) -> list[float]:
    """A deterministic unit vector of `EMBEDDING_DIM` floats for one input."""
    digest = answer_digest(model=model, prompt=text_key, variant=variant, seed=None, nonce=None)
    raw: list[float] = []
    block = 0
    while len(raw) < EMBEDDING_DIM:
        chunk = hashlib.blake2b(digest + block.to_bytes(4, "little"), digest_size=64).digest()
        # Eight unsigned 64-bit integers mapped into [-1, 1).
        raw.extend(value / 2**63 - 1.0 for value in struct.unpack("<8Q", chunk))
        block += 1
    raw = raw[:EMBEDDING_DIM]
    norm = math.sqrt(sum(value * value for value in raw)) or 1.0
    return [value / norm for value in raw]
