"""The proxy's own HTTP/1.1 server for the relayed routes (``/v1/``), on the proxy's socket.

Why (issue 15): aiohttp's server layer (its request object, router, a handler task per
request, the response writer) cost ~47-51 µs of CPU per small request where a bare uvloop
``Protocol`` costs ~5 µs; the relay itself was already lean. Here a connection is an
asyncio ``Protocol`` that parses requests with aiohttp's own C parser (llhttp), runs
``_relay.py:relay`` in one task per request, and writes the answer's head and end itself.

Rules:
1. Every connection starts here. At each request boundary the request line's target
   decides: ``/v1/...`` is read and relayed here; anything else (``/metrics``,
   ``/health``; the admin API has a listener of its own) hands the connection, with the bytes
   read so far, to aiohttp's protocol (``_connections.py``'s guarded handler) for the rest
   of its life, so aiohttp serves it exactly as before (its ``/v1/`` route relays too).
2. Requests are parsed by aiohttp's parser with aiohttp's bounds (``max_header_field_bytes``,
   ``max_header_count``), bodies left as they came (no ``Content-Encoding`` decoded: the
   primary gets them as sent, and ``max_body_bytes`` bounds what came); what it refuses
   is answered as aiohttp's guarded handler answers: OpenAI-style JSON, 431 for header
   overflows, 414 for a request line past the bound, else 400, counted, and the connection
   closed.
   ``Expect: 100-continue`` is answered ``100 Continue`` as the request starts (aiohttp's
   default expect handler does the same), so a client waiting for it sends its body at once;
   unless its ``Content-Length`` is past ``max_body_bytes``: the 413 is known from the head,
   and goes at once instead (RFC 9110 §10.1.1), so the client does not send a body to drop.
3. One request at a time per connection. Pipelined requests wait in the parser (it pauses
   after each whole message) and the connection stops reading while one waits. A pipelined
   request that is not ``/v1/`` cannot be handed over (its bytes are parsed already): the
   connection closes after the answers before it, which RFC 9112 §9.3.2 allows (the client
   retries it). So does one whose start the parser holds when the answer before it ends:
   the bytes after it continue it, whatever they look like, and the parser cannot be
   asked where it stands without ending it (a request line there would be a request
   smuggled inside a header value). So does the answer to a request that asks to switch
   protocols (``Upgrade``, ``CONNECT``): the gateway never switches, and aiohttp's parser
   keeps apart or drops the bytes after such a request. At a boundary, empty lines before
   a request line are dropped (RFC 9112 §2.2); bytes that do not start a request line go
   to the parser.
4. The bounds of ``_connections.py`` hold here too, counted with the same reasons: admission
   (``ConnectionGuard``, 503), a request head whole within ``header_timeout_s`` of its first
   byte (of the connection's start for its first), an idle keep-alive connection closed after
   ``keepalive_timeout_s``. Deadlines cost nothing per request: one timer per server checks
   its connections every ``DEADLINE_TICK_S`` (a deadline fires up to that late).
5. A client that goes away cancels its request's task: the relay closes its upstream call.
6. A request refused before its body was read (413, 431) is answered with
   ``Connection: close``; the rest of its body is read and dropped for up to ``LINGER_S``
   so that a client still sending reads the answer, not a reset.
7. Shutdown is aiohttp's runner's (``_app.py``): each connection is registered with its
   ``Server``; ``close`` ends an idle one at once and a busy one after its answer;
   ``shutdown`` waits for the answer in flight up to the timeout, then cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

from aiohttp import StreamReader, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpParser, HttpRequestParser, RawRequestMessage
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from gateway._connections import (
    VERSION_REFUSAL,
    ConnectionGuard,
    GatewayRunner,
    _GuardedServer,
    openai_error_body,
    parser_refusal,
    request_line,
)
from gateway._headers import wire_text
from gateway._relay import MAX_HELD_BYTES, origin_form, relay
from gateway._relaycore import ClientSink

if TYPE_CHECKING:
    from collections.abc import Sequence

    from multidict import CIMultiDict, CIMultiDictProxy

    from gateway._exceptions import GatewayError
    from gateway._state import GatewayState

__all__ = ["DEADLINE_TICK_S", "LINGER_S", "FrontRunner"]

log = logging.getLogger("understudy.gateway")

DEADLINE_TICK_S: Final = 0.25
"""How often a server checks its connections' header and keep-alive deadlines (rule 4)."""
LINGER_S: Final = 1.0
"""How long the unread body of a refused request is read and dropped (rule 6)."""
READ_BUFFER_BYTES: Final = 2**16
"""A request body's buffer before the connection stops reading (aiohttp's ``read_bufsize``)."""

