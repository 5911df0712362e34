"""An adversarial probe of the proxy's HTTP front, over raw sockets: what the primary
receives, byte for byte, against what the client sent, and how the front frames what it
cannot take.

The primary here is :func:`recording_upstream`, a raw socket server that keeps each request
exactly as it arrived (the simulator parses it), so a test can compare bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from gateway._relay import read_body
from tests.gateway.test_relay_front import (
    CHAT,
    connection,
    gateway,
    post,
    post_after_100_continue,
    read_answer,
)
from tests.gateway.test_wire import raw_listener
from tests.utils import RunningGateway, eventually, run_gateway, waiting_in

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@dataclass
class Recorded:
    """The requests a :func:`recording_upstream` received, as (head, body) bytes."""

    requests: list[tuple[bytes, bytes]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def relayed(self) -> list[tuple[bytes, bytes]]:
        """Those the relay sent (not the gateway's own scrapes of ``/metrics``)."""
        return [(h, b) for h, b in self.requests if not h.startswith(b"GET /metrics ")]

    async def one(self) -> tuple[bytes, bytes]:
        """The one relayed request, once it came (within 5 s)."""
        async with asyncio.timeout(5):
            while not self.relayed():
                self.arrived.clear()
                await self.arrived.wait()
        (request,) = self.relayed()
        return request


@asynccontextmanager
async def recording_upstream() -> AsyncIterator[tuple[str, Recorded]]:
    """A primary that records each request's bytes and answers a small JSON 200."""
    recorded = Recorded()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(100):  # bounded: a test sends a few requests
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            recorded.requests.append((head, body))
            recorded.arrived.set()
            answer = b'{"ok":true}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()

    async with raw_listener(serve) as port:
        yield f"http://127.0.0.1:{port}", recorded


@asynccontextmanager
async def recorded_gateway(**server: object) -> AsyncIterator[tuple[RunningGateway, Recorded]]:
    async with recording_upstream() as (url, recorded), \
            run_gateway(url, server=server) as gw:
        yield gw, recorded


def header_lines(head: bytes) -> list[bytes]:
    return head.split(b"\r\n")[1:]


async def rest_of(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """What comes until the gateway closes, or for 5 s, and whether it closed (a reset
    reads as a close)."""
    got = b""
    try:
        async with asyncio.timeout(5):
            for _ in range(1000):  # bounded
                piece = await reader.read(65536)
                if not piece:
                    return got, True
                got += piece
    except ConnectionResetError:
        return got, True
    except TimeoutError:
        pass
    return got, False


# -- the request target -------------------------------------------------------------------

@pytest.mark.parametrize(("target", "forwarded"), [
    (b"http://evil.example/v1/chat/completions", b"/v1/chat/completions"),
    (b"http://evil.example:81/v1/models?q=%2F&r=1", b"/v1/models?q=%2F&r=1"),
    (b"/v1/chat/completions?a=1#fragment", b"/v1/chat/completions?a=1"),
    (b"/v1/models#/../../metrics?x", b"/v1/models"),
])
async def test_the_primary_gets_the_origin_form_of_the_target(target: bytes,
                                                              forwarded: bytes) -> None:
    """RFC 9112 3.2: the target's path and query go upstream, never the client's scheme and
    authority (the primary, or anything in front of it, would route on the client's host)
    nor a fragment (never part of a request on the wire)."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        writer.write(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        upstream_head, _ = await recorded.one()
        assert upstream_head.split(b"\r\n")[0] == b"POST " + forwarded + b" HTTP/1.1"


# -- what the primary receives ------------------------------------------------------------

@pytest.mark.parametrize("handed_over", [False, True])
async def test_a_compressed_body_reaches_the_primary_as_sent(handed_over: bool) -> None:
    """A body with a ``Content-Encoding`` is the client's to the backend: it was forwarded
    decompressed under its ``Content-Encoding: gzip`` header, a body its header lies about."""
    body = gzip.compress(CHAT)
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        if handed_over:  # aiohttp's /v1/ route, on a connection the front handed over
            writer.write(HEALTH)
            await read_answer(reader)
        writer.write(post(body, extra="Content-Encoding: gzip\r\n"))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        upstream_head, upstream_body = await recorded.one()
        assert upstream_body == body
        assert b"Content-Encoding: gzip" in header_lines(upstream_head)


async def test_a_candidate_gets_a_compressed_body_with_its_encoding() -> None:
    body = gzip.compress(CHAT)
    async with recording_upstream() as (primary_url, primary), \
            recording_upstream() as (candidate_url, candidate), \
            run_gateway(primary_url, candidates=[{"name": "c", "url": candidate_url}]) as gw, \
            connection(gw) as (reader, writer):
        writer.write(post(body, extra="Content-Encoding: gzip\r\n"))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        for upstream in (primary, candidate):
            upstream_head, upstream_body = await upstream.one()
            assert upstream_body == body
            assert b"Content-Encoding: gzip" in header_lines(upstream_head)


async def test_a_compressed_body_is_bounded_as_it_came() -> None:
    body = gzip.compress(b" " * 4096)  # 4 KiB inflated, a few dozen bytes on the wire
    async with recorded_gateway(max_body_bytes=1024) as (gw, recorded), \
            connection(gw) as (reader, writer):
        writer.write(post(body, extra="Content-Encoding: gzip\r\n"))
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert (await recorded.one())[1] == body


@pytest.mark.parametrize("handed_over", [False, True])
async def test_header_values_beyond_ascii_reach_the_primary_as_sent(handed_over: bool) -> None:
    """UTF-8 (``é`` is C3 A9) and other obs-text in a value are opaque bytes a proxy passes
    on; they were re-encoded as Latin-1 (``é`` as one byte E9, ``\\xff`` as ``?``)."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        if handed_over:
            writer.write(HEALTH)
            await read_answer(reader)
        writer.write(post(CHAT)[:-len(CHAT) - 2]
                     + b"X-Title: Jos\xc3\xa9 \xe2\x9c\x93\r\nX-Raw: a\xff\x80b\r\n\r\n" + CHAT)
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        upstream_head, _ = await recorded.one()
        lines = header_lines(upstream_head)
        assert b"X-Title: Jos\xc3\xa9 \xe2\x9c\x93" in lines and b"X-Raw: a\xff\x80b" in lines


@pytest.mark.parametrize("handed_over", [False, True])
@pytest.mark.parametrize("expectation", ["100-continue", "something-else"])
async def test_the_expectation_is_the_gateways_and_not_forwarded(handed_over: bool,
                                                                 expectation: str) -> None:
    """The gateway meets ``Expect`` itself (it reads the whole body before relaying), so the
    primary gets no ``Expect`` (nginx drops it too): forwarded, it asked the primary for a
    ``100 Continue`` no client waits for, and an aiohttp primary answers an expectation it
    does not know with a 417 the gateway then relayed as the primary's answer."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        if handed_over:
            writer.write(HEALTH)
            await read_answer(reader)
        await post_after_100_continue(reader, writer, expectation)
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200"), head
        upstream_head, upstream_body = await recorded.one()
        assert upstream_body == CHAT
        assert not [line for line in header_lines(upstream_head)
                    if line.lower().startswith(b"expect:")]


async def test_a_body_over_the_bound_is_refused_instead_of_100_continue() -> None:
    """A 413 known from the head goes at once: ``100 Continue`` went first, inviting the
    client to send a body the gateway would only drop."""
    async with gateway(max_body_bytes=100) as gw, connection(gw) as (reader, writer):
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Expect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head
        assert json.loads(body)["error"]["code"] == 413
        writer.write(b"x" * 5000)  # a client that sends it anyway: read and dropped, closed
        assert await rest_of(reader) == (b"", True)


@pytest.mark.parametrize("handed_over", [False, True])
async def test_a_body_that_stalls_is_a_408_within_the_body_timeout(handed_over: bool) -> None:
    """A client that sends a head and part of its body, then nothing: the request held its
    connection, admission slot and relay task for ever (past the header timeout, which ends
    with the head). Now it is a 408 in OpenAI's shape when ``body_timeout_s`` runs out, the
    connection closed, counted; nothing reaches the primary."""
    async with recorded_gateway(body_timeout_s=0.5) as (gw, recorded), \
            connection(gw) as (reader, writer):
        if handed_over:
            writer.write(HEALTH)
            await read_answer(reader)
        writer.write(post(CHAT)[:-10])  # all but the last 10 bytes of the body
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
        error = json.loads(body)["error"]
        assert error["code"] == 408 and "within 0.5 s" in error["message"], error
        if not handed_over:  # aiohttp's handler closes after its own linger (10 s)
            assert (await rest_of(reader))[1]
        assert gw.metric("understudy_requests_rejected_total", reason="body_timeout") == 1
        assert recorded.relayed() == []


async def test_a_slow_body_that_arrives_whole_in_time_is_relayed() -> None:
    async with recorded_gateway(body_timeout_s=5) as (gw, recorded), \
            connection(gw) as (reader, writer):
        request = post(CHAT)
        writer.write(request[:-10])
        await eventually(lambda: waiting_in(read_body))  # the gateway waits for the rest
        # A pause of the client's, well within body_timeout_s: what is under test (no 408
        # before the bound), not an ordering; a slow machine only adds to it.
        await asyncio.sleep(0.3)
        writer.write(request[-10:])
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert (await recorded.one())[1] == CHAT


# -- request boundaries -------------------------------------------------------------------

async def test_empty_lines_before_a_request_line_are_ignored() -> None:
    """RFC 9112 2.2: a server SHOULD ignore empty lines before a request line. The front
    took ``\\r\\nGET /health`` for the rest of a held request, parsed it, and, as it is not
    ``/v1/``, closed the connection without an answer."""
    async with gateway() as gw:
        async with connection(gw) as (reader, writer):
            writer.write(b"\r\n" + HEALTH)
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "ok"
        async with connection(gw) as (reader, writer):
            writer.write(b"\r\n\r\n" + post(CHAT))
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"]
            writer.write(b"\r\n")  # an extra CRLF after a request, in a write of its own
            writer.write(b"\r\n" + HEALTH)
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "ok"
        async with connection(gw) as (reader, writer):
            writer.write(post(CHAT) + b"\r\n")  # one in the write of the request (RFC 9112 2.2)
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"]
            writer.write(HEALTH)
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "ok"


async def test_a_flood_of_empty_lines_is_bounded_by_the_header_timeout() -> None:
    async with gateway(header_timeout_s=0.5) as gw, connection(gw) as (reader, writer):
        for _ in range(20):  # bounded
            writer.write(b"\r\n" * 5000)
        assert await rest_of(reader) == (b"", True)
        assert gw.metric("understudy_connections_closed_total", reason="header_timeout") == 1


async def test_a_pipelined_request_cut_short_is_not_taken_for_a_new_request() -> None:
    """The start of a pipelined request held by the parser when the answer before it ended:
    the bytes that came next were judged as a request line of their own and handed to
    aiohttp, so ``GET /health`` inside the value of ``X-Smuggled`` was served as a request
    (any parser in front of the gateway reads one ``POST`` there). Now the connection closes
    after the answer, as for any pipelined request that cannot be handed over (rule 3)."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        writer.write(post(CHAT) + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 2\r\nX-Smuggled: ")
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(b"GET /health HTTP/1.1\r\nHost: y\r\n\r\n")
        assert await rest_of(reader) == (b"", True)
        assert len(recorded.relayed()) == 1


async def test_a_pipelined_request_whole_after_its_first_bytes_is_still_served() -> None:
    """The other side of the test above: a pipelined request whose rest comes while the one
    before it is answered is parsed and answered in order, as before."""
    async with gateway() as gw, connection(gw) as (reader, writer):
        second = post(CHAT, extra="X-Request-Id: two\r\n")
        writer.write(post(CHAT, extra="X-Request-Id: one\r\n") + second[:20])
        writer.write(second[20:])
        for name in (b"one", b"two"):
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and b"X-Request-Id: " + name in head


@pytest.mark.parametrize("head", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\nContent-Length: 2\r\n\r\n{}",
    b"CONNECT /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
])
@pytest.mark.parametrize("handed_over", [False, True])
async def test_a_request_after_an_upgrade_request_is_not_lost(head: bytes,
                                                               handed_over: bool) -> None:
    """The gateway never switches protocols (``Upgrade`` is hop-by-hop; the primary answers
    as for any request), so what follows such a request is the next request. aiohttp's
    parser keeps those bytes apart (websocket, CONNECT) or drops them (h2c): the front lost a
    request pipelined behind one, and the client waited for its answer until the keep-alive
    timeout (aiohttp's own server, for h2c, too). Now the answer to an upgrade request
    closes the connection: a pipelined request after it is retried on another (RFC 9112
    9.3.2), and nothing was parsed out of it."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        if handed_over:
            writer.write(HEALTH)
            await read_answer(reader)
        writer.write(head + post(CHAT))
        answer, _ = await read_answer(reader)
        rest, closed = await rest_of(reader)
        # Answered (aiohttp, for websocket) or closed, never left waiting for.
        assert rest.startswith(b"HTTP/1.1 200") or (rest, closed) == (b"", True), rest
        if not handed_over:  # the front's answer to it said so
            assert b"Connection: close" in answer and (rest, closed) == (b"", True)
            assert len(recorded.relayed()) == 1


# -- request framing ----------------------------------------------------------------------

def chunked_post(transfer_encoding: bytes, *, version: bytes = b"1.1") -> bytes:
    return (b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: " + transfer_encoding
            + b"\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(CHAT), CHAT))


@pytest.mark.parametrize("codings", [b"gzip, chunked", b"identity, chunked",
                                     b"x-custom ,chunked"])
@pytest.mark.parametrize("handed_over", [False, True])
async def test_a_transfer_coding_other_than_chunked_is_a_501(codings: bytes,
                                                             handed_over: bool) -> None:
    """RFC 9112 6.1: a server that receives a transfer coding it does not understand SHOULD
    answer 501 and close. The parser takes any list that ends in ``chunked`` as chunked, so
    ``gzip, chunked`` was relayed with its body still gzip-coded under a plain
    ``Content-Length`` (nginx answers 501). Now: 501 in OpenAI's shape, ``Connection:
    close``, closed, counted; nothing reaches the primary."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        if handed_over:
            writer.write(HEALTH)
            await read_answer(reader)
        writer.write(chunked_post(codings))
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 501") and b"Connection: close" in head, head
        error = json.loads(body)["error"]
        assert error["code"] == 501 and "Transfer-Encoding" in error["message"], error
        assert (await rest_of(reader))[1]
        assert gw.metric("understudy_requests_rejected_total",
                         reason="transfer_coding") == 1
        assert gw.metric("understudy_requests_total", route="chat_completions",
                         status="501") == 1
        assert recorded.relayed() == []


