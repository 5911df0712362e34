"""The front (gateway/_front.py): the proxy's own server for ``/v1/``, over raw sockets.

What the rest of the suite cannot see through an HTTP client: which server answered, the
hand-over to aiohttp at a request boundary on a kept-alive connection, pipelining, HTTP/1.0,
the framing of the answers, and the front's own bounds (rules 1-6 atop the module).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from gateway._front import FrontServer
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

CHAT = json.dumps({"model": "sim-model",
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
STREAM = json.dumps({"model": "sim-model", "stream": True,
                     "messages": [{"role": "user", "content": "hi"}]}).encode()


def post(body: bytes, *, path: str = "/v1/chat/completions", version: str = "1.1",
         extra: str = "") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer's head and body (Content-Length or chunked), within 5 s."""
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        lower = head.lower()
        if b"content-length:" in lower:
            length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            return head, await reader.readexactly(length)
        assert b"transfer-encoding: chunked" in lower, head
        body = b""
        for _ in range(10_000):  # bounded: a chunk per token at most
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            piece = await reader.readexactly(size + 2)
            if size == 0:
                return head, body
            body += piece[:-2]
        raise AssertionError("too many chunks")


@asynccontextmanager
async def gateway(**server: object) -> AsyncIterator[RunningGateway]:
    async with run_sim(ttft_ms=0, itl_ms=1, tokens=4) as sim, \
            run_gateway(sim.url, server=server) as gw:
        yield gw


def fronts(gw: RunningGateway) -> int:
    """Connections the front holds now (not handed over)."""
    server = gw.runner.server
    assert isinstance(server, FrontServer)
    return len(server.fronts)


@asynccontextmanager
async def connection(gw: RunningGateway) -> AsyncIterator[
        tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    port = int(gw.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def test_v1_requests_stay_with_the_front_and_others_hand_the_connection_over() -> None:
    async with gateway() as gw, connection(gw) as (reader, writer):
        writer.write(post(CHAT))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"]
        assert fronts(gw) == 1
        writer.write(post(STREAM))  # a stream on the same kept-alive connection
        head, body = await read_answer(reader)
        assert b"transfer-encoding: chunked" in head.lower() and body.endswith(
            b"data: [DONE]\n\n")
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the boundary: handed over
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "ok"
        await eventually(lambda: fronts(gw) == 0)
        writer.write(post(CHAT))  # aiohttp's own /v1/ route relays the rest
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"]
        assert gw.metric("understudy_connections_open") == 1
        assert gw.metric("understudy_requests_total", route="chat_completions",
                         status="200") == 3


async def test_pipelined_v1_requests_are_answered_in_order() -> None:
    async with gateway() as gw, connection(gw) as (reader, writer):
        writer.write(post(CHAT, extra="X-Request-Id: one\r\n")
                     + post(CHAT, extra="X-Request-Id: two\r\n")
                     + post(STREAM, extra="X-Request-Id: three\r\n"))
        for name in (b"one", b"two", b"three"):
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and b"X-Request-Id: " + name in head
            assert body


async def test_a_pipelined_request_that_is_not_v1_closes_after_the_answers_before_it() -> None:
    async with gateway() as gw, connection(gw) as (reader, writer):
        writer.write(post(CHAT) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # RFC 9112 9.3.2: retried


async def post_after_100_continue(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                  expectation: str = "100-continue") -> None:
    """A POST of ``CHAT`` with ``Expect``: its head, then (for ``100-continue``) the
    gateway's ``100 Continue`` within 5 s, then its body."""
    whole = post(CHAT, extra=f"Expect: {expectation}\r\n")
    head, _, body = whole.partition(b"\r\n\r\n")
    writer.write(head + b"\r\n\r\n")
    if expectation == "100-continue":
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)


async def test_a_client_that_expects_100_continue_gets_it_then_the_answer() -> None:
    async with gateway() as gw, connection(gw) as (reader, writer):
        await post_after_100_continue(reader, writer)
        head, answer = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(answer)["choices"]


async def test_http10_answers_close_or_keep_alive_as_asked() -> None:
    async with gateway() as gw:
        async with connection(gw) as (reader, writer):
            writer.write(post(CHAT, version="1.0"))
            head, body = await read_answer(reader)
            assert b"Connection: close" in head and json.loads(body)["choices"]
            assert await asyncio.wait_for(reader.read(), 5) == b""
        async with connection(gw) as (reader, writer):
            writer.write(post(STREAM, version="1.0", extra="Connection: keep-alive\r\n"))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert b"chunked" not in head.lower() and b"Connection: close" in head
            body = await asyncio.wait_for(reader.read(), 5)  # until close
            assert body.endswith(b"data: [DONE]\n\n")


async def test_a_refused_body_is_answered_and_an_unread_rest_closes_the_connection() -> None:
    async with gateway(max_body_bytes=100) as gw, connection(gw) as (reader, writer):
        writer.write(post(b"x" * 5000))  # all of it came: the connection stays
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" not in head
        assert json.loads(body)["error"]["code"] == 413
        whole = post(b"y" * 5000)
        writer.write(whole[:-4000])  # the rest is still to come: answered, then closed
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head
        writer.write(whole[-4000:])
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert gw.metric("understudy_requests_rejected_total", reason="body_too_large") == 2


async def test_malformed_request_is_400_json_and_counted() -> None:
    async with gateway() as gw, connection(gw) as (reader, writer):
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: zz\r\n\r\n")
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == 400
        assert gw.metric("understudy_connections_closed_total", reason="bad_request") == 1


async def test_idle_v1_connection_is_closed_after_the_keepalive_timeout() -> None:
    async with gateway(keepalive_timeout_s=0.5) as gw, connection(gw) as (reader, writer):
        writer.write(post(CHAT))
        await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert gw.metric("understudy_connections_closed_total",
                         reason="keepalive_timeout") == 1
        await eventually(lambda: gw.metric("understudy_connections_open") == 0)


@pytest.mark.parametrize("start", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHo"])
async def test_a_head_not_whole_in_time_closes_the_connection(start: bytes) -> None:
    async with gateway(header_timeout_s=0.5) as gw, connection(gw) as (reader, writer):
        writer.write(start)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert gw.metric("understudy_connections_closed_total", reason="header_timeout") == 1

