"""The simulator speaks vLLM's OpenAI protocol: shapes, usage, lengths, determinism.

Every test serves a real app on a loopback socket (`running_sim`, port 0) and drives it
with the official `openai` client (async, or sync in a worker thread so the server's
loop keeps running) or with raw aiohttp where the exact bytes matter.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections import deque
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from pydantic import ValidationError

import backends.sim
from backends.sim import (
    SIM_STATS,
    RecordedRequest,
    RunningSim,
    SimConfig,
    SimStats,
    build_app,
    running_sim,
)

FAST: dict[str, Any] = {"port": 0, "ttft_ms": 2.0, "itl_ms": 1.0, "tokens": 8}
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


def fast(**overrides: Any) -> SimConfig:
    return SimConfig(**{**FAST, **overrides})


def client(sim: RunningSim, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.base_url, api_key="sk-test", max_retries=0, **kwargs)


async def raw_sse(sim: RunningSim, path: str, body: dict[str, Any]) -> list[bytes]:
    """The `data:` payloads of one streamed answer before `[DONE]`, exactly as sent."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim.root_url + path, json=body) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert all(event.startswith(b"data: ") for event in events[:-1])
    return [event.removeprefix(b"data: ") for event in events[:-2]]


def test_config_is_validated_and_frozen() -> None:
    config = SimConfig()
    assert (config.host, config.port, config.model) == ("127.0.0.1", 8100, "sim-model")
    assert config.cached_tokens is None and config.fault == "none"
    with pytest.raises(ValidationError):
        SimConfig(fault_rate=1.5)
    with pytest.raises(ValidationError):
        SimConfig(fault="explode")
    with pytest.raises(ValidationError):
        SimConfig(tokens=0)
    with pytest.raises(ValidationError):
        config.port = 1  # type: ignore[misc]


async def test_chat_non_streamed_shape() -> None:
    async with running_sim(fast()) as sim, client(sim) as api:
        answer = await api.chat.completions.create(model="sim-model", messages=MESSAGES)
    assert answer.object == "chat.completion"
    assert answer.id.startswith("chatcmpl-")
    assert answer.model == "sim-model"
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    assert len(choice.message.content.split()) == 8
    assert answer.usage is not None
    # 3 + 6 words, 4 template tokens per message.
    assert answer.usage.prompt_tokens == 9 + 2 * 4
    # 8 words and the end-of-sequence token, which vLLM counts too.
    assert answer.usage.completion_tokens == 9
    assert answer.usage.total_tokens == 26
    assert answer.usage.prompt_tokens_details is None
    assert answer.system_fingerprint is not None
    assert answer.system_fingerprint.startswith("vllm-0.32.0-")


async def test_chat_stream_without_usage_matches_vllm_wire_format() -> None:
    body = {"model": "sim-model", "messages": MESSAGES, "stream": True}
    async with running_sim(fast(tokens=3)) as sim:
        events = [orjson.loads(event) for event in await raw_sse(sim, "/v1/chat/completions", body)]
    # The role chunk, three words, and the end-of-sequence token that carries the finish.
    assert len(events) == 1 + 3 + 1
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    assert len({event["id"] for event in events}) == 1
    assert all("usage" not in event for event in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [event["choices"][0]["finish_reason"] for event in events]
    assert finishes == [None, None, None, None, "stop"]
    contents = [event["choices"][0]["delta"]["content"] for event in events[1:]]
    assert contents[0] and not contents[0].startswith(" ")
    assert all(token.startswith(" ") for token in contents[1:3])
    assert contents[3] == ""
    assert [("system_fingerprint" in event) for event in events] == [False] * 4 + [True]


async def test_chat_stream_with_usage_and_cached_tokens() -> None:
    async with running_sim(fast(cached_tokens=5)) as sim, client(sim) as api:
        stream = await api.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        whole = await api.chat.completions.create(model="sim-model", messages=MESSAGES)
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 9
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 5
    assert all(chunk.usage is None for chunk in chunks[:-1])
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:-1])
    assert streamed == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 5


async def test_usage_chunk_omits_unknown_cached_tokens() -> None:
    body = {
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with running_sim(fast()) as sim:
        events = await raw_sse(sim, "/v1/chat/completions", body)
    usage = orjson.loads(events[-1])
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 17, "total_tokens": 26, "completion_tokens": 9}
    assert usage["system_fingerprint"].startswith("vllm-")


