"""The static sentence embedding distilled from all-MiniLM-L6-v2 (issue 15): its cache, its
agreement with MiniLM on real text pairs, and its place as the default semantic scorer."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.stats import spearmanr

from evaluators import _static_embedding
from evaluators._embedding import MAX_TEXT_CHARS, SentenceEncoder, model_folder
from evaluators._scorers import ScorerConfig, build_scorers
from evaluators._scorers_quality import SemanticSimilarityScorer
from evaluators._static_embedding import (
    STATIC_DIM,
    StaticSentenceEncoder,
    calibrated,
    load_or_distil,
)
from tests.evaluators.test_scorers import make_exchange, make_observation

PAIRS = json.loads((Path(__file__).parent / "data" / "real_text_pairs.json").read_text())["pairs"]
# Measured on these 60 pairs: Spearman 0.90 with MiniLM's cosine, calibrated values
# within 0.071 of it on average; the bounds leave room for float noise, not for a
# different recipe.
MIN_SPEARMAN = 0.85
MAX_MEAN_ABS_DIFF = 0.1


@pytest.fixture(scope="module")
def static() -> StaticSentenceEncoder:
    return StaticSentenceEncoder()


@pytest.fixture(scope="module")
def minilm() -> SentenceEncoder:
    return SentenceEncoder()


def test_the_table_is_cached_under_a_name_keyed_by_the_source(
        static: StaticSentenceEncoder, tmp_path: Path) -> None:
    assert static.table_path.parent.name == "static-embeddings"
    again = StaticSentenceEncoder()
    assert again.distil_s == 0.0 and again.table_path == static.table_path
    assert static.dim == STATIC_DIM
    source = tmp_path / "model"
    shutil.copytree(model_folder(), source)
    config = json.loads((source / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6  # other weights' settings: another table
    (source / "config.json").write_text(json.dumps(config))
    assert (_static_embedding._source_digest(source)
            != _static_embedding._source_digest(model_folder()))


def test_a_missing_table_is_distilled_once_however_many_ask(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rule 4 with a stand-in for the 40 s distillation: two threads (each with the file
    lock's own descriptor, as two processes would have) ask at once; one distils, the
    other waits and reads its file."""
    calls: list[int] = []
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    started = threading.Event()

    def fake_distil(_: Any) -> np.ndarray:
        calls.append(1)
        started.set()
        threading.Event().wait(0.3)  # the other thread reaches the lock meanwhile
        return table

    monkeypatch.setattr(_static_embedding, "distil", fake_distil)
    monkeypatch.setattr(_static_embedding, "SentenceEncoder", lambda *a, **k: None)
    results: list[tuple[Any, Path, float]] = []

    def load() -> None:
        results.append(load_or_distil(model_folder(), tmp_path))

    threads = [threading.Thread(target=load) for _ in range(2)]
    threads[0].start()
    assert started.wait(5)
    threads[1].start()
    for thread in threads:
        thread.join(10)
    assert len(calls) == 1 and len(results) == 2
    for loaded, path, _ in results:
        np.testing.assert_array_equal(loaded, table)
        assert path.parent == tmp_path / "static-embeddings"
    assert sorted(spent > 0 for _, _, spent in results) == [False, True]
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []


def test_agrees_with_minilm_on_real_text_pairs(static: StaticSentenceEncoder,
                                               minilm: SentenceEncoder) -> None:
    pairs = [(p["primary"], p["candidate"]) for p in PAIRS]
    reference = np.array(minilm.similarities(pairs))
    values = np.array(static.similarities(pairs))
    assert spearmanr(reference, values).statistic >= MIN_SPEARMAN
    assert np.abs(reference - values).mean() <= MAX_MEAN_ABS_DIFF
    unrelated = np.array([p["kind"] == "unrelated" for p in PAIRS])
    # Calibrated onto MiniLM's scale: unrelated answers far below the gates' 0.85.
    assert values[unrelated].max() < 0.7 < values[~unrelated & (reference > 0.9)].min()


