"""A bare request front: the floor an own request server for ``/v1/*`` would cost.

    python bench/_bare_front.py --primary http://127.0.0.1:8100 --port 8082

One asyncio ``Protocol`` per client connection on uvloop, no aiohttp: requests framed by
``Content-Length`` only (no chunked bodies, no pipelining guarantees, no bounds, no
timeouts), each forwarded with understudy's own upstream client (``gateway/_upstream.py``)
into a ``Capture`` and answered with one write of head and body. Non-streamed answers only.
What the gateway costs above this, per request, is aiohttp's server layer and the relay's
own header, metrics and mirroring work (issue 15). Not a server to run: a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import uvloop
from multidict import CIMultiDict

from evaluators import Capture
from gateway._config import UpstreamConfig
from gateway._headers import CREDENTIAL_HEADERS
from gateway._upstream import Upstream

_HEAD_END = b"\r\n\r\n"
_LENGTH = b"\r\ncontent-length:"


class BareFront(asyncio.Protocol):
    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(_HEAD_END)) >= 0:
            head = self._buffer[:end + 2]
            at = head.lower().find(_LENGTH)
            length = int(head[at + len(_LENGTH):head.index(b"\r\n", at + 2)]) if at >= 0 else 0
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4:end + 4 + length]
            self._buffer = self._buffer[end + 4 + length:]
            method, target, _ = head[:head.index(b"\r\n")].decode("latin-1").split(" ", 2)
            asyncio.get_running_loop().create_task(self._answer(method, target, body))

    async def _answer(self, method: str, target: str, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        capture = Capture(started=loop.time(), max_bytes=1 << 20, max_chunk_times=4096)
        headers = CIMultiDict({"Content-Type": "application/json"})
        async with self._upstream.call(method, target, headers, body, capture) as answer:
            await self._upstream.read(answer, capture)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
                    answer.status, answer.reason.encode("latin-1"),
                    answer.content_type.encode("latin-1"), len(capture.body), capture.body))


async def _serve(primary: str, port: int) -> None:
    upstream = Upstream(UpstreamConfig(name="primary", url=primary), credentials=CREDENTIAL_HEADERS)
    upstream.open()
    server = await asyncio.get_running_loop().create_server(
        lambda: BareFront(upstream), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--primary", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(_serve(args.primary, args.port))


if __name__ == "__main__":
    main()