_RELAYED = b"/v1/"
_MAX_METHOD = 16
_METHOD = re.compile(rb"[A-Z]{1,16}\Z")
_NO_BODY_STATUSES = frozenset({204, 304})
_TERMINAL_CHUNK = b"0\r\n\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_EMPTY_LINE = (b"\r", b"\n")

# Where a connection is (rule 4's deadlines are kept for the first two).
_HEAD, _IDLE, _BUSY = range(3)
# What the bytes at a request boundary are (rule 1, 3).
_UNDECIDED, _OURS, _AIOHTTPS, _CONTINUATION = range(4)


def _boundary(raw: bytes) -> int:
    """What ``raw``, the bytes at a request boundary, begin: a ``/v1/`` request line, another
    request line, too few bytes to tell, or no request line at all."""
    space = raw.find(b" ", 0, _MAX_METHOD + 1)
    if space < 0:
        return _UNDECIDED if len(raw) <= _MAX_METHOD and _METHOD.match(raw) else _CONTINUATION
    if not _METHOD.match(raw, 0, space):
        return _CONTINUATION
    target = raw[space + 1:space + 1 + len(_RELAYED)]
    if len(target) < len(_RELAYED) and _RELAYED.startswith(target):
        return _UNDECIDED
    return _OURS if target == _RELAYED else _AIOHTTPS


class FrontServer(_GuardedServer):
    """aiohttp's ``Server`` whose connections start as :class:`FrontConnection` (rule 1).

    Made by :class:`FrontRunner` from the server aiohttp builds (its class swapped, as
    ``GatewayRunner`` does), so the runner's sites and shutdown use it unchanged."""

    state: GatewayState
    fronts: set[FrontConnection]
    ticking: asyncio.TimerHandle | None

    def __call__(self) -> RequestHandler:
        # The loop takes any protocol; aiohttp's signature names its own.
        return FrontConnection(self)  # type: ignore[return-value]

    def aiohttp_handler(self) -> RequestHandler:
        return super().__call__()

    def track(self, conn: FrontConnection) -> None:
        self.fronts.add(conn)
        if self.ticking is None:
            self.ticking = self._loop.call_later(DEADLINE_TICK_S, self._tick)

    def _tick(self) -> None:
        self.ticking = None
        now = self._loop.time()
        for conn in list(self.fronts):
            conn.check_deadline(now)
        if self.fronts:
            self.ticking = self._loop.call_later(DEADLINE_TICK_S, self._tick)


