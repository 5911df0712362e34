"""Label values a client or a backend controls map to a bounded set (STYLE.md 8).

Each test sends many distinct values of one such input through a real gateway on loopback
and counts the series its ``/metrics`` exports.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import aiohttp

from gateway._metrics import STATUS_LABELS, status_label
from tests.utils import run_gateway


@asynccontextmanager
async def answering_statuses(codes: Iterator[int]) -> AsyncIterator[str]:
    """A keep-alive upstream answering each POST with the next status of ``codes`` (the
    rest, the gateway's own probes, with 404)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST "):
                    await reader.readexactly(int(head.lower().split(b"content-length:")[1]
                                                 .split(b"\r\n")[0]))
                code = next(codes) if head.startswith(b"POST ") else 404
                writer.write(b"HTTP/1.1 %03d X\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\n\r\n{}" % code)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _series(session: aiohttp.ClientSession, url: str, name: str) -> list[str]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


async def test_a_backend_sending_every_status_code_adds_a_bounded_set_of_series() -> None:
    # Every final status a backend may send: three digits from 200 (1xx are interim).
    codes = list(range(200, 1000))
    async with answering_statuses(iter(codes)) as upstream, run_gateway(upstream) as gw, \
            aiohttp.ClientSession() as session:
        for _ in codes:
            async with session.post(gw.url + "/v1/completions", json={"prompt": "x"}) as resp:
                await resp.read()
        series = await _series(session, gw.url, "understudy_requests_total")
    assert len(series) <= len(STATUS_LABELS)
    assert 'understudy_requests_total{route="completions",status="200"} 1.0' in series
    assert 'understudy_requests_total{route="completions",status="503"} 1.0' in series
    # 529 and 999 are no HTTP status the gateway knows: counted by class, or as "other".
    assert 'understudy_requests_total{route="completions",status="5xx"} 89.0' in series
    assert 'understudy_requests_total{route="completions",status="other"} 400.0' in series


def test_status_labels() -> None:
    assert [status_label(s) for s in (200, 404, 429, 499, 503)] == \
        ["200", "404", "429", "499", "503"]
    assert [status_label(s) for s in (0, 42, 150, 299, 418, 420, 529, 600, 999)] == \
        ["other", "other", "other", "2xx", "418", "4xx", "5xx", "other", "other"]
    assert {status_label(s) for s in range(-5, 2000)} <= STATUS_LABELS
