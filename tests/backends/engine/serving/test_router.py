"""The router's own checks: it refuses what its nodes would refuse, without asking them, it
waits on a node that stopped answering only for a bounded time, and a node's 200 that is no
answer is a clean error (or a failed prefill), never a 500.

Real nodes with a small KV pool (fewer tokens than the model's window) on loopback sockets;
a stopped node is a loopback server that takes the connection and answers nothing, a garbled
one a loopback server that answers every POST 200 with a given body.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import aiohttp
import orjson
import pytest
from aiohttp import web

from backends.engine import LlamaModel, RunningEngineServer
from backends.engine.serving import _router
from backends.engine.serving._kv_node import PREFILL_ROUTE
from backends.engine.serving._router import ROUTER
from backends.openai_wire import SSE_CONTENT_TYPE, sse_event
from tests.fixtures_engine import serve_disaggregated, serve_engine
from tests.utils import eventually, free_ports, run_sim, serving

MODEL = "SmolLM2-135M-Instruct"
SMALL_KV_BYTES = 49 * 30 * 2 * 3 * 16 * 64 * 4  # 48 blocks of SmolLM2 (+ the null block)
TOO_LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Pier 3 takes ships of 41 metres. " * 120}],
    "max_tokens": 4,
}


def _router_count(router: RunningEngineServer, name: str, **labels: str) -> float:
    registry = router.app[ROUTER].metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


async def _refused_alike(
    node: RunningEngineServer, router: RunningEngineServer, http: aiohttp.ClientSession
) -> None:
    """The router answers ``TOO_LONG`` with the node's own 400, and routes nothing."""
    limit = node.max_model_len
    answers = []
    for server in (node, router):
        async with http.post(server.base_url + "/chat/completions", json=TOO_LONG) as resp:
            answers.append((resp.status, orjson.loads(await resp.read())))
    assert answers[0] == answers[1] and answers[0][0] == 400
    assert f"maximum context length is {limit} tokens" in answers[0][1]["error"]["message"]
    # Neither node saw it: nothing was routed, no prefill failed.
    assert _router_count(router, "understudy_router_prefill_failures_total") == 0
    routed = _router_count(router, "understudy_router_requests_total", prefill="0", decode="0")
    assert routed == 0
    assert router.app[ROUTER].max_model_len == limit
    # ... and lists the nodes' window as its own, as a client sizing its prompts reads it.
    async with http.get(router.base_url + "/models") as resp:
        assert (await resp.json())["data"][0]["max_model_len"] == limit


async def test_the_router_refuses_a_prompt_its_nodes_cannot_hold(
    engine_model: LlamaModel,
) -> None:
    async with serve_disaggregated(
        engine_model, node={"kv_limit_bytes": SMALL_KV_BYTES}
    ) as cluster, aiohttp.ClientSession() as http:  # fmt: skip
        assert cluster.decode[0].max_model_len < engine_model.max_model_len
        await _refused_alike(cluster.decode[0], cluster.router, http)


async def test_a_node_not_up_leaves_the_others_limit_standing(engine_model: LlamaModel) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening
        async with serve_engine(
            engine_model, role="decode", kv_limit_bytes=SMALL_KV_BYTES
        ) as decode, serve_engine(
            engine_model, role="router", prefill_urls=(dead,), decode_urls=(decode.root_url,)
        ) as router, aiohttp.ClientSession() as http:  # fmt: skip
            await _refused_alike(decode, router, http)


async def test_nodes_that_come_up_later_are_asked_when_requests_arrive(
    engine_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_router, "NODE_LIMIT_RETRY_S", 0.0)
    prefill_port, decode_port = free_ports(2)
    async with serve_engine(
        engine_model,
        role="router",
        prefill_urls=(f"http://127.0.0.1:{prefill_port}",),
        decode_urls=(f"http://127.0.0.1:{decode_port}",),
    ) as router:
        state = router.app[ROUTER]
        assert state.max_model_len == engine_model.max_model_len  # nobody to ask yet
        async with serve_engine(
            engine_model, role="prefill", port=prefill_port, kv_limit_bytes=SMALL_KV_BYTES
        ) as prefill, serve_engine(
            engine_model, role="decode", port=decode_port, kv_limit_bytes=SMALL_KV_BYTES
        ) as decode, aiohttp.ClientSession() as http:  # fmt: skip
            # Not asked yet: the nodes refuse for themselves, as before; a request sets the
            # router asking them.
            async with http.post(router.base_url + "/chat/completions", json=TOO_LONG) as resp:
                assert resp.status == 400
            await eventually(lambda: state.max_model_len == decode.max_model_len)
            assert prefill.max_model_len == decode.max_model_len
            async with http.get(router.base_url + "/models") as resp:
                card = (await resp.json())["data"][0]
            assert card["max_model_len"] == decode.max_model_len
            labels = {"prefill": "0", "decode": "0"}
            routed = _router_count(router, "understudy_router_requests_total", **labels)
            async with http.post(router.base_url + "/chat/completions", json=TOO_LONG) as resp:
                assert resp.status == 400
            assert _router_count(router, "understudy_router_requests_total", **labels) == routed