@pytest.mark.parametrize("model", ["static", "minilm"])
def test_ranks_paraphrase_above_unrelated(model: str, static: StaticSentenceEncoder,
                                          minilm: SentenceEncoder) -> None:
    scorer = SemanticSimilarityScorer(static if model == "static" else minilm)
    primary = make_observation(text="The capital of France is Paris.")
    paraphrase, unrelated = (
        scorer.score(make_exchange(primary, text=text))[0].candidate
        for text in ("Paris is France's capital.", "Turtles can live 100 years."))
    assert paraphrase is not None and unrelated is not None
    assert paraphrase > 0.8 > 0.3 > unrelated


def test_identical_texts_are_one_without_encoding(static: StaticSentenceEncoder) -> None:
    before = static.stats
    text = PAIRS[0]["primary"]
    assert static.similarities([(text, text), ("", "")]) == [1.0, 1.0]
    assert static.stats.encoded == before.encoded
    assert static.stats.identical_pairs == before.identical_pairs + 2
    row = static.encode([text])[0]
    assert float(np.dot(row, row)) == pytest.approx(1.0, abs=1e-5)


def test_batched_equals_one_at_a_time_and_empty_text_is_the_zero_vector(
        static: StaticSentenceEncoder) -> None:
    pairs = [(p["primary"], p["candidate"]) for p in PAIRS[::5]] + [("", "an answer")]
    batched = static.similarities(pairs)
    single = [static.similarity(a, b) for a, b in pairs]
    assert max(abs(a - b) for a, b in zip(batched, single, strict=True)) < 1e-6
    assert batched[-1] == 0.0
    assert not static.encode([""]).any()
    assert static.encode([]).shape == (0, STATIC_DIM)


def test_a_long_answer_costs_its_head_not_its_length(
        static: StaticSentenceEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer tokenized a whole text before it truncated: twenty 240 KB answers of
    punctuation (a token a character) took ~10 s of CPU here when only 254 tokens are
    read. It is handed each text's first ``MAX_TEXT_CHARS`` characters."""
    handed: list[int] = []
    tokenizer = static._tokenizer

    class Recording:
        def encode_batch(self, texts: list[str], **options: Any) -> Any:
            handed.extend(len(text) for text in texts)
            return tokenizer.encode_batch(texts, **options)

    monkeypatch.setattr(static, "_tokenizer", Recording())
    marks = "!?.,;:" * 40_000
    pairs = [(marks[i:] + PAIRS[0]["primary"], marks[i + 1:]) for i in range(10)]
    values = static.similarities(pairs)
    assert handed and max(handed) <= MAX_TEXT_CHARS < len(marks)
    assert min(values) > 0.9  # the same first tokens: punctuation on both sides


@pytest.mark.parametrize("model", ["static", "minilm"])
def test_an_answer_s_first_tokens_are_read_whatever_follows(
        model: str, static: StaticSentenceEncoder, minilm: SentenceEncoder) -> None:
    encoder = static if model == "static" else minilm
    prose = PAIRS[0]["primary"]
    long = prose + " " + "!?.,;:" * 40_000
    assert encoder.similarity(long, prose + " !") == pytest.approx(
        encoder.similarity(long[:20_000], prose + " !"), abs=1e-6)


def test_calibration_is_monotone_for_a_length_and_bounded() -> None:
    for tokens in (1, 20, 200):
        values = [calibrated(c, tokens) for c in np.linspace(-1, 1, 41)]
        assert values == sorted(values) and values[-1] == 1.0
        assert min(values) >= -1.0
    # Long texts share more of their vocabulary by chance: the same cosine means less.
    assert calibrated(0.8, 200) < calibrated(0.8, 20) < 0.8


def test_the_default_semantic_scorer_is_static_and_minilm_is_a_config_option() -> None:
    (default,) = build_scorers(["semantic_similarity"])
    assert isinstance(default, SemanticSimilarityScorer)
    assert isinstance(default.encoder, StaticSentenceEncoder)
    (full,) = build_scorers(["semantic_similarity"],
                            ScorerConfig.model_validate({"semantic_model": "minilm"}))
    assert isinstance(full, SemanticSimilarityScorer)
    assert isinstance(full.encoder, SentenceEncoder)
    with pytest.raises(ValidationError, match="semantic_model"):
        ScorerConfig.model_validate({"semantic_model": "bert"})