class FrontRunner(GatewayRunner):
    """The proxy's runner: ``GatewayRunner``'s bounds, connections served by the front."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, state: GatewayState,
                 **kwargs: Any) -> None:
        # A connection handed over relays ``/v1/`` too: its bodies as they came (rule 2).
        super().__init__(app, guard, auto_decompress=False, **kwargs)
        self._state = state

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = FrontServer
        assert isinstance(server, FrontServer)
        server.state = self._state
        server.fronts = set()
        server.ticking = None
        return server


class FrontConnection(BaseProtocol):
    """One client connection while its requests are ``/v1/`` (rules 1-7)."""

    __slots__ = (
        "_admitted", "_at_boundary", "_closing", "_due", "_ip", "_line_bytes", "_line_ended",
        "_phase", "_queued", "_raw", "_request", "_scheme", "_server", "_task",
    )

    def __init__(self, server: FrontServer) -> None:
        config = server.state.config.server
        super().__init__(server._loop, HttpRequestParser(
            self, server._loop, READ_BUFFER_BYTES,
            max_line_size=config.max_header_field_bytes,
            max_field_size=config.max_header_field_bytes,
            max_headers=config.max_header_count,
            payload_exception=RequestPayloadError,
            auto_decompress=False,  # rule 2: the body is forwarded as it came
            max_msg_queue_size=1,  # the parser pauses after each whole message (rule 3)
        ))
        self._server = server
        self._admitted = False
        self._ip = ""
        self._scheme = "http"
        self._raw = b""
        self._at_boundary = True
        self._line_bytes = 0  # the request line being parsed (rule 2's 414), and whether it
        self._line_ended = False  # has ended
        self._phase = _HEAD
        self._due = 0.0
        self._closing = False
        self._queued: tuple[RawRequestMessage, StreamReader] | None = None
        self._request: FrontRequest | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def parser(self) -> HttpParser[Any]:
        assert self._parser is not None
        return self._parser

    # -- the connection -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server = self._server
        peer = transport.get_extra_info("peername")
        self._ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if transport.get_extra_info("sslcontext") is not None:
            self._scheme = "https"
        refusal = server.guard.admit(self._ip)
        if refusal is not None:  # answered and closed as aiohttp's guarded handler does
            server.guard.closed(refusal)
            self._write_error(503, "too many connections; retry later", "server_busy", None)
            return
        self._admitted = True
        server.connection_made(self, transport)  # type: ignore[arg-type]
        server.track(self)
        self._due = self._loop.time() + server.state.config.server.header_timeout_s

    def connection_lost(self, exc: BaseException | None) -> None:
        self._leave()
        request = self._request
        if request is not None and not request.content.is_eof():
            request.content.set_exception(ConnectionResetError("the client went away"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # rule 5
        super().connection_lost(exc)

    def _leave(self) -> None:
        """Give back what the server counts for this connection (closed, or handed over)."""
        server = self._server
        server.fronts.discard(self)
        server._connections.pop(self, None)  # type: ignore[call-overload]
        if self._admitted:
            self._admitted = False
            server.guard.release(self._ip)

    def check_deadline(self, now: float) -> None:
        if self._phase == _BUSY or now < self._due or self.transport is None:
            return
        self._server.guard.closed("header_timeout" if self._phase == _HEAD
                                  else "keepalive_timeout")
        self._phase = _BUSY  # counted once
        self.transport.close()

    def close(self) -> None:
        """Rule 7: end now if idle, else after the answer in flight."""
        self._closing = True
        if self._task is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None) -> None:  # noqa: ASYNC109 - aiohttp's
        self._closing = True
        task = self._task
        if task is not None:
            await asyncio.wait((task,), timeout=timeout)
            if not task.done():
                task.cancel()
                await asyncio.wait((task,), timeout=timeout)
        if self.transport is not None:
            self.transport.close()

    # -- reading --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self._at_boundary:
            raw = self._raw + data if self._raw else data
            if raw[:1] in _EMPTY_LINE:  # rule 3: empty lines before a request line
                raw = raw.lstrip(b"\r\n")
            if not raw:
                return
            if self._phase == _IDLE:
                self._phase = _HEAD
                self._due = self._loop.time() + self._server.state.config.server.header_timeout_s
            kind = _boundary(raw)
            if kind == _UNDECIDED:
                self._raw = raw
                return
            self._raw = b""
            self._at_boundary = False
            if kind == _AIOHTTPS:
                self._hand_over(raw)
                return
            data = raw
            self._line_bytes, self._line_ended = 0, False
        if not self._line_ended:
            self._line_bytes, self._line_ended = request_line(self._line_bytes, data)
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            messages, _, _ = self.parser.feed_data(data)
        except HttpProcessingError as exc:
            self._refuse_unparsed(exc)
            return
        for message, payload in messages:
            if self._request is None and self._queued is None:
                self._start(message, payload)
            else:  # pipelined (rule 3): waits, and nothing more is read meanwhile
                self._queued = (message, payload)
                self._pause_reading_for_buffer()

    def _hand_over(self, raw: bytes) -> None:
        """Rule 1: the connection, and ``raw``, to aiohttp's protocol."""
        transport = self.transport
        assert transport is not None
        self._leave()
        self.transport = None
        handler = self._server.aiohttp_handler()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        handler.data_received(raw)

    def _refuse_unparsed(self, exc: HttpProcessingError) -> None:
        """Rule 2, as ``_connections.py``'s ``handle_error``."""
        self._closing = True
        if self._request is not None:
            return  # an answer is in flight: the connection closes after it
        refusal = parser_refusal(exc, self._line_bytes,
                                 self._server.state.config.server.max_header_field_bytes)
        self._server.guard.closed(refusal.reason)
        self._write_error(refusal.status, refusal.message, "invalid_request_error", None)

    def _write_error(self, status: int, message: str, error_type: str,
                     request_id: str | None) -> None:
        transport = self.transport
        if transport is None:
            return
        transport.write(error_answer(status, openai_error_body(message, error_type, status),
                                     request_id, close=True))
        self._phase = _BUSY
        transport.close()

    # -- one request ----------------------------------------------------------------------

    def _start(self, message: RawRequestMessage, payload: StreamReader) -> None:
        self._phase = _BUSY
        self._at_boundary = False
        if not message.path.startswith("/v1/"):  # rule 3: a pipelined one, not ours
            self._closing = True
            if self.transport is not None:
                self.transport.close()
            return
        if message.version.major != 1:  # _connections.py rule 8
            self._closing = True
            self._server.guard.closed(VERSION_REFUSAL.reason)
            self._write_error(VERSION_REFUSAL.status, VERSION_REFUSAL.message,
                              "invalid_request_error", None)
            return
        if message.version >= (1, 1) and self.transport is not None \
                and message.headers.get("Expect", "").lower() == "100-continue" \
                and int(message.headers.get("Content-Length", 0)) \
                <= self._server.state.config.server.max_body_bytes:  # rule 2
            self.transport.write(_CONTINUE)  # as aiohttp's default expect handler does
        self._request = request = FrontRequest(self, message, payload)
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: FrontRequest) -> None:
        try:
            await relay(request, self._server.state)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the relay's own failure: as aiohttp answers it, a 500
            if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
                status, text, kind = 400, "malformed HTTP request", "invalid_request_error"
            else:
                log.exception("error relaying a request from %s", self._ip)
                status, text, kind = 500, "internal error of the gateway", "internal_error"
            if request.answered:
                request.cut()
            else:
                request.answered = True
                self._write_error(status, text, kind, None)
        if not request.content.is_eof() and self.transport is not None:
            await _drop_body(request.content, LINGER_S)  # rule 6
            self._closing = True
        self._done(request)

    def _done(self, request: FrontRequest) -> None:
        self._task = None
        self._request = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._closing or not request.keep_alive:
            transport.close()
            return
        self._phase = _IDLE
        self._at_boundary = True
        self._due = self._loop.time() + self._server.state.config.server.keepalive_timeout_s
        parser = self.parser
        parser.message_consumed()
        queued, self._queued = self._queued, None
        if queued is not None:
            self._start(*queued)
            self._resume_reading_for_buffer()
            return
        self._feed(b"")  # a pipelined request the parser held, if any (rule 3)
        if self._request is None and not transport.is_closing() and self._holds_a_start():
            self._closing = True  # rule 3: the start of one, cut short
            transport.close()

    def _holds_a_start(self) -> bool:
        """Whether the parser holds the start of a request (past its whole messages). Only
        ``feed_eof`` tells, and it ends that request: ask only when closing follows."""
        try:
            return self.parser.feed_eof() is not None
        except HttpProcessingError:
            return True


