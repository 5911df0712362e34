"""A loopback TCP relay the tests cut and restore: a database "unreachable mid-run"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

from sqlalchemy.engine import make_url

__all__ = ["QUICK_RETRIES", "TcpRelay", "relayed_database"]

QUICK_RETRIES: Final[dict[str, Any]] = {
    "flush_interval_s": 0.05, "retry_base_s": 0.05, "retry_max_s": 0.2, "connect_timeout_s": 1}
"""A store config's timings for a test that cuts its database: it notices and retries in
tenths of a second."""


@asynccontextmanager
async def relayed_database(database_url: str) -> AsyncIterator[tuple[TcpRelay, str]]:
    """The database at ``database_url`` behind a started relay: (the relay, the URL through
    it); the relay is closed on the way out."""
    url = make_url(database_url)
    relay = TcpRelay(url.host or "127.0.0.1", url.port or 5432)
    await relay.start()
    try:
        yield relay, url.set(port=relay.port).render_as_string(hide_password=False)
    finally:
        await relay.close()


class TcpRelay:
    """Forwards loopback connections to ``target``; ``cut()`` and ``restore()`` it."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._answers_flow = asyncio.Event()
        self._answers_flow.set()
        self._flowing = asyncio.Event()  # cleared: a black hole, nothing moves either way
        self._flowing.set()
        self._stall_after: bytes | None = None
        self._delay_s = 0.0
        self._refusals: list[tuple[str, str]] = []
        self.port = 0
        self.connections = 0

    def stall_answers_after(self, marker: bytes) -> None:
        """Once a client sends ``marker``, hold the server's answers: the server acts on
        the request, the client never hears back."""
        self._stall_after = marker

    def refuse_startups(self, count: int, sqlstate: str = "57P03",
                        message: str = "the database system is shutting down") -> None:
        """Answer the next ``count`` connections' startup as a PostgreSQL server that is
        shutting down or starting up does (a FATAL ErrorResponse), then relay again."""
        self._refusals.extend([(sqlstate, message)] * count)

    def black_hole(self) -> None:
        """Keep accepting and holding connections, but carry nothing either way: a
        database that is there and never answers (a dropped route, a silent firewall)."""
        self._flowing.clear()

    def slow_down(self, delay_s: float) -> None:
        """Hold every read ``delay_s`` before passing it on: a store that answers late."""
        self._delay_s = delay_s

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port,
                                                  reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        flowing = self._flowing.is_set()
        self._flowing.set()  # connections held by a black hole find their sockets aborted
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if not flowing:
            self._flowing.clear()
        await self._server.wait_closed()
        self._server = None

    async def restore(self) -> None:
        self._stall_after = None
        self._delay_s = 0.0
        self._answers_flow.set()
        self._flowing.set()
        if self._server is None:
            await self.start()  # the same port again

    async def close(self) -> None:
        if self._server is not None:
            await self.cut()

    async def _accept(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_w)
        if self._refusals:
            await _refuse_startup(client_r, client_w, *self._refusals.pop(0))
            return
        await self._flowing.wait()
        if client_w.transport.is_closing():
            return
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self._target)
        except OSError:
            client_w.transport.abort()
            return
        self._writers.update((client_w, upstream_w))
        for source, sink, upstream in ((client_r, upstream_w, True),
                                       (upstream_r, client_w, False)):
            task = asyncio.create_task(self._pump(source, sink, upstream))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                    upstream: bool) -> None:
        try:
            while data := await source.read(65536):
                if not upstream:
                    await self._answers_flow.wait()
                await self._flowing.wait()
                if self._delay_s:
                    await asyncio.sleep(self._delay_s)
                sink.write(data)
                if upstream and self._stall_after is not None and self._stall_after in data:
                    self._answers_flow.clear()
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sink.transport.abort()
            self._writers.discard(sink)


SSL_REQUEST_CODE: Final = 80877103


async def _refuse_startup(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          sqlstate: str, message: str) -> None:
    """Read a PostgreSQL client's startup (declining TLS) and answer it with a FATAL
    ErrorResponse, as the server does while it shuts down or starts up."""
    try:
        head = await reader.readexactly(8)
        length, code = int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")
        if length == 8 and code == SSL_REQUEST_CODE:
            writer.write(b"N")
            length = int.from_bytes(await reader.readexactly(4), "big")
            await reader.readexactly(length - 4)
        else:
            await reader.readexactly(length - 8)
        fields = b"".join(kind + text.encode() + b"\0" for kind, text in (
            (b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message)))
        body = fields + b"\0"
        writer.write(b"E" + (len(body) + 4).to_bytes(4, "big") + body)
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.transport.abort()
