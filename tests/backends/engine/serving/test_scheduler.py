"""The reference engine's scheduler: batching, chunked prefill, prefix reuse, preemption.

Every path that reuses or splits work must give the bits a lone, uncached run gives: tokens and
log-probabilities are compared exactly, on every BLAS kernel (``_numerics``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from backends.engine import Engine, LlamaModel, SamplingParams, TokenEvent
from backends.engine.kv._store import KVLayout

KV_LIMIT = 64 << 20
MAX_TOKENS = 8
# A real model on two shared cores: a few seconds a test when idle, minutes when loaded.
ENGINE_TEST_TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.load()


def _chat(model: LlamaModel, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _drain(engine: Engine) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    return events


def _solo(
    model: LlamaModel, prompt: Sequence[int], params: SamplingParams
) -> list[tuple[int, float]]:
    engine = Engine(model, KV_LIMIT, enable_prefix_caching=False, speculative_tokens=0)
    engine.add_request("solo", prompt, params)
    return [(e.token_id, e.logprob) for e in _drain(engine)["solo"]]


def _trace(events: list[TokenEvent]) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in events]


def _same(model: LlamaModel, got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """Equal tokens and bitwise equal log-probabilities."""
    assert model.bitwise_prefix_reuse
    return got == want


def test_concurrent_and_chunked_requests_match_solo_runs(model: LlamaModel) -> None:
    prompts = [
        _chat(model, "Name three colours."),
        _chat(model, "Write a haiku about the sea, then explain it in two sentences."),
        _chat(model, "What is 12 times 12?"),
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = Engine(model, KV_LIMIT, max_num_batched_tokens=37, max_num_seqs=4)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    events = _drain(engine)
    for index, prompt in enumerate(prompts):
        got = events[f"r{index}"]
        assert _same(model, _trace(got), _solo(model, prompt, params))
        assert [e.index for e in got] == list(range(MAX_TOKENS))
        assert got[-1].finish_reason == "length" and not any(e.finished for e in got[:-1])
        assert {e.num_prompt_tokens for e in got} == {len(prompt)}
    assert engine.stats().kv.usage == 0.0


def test_second_turn_reuses_the_first_turn_and_its_answer(model: LlamaModel) -> None:
    engine = Engine(model, KV_LIMIT)
    first = _chat(model, "Tell me about the Eiffel tower.")
    engine.add_request("turn-1", first, SamplingParams(max_tokens=20, ignore_eos=True))
    answer = [e.token_id for e in _drain(engine)["turn-1"]]
    assert engine.stats().kv.hits == 0
    follow = model.tokenizer.encode("\n<|im_start|>user\nHow tall is it?<|im_end|>\n")
    second = first + answer + follow + model.tokenizer.encode("<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=4)
    engine.add_request("turn-2", second, params)
    events = _drain(engine)["turn-2"]
    computed = len(first) + len(answer) - 1  # the last answer token was never fed back
    expected_hit = computed // engine.block_size * engine.block_size
    assert expected_hit > len(first) // 16 * 16  # blocks holding answer tokens were cached
    assert {e.cached_tokens for e in events} == {expected_hit}
    assert _same(model, _trace(events), _solo(model, second, params))
    stats = engine.stats().kv
    assert (stats.queries, stats.hits) == (len(first) + len(second), expected_hit)
    assert stats.num_cached_blocks >= computed // engine.block_size


def test_whole_prompt_cached_still_computes_the_last_token(model: LlamaModel) -> None:
    engine = Engine(model, KV_LIMIT)
    prompt = _chat(model, "Count from one to five.")
    prompt = prompt[: len(prompt) // 16 * 16]  # whole blocks only
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompt, params)
    first = _drain(engine)["a"]
    engine.add_request("b", prompt, params)
    again = _drain(engine)["b"]
    assert again[0].cached_tokens == len(prompt) - 16
    assert _same(model, _trace(again), _trace(first))


def test_preemption_under_a_tight_kv_limit(model: LlamaModel) -> None:
    layout = KVLayout.for_model(model.config)
    prompts = [_chat(model, "Describe a cat."), _chat(model, "Describe a dog.")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    per_request = -(-(max(map(len, prompts)) + params.max_tokens) // layout.block_size)
    blocks = per_request + per_request // 2  # room for one and a half requests
    engine = Engine(model, (blocks + 1) * layout.bytes_per_block)
    assert engine.pool.num_blocks == blocks
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    events = _drain(engine)
    for index, prompt in enumerate(prompts):
        assert _same(model, _trace(events[f"r{index}"]), _solo(model, prompt, params))
    assert engine.stats().kv.usage == 0.0


def test_kv_export_import_between_engines(model: LlamaModel) -> None:
    prompt = _chat(model, "Explain what a lighthouse does, in detail, for a child.")
    params = SamplingParams(max_tokens=8)
    producer = Engine(model, KV_LIMIT)
    producer.add_request("p", prompt, params)
    _drain(producer)
    blocks = producer.export_kv(prompt)
    assert len(blocks) == len(prompt) // 16
    assert all(b.data.shape == (30, 2, 3, 16, 64) for b in blocks)

    consumer = Engine(model, KV_LIMIT)
    consumer.import_kv(blocks)
    assert consumer.cached_prefix_blocks(prompt) != []
    consumer.add_request("c", prompt, params)
    events = _drain(consumer)["c"]
    assert events[0].cached_tokens == min(len(blocks), (len(prompt) - 1) // 16) * 16
    assert _same(model, _trace(events), _solo(model, prompt, params))
    salted = producer.export_kv(prompt, cache_salt="tenant-b")
    assert salted == []  # a salt gives a different hash chain


def test_sampling_is_seeded_and_batch_independent(model: LlamaModel) -> None:
    prompt = _chat(model, "Invent a name for a boat.")
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    engine = Engine(model, KV_LIMIT)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    engine.add_request("other", _chat(model, "Hello"), SamplingParams(max_tokens=6, seed=1))
    events = _drain(engine)
    assert _trace(events["a"]) == _trace(events["b"])  # same seed, same batch: same bits
    assert _same(model, _trace(events["a"]), _solo(model, prompt, params))
    narrow = SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    assert [t for t, _ in _solo(model, prompt, narrow)] == [
        t for t, _ in _solo(model, prompt, greedy)
    ]


def test_drafts_in_padding_rows_change_nothing_but_the_step_count(model: LlamaModel) -> None:
    prompt = _chat(
        model, "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."
    )
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(model, KV_LIMIT)
    engine.add_request("spec", prompt, params)
    steps, events = 0, []
    while engine.has_unfinished_requests():
        events.extend(engine.step())
        steps += 1
    assert _same(model, _trace(events), _solo(model, prompt, params))
    assert [e.index for e in events] == list(range(16))
    assert steps < 16  # some drafts were accepted


def test_stop_conditions(model: LlamaModel) -> None:
    prompt = _chat(model, "Reply with one word: yes or no. Is the sky blue?")
    engine = Engine(model, KV_LIMIT)
    engine.add_request("eos", prompt, SamplingParams(max_tokens=16))
    events = _drain(engine)["eos"]
    assert events[-1].finish_reason == "stop" and len(events) < 16
    assert events[-1].token_id == model.tokenizer.eos_token_id
    first = events[0].token_id
    engine.add_request("stop", prompt, SamplingParams(max_tokens=5, stop_token_ids=(first,)))
    (event,) = _drain(engine)["stop"]
    assert event.finish_reason == "stop" and event.token_id == first
    engine.add_request("more", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    events = _drain(engine)["more"]
    assert len(events) == 4 and events[-1].finish_reason == "length"


def test_abort_and_validation(model: LlamaModel) -> None:
    engine = Engine(model, KV_LIMIT)
    prompt = _chat(model, "Hi")
    engine.add_request("a", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("b", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.stats().num_running == 2 and engine.pool.usage > 0
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("nope")
    assert [e.request_id for e in engine.step()] == ["b"]
    _drain(engine)
    assert engine.stats().kv.usage == 0.0
    engine.add_request("queued", prompt)
    assert engine.abort("queued") and not engine.has_unfinished_requests()

    with pytest.raises(ValueError, match="already exists"):
        engine.add_request("x", prompt)
        engine.add_request("x", prompt)
    engine.abort("x")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("y", [])
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("y", [model.config.vocab_size])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("y", [5] * model.max_model_len)
    with pytest.raises(ValueError, match="KV blocks"):
        Engine(model, 4 * engine.pool.layout.bytes_per_block).add_request("y", [5] * 100)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    engine.add_request("busy", prompt)
    with pytest.raises(RuntimeError, match="idle"):
        engine.generate(prompt)
