"""Bad input to the backends' own HTTP servers (the simulator, the engine, the router) gets a
clear 4xx error body, as vLLM words it, never a 500 or a traceback in the log.

Each case was a 500 once; each test serves a real app on a loopback socket and sends the
exact bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from backends.engine import LlamaModel
from backends.engine.model._tokenizer import ChatTokenizer
from backends.engine.serving._openai import parse_generation_request
from backends.openai_wire import RequestError, ServedModel, install_openai_app, serve_app
from backends.sim import SimConfig, running_sim
from tests.fixtures_engine import serve_disaggregated, serve_engine
from tests.utils import eventually, waiting_in

CHAT = "/v1/chat/completions"
# "é" as one code point: its bytes differ in every encoding.
COMPLETION = '{"prompt": "Caf\u00e9 au lait is", "max_tokens": 2, "temperature": 0}'
COMPLETIONS = "/v1/completions"
PREFILL_ROUTE = "/kv/v1/prefill"  # a prefill node's route for the router
# FastAPI's answer to a body its JSON parser raises on without a syntax error.
NOT_PARSED = {
    "error": {
        "message": "There was an error parsing the body",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
}


def sim_config() -> SimConfig:
    return SimConfig(port=0, ttft_ms=1.0, itl_ms=1.0, tokens=4, model="sim-model")


async def post_raw(root: str, path: str, payload: bytes) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(root + path, data=payload, headers=headers) as resp:
            return resp.status, await resp.json()


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages of the records logged with a traceback."""
    return [record.getMessage() for record in caplog.records if record.exc_info]


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(nested(100_000), id="nested-past-the-recursion-limit"),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "x"}], "x": ' + nested(5_000) + b"}",
            id="nested-field",
        ),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": '
            + b"9" * 5_000
            + b"}",
            id="integer-past-the-digit-limit",
        ),
        # Starlette hands FastAPI's parser the bytes; bytes that are not UTF-8 raise
        # UnicodeDecodeError there, not a JSON error (the engine answered orjson's words).
        pytest.param(
            b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', id="invalid-utf-8"
        ),
        pytest.param(b"\xff\xfe{\x00\"", id="truncated-utf-16"),
    ],
)
async def test_a_body_the_parser_raises_on_is_a_400(
    payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with running_sim(sim_config()) as sim:
        assert await post_raw(sim.root_url, CHAT, payload) == (400, NOT_PARSED)
    assert no_tracebacks(caplog) == []


# orjson writes at most 254 levels: deeper bodies were read, then a 500 where a server wrote
# them again (the simulator's answer digest of the messages, the router's forwarded body).
DEEP_MESSAGE = (
    b'{"messages": [{"role": "user", "content": "x", "x": ' + nested(300) + b"}]}"
)
DEEP_FIELD = b'{"messages": [{"role": "user", "content": "x"}], "x": ' + nested(300) + b"}"
SHALLOW_ENOUGH = b'{"messages": [{"role": "user", "content": "x"}], "x": ' + nested(253) + b"}"


async def test_the_simulator_refuses_a_body_nested_too_deep_to_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    async with running_sim(sim_config()) as sim:
        assert await post_raw(sim.root_url, CHAT, DEEP_MESSAGE) == (400, NOT_PARSED)
        status, _ = await post_raw(sim.root_url, CHAT, SHALLOW_ENOUGH)
        assert status == 200
    assert no_tracebacks(caplog) == []


async def test_the_router_refuses_a_body_nested_too_deep_to_forward(
    engine_model: LlamaModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with serve_disaggregated(engine_model) as cluster:
        root = cluster.router.root_url
        assert await post_raw(root, CHAT, DEEP_FIELD) == (400, NOT_PARSED)
        body = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "x": [[1]]}'
        status, _ = await post_raw(root, CHAT, body)
        assert status == 200
        # An integer past 64 bits, which orjson cannot write, is forwarded as vLLM takes it.
        status, _ = await post_raw(root, CHAT, BIG_INTEGERS)
        assert status == 200
    assert no_tracebacks(caplog) == []


# Integers past 64 bits where vLLM bounds nothing: read exact (orjson read them as floats),
# and written again, where orjson cannot, by the simulator's answer digest and the router.
BIG_INTEGERS = (
    b'{"messages": [{"role": "user", "content": "x", "x": 18446744073709551616}], '
    b'"max_tokens": 1, "x": -1180591620717411303424}'
)


async def test_the_simulator_takes_integers_past_64_bits_where_nothing_bounds_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    config = SimConfig(port=0, ttft_ms=1.0, itl_ms=1.0, tokens=4, model="sim-model", cache="prefix")
    async with running_sim(config) as sim:
        first = await post_raw(sim.root_url, CHAT, BIG_INTEGERS)
        again = await post_raw(sim.root_url, CHAT, BIG_INTEGERS)
    assert first[0] == again[0] == 200
    assert first[1]["choices"] == again[1]["choices"]  # the same prompt, the same answer
    assert no_tracebacks(caplog) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_id_beyond_ascii_names_the_answer_as_vllm_does(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer's id takes the client's ``X-Request-Id``: its bytes beyond ASCII were a
    500 (aiohttp's surrogate escapes reached the JSON encoder); vLLM's server reads a header
    as Latin-1, and so do the backends here."""
    caplog.set_level(logging.WARNING)
    body = orjson.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                         "stream": stream})
    async with running_sim(sim_config()) as sim:
        port = int(sim.root_url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nX-Request-Id: r-\xff\xc3\xa9\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        async with asyncio.timeout(10):
            answer = await reader.read()
        writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert "chatcmpl-r-\u00ff\u00c3\u00a9".encode() in rest
    assert no_tracebacks(caplog) == []


async def test_the_router_files_a_short_turn_without_a_warning(
    engine_model: LlamaModel, caplog: pytest.LogCaptureFixture
) -> None:
    # A turn shorter than a KV block (a two-token prompt, one token answered) retains
    # nothing: the decode node's whole body carries ``kv_transfer_params: null``, which the
    # router logged as "bad kv_transfer_params" on every such request.
    caplog.set_level(logging.WARNING)
    async with serve_disaggregated(engine_model) as cluster:
        body = b'{"prompt": "hi", "max_tokens": 1}'
        status, answer = await post_raw(cluster.router.root_url, COMPLETIONS, body)
    assert status == 200
    assert answer["kv_transfer_params"] is None
    assert [record.getMessage() for record in caplog.records] == []


@pytest.mark.parametrize("flag", ["include_usage", "continuous_usage_stats"])
async def test_a_stream_option_that_is_not_a_boolean_is_a_400(flag: str) -> None:
    # It was taken for its truth: {"include_usage": "no"} sent the usage chunk.
    payload = orjson.dumps(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True, flag: "no"},
        }
    )
    async with running_sim(sim_config()) as sim:
        status, body = await post_raw(sim.root_url, CHAT, payload)
    assert status == 400
    assert body["error"]["param"] == f"body.stream_options.{flag}"
    assert body["error"]["type"] == "Bad Request"
    assert "Input should be a valid boolean" in body["error"]["message"]


async def test_a_prefill_node_refuses_booleans_as_token_ids(engine_model: LlamaModel) -> None:
    # JSON true and false were taken for token ids 1 and 0 and computed.
    async with serve_engine(engine_model, role="prefill") as node:
        payload = orjson.dumps({"prompt_token_ids": [True] * 40})
        status, body = await post_raw(node.root_url, PREFILL_ROUTE, payload)
    assert status == 400
    assert body["error"]["param"] == "prompt_token_ids"


# Each changes vLLM's answer; the engine implements none of them and answered as if unset.
UNSUPPORTED = {
    "min_tokens": 5,
    "min_p": 0.5,
    "use_beam_search": True,
    "include_stop_str_in_output": True,
    "allowed_token_ids": [1, 2],
    "bad_words": ["the"],
    "response_format": {"type": "json_object"},
    "guided_choice": ["yes", "no"],
}


async def test_the_engine_refuses_options_it_does_not_implement(
    engine_model: LlamaModel,
) -> None:
    async with serve_engine(engine_model) as engine:
        for name, value in UNSUPPORTED.items():
            body = {"prompt": "x", "max_tokens": 1, name: value}
            status, answer = await post_raw(engine.root_url, COMPLETIONS, orjson.dumps(body))
            assert (status, answer["error"]["param"]) == (400, name)
            assert "not supported by this engine" in answer["error"]["message"]
        neutral = {"min_tokens": 0, "min_p": 0.0, "response_format": {"type": "text"}}
        body = {"prompt": "x", "max_tokens": 1, **neutral}
        status, _ = await post_raw(engine.root_url, COMPLETIONS, orjson.dumps(body))
        assert status == 200


# vLLM renders, decodes or answers differently under each of these; the engine answered as if
# unset (a continued final message got a new assistant turn, <|im_end|> never appeared in the
# text, the token ids asked for were null).  The first three are chat fields only.
UNSUPPORTED_RENDERING = {
    "continue_final_message": True,
    "chat_template": "{{ messages[0]['content'] }}",
    "documents": [{"title": "t", "text": "x"}],
    "skip_special_tokens": False,
    "return_token_ids": True,
}


async def test_the_engine_refuses_rendering_options_it_does_not_implement(
    engine_model: LlamaModel,
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    async with serve_engine(engine_model) as engine:
        for name, value in UNSUPPORTED_RENDERING.items():
            body = {"messages": messages, "max_tokens": 1, "add_generation_prompt": False,
                    name: value}  # fmt: skip
            status, answer = await post_raw(engine.root_url, CHAT, orjson.dumps(body))
            assert (status, answer["error"]["param"]) == (400, name)
            assert "not supported by this engine" in answer["error"]["message"]
        for name in ("skip_special_tokens", "return_token_ids"):
            body = {"prompt": "x", "max_tokens": 1, name: UNSUPPORTED_RENDERING[name]}
            status, answer = await post_raw(engine.root_url, COMPLETIONS, orjson.dumps(body))
            assert (status, answer["error"]["param"]) == (400, name)
        neutral = {"continue_final_message": False, "skip_special_tokens": True,
                   "return_token_ids": False, "chat_template": None, "documents": None}  # fmt: skip
        body = {"messages": messages, "max_tokens": 1, **neutral}
        status, _ = await post_raw(engine.root_url, CHAT, orjson.dumps(body))
        assert status == 200
        # A completion has no chat template: vLLM takes (and ignores) the chat fields there.
        body = {"prompt": "x", "max_tokens": 1, "continue_final_message": True}
        status, _ = await post_raw(engine.root_url, COMPLETIONS, orjson.dumps(body))
        assert status == 200


# vLLM's chat_template_kwargs are the chat template's extra variables.  The engine took any
# value and rendered as if unset: a variable its template reads was never rendered, and a
# chat_template among them (vLLM refuses it) or a value that is no object (vLLM's request
# model refuses it) was answered 200.
THINKING = "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"


def _chat_prompt(tokenizer: ChatTokenizer, **fields: object) -> tuple[int, ...]:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}
    return parse_generation_request(
        "chat", body, tokenizer=tokenizer, served_model="m", max_model_len=2048
    ).prompt_ids


def _with_template(tokenizer: ChatTokenizer, template: str) -> ChatTokenizer:
    """The same vocabulary under another chat template (a GGUF may carry any)."""
    return ChatTokenizer(dataclasses.replace(tokenizer._spec, chat_template=template))


def test_the_engine_renders_the_chat_template_kwargs_its_template_reads(
    engine_model: LlamaModel,
) -> None:
    smol = engine_model.tokenizer
    template = smol._spec.chat_template
    assert template is not None and "enable_thinking" not in template
    thinking = _with_template(smol, THINKING + template)  # as Qwen3's and SmolLM3's read it
    plain = _chat_prompt(thinking)
    off = _chat_prompt(thinking, chat_template_kwargs={"enable_thinking": False})
    assert smol.decode(off, skip_special_tokens=False).startswith("/no_think\n")  # was plain
    assert off[-len(plain):] == plain
    assert _chat_prompt(thinking, chat_template_kwargs={"enable_thinking": True}) == plain
    # The request's own add_generation_prompt wins, as vLLM merges its fields over the kwargs.
    assert _chat_prompt(thinking, chat_template_kwargs={"add_generation_prompt": False}) == plain
    # A variable the template does not read changes nothing (vLLM drops it), even one the
    # render sets itself.
    unread = {"enable_thinking": False, "bos_token": "<s>"}
    assert _chat_prompt(smol, chat_template_kwargs=unread) == _chat_prompt(smol)
    # A variable the template fails on is the request's 400, never a 500 (OverflowError and
    # ZeroDivisionError escaped jinja2's and type errors).
    failing = _with_template(smol, "{% for _ in range(n) %}x{% endfor %}{{ 1 // d }}" + template)
    for variables in ({"n": 10**9, "d": 1}, {"n": 1, "d": 0}, {"n": "x", "d": 1}):
        with pytest.raises(RequestError) as refused:
            _chat_prompt(failing, chat_template_kwargs=variables)
        assert refused.value.status == 400 and refused.value.param == "messages"
        assert refused.value.message.startswith("The chat template failed: ")


async def test_chat_template_kwargs_are_checked_alike_and_a_template_among_them_refused(
    engine_model: LlamaModel,
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    not_an_object = orjson.dumps({**body, "chat_template_kwargs": "no thinking"})
    async with serve_engine(engine_model) as engine:
        status, plain = await post_raw(engine.root_url, CHAT, orjson.dumps(body))
        assert status == 200
        for kwargs in (None, {}, {"enable_thinking": False}):  # SmolLM2's template reads none
            payload = orjson.dumps({**body, "chat_template_kwargs": kwargs})
            status, answer = await post_raw(engine.root_url, CHAT, payload)
            assert status == 200
            assert answer["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
            assert answer["choices"] == plain["choices"]
        payload = orjson.dumps(
            {**body, "chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}"}}
        )
        status, answer = await post_raw(engine.root_url, CHAT, payload)
        assert (status, answer["error"]["param"]) == (400, "chat_template_kwargs")  # was 200
        assert "not supported by this engine" in answer["error"]["message"]
        served = await post_raw(engine.root_url, CHAT, not_an_object)
    # The simulator has no template: it renders no variable, but refuses what vLLM refuses.
    async with running_sim(sim_config()) as sim:
        payload = orjson.dumps({**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert (await post_raw(sim.root_url, CHAT, payload))[0] == 200
        simulated = await post_raw(sim.root_url, CHAT, not_an_object)
    assert served == simulated  # the engine's was 200
    status, error = served
    assert (status, error["error"]["param"]) == (400, "body.chat_template_kwargs")
    assert "Input should be a valid dictionary" in error["error"]["message"]


@pytest.mark.parametrize(
    "encoded",
    [
        pytest.param(b"\xef\xbb\xbf" + COMPLETION.encode(), id="utf-8-bom"),
        pytest.param(COMPLETION.encode("utf-16"), id="utf-16"),
        pytest.param(COMPLETION.encode("utf-32-le"), id="utf-32-le"),
    ],
)
async def test_a_body_in_an_encoding_vllms_parser_reads_is_answered(
    engine_model: LlamaModel, encoded: bytes
) -> None:
    """vLLM's parser (the standard library's, handed the bytes) reads a UTF-8 byte order mark,
    UTF-16 and UTF-32 (``json.detect_encoding``); orjson reads UTF-8 alone, so the simulator,
    the engine and the router refused such a body with a 400 that vLLM answers (a client that
    writes a BOM, as PowerShell's does, made the candidate look broken)."""
    async with running_sim(sim_config()) as sim:
        status, answer = await post_raw(sim.root_url, COMPLETIONS, encoded)
        assert status == 200, answer
    async with serve_engine(engine_model) as engine:
        _, plain = await post_raw(engine.root_url, COMPLETIONS, COMPLETION.encode())
        status, answer = await post_raw(engine.root_url, COMPLETIONS, encoded)
        assert status == 200, answer
    assert answer["choices"][0]["text"] == plain["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


async def test_a_body_aiohttp_cannot_read_is_a_json_400(caplog: pytest.LogCaptureFixture) -> None:
    # A Content-Encoding the body does not have was a 500 with a traceback.
    caplog.set_level(logging.WARNING)
    payload = b'{"messages": [{"role": "user", "content": "x"}]}'
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with running_sim(sim_config()) as sim, aiohttp.ClientSession() as session:
        async with session.post(sim.root_url + CHAT, data=payload, headers=headers) as resp:
            status, body = resp.status, await resp.json()
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["message"].startswith("The request body could not be read:")
    assert no_tracebacks(caplog) == []


async def test_a_client_gone_mid_body_leaves_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    async with running_sim(sim_config()) as sim:
        _, writer = await asyncio.open_connection(sim.host, sim.port)
        writer.write(head + b'{"messages": [')
        await writer.drain()
        await eventually(lambda: waiting_in(web.BaseRequest.read))  # the handler reads it
        writer.close()
        await writer.wait_closed()
        # and notices the client left: the connection's task has ended, all it logs logged
        await eventually(lambda: not waiting_in(web.RequestHandler.start))
        status, _ = await post_raw(sim.root_url, CHAT, b'{"messages": []}')
        assert status == 400  # still answering
    assert no_tracebacks(caplog) == []


async def test_a_body_past_the_size_limit_is_a_json_413() -> None:
    # aiohttp's own 413 was plain text, not an OpenAI error body.
    app = web.Application(client_max_size=64)
    install_openai_app(app, ServedModel("tiny", 16), version="0.0.0")

    async def echo(request: web.Request) -> web.StreamResponse:
        return web.Response(body=await request.read())

    app.router.add_post(CHAT, echo)
    async with serve_app(app, "127.0.0.1", 0) as served:
        status, body = await post_raw(served.root_url, CHAT, b"[" + b"1, " * 100 + b"1]")
    assert status == 413
    assert body["error"]["code"] == 413
    assert "64" in body["error"]["message"]


@pytest.mark.parametrize("content", [5, {"text": "x"}, True], ids=["int", "object", "bool"])
async def test_message_content_that_is_not_text_is_refused_alike(
    engine_model: LlamaModel, content: object
) -> None:
    # The simulator answered 200 where the engine (and vLLM) refuse.
    payload = orjson.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    async with running_sim(sim_config()) as sim:
        simulated = await post_raw(sim.root_url, CHAT, payload)
    async with serve_engine(engine_model) as engine:
        served = await post_raw(engine.root_url, CHAT, payload)
    assert simulated == served
    status, body = simulated
    assert (status, body["error"]["param"]) == (400, "body.messages.0.content")


@pytest.mark.parametrize("prompt", [[""], [[]]], ids=["empty-text", "no-ids"])
async def test_a_batch_of_one_empty_prompt_is_no_prompt(
    engine_model: LlamaModel, prompt: object
) -> None:
    # The simulator answered 200; the engine refused it as "more than one prompt".
    payload = orjson.dumps({"prompt": prompt, "max_tokens": 1})
    expected = (
        400,
        {
            "error": {
                "message": "Either prompt or prompt_embeds must be provided and non-empty. "
                "(parameter=prompt)",
                "type": "BadRequestError",
                "param": "prompt",
                "code": 400,
            }
        },
    )
    async with running_sim(sim_config()) as sim:
        assert await post_raw(sim.root_url, COMPLETIONS, payload) == expected
    async with serve_engine(engine_model) as engine:
        assert await post_raw(engine.root_url, COMPLETIONS, payload) == expected


@pytest.mark.parametrize(
    "field",
    [{"stop": 5}, {"stop": [["x"]]}, {"stop_token_ids": ["x"]}, {"ignore_eos": "yes"}],
    ids=["stop-number", "stop-nested", "stop-token-ids-text", "ignore-eos-text"],
)
async def test_stop_fields_of_the_wrong_type_are_refused_alike(
    engine_model: LlamaModel, field: dict[str, object]
) -> None:
    # The simulator answered 200 where the engine (and vLLM) refuse.
    payload = orjson.dumps({"prompt": "x", "max_tokens": 1, **field})
    async with running_sim(sim_config()) as sim:
        simulated = await post_raw(sim.root_url, COMPLETIONS, payload)
    async with serve_engine(engine_model) as engine:
        served = await post_raw(engine.root_url, COMPLETIONS, payload)
    assert simulated == served
    status, body = simulated
    assert (status, body["error"]["param"]) == (400, f"body.{next(iter(field))}")
