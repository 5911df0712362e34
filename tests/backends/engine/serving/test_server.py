"""The reference engine behind vLLM's OpenAI API, driven by the official ``openai`` client.

Every test serves the real model on a loopback socket (port 0) with the session's one loaded
model (``engine_model``), talks to it with ``openai`` (async, or sync in a worker thread so the
server's loop keeps running) or with raw aiohttp where the exact bytes or statuses matter.
Answers are greedy and short (<= 16 tokens) so that the suite stays quick on two cores.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

import aiohttp
import openai
import orjson
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import (
    ChatCompletionChunk,
    ChatCompletionMessageParam,
    ChatCompletionStreamOptionsParam,
)
from prometheus_client.parser import text_string_to_metric_families

from backends.engine import Engine, LlamaModel, RunningEngineServer, engine_command
from backends.engine.serving._detokenizer import IncrementalDetokenizer
from backends.engine.serving._openai import parse_generation_request
from backends.engine.serving._server import ENGINE_LOOP, ENGINE_METRICS
from backends.openai_wire import RequestError
from tests.fixtures_engine import serve_engine
from tests.utils import eventually, leave_stream_after

MODEL = "SmolLM2-135M-Instruct"


class Sampling(TypedDict):
    temperature: float
    max_tokens: int


QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
GREEDY: Sampling = {"temperature": 0, "max_tokens": 12}
# A long shared prefix (~300 tokens): what a second request, or a next turn, reuses.
SYSTEM = "You are a careful geography tutor. Answer in one short sentence. " + " ".join(
    f"Fact {i}: the river of region {i} flows north, its capital has {i + 3} bridges."
    for i in range(14)
)


def _client(server: RunningEngineServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)


async def _stream_chat(
    client: openai.AsyncOpenAI,
    messages: list[ChatCompletionMessageParam],
    *,
    max_tokens: int = GREEDY["max_tokens"],
    stop: list[str] | openai.Omit = openai.omit,
    stream_options: ChatCompletionStreamOptionsParam | openai.Omit = openai.omit,
) -> tuple[list[ChatCompletionChunk], str]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        temperature=GREEDY["temperature"],
        max_tokens=max_tokens,
        stop=stop,
        stream_options=stream_options,
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def _metric(server: RunningEngineServer, name: str, **labels: str) -> float:
    registry = server.app[ENGINE_METRICS].registry
    value = registry.get_sample_value(name, {"model_name": MODEL, "engine": "0", **labels})
    return 0.0 if value is None else value


async def test_chat_whole_and_streamed_agree_and_count_tokens(engine_model: LlamaModel) -> None:
    async with serve_engine(engine_model) as server:
        client = _client(server)
        whole = await client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
        chunks, text = await _stream_chat(client, QUESTION, stream_options={"include_usage": True})
        await client.close()
    content = whole.choices[0].message.content or ""
    assert "Paris" in content
    assert text == content
    usage = whole.usage
    assert usage is not None
    assert usage.prompt_tokens == len(engine_model.tokenizer.apply_chat_template(QUESTION))
    # The role chunk, one chunk per generated token, then the usage chunk.
    role, *tokens, last = chunks
    assert role.choices[0].delta.role == "assistant" and role.choices[0].delta.content == ""
    assert len(tokens) == usage.completion_tokens
    assert tokens[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in tokens[:-1])
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == usage.prompt_tokens
    assert last.usage.completion_tokens == usage.completion_tokens
    # A natural stop ends with <|im_end|>: a token without text, counted as vLLM counts it.
    assert tokens[-1].choices[0].delta.content == ""
    assert usage.completion_tokens == len(engine_model.tokenizer.encode(content)) + 1


async def test_wire_format_is_vllms(engine_model: LlamaModel) -> None:
    body = {"model": MODEL, "messages": QUESTION, "stream": True, **GREEDY, "max_tokens": 3}
    async with serve_engine(engine_model) as server, aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    docs = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert [d["object"] for d in docs] == ["chat.completion.chunk"] * 4
    assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert docs[-1]["choices"][0]["finish_reason"] == "length"
    assert "system_fingerprint" in docs[-1] and "usage" not in docs[-1]
    assert len({d["id"] for d in docs}) == 1 and docs[0]["id"].startswith("chatcmpl-")


async def test_sync_client_completions_from_text_and_token_ids(engine_model: LlamaModel) -> None:
    prompt = "The capital of France is"
    ids = engine_model.tokenizer.encode(prompt)

    def run(base_url: str) -> tuple[Any, Any, list[str]]:
        with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            by_text = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
            by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
            pieces = [
                c.choices[0].text
                for c in client.completions.create(
                    model=MODEL, prompt=prompt, stream=True, **GREEDY
                )
                if c.choices
            ]
            return by_text, by_ids, pieces

    async with serve_engine(engine_model) as server:
        by_text, by_ids, pieces = await asyncio.to_thread(run, server.base_url)
    assert by_text.choices[0].text == by_ids.choices[0].text == "".join(pieces)
    assert "Paris" in by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == len(pieces) == GREEDY["max_tokens"]
    assert by_text.choices[0].finish_reason == "length"


async def test_stop_strings_cut_the_text(engine_model: LlamaModel) -> None:
    async with serve_engine(engine_model) as server:
        client = _client(server)
        whole = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, stop=[" Paris"], **GREEDY
        )
        _, streamed = await _stream_chat(client, QUESTION, stop=[" Paris"])
        await client.close()
        # A stop string ends the request as vLLM counts it: finished by "stop", not aborted
        # (the engine is told to stop computing all the same).
        await eventually(lambda: server.app[ENGINE_LOOP].num_in_flight == 0, within_s=10)
        await eventually(lambda: not server.engine.has_unfinished_requests(), within_s=10)
        finished = "vllm:request_success_total"
        assert _metric(server, finished, finished_reason="stop") == 2
        assert _metric(server, finished, finished_reason="abort") == 0
        assert _metric(server, "vllm:e2e_request_latency_seconds_count") == 2
    content = whole.choices[0].message.content
    assert content == streamed and content is not None and "Paris" not in content
    assert whole.choices[0].finish_reason == "stop"
    assert whole.model_dump()["choices"][0]["stop_reason"] == " Paris"


async def test_prefix_cache_reports_cached_tokens_and_keeps_the_tokens(
    engine_model: LlamaModel,
) -> None:
    turns: list[list[ChatCompletionMessageParam]] = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        for question in ("Which river flows north?", "How many bridges in region 2?")
    ]
    results: dict[bool, list[tuple[str, int]]] = {}
    for caching in (True, False):
        async with serve_engine(engine_model, enable_prefix_caching=caching) as server:
            client = _client(server)
            answers = []
            for messages in turns:
                reply = await client.chat.completions.create(
                    model=MODEL, messages=messages, **GREEDY
                )
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                cached = reply.usage.prompt_tokens_details.cached_tokens
                assert cached is not None
                answers.append((reply.choices[0].message.content or "", cached))
            await client.close()
            results[caching] = answers
    (_, first), (_, second) = results[True]
    assert first == 0
    assert second > 200 and second % 16 == 0
    assert [cached for _, cached in results[False]] == [0, 0]
    assert [text for text, _ in results[True]] == [text for text, _ in results[False]]


async def test_a_cache_salt_keeps_one_tenants_prefix_cache_from_anothers(
    engine_model: LlamaModel,
) -> None:
    """vLLM's ``cache_salt``: requests share cached blocks only under the same salt, so one
    tenant cannot learn from the time to first token what another's prompts began with.
    The engine took the field and ignored it: every tenant shared one cache."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which river?"}]

    async def cached(client: openai.AsyncOpenAI, salt: str | None) -> int:
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        reply = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, **extra)  # type: ignore[call-overload]
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    async with serve_engine(engine_model) as server:
        client = _client(server)
        seen = [await cached(client, salt) for salt in ("tenant-a", "tenant-b", "tenant-a",
                                                       None, "tenant-b")]
        for bad in ("", 7):
            with pytest.raises(openai.BadRequestError, match="cache_salt"):
                await cached(client, bad)  # type: ignore[arg-type]
        await client.close()
    assert seen[0] == seen[1] == seen[3] == 0  # each salt (and none) starts cold
    assert seen[2] > 0 and seen[4] > 0  # and reuses its own blocks
    # A decode node's prompt blocks come from a prefill node whose cache every tenant
    # shares: it refuses the salt rather than take it and isolate nothing.
    async with serve_engine(engine_model, role="decode") as decode:
        client = _client(decode)
        with pytest.raises(openai.BadRequestError, match="disaggregated"):
            await cached(client, "tenant-a")
        await client.close()


