"""The lean upstream client (gateway/_wire.py) against raw servers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from yarl import URL

from gateway._wire import (
    DEADLINE_TICK_S,
    MAX_HEAD_BYTES,
    ConnectFailed,
    ConnectionPool,
    Disconnected,
    FirstByteTimeout,
    IdleTimeout,
    MalformedResponse,
    ResponseHead,
)
from tests.utils import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@asynccontextmanager
async def raw_listener(answer: bytes | Handler) -> AsyncIterator[int]:
    """A server that answers each request with ``answer`` (bytes, kept alive) or runs
    ``answer`` itself; yields its port."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if callable(answer):
                await answer(reader, writer)
                return
            for _ in range(16):  # bounded: a few requests per connection
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


@asynccontextmanager
async def raw_server(answer: bytes | Handler) -> AsyncIterator[ConnectionPool]:
    """``raw_listener``, and a pool pointing at it."""
    async with raw_listener(answer) as port:
        pool = ConnectionPool(URL(f"http://127.0.0.1:{port}"), limit=4, connect_timeout_s=2)
        try:
            yield pool
        finally:
            pool.close()


def answer_once(answer: bytes) -> Handler:
    """A handler that reads one request and sends ``answer``; ``raw_server`` then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()

    return handle


async def fetch(pool: ConnectionPool) -> tuple[ResponseHead, bytes]:
    conn = await pool.acquire()
    try:
        head = await conn.send(REQUEST, b"", head_only=False)
        pieces: list[bytes] = []
        await conn.attach(pieces.append)
        return head, b"".join(pieces)
    finally:
        pool.release(conn)


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, pos = b"", 0
    for size in sizes:
        out += b"%x\r\n%b\r\n" % (size, body[pos:pos + size])
        pos += size
    return out + b"0\r\n\r\n"


async def test_chunked_body_is_decoded_whatever_the_reads() -> None:
    body = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    head = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: text/event-stream\r\n\r\n")
    wire = head + chunked(body, [11, 11, len(body) - 22])

    async def byte_by_byte(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for i in range(len(wire)):
            writer.write(wire[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)

    for answer in (wire, byte_by_byte):
        async with raw_server(answer) as pool:
            got_head, got = await fetch(pool)
            assert got_head.status == 200 and got_head.content_type == "text/event-stream"
            assert got == body


async def test_chunk_extensions_trailers_and_length_bodies_in_pieces() -> None:
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;name=value \t\r\nhello\r\n1 \r\n!\r\n0\r\nX-Trailer: t\r\n\r\n")
    async with raw_server(wire) as pool:
        assert (await fetch(pool))[1] == b"hello!"
        assert (await fetch(pool))[1] == b"hello!"  # the trailer read whole: kept alive
        assert pool.size == 1
    length = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world"

    async def in_pieces(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for i in range(0, len(length), 7):
            writer.write(length[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0.01)

    async with raw_server(in_pieces) as pool:
        assert (await fetch(pool))[1] == b"hello world"


async def test_keep_alive_reuses_the_connection_and_close_does_not() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    async with raw_server(answer) as pool:
        assert (await fetch(pool))[1] == b"hello"
        conn = await pool.acquire()
        assert conn.reused
        pool.release(conn)
        assert (await fetch(pool))[1] == b"hello"
        assert pool.size == 1
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
    async with raw_server(closing) as pool:
        assert (await fetch(pool))[1] == b"hi"
        assert pool.size == 0


async def test_body_until_close_and_no_body_statuses() -> None:
    async with raw_server(answer_once(b"HTTP/1.0 200 OK\r\n\r\nall of it")) as pool:
        assert (await fetch(pool))[1] == b"all of it"
    async with raw_server(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n") as pool:
        head, body = await fetch(pool)
        assert head.status == 204 and body == b""


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nX-Bad: a\x00b\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\n\r\n",
    # Below 100: no HTTP status (RFC 9110 15); the relay wrote it to the client as "HTTP/1.1
    # 42", a status line no client parses.
    b"HTTP/1.1 042 X\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 000 X\r\nContent-Length: 0\r\n\r\n",
    b"SMTP ready\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * MAX_HEAD_BYTES + b"\r\n\r\n",
    # The C decoder's bounds: a chunk size of 16 hex digits at most, below 2**63; a
    # chunk-size line of 4096 bytes at most.
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8000000000000000\r\nab",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n00000000000000001\r\na\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"x" * 5000,
])
async def test_malformed_answers_are_refused(answer: bytes) -> None:
    async with raw_server(answer) as pool:
        with pytest.raises(MalformedResponse):
            await fetch(pool)
        assert pool.size == 0


async def test_a_cut_body_is_a_disconnect() -> None:
    cut = answer_once(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
    async with raw_server(cut) as pool:
        with pytest.raises(Disconnected):
            await fetch(pool)


async def test_connect_refused_and_the_limit() -> None:
    pool = ConnectionPool(URL(f"http://127.0.0.1:{free_port()}"), limit=1, connect_timeout_s=1)
    with pytest.raises(ConnectFailed):
        await pool.acquire()
    assert pool.size == 0
    pool.close()
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n") as pool:
        pool.limit = 1
        first = await pool.acquire()
        waiting = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the one slot is taken
        first.close()
        second = await asyncio.wait_for(waiting, 2)
        pool.release(second)


async def test_reading_pauses_and_resumes() -> None:
    piece = b"x" * 65536
    count = 64

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(piece) * count))
        for _ in range(count):
            writer.write(piece)
            await writer.drain()

    async with raw_server(flood) as pool:
        conn = await pool.acquire()
        await conn.send(REQUEST, b"", head_only=False)
        got = reads = 0

        def on_piece(data: bytes) -> None:
            nonlocal got, reads
            got, reads = got + len(data), reads + 1
            conn.pause_reading()

        done = conn.attach(on_piece)
        # Pieces held until attach paused reading again as they were handed on, and that
        # pause holds (rule 1); from here each turn lets one read through.
        conn.resume_reading()
        for _ in range(2_000):  # bounded: each turn lets at least one read through
            seen = reads
            for _ in range(500):  # a read arrives (and pauses reading) or the body ends
                if reads != seen or done.done():
                    break
                await asyncio.sleep(0.001)
            if done.done():
                break
            await asyncio.sleep(0.005)
            assert reads == seen + 1  # paused: nothing read meanwhile
            conn.resume_reading()
        await done
        assert got == len(piece) * count
        pool.release(conn)


async def test_deadlines_fail_a_watched_call_without_a_timer_of_its_own() -> None:
    """Rule 6: no head by the due time is a FirstByteTimeout; silence after the head for
    the idle time an IdleTimeout; both fire within DEADLINE_TICK_S of their due time."""
    release = asyncio.Event()

    async def head_then_silence(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()
        await release.wait()

    async def silence(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()

    loop = asyncio.get_running_loop()
    try:
        async with raw_server(silence) as pool:
            conn = await pool.acquire()
            started = loop.time()
            conn.watch(started + 0.2, idle_s=60)
            with pytest.raises(FirstByteTimeout):
                await conn.send(REQUEST, b"", head_only=False)
            assert 0.2 <= loop.time() - started <= 0.2 + DEADLINE_TICK_S + 0.2
            pool.release(conn)
            assert pool.size == 0  # a timed-out connection is closed, never reused
        async with raw_server(head_then_silence) as pool:
            conn = await pool.acquire()
            conn.watch(loop.time() + 60, idle_s=0.2)
            head = await conn.send(REQUEST, b"", head_only=False)
            assert head.status == 200
            pieces: list[bytes] = []
            started = loop.time()
            with pytest.raises(IdleTimeout):
                await conn.attach(pieces.append)
            assert pieces == [b"half"]
            assert 0.2 - 0.05 <= loop.time() - started <= 0.2 + DEADLINE_TICK_S + 0.2
            pool.release(conn)
    finally:
        release.set()


async def test_an_answered_call_is_never_timed_out_and_idle_connections_expire(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway._wire.KEEPALIVE_S", 0.2)
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi") as pool:
        conn = await pool.acquire()
        conn.watch(asyncio.get_running_loop().time() + 0.05, idle_s=0.05)
        await conn.send(REQUEST, b"", head_only=False)
        await conn.attach(None)
        await asyncio.sleep(0.05 + 2 * DEADLINE_TICK_S)  # past both deadlines, whole
        assert conn.complete and conn.transport is not None
        pool.release(conn)
        assert pool.size == 1
        for _ in range(100):  # bounded: expiry is due 0.2 s after the release
            if pool.size == 0:
                break
            await asyncio.sleep(0.02)
        assert pool.size == 0 and conn.transport is None