@pytest.mark.parametrize("limit_field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_caps_the_answer(limit_field: str) -> None:
    three: dict[str, Any] = {limit_field: 3}
    eight: dict[str, Any] = {limit_field: 8}
    nine: dict[str, Any] = {limit_field: 9}
    async with running_sim(fast()) as sim, client(sim) as api:
        full = await api.chat.completions.create(model="sim-model", messages=MESSAGES)
        capped = await api.chat.completions.create(model="sim-model", messages=MESSAGES, **three)
        stream = await api.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True, **three
        )
        chunks = [chunk async for chunk in stream]
        # Eight words fit, the end-of-sequence token does not: vLLM says "length".
        words_only = await api.chat.completions.create(
            model="sim-model", messages=MESSAGES, **eight
        )
        with_eos = await api.chat.completions.create(model="sim-model", messages=MESSAGES, **nine)
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage is not None and capped.usage.completion_tokens == 3
    full_text = full.choices[0].message.content
    capped_text = capped.choices[0].message.content
    assert full_text is not None and capped_text is not None
    assert full_text.startswith(capped_text)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == capped_text
    assert words_only.choices[0].finish_reason == "length"
    assert words_only.choices[0].message.content == full_text
    assert with_eos.choices[0].finish_reason == "stop"
    assert with_eos.usage is not None and with_eos.usage.completion_tokens == 9


async def test_completions_sync_client_streamed_and_not() -> None:
    async with running_sim(fast(tokens=32)) as sim:

        def call() -> tuple[openai.types.Completion, list[openai.types.Completion]]:
            with openai.OpenAI(base_url=sim.base_url, api_key="k", max_retries=0) as api:
                whole = api.completions.create(model="sim-model", prompt="Once upon a time")
                stream = api.completions.create(
                    model="sim-model",
                    prompt="Once upon a time",
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                return whole, list(stream)

        whole, chunks = await asyncio.to_thread(call)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    # vLLM's completions default max_tokens is 16.
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 16)
    assert [chunk.choices[0].finish_reason for chunk in chunks[:-1]] == [None] * 3 + ["length"]
    streamed = "".join(chunk.choices[0].text for chunk in chunks[:-1])
    assert whole.choices[0].text.startswith(streamed)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


async def test_text_is_deterministic_per_prompt_variant_and_seed() -> None:
    async def text(api: openai.AsyncOpenAI, messages: list[Any] = MESSAGES, **extra: Any) -> str:
        answer = await api.chat.completions.create(model="sim-model", messages=messages, **extra)
        content = answer.choices[0].message.content
        assert isinstance(content, str)
        return content

    async with (
        running_sim(fast(tokens=16)) as a,
        running_sim(fast(tokens=16)) as a2,
        running_sim(fast(tokens=16, variant="b")) as b,
        client(a) as api_a,
        client(a2) as api_a2,
        client(b) as api_b,
    ):
        base = await text(api_a)
        assert base == await text(api_a) == await text(api_a2)
        assert base != await text(api_b)
        fingerprints = set()
        for api in (api_a, api_a2, api_b):
            answer = await api.chat.completions.create(model="sim-model", messages=MESSAGES)
            fingerprints.add(answer.system_fingerprint)
        assert len(fingerprints) == 2
        other = [{"role": "user", "content": "Something else entirely"}]
        assert base != await text(api_a, messages=other)
        assert await text(api_a, seed=7) == await text(api_a2, seed=7) != base
        assert await text(api_a, temperature=0.0) == base
        sampled = {await text(api_a, temperature=0.8) for _ in range(3)}
        assert len(sampled) == 3


async def test_embeddings_are_deterministic_unit_vectors() -> None:
    async with running_sim(fast()) as sim, client(sim) as api:
        # The openai client asks for base64 by default and decodes it.
        answer = await api.embeddings.create(model="sim-model", input=["hello world", "bye"])
        again = await api.embeddings.create(
            model="sim-model", input="hello world", encoding_format="float"
        )
        async with aiohttp.ClientSession() as session:
            body = {"input": "bye", "encoding_format": "base64"}
            async with session.post(sim.base_url + "/embeddings", json=body) as resp:
                raw = await resp.json()
    assert answer.object == "list" and len(answer.data) == 2
    first = answer.data[0].embedding
    assert len(first) == 384
    assert math.isclose(math.fsum(value * value for value in first), 1.0, rel_tol=1e-5)
    assert first == pytest.approx(again.data[0].embedding, abs=1e-6)
    assert first != pytest.approx(answer.data[1].embedding, abs=1e-3)
    decoded = struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(decoded) == pytest.approx(answer.data[1].embedding, abs=1e-6)
    assert answer.usage.prompt_tokens == 3 and raw["id"].startswith("embd-")


async def test_models_and_health() -> None:
    async with running_sim(fast(model="org/tiny")) as sim, client(sim) as api:
        models = [model async for model in api.models.list()]
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.root_url + "/health") as resp:
                assert resp.status == 200 and await resp.read() == b""
            async with session.get(sim.base_url + "/models") as resp:
                raw = await resp.json()
    assert [model.id for model in models] == ["org/tiny"]
    assert raw["object"] == "list"
    assert raw["data"][0]["owned_by"] == "vllm" and raw["data"][0]["max_model_len"] == 8192