async def test_concurrent_requests_match_solo_answers(engine_model: LlamaModel) -> None:
    questions = [
        "What is the capital of France?",
        "Name three colours.",
        "What is 12 times 12?",
        "Write a haiku about the sea.",
    ]
    conversations: list[list[ChatCompletionMessageParam]] = [
        [{"role": "user", "content": q}] for q in questions
    ]
    async with serve_engine(engine_model, enable_prefix_caching=False) as server:
        client = _client(server)
        solo = [(await _stream_chat(client, c, max_tokens=8))[1] for c in conversations]
        together = await asyncio.gather(
            *(_stream_chat(client, c, max_tokens=8) for c in conversations)
        )
        await client.close()
        assert _metric(server, "vllm:num_requests_running") == 0
    assert [text for _, text in together] == solo
    assert all(solo)


async def test_client_disconnect_aborts_the_request(engine_model: LlamaModel) -> None:
    async with serve_engine(engine_model) as server:
        client = _client(server)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            stream=True,
            temperature=0,
            max_tokens=400,
            extra_body={"ignore_eos": True},
        )
        await leave_stream_after(stream, 3)
        await client.close()
        await eventually(lambda: not server.engine.has_unfinished_requests(), within_s=10)
        assert _metric(server, "vllm:request_success_total", finished_reason="abort") == 1
        # A non-streamed request whose client gives up is aborted too.
        body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 400,
                "ignore_eos": True}  # fmt: skip
        async with aiohttp.ClientSession() as session:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):
                    await session.post(server.base_url + "/chat/completions", json=body)
        await eventually(lambda: not server.engine.has_unfinished_requests(), within_s=10)
        assert _metric(server, "vllm:request_success_total", finished_reason="abort") == 2
        assert server.app[ENGINE_LOOP].num_in_flight == 0


