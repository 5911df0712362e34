"""The encoder's shortcuts (issue 15): identical texts are not encoded, a text met again
comes from the cache, and neither changes a similarity; the cheaper approximations are
measured against the full similarity on real text pairs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from evaluators._embedding import SentenceEncoder
from evaluators._scorers_quality import SemanticSimilarityScorer
from tests.evaluators.test_scorers import make_exchange, make_observation

PAIRS = json.loads((Path(__file__).parent / "data" / "real_text_pairs.json").read_text())["pairs"]
MIN_AGREEMENT = 0.99


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder()


def _forbid_encoding(encoder: SentenceEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("the encoder ran")
    monkeypatch.setattr(encoder, "_encode_into", fail)


def test_identical_texts_score_one_without_the_encoder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = SentenceEncoder(cache_entries=0)
    _forbid_encoding(encoder, monkeypatch)
    text = PAIRS[0]["primary"]
    assert encoder.similarity(text, text) == 1.0
    assert encoder.similarities([(text, text), ("", "")]) == [1.0, 1.0]
    scorer = SemanticSimilarityScorer(encoder)
    exchange = make_exchange(primary=make_observation(text=text),
                             candidate=make_observation(backend="cand", text=text))
    assert scorer.score(exchange)[0].candidate == 1.0
    assert scorer.score_batch([exchange, exchange])[1][0].candidate == 1.0
    assert encoder.stats.encoded == 0
    assert encoder.stats.identical_pairs == 6


def test_identical_shortcut_agrees_with_encoding_the_text(encoder: SentenceEncoder) -> None:
    text = PAIRS[1]["primary"]
    row = encoder.encode([text])[0]
    assert float(np.dot(row, row)) == pytest.approx(1.0, abs=1e-5)


def test_a_text_met_again_comes_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = SentenceEncoder(cache_entries=8)
    primary, first, second = PAIRS[2]["primary"], PAIRS[2]["candidate"], PAIRS[3]["candidate"]
    fresh = SentenceEncoder(cache_entries=0).similarities([(first, primary), (second, primary)])
    assert encoder.similarity(first, primary) == pytest.approx(fresh[0], abs=1e-5)
    assert encoder.stats.encoded == 2
    assert encoder.similarity(second, primary) == pytest.approx(fresh[1], abs=1e-5)
    assert encoder.stats.encoded == 3  # the primary's answer was not encoded again
    assert encoder.stats.cache_hits == 1
    _forbid_encoding(encoder, monkeypatch)
    assert encoder.similarity(second, first) == pytest.approx(
        SentenceEncoder(cache_entries=0).similarity(second, first), abs=1e-5)


def test_the_cache_is_bounded_and_forgets_the_least_recently_used() -> None:
    encoder = SentenceEncoder(cache_entries=2)
    encoder.encode(["one", "two"])
    encoder.encode(["one"])  # "two" is now the least recently used
    encoder.encode(["three"])
    assert encoder.stats.encoded == 3
    encoder.encode(["one", "three"])
    assert encoder.stats.encoded == 3
    encoder.encode(["two"])
    assert encoder.stats.encoded == 4
    encoder.clear_cache()
    encoder.encode(["one"])
    assert encoder.stats.encoded == 5


def test_a_disabled_cache_encodes_every_call() -> None:
    encoder = SentenceEncoder(cache_entries=0)
    encoder.encode(["one"])
    encoder.encode(["one"])
    assert (encoder.stats.encoded, encoder.stats.cache_hits) == (2, 0)


def test_duplicates_in_one_call_are_encoded_once_and_placed_everywhere() -> None:
    encoder = SentenceEncoder(cache_entries=0)
    rows = encoder.encode(["a b", "c d", "a b"])
    assert encoder.stats.encoded == 2
    np.testing.assert_array_equal(rows[0], rows[2])


def test_rejects_bad_cache_and_token_settings() -> None:
    with pytest.raises(ValueError, match="cache_entries"):
        SentenceEncoder(cache_entries=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SentenceEncoder(max_tokens=257)


def test_batched_cached_similarity_agrees_with_the_reference_on_real_pairs(
        encoder: SentenceEncoder) -> None:
    """What the scoring child runs (batched, cached) against one pair at a time with no
    cache, on a fixed subset of the real text pairs (all kinds)."""
    pairs = [(p["primary"], p["candidate"]) for p in PAIRS[::6]]
    reference = SentenceEncoder(cache_entries=0)
    expected = [reference.similarity(a, b) for a, b in pairs]
    encoder.clear_cache()
    got = encoder.similarities(pairs)
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-5
    assert np.corrcoef(expected, got)[0, 1] >= MIN_AGREEMENT


def test_truncation_does_not_agree_enough_to_be_a_default() -> None:
    """Why the encoder reads all 256 tokens: at 64 the similarity of real pairs whose
    candidate diverged late (a rewritten tail) no longer follows the full one."""
    pairs = [(p["primary"], p["candidate"]) for p in PAIRS if p["kind"] == "tail"][:6]
    full = SentenceEncoder(cache_entries=0).similarities(pairs)
    short = SentenceEncoder(cache_entries=0, max_tokens=64).similarities(pairs)
    assert max(abs(a - b) for a, b in zip(full, short, strict=True)) > 0.05
