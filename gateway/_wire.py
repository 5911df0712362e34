"""A lean HTTP/1.1 client for the upstreams: one asyncio ``Protocol`` per connection, pooled.

Why not aiohttp's client (issue 15): its body reader wakes the reading task once per chunk
(``StreamReader.readany``) and its request path builds a dozen Python objects per request;
the profile put most of the relay's cost there. Here a connection decodes the body's
framing inside ``data_received`` and hands each piece to a callback: the relay writes it
on to its client from there, so a streamed chunk costs a few buffer operations and no task
switch. The task that sent the request waits once for the headers and once for the end.

Rules:
1. Per ``data_received`` a connection only decodes framing (Content-Length, chunked, or
   until close) and calls ``on_piece`` for each piece of body: in C (the ``BodyFraming``
   base, ``gateway/_relaycore.c``), where a ``BodyTee`` as ``on_piece`` is called without a
   Python frame; the head is parsed here, once per answer. Pieces that arrive before
   a callback is attached (with the headers, typically) are held and handed on when it
   is; past ``MAX_HELD_BYTES`` held the connection stops reading until then.
2. Flow control both ways: the callback's owner pauses and resumes reading
   (``pause_reading``/``resume_reading``) when its own client cannot keep up; request
   bodies are bounded by the gateway's ``max_body_bytes`` and written whole.
3. Anything the connection cannot parse (a head over ``MAX_HEAD_BYTES``, a bad status
   line, bad chunk framing, conflicting lengths) is a ``MalformedResponse``; a connection
   that closes before the body's end is ``Disconnected``. Neither quotes the bytes.
4. A connection goes back to its pool only after a whole response with keep-alive; a
   failure, an abandoned call or ``Connection: close`` closes it. Idle connections are
   closed after ``KEEPALIVE_S``.
5. A pool holds at most ``limit`` connections (in use and idle); a caller beyond that
   waits, first come first served.
6. Deadlines are coarse and cost nothing per request or per piece: a watched connection
   (``watch``) fails with ``FirstByteTimeout`` when its head is not whole by its due time,
   and with ``IdleTimeout`` when no bytes came for its idle time once the head was; idle
   pooled connections expire. One timer per pool checks them every ``DEADLINE_TICK_S``
   while any is watched (else at the next keep-alive expiry), so a deadline fires up to
   that late; each ``data_received`` notes the loop's time, once. (A timer per request
   costs ~6 µs to arm and cancel on uvloop, about as much as a small answer's parsing.)
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl as _ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway._relaycore import BodyFraming

__all__ = [
    "ConnectFailed",
    "ConnectTimeout",
    "Connection",
    "ConnectionPool",
    "Disconnected",
    "FirstByteTimeout",
    "IdleTimeout",
    "MalformedResponse",
    "ResponseHead",
    "WireError",
]

MAX_HEAD_BYTES: Final = 64 * 1024
"""The most bytes of a response's status line and headers (aiohttp's client: 8190 per line)."""
# The body's bounds are the C decoder's (gateway/_relaycore.c): a chunk-size line of at most
# 4096 bytes (extensions included), a chunk size of at most 16 hex digits below 2**63, and
# trailers of at most MAX_HEAD_BYTES.
MAX_HELD_BYTES: Final = 256 * 1024
"""Body bytes held for a caller that has not attached its callback yet (rule 1)."""
KEEPALIVE_S: Final = 15.0
"""How long an idle pooled connection is kept (aiohttp's connector default)."""
DEADLINE_TICK_S: Final = 0.05
"""How often a pool checks its watched connections' deadlines: the most a first-byte or
idle timeout fires late (rule 6)."""

_DIGITS = re.compile(r"[0-9]{1,19}")
# The bytes a response head may hold: control characters are never valid in one, and CR and LF
# only as a CRLF line end (counted apart, in ``_parse_head``). Deleting these bytes from a head
# leaves its control characters, if any: ~1 µs an answer, where a regex took ~3.
_HEAD_BYTES = bytes(b for b in range(256) if b in (0x09, 0x0a, 0x0d) or (b >= 0x20 and b != 0x7f))
_NO_BODY_STATUSES = frozenset({204, 304})


class WireError(Exception):
    """A failure talking HTTP to an upstream (translated in ``_exceptions.py``)."""


class ConnectFailed(WireError):
    """The TCP (or TLS) connect failed."""


class ConnectTimeout(WireError, TimeoutError):
    """The TCP (or TLS) connect took longer than the pool's ``connect_timeout_s``."""


class FirstByteTimeout(WireError, TimeoutError):
    """The response head was not whole by the watched connection's due time (rule 6)."""


class IdleTimeout(WireError, TimeoutError):
    """No bytes of the body came for the watched connection's idle time (rule 6)."""


class Disconnected(WireError, ConnectionResetError):
    """The upstream closed (or reset) the connection before the answer's end."""


class MalformedResponse(WireError):
    """The upstream's bytes are not an HTTP/1.1 response this client accepts."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    reason: str
    headers: CIMultiDictProxy[str]
    content_type: str  # the media type, lower case, without parameters


# Framing of the body being read.
_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
# Where the chunked decoder is (the C base's states; only the first is set from here).
_SIZE = 0


class Connection(BodyFraming, asyncio.Protocol):
    """One upstream connection: sends a request, parses the answer (rules 1-3).

    The body's framing is decoded by the C base (``gateway/_relaycore.c``): its
    ``data_received`` decodes the body and hands each piece to ``on_piece``; bytes outside
    a body (the head, bytes nobody asked for) come here, to ``_outside_body``."""

    __slots__ = (
        "_body_waiter", "_first_byte_due", "_head_only", "_head_waiter", "_held",
        "_held_bytes", "_idle_s", "_paused", "_pool", "_reused", "idle_since", "transport",
    )

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._time = pool.loop.time
        self.last_read = self.idle_since = self._time()
        """The loop's time at the last bytes read; at the return to the pool (rule 6)."""
        self._first_byte_due = self._idle_s = math.inf
        self.transport: asyncio.Transport | None = None
        self._head_waiter: asyncio.Future[ResponseHead] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._head_only = False
        self._paused = False
        self._reused = False

    # -- the caller's side ---------------------------------------------------------

    @property
    def reused(self) -> bool:
        return self._reused

    def send(self, head: bytes, body: bytes, *, head_only: bool) -> asyncio.Future[ResponseHead]:
        """Write one request; the future resolves with the response head."""
        assert self.transport is not None
        loop = self._pool.loop
        self._head_waiter = loop.create_future()
        self._body_waiter = loop.create_future()
        self._head_only = head_only
        self._framing = _NONE
        self._in_body = False
        self._buf = b""
        if len(body) > 4096:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head + body if body else head)
        return self._head_waiter

    def watch(self, first_byte_due: float, idle_s: float) -> None:
        """Fail this call with a timeout past ``first_byte_due`` (loop time) without a
        whole head, or after ``idle_s`` without bytes once it came (rule 6)."""
        self._first_byte_due, self._idle_s = first_byte_due, idle_s
        self._pool.watch(self)

    def overdue(self, now: float) -> WireError | None:
        head_waiter, body_waiter = self._head_waiter, self._body_waiter
        if head_waiter is None or body_waiter is None or body_waiter.done():
            return None  # no call yet, or the answer is whole (or failed) already
        if not head_waiter.done():
            return FirstByteTimeout("no response head in time") \
                if now >= self._first_byte_due else None
        return IdleTimeout("the upstream went silent") \
            if now - self.last_read >= self._idle_s else None

    def expire(self, exc: WireError) -> None:
        self._fail(exc)
        self.close()

    def attach(self, on_piece: Callable[[bytes], None] | None) -> asyncio.Future[None]:
        """Hand the body's pieces to ``on_piece`` from now on (the held ones first); the
        future resolves at the body's end, or with the failure."""
        assert self._body_waiter is not None
        self.on_piece = on_piece
        if self._held:
            held, self._held, self._held_bytes = self._held, [], 0
            # Resumed before the held pieces go: ``on_piece`` may pause reading again
            # (its client behind already), and that pause must hold.
            self.resume_reading()
            if on_piece is not None:
                for piece in held:
                    on_piece(piece)
        return self._body_waiter

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    @property
    def complete(self) -> bool:
        return self._body_waiter is not None and self._body_waiter.done() \
            and self._body_waiter.exception() is None

    # -- asyncio.Protocol (data_received is the C base's) ----------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but are ones.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._pool.lost(self)
        if self._framing == _UNTIL_CLOSE and self._head_waiter is not None \
                and self._head_waiter.done() and exc is None:
            self._end_body()
            return
        self._fail(Disconnected("the upstream closed the connection"))

    def _outside_body(self, data: bytes) -> None:
        """Bytes while no body is being read: the head (then the body's first bytes)."""
        head_waiter = self._head_waiter
        if head_waiter is None or self._body_waiter is None or self._body_waiter.done():
            self._pool.lost(self)  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        if not head_waiter.done():
            data = self._buf + data if self._buf else data
            self._buf = b""
            try:
                rest = self._parse_head(data)
            except MalformedResponse as exc:
                self._fail(exc)
                self.close()
                return
            if rest is None or self._body_waiter.done():
                return
            data = rest
        self.body_received(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost decides what the EOF means

    # -- parsing ---------------------------------------------------------------------

    def _parse_head(self, data: bytes) -> bytes | None:
        """Parse the head if whole; the bytes after it, or ``None`` while incomplete."""
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise MalformedResponse("response head too large")
                self._buf = data
                return None
            if end > MAX_HEAD_BYTES:
                raise MalformedResponse("response head too large")
            head, data = data[:end], data[end + 4:]
            # Every CR followed by LF and every LF preceded by CR: no bare line break.
            if head.translate(None, _HEAD_BYTES) or not (
                    head.count(b"\r") == head.count(b"\r\n") == head.count(b"\n")):
                raise MalformedResponse("control character in the response head")
            status = self._read_head(head.decode("latin-1"))
            if status is not None:  # an interim 1xx answer: the real one follows
                continue
            return data

    def _read_head(self, text: str) -> int | None:
        """The head's status if it is an interim one; ``text`` holds no control character
        and no bare CR or LF (checked by ``_parse_head``)."""
        lines = text.split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        # Three digits, from 100: below is no HTTP status (RFC 9110 15), and it would reach
        # the client as a status line of one or two digits.
        if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit() \
                or code[0] == "0":
            raise MalformedResponse("bad status line")
        status = int(code)
        if 100 <= status < 200:
            if status == 101:
                raise MalformedResponse("unexpected protocol switch")
            return status
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip() or line[0] in " \t":
                raise MalformedResponse("bad header line")
            headers.add(name, value.strip(" \t"))
        connection = headers.get("Connection", "").lower()
        keep_alive = ("close" not in connection) if version == "HTTP/1.1" \
            else ("keep-alive" in connection)
        encoding = headers.getall("Transfer-Encoding", [])
        lengths = headers.getall("Content-Length", [])
        if self._head_only or status in _NO_BODY_STATUSES:
            framing = _NONE
        elif encoding:
            last = encoding[-1].rpartition(",")[2].strip().lower()
            framing = _CHUNKED if last == "chunked" else _UNTIL_CLOSE
            if framing == _UNTIL_CLOSE or lengths:
                keep_alive = False
        elif lengths:
            if len(set(lengths)) != 1 or not _DIGITS.fullmatch(lengths[0]):
                raise MalformedResponse("bad Content-Length")
            framing = _LENGTH
            self._remaining = int(lengths[0])
        else:
            framing = _UNTIL_CLOSE
            keep_alive = False
        self._framing, self._keep_alive = framing, keep_alive
        self._chunk_state = _SIZE
        self._in_body = framing != _NONE
        content_type = headers.get("Content-Type", "application/octet-stream")
        assert self._head_waiter is not None
        self._head_waiter.set_result(ResponseHead(
            status, reason, CIMultiDictProxy(headers),
            content_type.partition(";")[0].strip().lower()))
        if framing == _NONE or (framing == _LENGTH and self._remaining == 0):
            self._end_body()
        return None

    # -- delivering ------------------------------------------------------------------

    def _hold(self, piece: bytes) -> None:
        """A piece before ``attach`` (rule 1)."""
        self._held.append(piece)
        self._held_bytes += len(piece)
        if self._held_bytes > MAX_HELD_BYTES:
            self.pause_reading()

    def _malformed(self, why: str) -> None:
        self._fail(MalformedResponse(why))
        self.close()

    def _end_body(self) -> None:
        waiter = self._body_waiter
        self._framing = _NONE
        self._in_body = False
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: WireError) -> None:
        self._keep_alive = False
        for waiter in (self._head_waiter, self._body_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
                # Retrieved here: a caller that left early must not log it as unretrieved.
                waiter.exception()

    # -- the pool's side --------------------------------------------------------------

    def reusable(self) -> bool:
        return (self._keep_alive and self.complete and self.transport is not None
                and not self.transport.is_closing() and not self._held and not self._paused)

    def reset_for_pool(self) -> None:
        self.on_piece = None
        self._head_waiter = self._body_waiter = None
        self._first_byte_due = self._idle_s = math.inf
        self._reused = True
        self.idle_since = self._time()


class ConnectionPool:
    """Connections to one upstream address: at most ``limit``, idle ones reused (rule 5),
    deadlines checked by one coarse timer (rule 6)."""

    def __init__(self, url: URL, *, limit: int, connect_timeout_s: float) -> None:
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ValueError(f"not an http(s) URL: {url}")
        self.loop = asyncio.get_running_loop()
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self._host = url.raw_host
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl: _ssl.SSLContext | None = (_ssl.create_default_context()
                                            if url.scheme == "https" else None)
        self._server_hostname = url.host if self._ssl is not None else None
        self._idle: deque[Connection] = deque()  # the oldest returned on the left
        self._watched: set[Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_at = math.inf
        self._open: set[Connection] = set()
        self._connecting = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def size(self) -> int:
        return len(self._open) + self._connecting

    def idle_connection(self) -> Connection | None:
        """An idle connection to reuse at once, or ``None``."""
        while self._idle:
            conn = self._idle.pop()  # the most recently used: least likely closed
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
            self._open.discard(conn)
        return None

    async def acquire(self) -> Connection:
        while True:
            if self._closed:
                raise ConnectFailed("the pool is closed")
            if (conn := self.idle_connection()) is not None:
                return conn
            if self.size < self.limit:
                return await self._connect()
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()  # pass the slot this caller was given to the next
                raise

    async def _connect(self) -> Connection:
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self), self._host, self._port, ssl=self._ssl,
                    server_hostname=self._server_hostname)
        except TimeoutError as exc:
            raise ConnectTimeout("connect timed out") from exc
        except OSError as exc:
            raise ConnectFailed(str(exc)) from exc
        finally:
            self._connecting -= 1
        if conn.transport is None:  # closed between connect and here
            self._wake_one()
            raise ConnectFailed("closed while connecting")
        self._open.add(conn)
        return conn

    def watch(self, conn: Connection) -> None:
        """Check ``conn``'s deadlines until it is released (rule 6)."""
        self._watched.add(conn)
        self._sweep_soon(self.loop.time() + DEADLINE_TICK_S)

    def release(self, conn: Connection) -> None:
        """Take ``conn`` back after a call: kept if whole and keep-alive, else closed."""
        self._watched.discard(conn)
        if not self._closed and conn.reusable():
            conn.reset_for_pool()
            self._idle.append(conn)
            self._sweep_soon(conn.idle_since + KEEPALIVE_S)
        else:
            self._open.discard(conn)
            conn.close()
        self._wake_one()

    def lost(self, conn: Connection) -> None:
        """``conn`` closed (the upstream, a timer or a failure): forget it."""
        self._watched.discard(conn)
        if conn in self._open:
            self._open.discard(conn)
            if conn in self._idle:
                self._idle.remove(conn)
            self._wake_one()

    def _sweep_soon(self, when: float) -> None:
        if self._closed or when >= self._sweep_at:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._sweep_at = when
        self._sweeper = self.loop.call_at(when, self._sweep)

    def _sweep(self) -> None:
        self._sweeper, self._sweep_at = None, math.inf
        now = self.loop.time()
        for conn, exc in [(c, e) for c in self._watched if (e := c.overdue(now)) is not None]:
            self._watched.discard(conn)
            conn.expire(exc)
        while self._idle and now - self._idle[0].idle_since >= KEEPALIVE_S:
            self._idle.popleft().close()  # connection_lost forgets it (lost)
        if self._watched:
            self._sweep_soon(now + DEADLINE_TICK_S)
        elif self._idle:
            self._sweep_soon(self._idle[0].idle_since + KEEPALIVE_S)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._watched.clear()
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
