"""The gateway in front of the simulator, driven by the official openai client."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
from openai.types.chat.chat_completion_stream_options_param import (
    ChatCompletionStreamOptionsParam,
)

from tests.utils import eventually, run_gateway, run_sim

CHAT: list[ChatCompletionMessageParam] = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three prime numbers."}]


def _chunk_view(chunk: ChatCompletionChunk) -> dict[str, Any]:
    """What a client sees of a chunk, minus the fields that differ per call (id, time)."""
    data = chunk.model_dump()
    data.pop("id", None)
    data.pop("created", None)
    return data


async def _stream(client: openai.AsyncOpenAI,
                  stream_options: ChatCompletionStreamOptionsParam | openai.Omit = openai.omit,
                  ) -> list[dict[str, Any]]:
    stream = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                  stream=True, stream_options=stream_options)
    return [_chunk_view(chunk) async for chunk in stream]


async def test_streamed_chat_equals_direct() -> None:
    async with run_sim(ttft_ms=5, itl_ms=1, tokens=12, cached_tokens=4) as sim, \
            run_gateway(sim.url) as gw:
        direct = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x")
        proxied = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        usage: ChatCompletionStreamOptionsParam = {"include_usage": True}
        for options in (openai.omit, usage):
            assert await _stream(proxied, options) == await _stream(direct, options)
        await direct.close()
        await proxied.close()


async def test_usage_chunk_only_when_client_asked() -> None:
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=6) as sim, run_gateway(sim.url) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        chunks = await _stream(client)
        await client.close()
        assert all(c["usage"] is None for c in chunks)
        assert all(c["choices"] for c in chunks)
        # The gateway asked the primary for usage on its own leg and recorded it.
        upstream_body = sim.stats.requests[-1].body
        assert isinstance(upstream_body, dict)
        assert upstream_body["stream_options"] == {"include_usage": True}
        (observation,) = gw.state.observations.snapshot()
        direct = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x")
        reference = await _stream(direct, stream_options={"include_usage": True})
        await direct.close()
        assert observation.usage is not None
        assert observation.usage.completion_tokens == reference[-1]["usage"]["completion_tokens"]
        assert observation.text == "".join(c["choices"][0]["delta"]["content"] or ""
                                           for c in chunks)


async def test_non_streamed_chat_and_completions_equal_direct() -> None:
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=9, cached_tokens=2) as sim, \
            run_gateway(sim.url) as gw:
        direct = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x")
        proxied = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        a = await direct.chat.completions.create(model="sim-model", messages=CHAT)
        b = await proxied.chat.completions.create(model="sim-model", messages=CHAT)
        assert b.choices[0].message.content == a.choices[0].message.content
        assert b.usage == a.usage
        c = await direct.completions.create(model="sim-model", prompt="Once upon", max_tokens=5)
        d = await proxied.completions.create(model="sim-model", prompt="Once upon", max_tokens=5)
        assert (d.choices[0].text, d.choices[0].finish_reason, d.usage) == (
            c.choices[0].text, c.choices[0].finish_reason, c.usage)
        e = await proxied.embeddings.create(model="sim-model", input="hello")
        assert len(e.data[0].embedding) == 384
        models = await proxied.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
        await direct.close()
        await proxied.close()
        observation = gw.state.observations.snapshot()[0]
        assert observation.usage is not None and observation.usage.cached_tokens == 2
        assert observation.finish_reason == "stop"


async def test_sync_client_streamed_and_not() -> None:
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=5) as sim, run_gateway(sim.url) as gw:

        def use_sync_client(base_url: str) -> tuple[str, list[str]]:
            with openai.OpenAI(base_url=base_url, api_key="x") as client:
                whole = client.chat.completions.create(model="sim-model", messages=CHAT)
                pieces = [c.choices[0].delta.content or "" for c in
                          client.chat.completions.create(model="sim-model", messages=CHAT,
                                                         stream=True) if c.choices]
                return whole.choices[0].message.content or "", pieces

        direct = await asyncio.to_thread(use_sync_client, sim.base_url)
        proxied = await asyncio.to_thread(use_sync_client, gw.base_url)
        assert proxied == direct
        assert proxied[0] == "".join(proxied[1])


async def test_headers_request_id_forwarding_and_hop_by_hop() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as sim, run_gateway(sim.url) as gw, \
            aiohttp.ClientSession() as http:
        body = {"model": "sim-model", "messages": CHAT}
        headers = {"Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1", "X-Keep": "2",
                   "X-Forwarded-For": "10.1.2.3"}
        async with http.post(gw.base_url + "/chat/completions", json=body,
                             headers=headers) as resp:
            assert resp.status == 200
            generated = resp.headers["X-Request-Id"]
            assert len(generated) == 32
        seen = sim.stats.requests[-1].headers
        assert seen["X-Request-Id"] == generated
        assert "X-Drop-Me" not in seen and seen["X-Keep"] == "2"
        assert seen["X-Forwarded-For"] == "10.1.2.3, 127.0.0.1"
        assert seen["X-Forwarded-Proto"] == "http"
        async with http.post(gw.base_url + "/chat/completions", json=body,
                             headers={"X-Request-Id": "mine-1"}) as resp:
            assert resp.headers["X-Request-Id"] == "mine-1"
        assert sim.stats.requests[-1].headers["X-Request-Id"] == "mine-1"


async def test_upstream_unreachable_is_502_with_openai_error() -> None:
    async with run_sim() as sim:
        dead = sim.url
    async with run_gateway(dead) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="sim-model", messages=CHAT)
        await client.close()
        assert info.value.status_code == 502
        assert info.value.body["type"] == "upstream_error"  # type: ignore[index]
        assert 'kind="connect"' in (await _metrics(gw.url))


async def test_upstream_hang_before_first_byte_is_504() -> None:
    async with run_sim(fault="hang_before_first_byte") as sim, \
            run_gateway(sim.url, primary={"first_byte_timeout_s": 0.3}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="sim-model", messages=CHAT, stream=True)
        await client.close()
        assert info.value.status_code == 504
        assert 'kind="first_byte_timeout"' in (await _metrics(gw.url))


async def test_upstream_hang_mid_stream_cuts_the_answer_after_idle_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="understudy.gateway")
    async with run_sim(fault="hang_mid_stream", fault_after_chunks=3, itl_ms=1) as sim, \
            run_gateway(sim.url, primary={"idle_timeout_s": 0.3}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        received = 0
        with pytest.raises(openai.APIConnectionError):
            stream = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                          stream=True)
            async for _ in stream:
                received += 1
        await client.close()
        assert received >= 1
        assert 'kind="idle_timeout"' in (await _metrics(gw.url))
        await eventually(lambda: sim.stats.in_flight == 0)
    # A cut is logged with its request and cause, not only counted.
    assert any("cut mid-answer" in r.getMessage() and "idle_timeout" in r.getMessage()
               for r in caplog.records)


async def test_upstream_reset_mid_stream_is_a_cut_answer_and_gateway_survives() -> None:
    async with run_sim(fault="reset_mid_stream", fault_after_chunks=2, fault_rate=0.5,
                       itl_ms=1) as sim, run_gateway(sim.url) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        outcomes = []
        for _ in range(4):
            try:
                stream = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                              stream=True)
                outcomes.append(len([c async for c in stream]))
            except openai.APIConnectionError:
                outcomes.append(-1)
        await client.close()
        assert outcomes.count(-1) == 2 and all(n > 0 for n in outcomes if n != -1)
        assert 'kind="reset"' in (await _metrics(gw.url))


async def test_malformed_upstream_chunks_are_relayed_byte_for_byte() -> None:
    async with run_sim(fault="malformed_chunks", itl_ms=0, tokens=6) as sim, \
            run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        body = {"model": "sim-model", "messages": CHAT, "stream": True, "seed": 1,
                "stream_options": {"include_usage": True}}
        async with http.post(sim.base_url + "/chat/completions", json=body) as resp:
            direct = await resp.read()
        async with http.post(gw.base_url + "/chat/completions", json=body) as resp:
            assert resp.status == 200
            proxied = await resp.read()
        assert _without_ids(proxied) == _without_ids(direct)
        assert b"data: [DONE]" in proxied
        observation = gw.state.observations.snapshot()[-1]
        assert observation.status == 200 and observation.error is None


async def test_body_over_limit_is_413_and_never_forwarded() -> None:
    async with run_sim() as sim, \
            run_gateway(sim.url, server={"max_body_bytes": 2048}) as gw, \
            aiohttp.ClientSession() as http:
        big = {"model": "sim-model", "messages": [{"role": "user", "content": "x" * 4096}]}
        async with http.post(gw.base_url + "/chat/completions", json=big) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
        assert error["code"] == 413 and "limit" in error["message"]
        # Chunked upload without Content-Length is bounded too.
        async def chunks() -> Any:
            for _ in range(8):
                yield b"y" * 1024

        async with http.post(gw.base_url + "/completions", data=chunks()) as resp:
            assert resp.status == 413
        assert sim.stats.requests_seen == 0


async def test_malformed_request_body_is_forwarded_and_answered_by_backend() -> None:
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        for payload in (b"{not json", b"[1, 2]", b'{"stream": true, "stream_options": 5}'):
            async with http.post(gw.base_url + "/chat/completions", data=payload,
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400, payload
                assert "error" in await resp.json()
        async with http.get(gw.url + "/health") as resp:
            assert resp.status == 200


async def test_client_disconnect_cancels_upstream_request() -> None:
    async with run_sim(ttft_ms=1, itl_ms=50, tokens=200) as sim, run_gateway(sim.url) as gw, \
            aiohttp.ClientSession() as http:
        body = {"model": "sim-model", "messages": CHAT, "stream": True}
        resp = await http.post(gw.base_url + "/chat/completions", json=body)
        await resp.content.readline()
        resp.close()  # the client goes away mid-stream
        await eventually(lambda: sim.stats.cancelled == 1)
        assert sim.stats.in_flight == 0 and sim.stats.completed == 0
        await eventually(lambda: gw.state.metrics.relaying == 0)
        assert gw.state.observations.snapshot()[-1].error == "client_disconnected"


async def test_graceful_shutdown_lets_in_flight_stream_finish() -> None:
    async with run_sim(ttft_ms=1, itl_ms=20, tokens=15) as sim, \
            run_gateway(sim.url, server={"shutdown_timeout_s": 5}) as gw:
        direct = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x")
        expected = await _stream(direct)
        await direct.close()
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        stream = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                      stream=True)
        first = await anext(aiter(stream))
        shutdown = asyncio.create_task(gw.runner.cleanup())
        rest = [c async for c in stream]
        await shutdown
        await client.close()
        assert [_chunk_view(c) for c in [first, *rest]] == expected
        assert sim.stats.completed == 2


async def test_metrics_endpoint() -> None:
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=3) as sim, run_gateway(sim.url) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        await _stream(client)
        await client.close()
        text = await _metrics(gw.url)
        assert 'understudy_requests_total{route="chat_completions",status="200"} 1.0' in text
        assert "understudy_primary_ttft_seconds_bucket" in text
        assert "understudy_requests_in_flight 0.0" in text


async def test_event_loop_tasks_metric_counts_tasks_and_returns_to_baseline() -> None:
    # The simulator runs on the same loop: its handlers of the gateway's pooled keep-alive
    # connections stay, so the baseline is taken after a first batch has filled the pool.
    async with run_sim(ttft_ms=1, itl_ms=200, tokens=3) as sim, run_gateway(sim.url) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        await asyncio.gather(*(_stream(client) for _ in range(5)))
        baseline = gw.metric("understudy_event_loop_tasks")
        assert baseline >= 1  # at least the test's own task runs on the loop
        streams = [asyncio.create_task(_stream(client)) for _ in range(5)]
        await eventually(lambda: gw.metric("understudy_event_loop_tasks") >= baseline + 10)
        await asyncio.gather(*streams)
        await eventually(lambda: gw.metric("understudy_event_loop_tasks") <= baseline)
        await client.close()


def _without_ids(raw: bytes) -> bytes:
    return re.sub(rb'"(id|created)": ?("[^"]*"|\d+)', b"", raw)


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        return await resp.text()
