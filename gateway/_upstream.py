"""One pooled client session per upstream, and the one watched read of an answer from it.

The relay (the primary's answer, to the client) and the mirror (a candidate's answer, to
its Observation) read an upstream the same way, here: ``Upstream.call`` sends and waits
for the headers, ``Upstream.read`` reads the body chunk by chunk into a ``Capture``.

Rules:
1. A failure before the response headers is translated as phase ``connect`` (a 502/504
   while nothing was answered); one while the body is read, or while a chunk is written
   on, as phase ``stream``. ``call`` always closes the response.
2. Per chunk ``read`` does only: read a clock, note the time for the idle watchdog, append
   to the bounded capture, and hand the chunk (through the optional filter) to the writer.

Timeouts, each a named setting of :class:`UpstreamConfig`:
1. ``connect_timeout_s``: the TCP connect (aiohttp ``sock_connect``).
2. ``first_byte_timeout_s``: from sending the request to the response headers.
3. ``idle_timeout_s``: the longest silence between two body chunks. It is watched by
   one timer per idle period that reads the time of the last chunk, not by a timer per
   chunk, so it costs the relay nothing per chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import aiohttp
from yarl import URL

from gateway._config import UpstreamConfig
from gateway._exceptions import translate_upstream_errors
from gateway._headers import allowed_only, with_credentials

if TYPE_CHECKING:
    from multidict import CIMultiDict

    from evaluators import Capture

__all__ = ["ChunkFilter", "IdleWatchdog", "Upstream"]


class ChunkFilter(Protocol):
    """Rewrites the chunks on their way to the writer (the capture keeps them as read)."""

    def feed(self, chunk: bytes) -> bytes:
        """What to write for ``chunk``; ``b""`` to write nothing yet."""
        ...

    def flush(self) -> bytes:
        """What is still held back once the body has ended."""
        ...


class Upstream:
    """A backend the gateway forwards to, with its own connection pool."""

    def __init__(self, config: UpstreamConfig, *, forward_credentials: bool = True,
                 allowed_headers: frozenset[str] | None = None) -> None:
        self.config = config
        self.forward_credentials = forward_credentials
        # None: every forwarded header (the primary); else only these (a candidate).
        self.allowed_headers = allowed_headers
        self.name = config.name
        self._base = URL(config.url)
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_connections, limit_per_host=self.config.max_connections
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"upstream {self.name} is not open")
        return self._session

    def credentials(self, headers: CIMultiDict[str]) -> CIMultiDict[str]:
        """``headers`` with this upstream's header allow-list and credential policy applied."""
        if self.allowed_headers is not None:
            headers = allowed_only(headers, self.allowed_headers)
        key = self.config.api_key
        return with_credentials(headers, forward_client_credentials=self.forward_credentials,
                                api_key=key.get_secret_value() if key is not None else None)

    def url_for(self, raw_path: str) -> URL:
        return URL(str(self._base) + raw_path, encoded=True)

    async def send(
        self, method: str, raw_path: str, headers: CIMultiDict[str], body: bytes
    ) -> aiohttp.ClientResponse:
        """Send the request and wait for the response headers (first-byte timeout)."""
        async with asyncio.timeout(self.config.first_byte_timeout_s):
            return await self.session.request(
                method,
                self.url_for(raw_path),
                headers=headers,
                data=body if body else None,
                allow_redirects=False,
                compress=False,
            )

    @asynccontextmanager
    async def call(self, method: str, raw_path: str, headers: CIMultiDict[str], body: bytes,
                   capture: Capture) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send the request; yield the response, its status and kind noted in ``capture``."""
        with translate_upstream_errors(self.name, "connect"):
            response = await self.send(method, raw_path, headers, body)
        try:
            capture.status = response.status
            capture.streamed = response.content_type == "text/event-stream"
            yield response
        finally:
            response.close()

    async def read(self, response: aiohttp.ClientResponse, capture: Capture,
                   write: Callable[[bytes], Awaitable[object]] | None = None,
                   chunk_filter: ChunkFilter | None = None) -> None:
        """Read the body into ``capture`` as it arrives, each chunk also to ``write``.

        Bounded by the idle timeout; any failure (a failed ``write`` too) raises an
        ``UpstreamError`` of phase ``stream``.
        """
        loop = asyncio.get_running_loop()
        reader = response.content
        with translate_upstream_errors(self.name, "stream"):
            async with asyncio.timeout(None) as deadline:
                watchdog = IdleWatchdog(deadline, self.config.idle_timeout_s)
                try:
                    while chunk := await reader.readany():
                        now = loop.time()
                        watchdog.last_activity = now
                        capture.add_chunk(now, chunk)
                        if write is None:
                            continue
                        if chunk_filter is not None:
                            chunk = chunk_filter.feed(chunk)
                            if not chunk:
                                continue
                        await write(chunk)
                    if write is not None and chunk_filter is not None \
                            and (rest := chunk_filter.flush()):
                        await write(rest)
                finally:
                    watchdog.stop()


class IdleWatchdog:
    """Cancels a relay whose upstream has been silent for ``idle_s``.

    The relay stores the loop time of each chunk in ``last_activity``; the watchdog wakes
    once per idle period and expires ``deadline`` only if nothing arrived meanwhile.
    """

    __slots__ = ("_deadline", "_handle", "_idle_s", "_loop", "last_activity")

    def __init__(self, deadline: asyncio.Timeout, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._deadline = deadline
        self._idle_s = idle_s
        self.last_activity = self._loop.time()
        self._handle = self._loop.call_at(self.last_activity + idle_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        due = self.last_activity + self._idle_s
        if now >= due:
            self._deadline.reschedule(now)
        else:
            self._handle = self._loop.call_at(due, self._check)

    def stop(self) -> None:
        self._handle.cancel()