async def _drop_body(content: StreamReader, within_s: float) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(within_s):
            while await content.readany():
                pass


def error_answer(status: int, body: bytes, request_id: str | None, *, close: bool) -> bytes:
    """A whole JSON answer: head and body, for one write."""
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n")
    if request_id:
        head += f"X-Request-Id: {wire_text(request_id)}\r\n"  # the client's bytes
    if close:
        head += "Connection: close\r\n"
    return (head + "\r\n").encode("latin-1", "replace") + body


class FrontRequest:
    """A ``_relay.py:RelayClient``: one request read by a :class:`FrontConnection`."""

    __slots__ = ("_conn", "_message", "answered", "content", "keep_alive", "path")

    def __init__(self, conn: FrontConnection, message: RawRequestMessage,
                 payload: StreamReader) -> None:
        self._conn = conn
        self._message = message
        self.content = payload
        self.path = message.url.path
        self.keep_alive = not message.should_close and not message.upgrade  # rule 3
        self.answered = False

    @property
    def method(self) -> str:
        return self._message.method

    @property
    def version(self) -> tuple[int, int]:
        return self._message.version

    @property
    def raw_path(self) -> str:
        return origin_form(self._message.path, self._message.url)

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self._message.headers

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self._message.raw_headers

    @property
    def content_length(self) -> int | None:
        value = self._message.headers.get("Content-Length")
        return int(value) if value is not None else None

    @property
    def client_ip(self) -> str | None:
        return self._conn._ip or None

    @property
    def scheme(self) -> str:
        return self._conn._scheme

    def refuse(self, error: GatewayError, request_id: str | None) -> None:
        self.answered = True
        transport = self._conn.transport
        if transport is None:
            return
        close = error.closes_connection or not self.content.is_eof()  # rule 6
        status = error.status_hint
        transport.write(error_answer(
            status, openai_error_body(str(error), error.error_type, status), request_id,
            close=close or not self.keep_alive))
        if close:
            self.keep_alive = False

    async def begin(self, status: int, reason: str, headers: CIMultiDict[str], *,
                    live_soon: bool) -> FrontStream:
        self.answered = True
        conn = self._conn
        transport = conn.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        message = self._message
        if message.method == "HEAD" or status in _NO_BODY_STATUSES or status < 200:
            framing = _NO_BODY
        elif "Content-Length" in headers:
            framing = _LENGTH
        elif message.version >= (1, 1):
            framing = _CHUNKED
        else:
            framing = _UNTIL_CLOSE
            self.keep_alive = False
        if conn._closing:
            self.keep_alive = False
        return FrontStream(transport, conn, status, reason, headers, framing,
                           self.keep_alive, message.version < (1, 1), live_soon=live_soon)

    async def end(self, stream: Any) -> None:
        assert isinstance(stream, FrontStream)
        stream.end()

    def cut(self) -> None:
        self.keep_alive = False
        transport = self._conn.transport
        if transport is not None:
            transport.abort()


