"""Bounds on the gateway's client connections, kept where aiohttp reads them.

Rules (issue 12: slowloris, floods, oversized headers):
1. A connection beyond ``server.max_connections`` in all, or beyond
   ``server.max_connections_per_ip`` from one address, is answered 503 (OpenAI-style
   JSON, ``Connection: close``) and closed at once, before anything of it is parsed.
2. A request's headers must arrive whole within ``server.header_timeout_s`` of its first
   byte (for a connection's first request: of the connection's start); else the
   connection is closed. One timer per request, armed on its first byte and cancelled
   when its handler starts: nothing per chunk, so the relay's hot path pays nothing.
3. An idle keep-alive connection is closed after ``server.keepalive_timeout_s``
   (aiohttp's own timer; aiohttp arms it at a connection's start too).
4. aiohttp's own answers to requests it cannot parse (a header line over
   ``max_header_field_bytes``, more than ``max_header_count`` headers, bad framing) are
   OpenAI-style JSON; header overflows answer 431, a request line past
   ``max_header_field_bytes`` 414 (as nginx, RFC 9112 §3). The total of a request's header bytes
   (``max_header_bytes``) is checked by the proxy route before it forwards (``_app.py``).
5. Each bound exceeded is counted once in ``understudy_connections_closed{reason}``;
   ``understudy_connections_open`` is the number admitted now.
6. After a request that asks to switch protocols where aiohttp does not (``Upgrade: h2c``,
   say: only websocket and ``CONNECT`` are kept apart), aiohttp's parser drops the bytes
   that came after it; the connection closes after its answer, so a request pipelined
   behind it is retried on another connection (RFC 9112 §9.3.2), never left unanswered.
7. A request target that is no path (``OPTIONS *``, ``CONNECT host:443``, ``http://host``
   without one) matches no route, and aiohttp answered it with a plain-text 404: it is a
   400 in OpenAI's shape (nginx answers 400), on the admin listener too.
8. A request whose major version is not 1 (``HTTP/2.0`` in a request line, no HTTP/2 frames;
   HTTP/0.9's bare ``GET /path``) was served, aiohttp's status line echoing its version
   (``HTTP/2.0 200 OK``): it is a 505 in OpenAI's shape with an HTTP/1.1 status line, the
   connection closed, counted as ``http_version`` (nginx answers 505).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway._config import ServerConfig

__all__ = [
    "VERSION_REFUSAL",
    "ConnectionClose",
    "ConnectionGuard",
    "GatewayRunner",
    "ParserRefusal",
    "openai_error_body",
    "parser_refusal",
    "request_line",
]

ConnectionClose = Literal[
    "max_connections", "max_connections_per_ip", "header_timeout", "keepalive_timeout",
    "headers_too_large", "uri_too_long", "bad_request", "http_version",
]
"""Why the gateway closed a client connection: the ``reason`` label of
``understudy_connections_closed``."""


def openai_error_body(message: str, error_type: str, code: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": None,
                                   "code": code}})


@dataclass(frozen=True, slots=True)
class ParserRefusal:
    """How a request the HTTP parser refused is answered and counted (rule 4)."""

    status: int
    message: str
    reason: ConnectionClose


_HEADERS_TOO_LARGE = ParserRefusal(431, "request header fields too large", "headers_too_large")
_URI_TOO_LONG = ParserRefusal(414, "request target too long", "uri_too_long")
_MALFORMED = ParserRefusal(400, "malformed HTTP request", "bad_request")
VERSION_REFUSAL = ParserRefusal(505, "HTTP version not supported: the gateway speaks HTTP/1.x",
                                "http_version")
"""Rule 8: a request whose major version is not 1."""


def parser_refusal(exc: HttpProcessingError, request_line_bytes: int,
                   max_line_bytes: int) -> ParserRefusal:
    """A request line past ``max_line_bytes`` is a 414 (RFC 9112 §3: MUST), a header line or
    count past the bounds a 431; anything else the parser refuses, 400. The parser's error
    does not say which line was too long; the request line's length does
    (it counts the method and version too: a target within a few bytes of the bound beside a
    header past it reads as a 414)."""
    if isinstance(exc, LineTooLong):
        return _URI_TOO_LONG if request_line_bytes > max_line_bytes else _HEADERS_TOO_LARGE
    return _HEADERS_TOO_LARGE if "Too many headers" in str(exc) else _MALFORMED


def request_line(so_far: int, data: bytes) -> tuple[int, bool]:
    """The request line's length after ``data`` came (``so_far`` before), and whether it
    ended in ``data``. Called per read only until it ends: one ``find`` per request."""
    end = data.find(b"\n")
    return (so_far + len(data), False) if end < 0 else (so_far + end, True)


_BUSY = openai_error_body("too many connections; retry later", "server_busy", 503)
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode()
                  + b"\r\n\r\n" + _BUSY)


class ConnectionGuard:
    """Counts admitted connections, in all and per client address (rule 1)."""

    __slots__ = ("_per_ip", "closed", "config", "open")

    def __init__(self, config: ServerConfig, closed: Callable[[ConnectionClose], None]) -> None:
        self.config = config
        self.closed = closed  # counts one closing, by reason
        self.open = 0
        self._per_ip: Counter[str] = Counter()

    def admit(self, ip: str) -> ConnectionClose | None:
        """Take a slot for a connection from ``ip``; the reason when there is none."""
        if self.open >= self.config.max_connections:
            return "max_connections"
        if self._per_ip[ip] >= self.config.max_connections_per_ip:
            return "max_connections_per_ip"
        self.open += 1
        self._per_ip[ip] += 1
        return None

    def release(self, ip: str) -> None:
        self.open -= 1
        self._per_ip[ip] -= 1
        if self._per_ip[ip] <= 0:
            del self._per_ip[ip]


async def _not_a_path(request: BaseRequest) -> web.StreamResponse:
    """Rule 7: a request target with no path to route (``*``, ``host:port``)."""
    return web.Response(status=400, content_type="application/json", body=openai_error_body(
        "the request target is not a path", "invalid_request_error", 400))


async def _version_not_supported(_: BaseRequest) -> web.StreamResponse:
    """Rule 8."""
    response = web.Response(status=505, content_type="application/json", body=openai_error_body(
        VERSION_REFUSAL.message, "invalid_request_error", 505))
    response.force_close()
    return response


class _GuardedHandler(RequestHandler):
    """aiohttp's protocol with the bounds of rules 1, 2 and 4 and the counting of 3."""

    __slots__ = ("_admitted", "_guard", "_header_deadline", "_ip", "_line_bytes", "_line_ended")

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._ip = ""
        self._admitted = False
        self._header_deadline: asyncio.TimerHandle | None = None
        self._line_bytes = 0  # the request line being read (rule 4's 414), and whether it
        self._line_ended = False  # has ended

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refusal = self._guard.admit(self._ip)
        if refusal is not None:
            self._guard.closed(refusal)
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(_BUSY_RESPONSE)
            self.force_close()  # closes the transport once the answer is flushed
            return
        self._admitted = True
        self._arm_header_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_header_deadline()
        if self._admitted:
            self._admitted = False
            self._guard.release(self._ip)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and not self._request_in_progress:
            self._arm_header_deadline()  # the first byte of the next request
            self._line_bytes, self._line_ended = 0, False
        if not self._line_ended:
            self._line_bytes, self._line_ended = request_line(self._line_bytes, data)
        super().data_received(data)

    async def _handle_request(
        self, request: BaseRequest, start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        self._disarm_header_deadline()
        if request._message.version.major != 1:  # rule 8 (read before .version caches it)
            self._guard.closed(VERSION_REFUSAL.reason)
            # aiohttp's status line echoes the request's version ("HTTP/2.0 505").
            request._version = HttpVersion11
            request_handler = _version_not_supported
        elif not request.rel_url.path.startswith("/"):  # rule 7
            request_handler = _not_a_path
        response, reset = await super()._handle_request(request, start_time, request_handler)
        if request._message.upgrade and not self._upgraded:  # rule 6
            response.force_close()
        return response, reset

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self._loop.call_later(self._guard.config.header_timeout_s,
                                                      self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self._request_in_progress or self._messages or self._force_close:
            return  # the headers did arrive; the handler has them or will
        self._guard.closed("header_timeout")
        self.force_close()

    def _process_keepalive(self) -> None:
        open_before = not self._force_close
        super()._process_keepalive()
        if open_before and self._force_close:
            self._guard.closed("keepalive_timeout")

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's own error answers, as OpenAI-style JSON (rule 4)."""
        if isinstance(exc, HttpProcessingError):
            refusal = parser_refusal(exc, self._line_bytes,
                                     self._guard.config.max_header_field_bytes)
            status = refusal.status if refusal.status in (414, 431) else status
            self._guard.closed(refusal.reason)
            text, error_type = refusal.message, "invalid_request_error"
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            text, error_type = "internal error of the gateway", "internal_error"
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun; it cannot become an error")
        response = web.Response(status=status, body=openai_error_body(text, error_type, status),
                                content_type="application/json")
        response.force_close()
        return response


class _GuardedServer(web.Server):
    guard: ConnectionGuard

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, self.guard, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections are bounded by ``guard`` (the rules above)."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs: Any) -> None:
        config = guard.config
        super().__init__(app, keepalive_timeout=config.keepalive_timeout_s,
                         max_field_size=config.max_header_field_bytes,
                         max_line_size=config.max_header_field_bytes,
                         max_headers=config.max_header_count, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds the Server itself; only its protocol factory differs here.
        server.__class__ = _GuardedServer
        assert isinstance(server, _GuardedServer)
        server.guard = self.guard
        return server
