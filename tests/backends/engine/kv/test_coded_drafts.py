"""Prompt-lookup drafts under a KV codec (``Engine`` rule 8): a greedy answer has the tokens and
log-probabilities of plain one-token decoding, in fewer steps, and no draft completes a block.

The prompt repeats the alphabet, so drafts match often; the answer crosses block boundaries, so
drafts run up to a block's last position and a step whose real row completes a block carries
drafts into the next one.
"""

from __future__ import annotations

import pytest

from backends.engine import Engine, LlamaModel, SamplingParams
from backends.engine.kv._blockpool import BlockHash, hash_blocks
from backends.engine.kv._plan import KVPlan
from backends.engine.kv.codecs._calibration_cache import Calibration, cached_calibration
from backends.engine.model._attention import MIN_GEMM_ROWS

KV_LIMIT = 64 << 20
BS = 16
# Two prompts: the alphabet, which every codec goes on with (drafts accepted), and a repeated
# sentence, which some codecs answer with prose of their own (drafts proposed and rejected, also
# at a block's end: where the rule is needed).
PROMPT_TEXTS = (
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2 + "a b c",
    "The quick brown fox jumps over the lazy dog. " * 4 + "The quick brown",
)
TOKENS = 40


@pytest.fixture(scope="module")
def calibration(engine_model: LlamaModel) -> Calibration:
    return cached_calibration(engine_model)


def _answer(engine: Engine, prompt: list[int]) -> tuple[list[tuple[int, float]], int]:
    """The greedy answer's (token, logprob) pairs and the steps it took."""
    engine.add_request("r", prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    out: list[tuple[int, float]] = []
    steps = 0
    while engine.has_unfinished_requests():
        out += [(e.token_id, e.logprob) for e in engine.step()]
        steps += 1
    return out, steps


@pytest.mark.parametrize("name", ["e8-2", "kivi-2", "e8-2w", "e8-2+w32"])
def test_drafts_under_a_codec_change_nothing_but_the_step_count(
    engine_model: LlamaModel,
    calibration: Calibration,
    name: str,
) -> None:
    layers = engine_model.config.num_layers
    codec: str | KVPlan = name
    if name == "e8-2+w32":
        codec = KVPlan.uniform("e8-2", layers, window_tokens=32)

    def engine(speculative_tokens: int) -> Engine:
        return Engine(
            engine_model,
            KV_LIMIT,
            kv_codec=codec,
            kv_calibration=calibration,
            max_num_seqs=4,
            speculative_tokens=speculative_tokens,
        )

    saved = 0
    for text in PROMPT_TEXTS:
        prompt = engine_model.tokenizer.encode(text)
        plain_engine, drafted_engine = engine(0), engine(MIN_GEMM_ROWS - 1)  # the default
        plain, plain_steps = _answer(plain_engine, prompt)
        answer, steps = _answer(drafted_engine, prompt)
        assert answer == plain
        assert plain_steps == TOKENS
        saved += TOKENS - steps
        # Every complete block holds the same codes (and window rows) in both: a rejected draft
        # that had sealed a block would have left other codes there.
        tokens = [*prompt, *(token for token, _ in answer)][: len(prompt) + TOKENS - 1]
        hashes = hash_blocks(plain_engine.pool.seed, tokens, BS)
        assert len(hashes) == len(tokens) // BS > len(prompt) // BS + 1
        assert len(_packed(plain_engine, hashes)) == len(hashes)
        assert _packed(drafted_engine, hashes) == _packed(plain_engine, hashes)
    assert saved > 4  # drafts were accepted


def _packed(engine: Engine, hashes: list[BlockHash]) -> list[bytes]:
    """The packed bytes of the engine's cached blocks with these hashes."""
    blocks = engine.pool.export_blocks(engine.pool.lookup(hashes))
    return [block.data.tobytes() for block in blocks]