@pytest.mark.parametrize("handed_over", [False, True])
async def test_an_http10_request_with_transfer_encoding_is_a_400(handed_over: bool) -> None:
    """RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding MUST be treated as having
    faulty framing (an HTTP/1.0 hop before the gateway reads its body by Content-Length or
    to the close: a request smuggled in the difference). It was relayed as chunked; nginx
    answers 400. Now: 400 in OpenAI's shape, closed, counted; nothing reaches the primary."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        if handed_over:
            writer.write(HEALTH)
            await read_answer(reader)
        writer.write(chunked_post(b"chunked", version=b"1.0"))
        head, body = await read_answer(reader)
        assert head.split(b" ")[1] == b"400", head  # HTTP/1.0: closing is the default
        assert json.loads(body)["error"]["code"] == 400
        assert (await rest_of(reader))[1]
        assert gw.metric("understudy_requests_rejected_total", reason="faulty_framing") == 1
        assert recorded.relayed() == []


async def test_plain_chunked_requests_are_relayed_on_a_kept_alive_connection() -> None:
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        for codings in (b"chunked", b"Chunked"):
            writer.write(chunked_post(codings))
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" not in head
        assert [body for _, body in recorded.relayed()] == [CHAT, CHAT]


async def test_a_body_over_the_bound_is_refused_instead_of_100_continue_when_handed_over(
) -> None:
    """The same on aiohttp's ``/v1/`` route (a connection the front handed over): aiohttp's
    default expect handler sent ``100 Continue``, then the 413, and kept the connection,
    so a client that never sent the body had its next request read as that body."""
    async with gateway(max_body_bytes=100) as gw, connection(gw) as (reader, writer):
        writer.write(HEALTH)
        await read_answer(reader)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Expect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
        head, body = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head, head
        assert json.loads(body)["error"]["code"] == 413
        assert gw.metric("understudy_requests_rejected_total", reason="body_too_large") == 1


async def test_100_continue_still_comes_within_the_bound_when_handed_over() -> None:
    async with gateway() as gw, connection(gw) as (reader, writer):
        writer.write(HEALTH)
        await read_answer(reader)
        await post_after_100_continue(reader, writer)
        head, answer = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(answer)["choices"]


@pytest.mark.parametrize("head", [
    b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    b"GET http://x HTTP/1.1\r\nHost: x\r\n\r\n",
])
@pytest.mark.parametrize("listener", ["proxy", "admin"])
async def test_a_target_that_is_no_path_is_a_400_in_json(head: bytes, listener: str) -> None:
    """It matched no route: aiohttp answered a plain-text '404: Not Found'."""
    async with gateway() as gw:
        url = gw.url if listener == "proxy" else gw.admin_url.removesuffix("/admin/v1")
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head)
            answer, body = await read_answer(reader)
        finally:
            writer.close()
        assert answer.startswith(b"HTTP/1.1 400") and b"application/json" in answer, answer
        assert json.loads(body)["error"]["code"] == 400


@pytest.mark.parametrize("split", [600, None])  # the line spans reads, or one write
@pytest.mark.parametrize("handed_over", [False, True])
async def test_a_request_line_past_the_bound_is_a_414_and_a_header_a_431(
        handed_over: bool, split: int | None) -> None:
    """RFC 9112 3: a request-target longer than the server parses MUST be a 414 (nginx's
    answer); the parser's one error for any line too long made it a 431 like a header."""
    async with gateway(max_header_field_bytes=1024) as gw:
        for head, status, reason in (
                (b"GET /v1/models?q=" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"414", "uri_too_long"),
                (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 2000 + b"\r\n\r\n",
                 b"431", "headers_too_large")):
            async with connection(gw) as (reader, writer):
                if handed_over:
                    writer.write(HEALTH)
                    await read_answer(reader)
                for piece in (head[:split], head[split:]) if split else (head,):
                    writer.write(piece)
                    await asyncio.sleep(0.05)
                answer, body = await read_answer(reader)
                assert answer.split(b" ")[1] == status, answer
                assert json.loads(body)["error"]["code"] == int(status)
                assert (await rest_of(reader))[1]
            assert gw.metric("understudy_connections_closed_total", reason=reason) == 1


