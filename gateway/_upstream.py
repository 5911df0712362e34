"""One pooled client session per upstream, and the timeouts that bound a call to it.

Timeouts, each a named setting of :class:`UpstreamConfig`:
1. ``connect_timeout_s``: the TCP connect (aiohttp ``sock_connect``).
2. ``first_byte_timeout_s``: from sending the request to the response headers.
3. ``idle_timeout_s``: the longest silence between two body chunks. It is watched by
   one timer per idle period that reads the time of the last chunk, not by a timer per
   chunk, so it costs the relay nothing per chunk.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp
from yarl import URL

from gateway._config import UpstreamConfig
from gateway._headers import with_credentials

if TYPE_CHECKING:
    from multidict import CIMultiDict

__all__ = ["IdleWatchdog", "Upstream"]


class Upstream:
    """A backend the gateway forwards to, with its own connection pool."""

    def __init__(self, config: UpstreamConfig, *, forward_credentials: bool = True) -> None:
        self.config = config
        self.forward_credentials = forward_credentials
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
        """``headers`` with this upstream's credential policy applied."""
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