# How an answer's body is framed to the client.
_NO_BODY, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)


class FrontStream(ClientSink):
    """The client's writer of one answer (``_relay.py:ClientStream``'s contract): pieces
    held until the stream goes live (a stream, on the loop's next iteration) or the answer
    ends or passes ``MAX_HELD_BYTES``; then the head and what was held leave in one write,
    and each piece after it is framed and written by the C base."""

    __slots__ = ("_framing", "_head", "_keep_alive")

    def __init__(self, transport: asyncio.Transport, conn: FrontConnection, status: int,
                 reason: str, headers: CIMultiDict[str], framing: int, keep_alive: bool,
                 http10: bool, *, live_soon: bool) -> None:
        super().__init__(transport, conn, framing == _CHUNKED, MAX_HELD_BYTES)
        self._framing = framing
        self._keep_alive = keep_alive
        # Each line joined in C (``": ".join`` of a name and value pair), not formatted: an
        # f-string per header was ~1.5x the time of this for a typical answer's head (timeit).
        lines = [f"HTTP/1.1 {status} {reason}", *map(": ".join, headers.items())]
        if not keep_alive:
            lines.append("Connection: close")
        elif http10:
            lines.append("Connection: keep-alive")
        lines.append("")
        self._head = "\r\n".join(lines)
        if live_soon:
            conn._loop.call_soon(self.go_live)

    @property
    def gone(self) -> bool:
        return self._transport.is_closing()

    async def drain(self) -> None:
        protocol: FrontConnection = self._protocol
        await protocol._drain_helper()

    def _head_bytes(self, length: int | None) -> bytes:
        head = self._head
        if self._framing == _CHUNKED:
            head += "Transfer-Encoding: chunked\r\n"
        elif length is not None:
            head += f"Content-Length: {length}\r\n"
        return (head + "\r\n").encode("latin-1", "replace")

    def go_live(self) -> None:
        held, self._held = self._held, None
        if held is None or self._transport.is_closing():
            return
        body = b"".join(held)
        if body and self._framing == _CHUNKED:
            body = b"%x\r\n%b\r\n" % (len(body), body)
        self._transport.write(self._head_bytes(None) + body)

    def end(self) -> None:
        """The answer's end: a whole answer never live leaves in one write, with its length."""
        transport = self._transport
        if transport.is_closing():
            return
        held, self._held = self._held, None
        if held is None:
            if self._framing == _CHUNKED:
                transport.write(_TERMINAL_CHUNK)
            return
        body = b"".join(held)
        if self._framing == _CHUNKED:
            self._framing = _LENGTH  # the whole body is here: its length, not chunks
            transport.write(self._head_bytes(len(body)) + body)
        else:
            transport.write(self._head_bytes(None) + body)
        if self._framing == _UNTIL_CLOSE:
            transport.close()
