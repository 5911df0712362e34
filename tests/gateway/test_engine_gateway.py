"""The gateway in front of reference engines: recompute every turn vs reuse the history.

The primary runs without prefix caching (every turn's whole history is computed again); the
candidate is an engine with prefix caching, or a router over a prefill and a decode node that
hand the history's KV back and forth (bidirectional KV): either computes only what the previous
turn did not.  Both serve the same
weights greedily, so their answers must be equal; the candidate's time to first token on later
turns must be lower -- with a ~400-token system prompt the gap is several-fold, far above the
noise of a shared two-core machine.
"""

from __future__ import annotations

from collections.abc import Callable

import openai
from openai.types.chat import ChatCompletionMessageParam

from backends.engine import LlamaModel
from evaluators import Exchange
from tests.fixtures_engine import serve_disaggregated, serve_engine
from tests.utils import RunningGateway, eventually, run_gateway

MODEL = "SmolLM2-135M-Instruct"
KV_LIMIT_BYTES = 256 << 20
SYSTEM = " ".join(
    [
        "You are the help desk of the city library. Answer in one short sentence.",
        *(
            f"Rule {i}: the reading room on floor {i % 4 + 1} opens at {7 + i % 5} o'clock, "
            f"shelf {i * 3} holds books on topic {i}, and a member may borrow {i % 6 + 2} "
            "items from it for three weeks."
            for i in range(12)
        ),
    ]
)
QUESTIONS = [
    "When does the reading room on floor 2 open?",
    "How many items may I borrow from shelf 9?",
    "Which shelf holds books on topic 5?",
]


def _joined(gw: RunningGateway, count: int) -> Callable[[], bool]:
    return lambda: len(gw.sink) >= count


async def _converse(primary_url: str, candidate_url: str) -> tuple[list[str], list[Exchange]]:
    """Three turns through a gateway mirroring every request to the candidate."""
    async with run_gateway(
        primary_url, candidates=[{"name": "candidate", "url": candidate_url}]
    ) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
        answers = []
        for turn, question in enumerate(QUESTIONS, start=1):
            messages.append({"role": "user", "content": question})
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, stream=True, temperature=0,
                max_tokens=12, extra_headers={"X-Session-Id": "library-visitor"},
            )  # fmt: skip
            answer = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            answers.append(answer)
            messages.append({"role": "assistant", "content": answer})
            # One turn at a time: the next starts once the candidate answered this one.
            await eventually(_joined(gw, turn), within_s=300)
        await client.close()
        return answers, gw.sink.snapshot()


def _check_later_turns_faster(answers: list[str], exchanges: list[Exchange]) -> list[float]:
    """Equal answers every turn; on turns 2+, the candidate reused the history and answered
    first.  The TTFT ratios of turns 2+."""
    assert all(answers)
    ratios = []
    for turn, exchange in enumerate(exchanges, start=1):
        p, c = exchange.primary, exchange.candidate_observation
        assert p.ok and c.ok and p.streamed and c.streamed
        assert p.text == c.text == answers[turn - 1]
        assert p.usage is not None and c.usage is not None
        assert p.usage.prompt_tokens == c.usage.prompt_tokens
        assert p.usage.prompt_tokens is not None and p.usage.prompt_tokens >= 400
        assert p.usage.cached_tokens == 0
        assert p.ttft_s is not None and c.ttft_s is not None
        if turn > 1:
            # The candidate reused all full blocks of the history it computed last turn.
            assert c.usage.cached_tokens is not None and c.usage.cached_tokens >= 400
            assert c.usage.cached_tokens % 16 == 0
            assert c.ttft_s < p.ttft_s
            ratios.append(c.ttft_s / p.ttft_s)
    return ratios


async def test_prefix_reuse_keeps_answers_and_cuts_ttft(engine_model: LlamaModel) -> None:
    assert len(engine_model.tokenizer.encode(SYSTEM)) >= 350
    async with serve_engine(
        engine_model, enable_prefix_caching=False, kv_limit_bytes=KV_LIMIT_BYTES
    ) as primary, serve_engine(
        engine_model, enable_prefix_caching=True, kv_limit_bytes=KV_LIMIT_BYTES
    ) as candidate:  # fmt: skip
        answers, exchanges = await _converse(primary.root_url, candidate.root_url)
    ratios = _check_later_turns_faster(answers, exchanges)
    print(f"candidate/primary TTFT on turns 2-3: {[round(r, 3) for r in ratios]}")


async def test_disaggregated_bidirectional_kv_keeps_answers_and_cuts_ttft(
    engine_model: LlamaModel,
) -> None:
    async with serve_engine(
        engine_model, enable_prefix_caching=False, kv_limit_bytes=KV_LIMIT_BYTES
    ) as primary, serve_disaggregated(
        engine_model, node={"kv_limit_bytes": KV_LIMIT_BYTES}
    ) as candidate:  # fmt: skip
        answers, exchanges = await _converse(primary.root_url, candidate.router.root_url)
    ratios = _check_later_turns_faster(answers, exchanges)
    print(f"disaggregated/primary TTFT on turns 2-3: {[round(r, 3) for r in ratios]}")
