"""Upstream.call/read (gateway/_upstream.py) against a raw server on loopback, with a
client that falls behind: flow control and the idle deadline while the relay waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from multidict import CIMultiDict

from evaluators import Capture
from gateway._config import UpstreamConfig
from gateway._exceptions import UpstreamTimeout
from gateway._headers import CREDENTIAL_HEADERS
from gateway._upstream import Upstream
from tests.gateway.test_wire import Handler, raw_listener
from tests.utils import HANG_S, eventually

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b"data: %d\n\n" % i for i in range(4)]


class SlowClient:
    """A ClientWriter past its high-water mark after its first piece, until ``caught_up``."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.caught_up = asyncio.Event()
        self.drains = 0
        self.gone = False

    def write(self, piece: bytes) -> bool:
        self.pieces.append(piece)
        return not self.caught_up.is_set()

    async def drain(self) -> None:
        self.drains += 1
        await self.caught_up.wait()


@asynccontextmanager
async def upstream_at(handler: Handler, idle_timeout_s: float) -> AsyncIterator[Upstream]:
    async with raw_listener(handler) as port:
        upstream = Upstream(UpstreamConfig(url=f"http://127.0.0.1:{port}",
                                           idle_timeout_s=idle_timeout_s),
                            credentials=CREDENTIAL_HEADERS)
        upstream.open()
        try:
            yield upstream
        finally:
            await upstream.close()


def new_capture() -> Capture:
    return Capture(started=asyncio.get_running_loop().time(), max_bytes=1 << 20,
                   max_chunk_times=1024)


async def relay_to(upstream: Upstream, client: SlowClient, capture: Capture) -> None:
    async with upstream.call("GET", "/v1/stream", CIMultiDict(), b"", capture) as answer:
        await upstream.read(answer, capture, client)


async def test_a_slow_client_pauses_the_upstream_and_gets_every_piece() -> None:
    sent = asyncio.Event()

    async def events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        framed = [b"%x\r\n%b\r\n" % (len(event), event) for event in EVENTS]
        writer.write(HEAD + framed[0])  # the first piece with the head: held until attached
        for frame in framed[1:]:
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(frame)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        sent.set()

    async with upstream_at(events, idle_timeout_s=5) as upstream:
        client, capture = SlowClient(), new_capture()
        relay = asyncio.create_task(relay_to(upstream, client, capture))
        await eventually(lambda: client.drains > 0)  # the first piece puts the client behind
        # Every other piece and the end are at the relay's socket now (on loopback a write
        # is at the peer as it returns); a relay reading on read them at the loop's next
        # turns, whatever the machine's speed: three turns, no wall-clock wait.
        async with asyncio.timeout(HANG_S):
            await sent.wait()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not relay.done() and client.drains == 1  # still waiting for the client
        assert len(client.pieces) < len(EVENTS)  # the upstream is not read meanwhile
        client.caught_up.set()
        await asyncio.wait_for(relay, 5)
        assert b"".join(client.pieces) == b"".join(EVENTS) == bytes(capture.body)


async def test_the_idle_deadline_ends_a_wait_for_a_client_that_never_catches_up() -> None:
    silent = asyncio.Event()

    async def one_then_silence(reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD + b"%x\r\n%b\r\n" % (len(EVENTS[0]), EVENTS[0]))
        await writer.drain()
        await silent.wait()

    try:
        async with upstream_at(one_then_silence, idle_timeout_s=0.2) as upstream:
            client, capture = SlowClient(), new_capture()
            started = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamTimeout) as info:
                await asyncio.wait_for(relay_to(upstream, client, capture), 5)
            assert info.value.kind == "idle_timeout"
            assert asyncio.get_running_loop().time() - started < 2
            assert client.pieces == [EVENTS[0]] and client.drains == 1
    finally:
        silent.set()


def test_the_request_head_keeps_the_base_path_under_credentials_and_refuses_line_breaks(
) -> None:
    """An upstream URL's user and password become Basic credentials, never part of the
    path; a header value holding CR, LF or NUL is refused, never sent."""
    upstream = Upstream(UpstreamConfig(name="p", url="http://user:pw@127.0.0.1:8000/base"),
                        credentials=CREDENTIAL_HEADERS)
    head = upstream.request_head("POST", "/v1/models?x=1", CIMultiDict(Accept="*/*"), b"{}")
    assert head == (b"POST /base/v1/models?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
                    b"Accept: */*\r\nAuthorization: Basic dXNlcjpwdw==\r\n"
                    b"Content-Length: 2\r\n\r\n")
    for bad in ("a\nb", "a\rb", "a\0b", "a\r\nX-Smuggled: 1"):
        with pytest.raises(ValueError, match="line break or NUL"):
            upstream.request_head("GET", "/v1/models", CIMultiDict({"X-Tag": bad}), b"")