@pytest.mark.parametrize(
    ("payload", "err_type", "param", "fragment"),
    [
        (b'{"messages": [', "Bad Request", "body.14", "json_invalid"),
        (b"[1, 2]", "Bad Request", "body", "model_attributes_type"),
        (b'{"model": "sim-model"}', "Bad Request", "body.messages", "Field required"),
        (b'{"messages": [{"content": "x"}]}', "Bad Request", "body.messages.0.role", "missing"),
        (b'{"messages": []}', "BadRequestError", None, "empty conversation"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            "BadRequestError",
            "max_tokens",
            "max_tokens must be at least 1, got 0.",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"stream_options": {"include_usage": true}}',
            "BadRequestError",
            "stream_options",
            "only be defined when `stream=True`",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}',
            "BadRequestError",
            "max_tokens",
            "cannot be greater than max_model_len=8192",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "n": 2}',
            "BadRequestError",
            "n",
            "one choice",
        ),
    ],
)
async def test_bad_requests_get_vllm_error_bodies(
    payload: bytes, err_type: str, param: str | None, fragment: str
) -> None:
    async with running_sim(fast()) as sim, aiohttp.ClientSession() as session:
        url = sim.base_url + "/chat/completions"
        headers = {"Content-Type": "application/json"}
        async with session.post(url, data=payload, headers=headers) as resp:
            assert resp.status == 400
            assert resp.headers["Content-Type"] == "application/json"
            body = await resp.json()
        stats = sim.stats
        assert (stats.rejected, stats.started, stats.requests_seen) == (1, 0, 1)
    error = body["error"]
    assert body == {"error": {**error, "type": err_type, "param": param, "code": 400}}
    assert fragment in error["message"]


async def test_long_prompts_and_context_caps() -> None:
    async with running_sim(fast(max_model_len=20, tokens=50)) as sim, client(sim) as api:
        # 9 prompt tokens leave 11 for the answer: silently shortened, as vLLM does.
        short = await api.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "a b c d e"}], max_tokens=15
        )
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "w " * 16}]
            )
    assert short.usage is not None and short.usage.completion_tokens == 11
    assert short.choices[0].finish_reason == "length"
    assert "maximum context length is 20 tokens" in str(caught.value)


async def test_continuous_usage_stats_put_usage_on_every_chunk() -> None:
    body = {
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with running_sim(fast()) as sim:
        events = [orjson.loads(e) for e in await raw_sse(sim, "/v1/chat/completions", body)]
    assert [event["usage"]["completion_tokens"] for event in events] == [0, 1, 2, 2]
    assert events[-1]["choices"] == []


async def test_unknown_model_is_404_not_found() -> None:
    async with running_sim(fast()) as sim, client(sim) as api:
        with pytest.raises(openai.NotFoundError) as caught:
            await api.chat.completions.create(model="gpt-4", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError):
            await api.completions.create(model="sim-model", prompt=["one", "two"])
    assert "The model `gpt-4` does not exist. Valid aliases: sim-model." in str(caught.value)


async def test_headers_and_bodies_are_recorded_and_request_id_is_honoured() -> None:
    async with running_sim(fast()) as sim:
        api = client(sim, default_headers={"X-Tenant": "blue"})
        async with api:
            answer = await api.chat.completions.create(
                model="sim-model",
                messages=MESSAGES,
                extra_headers={"X-Request-Id": "abc123"},
            )
        recorded = sim.stats.requests[-1]
    assert answer.id == "chatcmpl-abc123"
    assert (recorded.method, recorded.path) == ("POST", "/v1/chat/completions")
    assert recorded.headers["authorization"] == "Bearer sk-test"
    assert recorded.headers["x-tenant"] == "blue"
    assert isinstance(recorded.body, dict) and recorded.body["messages"] == MESSAGES


async def test_request_record_is_bounded() -> None:
    assert build_app(fast())[SIM_STATS].requests.maxlen == backends.sim.MAX_RECORDED_REQUESTS
    stats = SimStats(requests=deque(maxlen=2))
    for index in range(3):
        stats.record(RecordedRequest.capture("POST", "/v1/completions", {"X-N": str(index)}, None))
    assert [request.headers["x-n"] for request in stats.requests] == ["1", "2"]
    assert (stats.requests_seen, stats.requests_evicted) == (3, 1)


async def test_version_is_the_simulated_vllm_release() -> None:
    async with running_sim(fast()) as sim, aiohttp.ClientSession() as session:
        async with session.get(sim.root_url + "/version") as resp:
            assert await resp.json() == {"version": "0.32.0"}