BAD_BODIES: list[tuple[str, Any, int]] = [
    ("not a dict", [1, 2], 400),
    ("no messages", {"model": MODEL}, 400),
    ("messages not a list", {"messages": "hi"}, 400),
    ("empty messages", {"messages": []}, 400),
    ("message without role", {"messages": [{"content": "hi"}]}, 400),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("content a number", {"messages": [{"role": "user", "content": 3}]}, 400),
    ("temperature a string", {"messages": QUESTION, "temperature": "hot"}, 400),
    ("negative temperature", {"messages": QUESTION, "temperature": -1}, 400),
    ("top_p zero", {"messages": QUESTION, "top_p": 0}, 400),
    ("top_k negative", {"messages": QUESTION, "top_k": -5}, 400),
    ("max_tokens zero", {"messages": QUESTION, "max_tokens": 0}, 400),
    ("max_tokens huge", {"messages": QUESTION, "max_tokens": 10**9}, 400),
    ("max_tokens a float", {"messages": QUESTION, "max_tokens": 1.5}, 400),
    ("n two", {"messages": QUESTION, "n": 2}, 400),
    ("logprobs", {"messages": QUESTION, "logprobs": True}, 400),
    ("stream_options without stream", {"messages": QUESTION, "stream_options": {"a": 1}}, 400),
    ("stop a number", {"messages": QUESTION, "stop": 5}, 400),
    ("stream not a bool", {"messages": QUESTION, "stream": "yes"}, 400),
    ("unknown model", {"model": "gpt-9", "messages": QUESTION}, 404),
]
BAD_COMPLETIONS: list[tuple[str, Any, int]] = [
    ("no prompt", {"model": MODEL}, 400),
    ("empty prompt", {"prompt": ""}, 400),
    ("token id out of vocabulary", {"prompt": [1, 10**9]}, 400),
    ("two prompts", {"prompt": ["a", "b"]}, 400),
    ("prompt a dict", {"prompt": {"text": "a"}}, 400),
    ("prompt too long", {"prompt": [1] * 100_000}, 400),
    ("echo", {"prompt": "a", "echo": True}, 400),
]


async def test_bad_requests_answer_vllm_style_errors(engine_model: LlamaModel) -> None:
    async with serve_engine(engine_model) as server, aiohttp.ClientSession() as session:
        cases = [("/chat/completions", *case) for case in BAD_BODIES] + [
            ("/completions", *case) for case in BAD_COMPLETIONS
        ]
        for route, name, body, status in cases:
            async with session.post(server.base_url + route, json=body) as resp:
                assert resp.status == status, name
                error = (await resp.json())["error"]
                assert error["code"] == status and error["message"], name
        async with session.post(server.base_url + "/chat/completions", data=b"{bad") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "Bad Request"
        async with session.get(server.base_url + "/nothing") as resp:
            assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
        assert not server.engine.has_unfinished_requests()
    async with serve_engine(engine_model) as server:
        client = _client(server)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
        await client.close()


async def test_a_full_server_refuses_with_503(engine_model: LlamaModel) -> None:
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with serve_engine(engine_model, max_num_seqs=1, max_waiting_requests=0) as server, \
            aiohttp.ClientSession() as session:  # fmt: skip
        async with session.post(server.base_url + "/chat/completions", json=body) as busy:
            await busy.content.readline()  # the request is in flight
            async with session.post(server.base_url + "/chat/completions", json=body) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == 503
        refused = "understudy_engine_requests_refused_total"
        assert _metric(server, refused, reason="overloaded") == 1
        await eventually(lambda: not server.engine.has_unfinished_requests(), within_s=10)


