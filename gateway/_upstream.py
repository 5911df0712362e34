"""One connection pool per upstream, and the one watched read of an answer from it.

The relay (the primary's answer, to the client) and the mirror (a candidate's answer, to
its Observation) read an upstream the same way, here: ``Upstream.call`` sends and waits
for the headers, ``Upstream.read`` reads the body into a ``Capture``. The connections are
``gateway/_wire.py``'s: the body is decoded inside the connection's ``data_received`` and
each piece goes through :class:`BodyTee` (capture, watchdog, optional filter and client)
there; the reading task wakes only at the body's end (or to wait for a slow client).

Rules:
1. A failure before the response headers is translated as phase ``connect`` (a 502/504
   while nothing was answered); one while the body is read, or while a chunk is written
   on, as phase ``stream``. ``call`` always gives the connection back (kept only after a
   whole answer).
2. Per piece of body the tee does only: read a clock, note the time for the idle
   watchdog, append to the bounded capture, and hand the piece (through the optional
   filter) to the client's writer.
3. Flow control: when the client's transport is past its high-water mark the upstream
   connection stops reading; it resumes once the client's buffer has drained.

Timeouts, each a named setting of :class:`UpstreamConfig`:
1. ``connect_timeout_s``: the TCP connect.
2. ``first_byte_timeout_s``: from asking for a connection to the response headers.
3. ``idle_timeout_s``: the longest silence of the upstream once its headers came.
The last two are the connection's deadlines, checked by its pool's coarse timer
(``_wire.py`` rule 6): no timer per request, nothing per chunk, and no task cancelled:
an expired deadline fails the connection, which the waiting call reads as a timeout.
Only a call that must wait for a connection (none idle) arms a timer of its own.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from yarl import URL

from evaluators import Capture
from gateway._config import UpstreamConfig
from gateway._exceptions import translate_upstream_errors
from gateway._headers import allowed_only, with_credentials
from gateway._relaycore import Tee
from gateway._wire import Connection, ConnectionPool, Disconnected

if TYPE_CHECKING:
    from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["BodyTee", "ChunkFilter", "ClientWriter", "Upstream", "UpstreamAnswer",
           "UpstreamCall"]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class ChunkFilter(Protocol):
    """Rewrites the chunks on their way to the writer (the capture keeps them as read)."""

    def feed(self, chunk: bytes) -> bytes:
        """What to write for ``chunk``; ``b""`` to write nothing yet."""
        ...

    def flush(self) -> bytes:
        """What is still held back once the body has ended."""
        ...


class ClientWriter(Protocol):
    """Where the relay's pieces go, synchronously (the client's transport)."""

    def write(self, piece: bytes) -> bool:
        """Write ``piece`` on; ``True`` when the client is past its high-water mark (or
        gone), so the upstream should stop reading for now."""
        ...

    @property
    def gone(self) -> bool:
        """The client's connection is closing: nothing more can be written."""
        ...

    async def drain(self) -> None:
        """Wait until the client's buffer is below its low-water mark."""
        ...


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """The response head of one call, and the connection its body comes on."""

    status: int
    reason: str
    headers: CIMultiDictProxy[str]
    content_type: str
    connection: Connection