@pytest.mark.parametrize("request_line", [b"GET /v1/models HTTP/2.0\r\nHost: x",
                                          b"GET /health HTTP/2.0\r\nHost: x",
                                          b"GET /v1/models"])  # HTTP/0.9's request line
@pytest.mark.parametrize("handed_over", [False, True])
async def test_a_request_in_another_major_version_is_a_505(request_line: bytes,
                                                          handed_over: bool) -> None:
    """The gateway speaks HTTP/1.x only: 'GET /v1/models HTTP/2.0' (no HTTP/2 frames, a
    confused or probing client) was relayed and answered '200', on a handed-over connection
    with the status line 'HTTP/2.0 200 OK' (aiohttp echoes the request's version). nginx
    answers 505. Now: 505 in OpenAI's shape, an HTTP/1.1 status line, closed, counted."""
    async with recorded_gateway() as (gw, recorded), connection(gw) as (reader, writer):
        if handed_over:
            writer.write(HEALTH)
            await read_answer(reader)
        writer.write(request_line + b"\r\n\r\n")
        answer, body = await read_answer(reader)
        assert answer.startswith(b"HTTP/1.1 505 "), answer
        assert json.loads(body)["error"]["code"] == 505
        assert (await rest_of(reader))[1]
        assert gw.metric("understudy_connections_closed_total", reason="http_version") == 1
        assert recorded.relayed() == []
