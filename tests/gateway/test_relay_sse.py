"""The relay's SSE path against a raw upstream on loopback: the client gets the bytes the
upstream sent, without the usage event when the gateway asked for it (``UsageEventFilter``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from tests.utils import run_gateway

_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n")
_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _event(choices: list[dict[str, Any]], end: bytes, **fields: Any) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": choices, **fields}
    return b"data: " + orjson.dumps(chunk) + end


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@asynccontextmanager
async def _upstream(first: bytes, rest: bytes, more: asyncio.Event) -> AsyncIterator[str]:
    """A chunked SSE answer: ``first``, then ``rest`` once ``more`` is set (or 5 s passed)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_HEAD + _chunk(first))
        try:
            async with asyncio.timeout(5):
                await more.wait()
        except TimeoutError:
            pass
        writer.write(_chunk(rest) + b"0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("end", [b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\n\n"])
async def test_events_ended_by_any_blank_line_stream_and_lose_only_the_usage_event(
    end: bytes,
) -> None:
    """SSE ends an event with a blank line of CRLF, LF or CR line ends (sse-starlette writes
    ``\\r\\n\\r\\n``). The filter looked for ``\\n\\n`` alone: with the gateway's injected
    usage, the client got nothing until the upstream's end, then the usage event it never
    asked for."""
    first = _event([{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}], end)
    terminal = _event([{"index": 0, "delta": {}, "finish_reason": "stop"}], end)
    usage = _event([], end, usage={"prompt_tokens": 1, "completion_tokens": 1})
    done = b"data: [DONE]" + end
    more = asyncio.Event()
    async with _upstream(first, terminal + usage + done, more) as url, \
            run_gateway(url) as gw, aiohttp.ClientSession() as http, \
            http.post(gw.base_url + "/chat/completions", json=_REQUEST) as resp:
        try:
            async with asyncio.timeout(2):  # before the upstream sends the rest
                got = await resp.content.readexactly(len(first))
        finally:
            more.set()
        got += await resp.content.read()
    assert got == first + terminal + done


@pytest.mark.parametrize("split", [True, False], ids=["apart", "in_one_read"])
async def test_what_follows_the_usage_event_passes_however_the_reads_fall(split: bool) -> None:
    """The filter drops the one usage event the gateway's ``include_usage`` added and passes
    what follows as it came (the C base, once ``_done``). An event after it in the same read
    went through ``_marked``, which dropped a second usage event too: the client's bytes
    depended on where the upstream's reads fell."""
    end = b"\n\n"
    first = _event([{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}], end)
    terminal = _event([{"index": 0, "delta": {}, "finish_reason": "stop"}], end)
    usage = _event([], end, usage={"prompt_tokens": 1, "completion_tokens": 1})
    again = _event([], end, usage={"prompt_tokens": 1, "completion_tokens": 2})
    done = b"data: [DONE]" + end
    head, tail = first + terminal + usage, again + done
    more = asyncio.Event()
    async with _upstream(head if split else head + tail, tail if split else b"", more) as url, \
            run_gateway(url) as gw, aiohttp.ClientSession() as http, \
            http.post(gw.base_url + "/chat/completions", json=_REQUEST) as resp:
        try:
            async with asyncio.timeout(2):
                got = await resp.content.readexactly(len(first + terminal))
        finally:
            more.set()
        got += await resp.content.read()
    assert got == first + terminal + again + done