class Upstream:
    """A backend the gateway forwards to, with its own connection pool."""

    def __init__(self, config: UpstreamConfig, *, forward_credentials: bool = True,
                 allowed_headers: frozenset[str] | None = None,
                 credentials: frozenset[str]) -> None:
        self.config = config
        self.forward_credentials = forward_credentials
        # The headers that carry the client's credentials (``_headers``).
        self.client_credentials = credentials
        # None: every forwarded header (the primary); else only these (a candidate).
        self.allowed_headers = allowed_headers
        self.name = config.name
        base = URL(config.url)
        self._base = base
        # The path (and query) after the origin; the user and password go in a header.
        self._prefix = str(base.with_user(None))[len(str(base.origin())):]
        self._host = base.raw_host or ""
        if base.explicit_port is not None:
            self._host += f":{base.explicit_port}"
        self._basic_auth = None if base.user is None else "Basic " + base64.b64encode(
            f"{base.user}:{base.password or ''}".encode()).decode("ascii")
        self._pool: ConnectionPool | None = None

    def open(self) -> None:
        self._pool = ConnectionPool(self._base, limit=self.config.max_connections,
                                    connect_timeout_s=self.config.connect_timeout_s)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None:
            raise RuntimeError(f"upstream {self.name} is not open")
        return self._pool

    def credentials(self, headers: CIMultiDict[str]) -> CIMultiDict[str]:
        """``headers`` with this upstream's header allow-list and credential policy applied."""
        if self.allowed_headers is not None:
            headers = allowed_only(headers, self.allowed_headers)
        key = self.config.api_key
        return with_credentials(headers, forward_client_credentials=self.forward_credentials,
                                credentials=self.client_credentials,
                                api_key=key.get_secret_value() if key is not None else None)

    def request_head(self, method: str, raw_path: str, headers: CIMultiDict[str],
                     body: bytes) -> bytes:
        """The request line and headers, as sent (``Host`` and the length computed)."""
        lines = [f"{method} {self._prefix}{raw_path} HTTP/1.1\r\n", f"Host: {self._host}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
        if self._basic_auth is not None and "Authorization" not in headers:
            lines.append(f"Authorization: {self._basic_auth}\r\n")
        if body or method in _BODY_METHODS:
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        text = "".join(lines)
        # One CR and one LF per line, no NUL: no header value can smuggle a line in.
        if text.count("\n") != len(lines) or text.count("\r") != len(lines) or "\0" in text:
            raise ValueError("a header holds a line break or NUL")
        # The client's bytes as they came: aiohttp's parser decodes a request's target and
        # fields as UTF-8 with surrogate escapes, so this gives back each byte it read (a
        # value's UTF-8, or any other obs-text); the gateway's own text is ASCII.
        return text.encode("utf-8", "surrogateescape")

    def call(self, method: str, raw_path: str, headers: CIMultiDict[str], body: bytes,
             capture: Capture) -> UpstreamCall:
        """``async with`` it: sends the request and gives the answer's head, its status and
        kind noted in ``capture``; the connection goes back to the pool (or is closed) on
        leaving."""
        return UpstreamCall(self, self.request_head(method, raw_path, headers, body), body,
                            method, capture)

    async def connection(self, first_byte_due: float) -> Connection:
        """An idle connection at once, else one the pool opens or frees by the due time."""
        pool = self.pool
        conn = pool.idle_connection()
        if conn is not None:
            return conn
        async with asyncio.timeout_at(first_byte_due):
            return await pool.acquire()

    async def read(self, answer: UpstreamAnswer, capture: Capture,
                   out: ClientWriter | None = None,
                   chunk_filter: ChunkFilter | None = None) -> None:
        """Read the body into ``capture`` as it arrives, each piece also to ``out``.

        Bounded by the idle timeout (the connection's deadline); any failure (the client
        gone too) raises an ``UpstreamError`` of phase ``stream``.
        """
        conn = answer.connection
        with translate_upstream_errors(self.name, "stream"):
            tee = BodyTee(conn, capture, out, chunk_filter)
            loop = asyncio.get_running_loop()
            try:
                done = conn.attach(tee)
                if not done.done():
                    done.add_done_callback(tee.wake_up)
                while not done.done():
                    if tee.paused:
                        await tee.drain(done)
                        continue
                    tee.waiter = waiter = loop.create_future()
                    await waiter
                done.result()
                if out is not None and out.gone:
                    raise Disconnected("the client went away")
                if out is not None and chunk_filter is not None \
                        and (rest := chunk_filter.flush()):
                    out.write(rest)
            finally:
                tee.close()


class UpstreamCall:
    """One request to an upstream, as an async context manager (``Upstream.call``): a
    class rather than ``@asynccontextmanager``, which costs a generator and its frames
    per request on the relay's path."""

    __slots__ = ("_body", "_capture", "_conn", "_head", "_method", "_upstream")

    def __init__(self, upstream: Upstream, head: bytes, body: bytes, method: str,
                 capture: Capture) -> None:
        self._upstream = upstream
        self._head = head
        self._body = body
        self._method = method
        self._capture = capture
        self._conn: Connection | None = None

    async def __aenter__(self) -> UpstreamAnswer:
        upstream = self._upstream
        config = upstream.config
        pool = upstream.pool
        pool.limit = config.max_connections
        pool.connect_timeout_s = config.connect_timeout_s
        first_byte_due = pool.loop.time() + config.first_byte_timeout_s
        head_only = self._method == "HEAD"
        try:
            with translate_upstream_errors(upstream.name, "connect"):
                self._conn = conn = await upstream.connection(first_byte_due)
                conn.watch(first_byte_due, config.idle_timeout_s)
                try:
                    head = await conn.send(self._head, self._body, head_only=head_only)
                except Disconnected:
                    if not conn.reused or self._method in _BODY_METHODS:
                        raise
                    # An idle connection the upstream had just closed: once more, new.
                    self._conn = None
                    pool.release(conn)
                    self._conn = conn = await upstream.connection(first_byte_due)
                    conn.watch(first_byte_due, config.idle_timeout_s)
                    head = await conn.send(self._head, self._body, head_only=head_only)
        except BaseException:
            self._release()
            raise
        self._capture.status = head.status
        self._capture.streamed = head.content_type == "text/event-stream"
        return UpstreamAnswer(head.status, head.reason, head.headers, head.content_type, conn)

    async def __aexit__(self, *_: object) -> None:
        self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._upstream.pool.release(conn)


class BodyTee(Tee):
    """Each piece of an upstream body: to the capture, the watchdog and the client.

    Called with each piece (rule 2); the C base (``gateway/_relaycore.c``) does that work,
    with no Python frame when the filter and the writer are the relay's own C-based
    ``UsageEventFilter`` and ``ClientStream``. What happens once per answer is here."""

    __slots__ = ()

    def __init__(self, conn: Connection, capture: Capture, out: ClientWriter | None,
                 chunk_filter: ChunkFilter | None) -> None:
        # A Capture's common case is appended by the C base on its slots (its rule 4);
        # another class (a subclass too) is only called.
        super().__init__(conn, capture.add_chunk, out, chunk_filter,
                         capture if type(capture) is Capture else None)

    def _stop_reading(self) -> None:
        """The client is past its high-water mark, or gone (rule 3)."""
        out = self._out
        if out is not None and out.gone:  # nobody to relay to: stop the upstream; it fails
            self._out = None
            self._conn.close()
            return
        self._conn.pause_reading()
        self.paused = True
        self.wake_up()

    def wake_up(self, _: object = None) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self, done: asyncio.Future[None]) -> None:
        """The client was past its high-water mark: wait for it, then read on; or stop
        waiting when the body ends first (failed: the upstream's idle deadline passed)."""
        if self._out is not None:
            drained = asyncio.ensure_future(self._out.drain())
            try:
                await asyncio.wait((drained, done), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not drained.done():
                    drained.cancel()  # done first (failed), or this task was cancelled
            if not drained.done():
                return
            drained.result()  # raises if the client's connection failed meanwhile
        self.paused = False
        self._conn.resume_reading()

    def close(self) -> None:
        self._out = None
        self.wake_up()