# -- nodes that stop answering (rule 7) -------------------------------------------------------

READ_TIMEOUT_S = 0.5
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
_CHUNK = {
    "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
}  # fmt: skip


@dataclass
class _Frozen:
    """A node that stops answering, and what it saw."""

    url: str = ""
    posts_ended: int = 0  # generation requests whose connection the router closed


@asynccontextmanager
async def _frozen_node(*, events_first: int = 0) -> AsyncIterator[_Frozen]:
    """A node that took the connection and then stopped answering (as a SIGSTOPped one does):
    every request waits for ever, its ``/health`` too; a POST first sends its headers and
    ``events_first`` events when that is not 0 (a node stopped mid-stream)."""
    state = _Frozen()

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            if request.method == "POST" and events_first:
                response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
                await response.prepare(request)
                for _ in range(events_first):
                    await response.write(sse_event(_CHUNK))
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            state.posts_ended += request.method == "POST"
            raise
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    async with serving(web.AppRunner(app, handler_cancellation=True)) as url:
        state.url = url
        yield state


def _given_up(router: RunningEngineServer, role: str) -> float:
    return _router_count(router, "understudy_router_node_timeouts_total", role=role, node="0")


async def _all_ended(node: _Frozen, posts: int) -> None:
    await eventually(lambda: node.posts_ended == posts)


async def _ask(
    http: aiohttp.ClientSession, router: RunningEngineServer, body: dict[str, object]
) -> tuple[int, bytes, float]:
    started = time.monotonic()
    url = router.base_url + "/chat/completions"
    async with asyncio.timeout(30), http.post(url, json=body) as response:
        return response.status, await response.read(), time.monotonic() - started


