"""The numpy all-MiniLM-L6-v2 encoder against transformers, and its own behaviour."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from backends.vllm import vllm_python
from evaluators import _embedding
from evaluators._embedding import (
    EMBEDDING_DIM,
    MAX_SEQUENCE_TOKENS,
    EmbeddingModelMissing,
    SentenceEncoder,
    model_folder,
)

TEXTS = [
    "The capital of France is Paris.",
    "Paris is the capital city of France.",
    "I like turtles.",
    "",
    "a",
    "Hello, world! naïve café, 東京, emoji 😀 and\ttabs\nnewlines.",
    "word " * 400,  # past MAX_SEQUENCE_TOKENS: truncated
    "def f(x):\n    return {'json': [1, 2, 3]}",
]

# transformers' BertModel, mean pooling over the attention mask, L2 normalisation: what
# sentence-transformers computes for this model (its max_seq_length is 256).
REFERENCE_SCRIPT = """
import json, sys
import torch, transformers
folder, texts = sys.argv[1], json.loads(sys.stdin.read())
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
model = transformers.AutoModel.from_pretrained(folder).eval()
with torch.no_grad():
    batch = tokenizer(texts, padding=True, truncation=True, max_length=int(sys.argv[2]),
                      return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    print(json.dumps(torch.nn.functional.normalize(pooled, dim=1).tolist()))
"""
REFERENCE_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder()


def reference_embeddings(texts: list[str]) -> np.ndarray:
    python = vllm_python()
    if not python.exists():
        pytest.fail(f"{python} is missing: build it with scripts/setup-vllm.sh")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [str(python), "-c", REFERENCE_SCRIPT, str(model_folder()), str(MAX_SEQUENCE_TOKENS)],
        input=json.dumps(texts), capture_output=True, text=True, env=env,
        timeout=REFERENCE_TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return np.asarray(json.loads(result.stdout), dtype=np.float64)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(REFERENCE_TIMEOUT_S + 60)
def test_matches_transformers(encoder: SentenceEncoder) -> None:
    ours = encoder.encode(TEXTS).astype(np.float64)
    reference = reference_embeddings(TEXTS)
    assert ours.shape == reference.shape == (len(TEXTS), EMBEDDING_DIM)
    assert np.min(np.sum(ours * reference, axis=1)) > 0.9999
    assert np.max(np.abs(ours - reference)) < 1e-4


def test_embeddings_are_unit_length_and_ordered_as_given(encoder: SentenceEncoder) -> None:
    embeddings = encoder.encode(TEXTS)
    assert embeddings.shape == (len(TEXTS), EMBEDDING_DIM)
    assert embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    # batching (length-sorted, padded) changes nothing: each text alone gives the same row
    for text, row in zip(TEXTS, embeddings, strict=True):
        np.testing.assert_allclose(encoder.encode([text])[0], row, atol=1e-5)


def test_empty_input_gives_no_rows(encoder: SentenceEncoder) -> None:
    assert encoder.encode([]).shape == (0, EMBEDDING_DIM)


def test_long_texts_are_truncated_to_the_model_limit(encoder: SentenceEncoder) -> None:
    long = "alpha beta " * 1000
    assert encoder.similarity(long, long + " and then something else entirely") == (
        pytest.approx(1.0, abs=1e-6))


def test_paraphrases_score_higher_than_unrelated_sentences(encoder: SentenceEncoder) -> None:
    pairs = [
        ("The capital of France is Paris.", "Paris is France's capital city.",
         "Bananas are rich in potassium."),
        ("How do I reset my password?", "What are the steps to change my password?",
         "The weather in Tokyo is rainy today."),
        ("The function returns the sum of two integers.",
         "This function computes the sum of two whole numbers.",
         "My cat sleeps on the sofa all afternoon."),
    ]
    for anchor, paraphrase, unrelated in pairs:
        close = encoder.similarity(anchor, paraphrase)
        far = encoder.similarity(anchor, unrelated)
        assert close > 0.6 and far < 0.3 and close > far + 0.4, (anchor, close, far)
    assert encoder.similarity("same text", "same text") == pytest.approx(1.0, abs=1e-5)


def test_a_batch_of_short_answers_encodes_quickly(encoder: SentenceEncoder) -> None:
    answers = [f"Answer {i}: the result is {i * 7} because of reason number {i}."
               for i in range(16)]
    encoder.encode(answers)  # warm up the allocator
    # CPU time, not wall time: other work on a shared machine must not fail this test.
    # Measured 0.15 s here; with one BLAS thread, wall time equals it on an idle machine.
    best = min(_cpu_seconds(encoder, answers) for _ in range(3))
    assert best < 0.5, f"{best:.3f} s of CPU for 16 short answers"


def _cpu_seconds(encoder: SentenceEncoder, texts: list[str]) -> float:
    start = time.process_time()
    encoder.encode(texts)
    return time.process_time() - start


def test_missing_model_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_embedding, "MODEL_DISTRIBUTION", "no-such-model-package")
    with pytest.raises(EmbeddingModelMissing, match="pip install"):
        model_folder()


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        SentenceEncoder(batch_size=0)
    with pytest.raises(ValueError):
        SentenceEncoder(blas_threads=0)


def test_encoding_leaves_the_blas_thread_count_as_it_was(encoder: SentenceEncoder) -> None:
    controller = ThreadpoolController()
    before = [info["num_threads"] for info in controller.info()]
    encoder.encode(["one", "two"])
    assert [info["num_threads"] for info in ThreadpoolController().info()] == before
    unlimited = SentenceEncoder(blas_threads=None)
    np.testing.assert_allclose(unlimited.encode(["one"]), encoder.encode(["one"]), atol=1e-5)