async def test_models_health_and_metrics(engine_model: LlamaModel) -> None:
    async with serve_engine(engine_model) as server, aiohttp.ClientSession() as session:
        client = _client(server)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert models.data[0].model_dump()["max_model_len"] == server.max_model_len
        reply = await client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
        await client.close()
        async with session.get(server.root_url + "/health") as resp:
            assert resp.status == 200
        async with session.get(server.root_url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    names = {family.name for family in text_string_to_metric_families(text)}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
                 "prompt_tokens", "generation_tokens"):  # fmt: skip
        assert f"vllm:{name}" in names
    assert reply.usage is not None
    assert _metric(server, "vllm:generation_tokens_total") == reply.usage.completion_tokens
    assert _metric(server, "vllm:prompt_tokens_total") == reply.usage.prompt_tokens
    assert _metric(server, "vllm:prefix_cache_queries_total") == reply.usage.prompt_tokens
    assert _metric(server, "vllm:time_to_first_token_seconds_count") == 1
    assert _metric(server, "vllm:request_success_total", finished_reason="stop") == 1


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | _JSON},
        optional={"content": st.text(max_size=40) | _JSON},
    ),
    max_size=3,
)
_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream",
           "stream_options", "n", "logprobs", "echo", "add_generation_prompt"]  # fmt: skip
_BODIES = st.dictionaries(
    st.sampled_from(_FIELDS),
    _JSON | _MESSAGES | st.lists(st.integers(-5, 60_000), min_size=1, max_size=6),
    max_size=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_BODIES | _JSON, kind=st.sampled_from(["chat", "completion"]))
def test_any_body_is_accepted_by_the_engine_or_refused_with_a_4xx(
    engine_model: LlamaModel, body: Any, kind: Any
) -> None:
    engine = Engine(engine_model, 8 << 20)
    max_model_len = engine.pool.num_blocks * engine.block_size
    try:
        parsed = parse_generation_request(
            kind, body, tokenizer=engine_model.tokenizer, served_model=MODEL,
            max_model_len=max_model_len,
        )  # fmt: skip
    except RequestError as exc:
        assert 400 <= exc.status < 500 and exc.body()["error"]["message"]
        return
    engine.add_request("fuzz", parsed.prompt_ids, parsed.params)  # never a ValueError
    assert len(parsed.prompt_ids) + parsed.params.max_tokens <= max_model_len


def test_incremental_detokenizer_prints_multibyte_text_whole(engine_model: LlamaModel) -> None:
    tokenizer = engine_model.tokenizer
    text = "Café naïve — 日本語のテキスト 🙂👍 done"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some tokens split a character
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(i, last=n == len(ids) - 1).text for n, i in enumerate(ids)]
    assert "".join(pieces) == text == detokenizer.text
    assert not any("\ufffd" in piece for piece in pieces)
    # A stop string is cut out, and text that may start one is held back until it cannot.
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["テキスト"])
    pieces = []
    for i in ids:
        piece = detokenizer.push(i)
        pieces.append(piece.text)
        if piece.stop is not None:
            break
    assert piece.stop == "テキスト"
    assert "".join(pieces) == "Café naïve — 日本語の"


def test_cli_help_and_validation() -> None:
    runner = CliRunner()
    result = runner.invoke(engine_command, ["--help"])
    assert result.exit_code == 0
    for option in ("--role", "--port", "--host", "--kv-gib", "--no-prefix-caching"):
        assert option in result.output
    result = runner.invoke(engine_command, ["--role", "encode"])
    assert result.exit_code == 2
    result = runner.invoke(engine_command, ["--kv-gib", "0"])  # fails before loading the model
    assert result.exit_code == 2 and "kv_limit_bytes" in result.output


async def test_an_idle_engine_names_its_kv_codec_and_its_bytes_in_metrics(
    engine_model: LlamaModel,
) -> None:
    """A user comparing candidates reads which codec each engine serves and what a token of
    its KV costs.  understudy_kv_bytes_per_token (and the decoded cache's bound) read 0 until
    the engine's first step, so an engine not yet sent traffic looked free of KV."""
    async with serve_engine(engine_model, kv_codec="fp8") as server:
        size = server.engine.pool.bytes_per_token
        assert size > 0 and _metric(server, "understudy_kv_bytes_per_token") == size
        assert _metric(server, "understudy_kv_decoded_cache_capacity_bytes") > 0
        assert _metric(server, "understudy_engine_kv_codec_info", codec="fp8", plan="") == 1