async def test_a_decode_node_that_stops_answering_is_a_504_then_a_cut_stream(
    engine_model: LlamaModel,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # prefill fails: decode computes
        async with _frozen_node() as frozen, _frozen_node(events_first=1) as midway:
            for decode, streams in ((frozen, (False, True)), (midway, (True,))):
                async with serve_engine(
                    engine_model, role="router", prefill_urls=(dead,),
                    decode_urls=(decode.url,), node_read_timeout_s=READ_TIMEOUT_S,
                ) as router, aiohttp.ClientSession() as http:  # fmt: skip
                    for stream in streams:
                        status, raw, took = await _ask(http, router, {**CHAT, "stream": stream})
                        assert took < 2 * READ_TIMEOUT_S + 5  # silence, then a failed check
                        if decode is frozen:  # nothing sent: an OpenAI-style 504
                            error = orjson.loads(raw)["error"]
                            assert status == 504 and error["code"] == 504
                            assert error["type"] == "GatewayTimeoutError"
                            assert error["message"].startswith("decode node 0 sent nothing for")
                        else:  # headers and an event out: an error event, then [DONE]
                            assert status == 200 and raw.startswith(sse_event(_CHUNK))
                            assert b'"code":504' in raw and raw.endswith(b"data: [DONE]\n\n")
                    assert _given_up(router, "decode") == len(streams)
                    assert router.app[ROUTER].cluster.decode_streams == [0]
                # The node's request ended: the router closed its connection.
                await _all_ended(decode, len(streams))


async def test_a_silent_prefill_node_falls_back_and_a_busy_node_is_waited_for(
    engine_model: LlamaModel,
) -> None:
    async with (
        _frozen_node() as frozen,
        run_sim(model=MODEL, ttft_ms=4 * READ_TIMEOUT_S * 1000) as slow,  # alive, just slow
        serve_engine(
            engine_model, role="router", prefill_urls=(frozen.url,), decode_urls=(slow.url,),
            node_read_timeout_s=READ_TIMEOUT_S,
        ) as router,
        aiohttp.ClientSession() as http,
    ):  # fmt: skip
        status, raw, took = await _ask(http, router, CHAT)
        assert status == 200 and orjson.loads(raw)["choices"][0]["message"]["content"]
        assert took > 4 * READ_TIMEOUT_S  # several silent periods, each a passed check
        assert _router_count(router, "understudy_router_prefill_failures_total") == 1
        assert _given_up(router, "prefill") == 1
        # The slow decode node answered its health checks: waited for, never given up.
        assert _given_up(router, "decode") == 0
        await _all_ended(frozen, 1)


# -- nodes that fail (rule 8) -----------------------------------------------------------------

@asynccontextmanager
async def _slow_prefill_node() -> AsyncIterator[str]:
    """A prefill node alive but slow: its ``/health`` answers 200, a prefill never ends."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def prefill(_: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post(PREFILL_ROUTE, prefill)
    async with serving(web.AppRunner(app, handler_cancellation=True)) as url:
        yield url


async def test_a_slow_prefill_past_its_timeout_does_not_mark_its_node_down(
    engine_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill node that answered every health check (busy, rule 7) but outlasted
    ``PREFILL_TIMEOUT_S`` was marked down like a dead one (the timeout is an OSError): a
    live node left out for ``NODE_DOWN_S``.  The prefill fails, the node stays up."""
    monkeypatch.setattr(_router, "PREFILL_TIMEOUT_S", 3 * READ_TIMEOUT_S)
    async with (
        _slow_prefill_node() as slow,
        run_sim(model=MODEL) as decode,
        serve_engine(
            engine_model, role="router", prefill_urls=(slow,), decode_urls=(decode.url,),
            node_read_timeout_s=READ_TIMEOUT_S,
        ) as router,
        aiohttp.ClientSession() as http,
    ):  # fmt: skip
        cluster = router.app[ROUTER].cluster
        downs: list[tuple[str, int]] = []
        monkeypatch.setattr(cluster, "node_down", lambda role, node: downs.append((role, node)))
        status, raw, took = await _ask(http, router, CHAT)
        assert status == 200 and orjson.loads(raw)["choices"][0]["message"]["content"]
        assert took >= 3 * READ_TIMEOUT_S  # the whole prefill budget, checks passed meanwhile
        assert _router_count(router, "understudy_router_prefill_failures_total") == 1
        assert _given_up(router, "prefill") == 0
        assert downs == []  # was [("prefill", 0)]


HARBOUR = "You are the help desk of a harbour. " + " ".join(
    f"Pier {i} takes ships of up to {20 + 7 * i} metres." for i in range(8)
)


async def _answer(
    http: aiohttp.ClientSession, server: RunningEngineServer, messages: list[dict[str, str]]
) -> tuple[int, dict[str, object]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    async with asyncio.timeout(60), http.post(
        server.base_url + "/chat/completions", json=body
    ) as response:  # fmt: skip
        return response.status, await response.json()


async def test_a_dead_decode_node_is_left_out_and_its_conversations_move(
    engine_model: LlamaModel,
) -> None:
    """Two decode nodes, the first killed after a conversation's first turn: kv-aware sent
    that conversation's every later turn, and every new conversation (an idle dead node is the
    cheapest), to the dead node -- 502 after 502.  Now one request fails (counted) and the next
    ones go to the live node, with the tokens of an engine that computes everything."""
    first = [{"role": "system", "content": HARBOUR}, {"role": "user", "content": "Which pier?"}]
    other = [{"role": "system", "content": HARBOUR}, {"role": "user", "content": "Hello there."}]
    async with serve_engine(engine_model, enable_prefix_caching=False) as unified, (
        aiohttp.ClientSession()
    ) as http:  # fmt: skip
        _, turn1 = await _answer(http, unified, first)
        reply = turn1["choices"][0]["message"]["content"]  # type: ignore[index]
        second = [
            *first,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Why?"},
        ]
        expected = [await _answer(http, unified, messages) for messages in (second, other)]
        doomed = AsyncExitStack()
        dead = await doomed.enter_async_context(serve_engine(engine_model, role="decode"))
        async with (
            doomed,
            serve_engine(engine_model, role="prefill") as prefill,
            serve_engine(engine_model, role="decode") as live,
            serve_engine(
                engine_model, role="router", prefill_urls=(prefill.root_url,),
                decode_urls=(dead.root_url, live.root_url), routing_policy="kv-aware",
            ) as router,
        ):  # fmt: skip
            status, answer = await _answer(http, router, first)  # on decode node 0
            assert status == 200 and answer["choices"] == turn1["choices"]
            await doomed.aclose()
            status, error = await _answer(http, router, second)
            assert status == 502 and "decode node 0 failed" in str(error)
            started = time.monotonic()
            got = [await _answer(http, router, messages) for messages in (second, other)]
            took = time.monotonic() - started
            failures = [
                _router_count(router, "understudy_router_decode_failures_total", node=str(n))
                for n in (0, 1)
            ]
    for (status, answer), (_, want) in zip(got, expected, strict=True):
        assert status == 200
        assert answer["choices"] == want["choices"]
    assert failures == [1, 0]
    assert took < 30  # no read-back waited on the dead node


# -- nodes that answer 200 with a bad body (rule 8) --------------------------------------------

@asynccontextmanager
async def _answering_node(body: bytes, content_type: str) -> AsyncIterator[str]:
    """A node up at the transport (``/health`` is 200) whose every POST is a 200 with
    ``body`` typed ``content_type``."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def post(_: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", post)
    async with serving(web.AppRunner(app)) as url:
        yield url


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"not json", "application/json"),  # was a 500: JSONDecodeError out of the handler
        (b'{"id": "chatcmpl-1", "choices": [{"ind', "application/json"),  # cut short
        (b"", "application/json"),  # was a 500: aiohttp reads an empty body as None
        (b'["not", "an", "object"]', "application/json"),  # was a 500: list.get
        (b"\xff\xfe not utf-8", "application/json"),
        (b"not json", "text/plain"),  # already a 502 (aiohttp's ContentTypeError)
    ],
)
async def test_a_decode_node_that_answers_200_without_a_json_object_is_a_502(
    engine_model: LlamaModel, monkeypatch: pytest.MonkeyPatch, body: bytes, content_type: str
) -> None:
    """Counted as a decode failure, its node asked its limit again, but not marked down: it
    answered at the transport (rule 8), as a node that answers an error status does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # prefill fails: decode computes
        async with (
            _answering_node(body, content_type) as garbled,
            serve_engine(
                engine_model, role="router", prefill_urls=(dead,), decode_urls=(garbled,)
            ) as router,
            aiohttp.ClientSession() as http,
        ):  # fmt: skip
            state = router.app[ROUTER]
            downs: list[tuple[str, int]] = []
            monkeypatch.setattr(
                state.cluster, "node_down", lambda role, node: downs.append((role, node))
            )
            status, raw, _ = await _ask(http, router, CHAT)
            assert status == 502, raw
            error = orjson.loads(raw)["error"]
            assert error["code"] == 502 and error["type"] == "BadGatewayError"
            assert error["message"].startswith("decode node 0 failed")
            assert _router_count(router, "understudy_router_decode_failures_total", node="0") == 1
            assert ("decode", 0) not in downs
            assert garbled in state._unsure  # rule 6: asked its limit again
            assert state.cluster.decode_streams == [0]


async def test_a_finishing_event_that_is_not_json_is_an_error_event_then_done(
    engine_model: LlamaModel,
) -> None:
    """The router parses the event that carries ``kv_transfer_params`` (rule 3); one cut short
    escaped the handler (an orjson error after the headers: the stream ended without
    ``[DONE]``).  Now it is a decode failure, mid-stream: an error event, then ``[DONE]``."""
    stream = sse_event(_CHUNK) + b'data: {"choices": [], "kv_transfer_params": {"remo\n\n'
    async with (
        _answering_node(stream, SSE_CONTENT_TYPE) as garbled,
        serve_engine(
            engine_model, role="router", prefill_urls=(garbled,), decode_urls=(garbled,)
        ) as router,
        aiohttp.ClientSession() as http,
    ):  # fmt: skip
        status, raw, _ = await _ask(http, router, {**CHAT, "stream": True})
        assert status == 200 and raw.startswith(sse_event(_CHUNK))
        assert b"kv_transfer_params" not in raw  # rule 3, even for a bad event
        assert b'"code":502' in raw and raw.endswith(b"data: [DONE]\n\n")
        assert b"decode node 0 failed mid-stream: its finishing event is not JSON" in raw
        assert _router_count(router, "understudy_router_decode_failures_total", node="0") == 1


@pytest.mark.parametrize(
    "body",
    [
        b"not json",  # already a failed prefill
        b'{"computed_tokens": "many", "compute_s": 0.1}',  # was a 500: int("many")
        b'{"computed_tokens": null}',  # was a 500: int(None)
        b'{"computed_tokens": 12, "compute_s": "fast"}',  # was a 500: float("fast")
    ],
)
async def test_a_prefill_node_that_answers_200_with_a_bad_body_is_a_failed_prefill(
    engine_model: LlamaModel, body: bytes
) -> None:
    """The decode node computes the prompt itself (rule 4); the prices are not touched."""
    async with (
        _answering_node(body, "application/json") as garbled,
        run_sim(model=MODEL) as decode,
        serve_engine(
            engine_model, role="router", prefill_urls=(garbled,), decode_urls=(decode.url,)
        ) as router,
        aiohttp.ClientSession() as http,
    ):  # fmt: skip
        cluster = router.app[ROUTER].cluster
        prices = (cluster.prefill_s_per_token, cluster.transfer_s_per_block)
        status, raw, _ = await _ask(http, router, CHAT)
        assert status == 200 and orjson.loads(raw)["choices"][0]["message"]["content"]
        assert _router_count(router, "understudy_router_prefill_failures_total") == 1
        assert (cluster.prefill_s_per_token, cluster.transfer_s_per_block) == prices
