"""The usage filter's bound on an unfinished SSE event (``MAX_EVENT_BYTES``, ``_relay`` rule 2,
``_relaycore.c`` rule 5).

The filter kept an unfinished event whole in ``_pending`` until its blank line and copied
and searched all of it again on every upstream read: an 8 MiB event in 4 KiB reads cost
9.6-14 s of CPU (quadratic), and ``_pending`` grew with whatever a backend sent without a
blank line. Now an event past the bound passes on unheld, as it comes, counted; and each
byte is searched once, whatever the bound.

Properties:
1. The filter writes what the old search (every read, all of ``_pending`` copied and
   searched again) with the bound's rule writes, read for read, whatever the bytes, the
   split and the bound (``_Reference``).
2. ``_pending`` never holds more than the bound, and each byte fed is handed to the
   blank-line search once (``_scanned``): no read searches the pending bytes again.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway._relay import MAX_EVENT_BYTES, UsageEventFilter
from tests.utils import fuzz_settings, run_gateway

FUZZ = fuzz_settings(300)

_LF, _CR = 10, 13
_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n")
_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _event(choices: list[dict[str, Any]], **fields: Any) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": choices, **fields}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _content(size: int) -> bytes:
    """An event of ``size`` bytes with neither marker (a long echo, say)."""
    head, tail = b'data: {"choices":[{"index":0,"delta":{"content":"', b'"}}]}\n\n'
    return head + b"x" * (size - len(head) - len(tail)) + tail


_FIRST = _event([{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}])
_TERMINAL = _event([{"index": 0, "delta": {}, "finish_reason": "stop"}])
_USAGE = _event([], usage={"prompt_tokens": 1, "completion_tokens": 1},
                system_fingerprint="fp")
_STAMPED = _event([{"index": 0, "delta": {}, "finish_reason": "stop"}],
                  system_fingerprint="fp")
_DONE = b"data: [DONE]\n\n"


def _reads(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def test_an_event_past_the_bound_passes_as_it_comes_and_is_never_held_whole() -> None:
    """An 8 MiB event in 4 KiB reads: the old filter held it all (``_pending`` 8 MiB, the
    client got nothing until its blank line). Past the bound each read passes as it came."""
    event = _content(8 * 1024 * 1024)
    usage_filter = UsageEventFilter()
    assert usage_filter.max_event_bytes == MAX_EVENT_BYTES
    out = []
    for piece in _reads(event, 4096):
        out.append(usage_filter.feed(piece))
        assert len(usage_filter._pending) <= MAX_EVENT_BYTES
    assert b"".join(out) + usage_filter.flush() == event
    reads, held = _reads(event, 4096), MAX_EVENT_BYTES // 4096  # the reads under the bound
    assert out[:held] == [b""] * held
    assert out[held] == b"".join(reads[:held + 1])  # the read past it: all of it so far
    assert out[held + 1:] == reads[held + 1:]  # then each read as it came
    assert usage_filter.oversized == 1
    assert usage_filter._scanned == len(event)  # each byte searched once


def test_each_byte_is_searched_once_under_the_bound_too() -> None:
    """An event under the bound in 1-byte reads is held whole and passed whole, as before; the
    old filter searched all of ``_pending`` on each read (60 KiB reads: 1.8 G bytes)."""
    event = _content(60 * 1024)
    usage_filter = UsageEventFilter()
    out = b"".join(usage_filter.feed(event[i:i + 1]) for i in range(len(event)))
    assert out == event and usage_filter._pending == b""
    assert usage_filter._scanned == len(event) and usage_filter.oversized == 0


def test_filtering_resumes_after_the_event_past_the_bound() -> None:
    """A terminal event held when an event outgrows the bound passes before it, as it came
    (as before any other event); the usage event after it is still dropped and stamps the
    terminal events held then."""
    big = _content(3 * MAX_EVENT_BYTES)
    upstream = _FIRST + _TERMINAL + big + _TERMINAL + _USAGE + _DONE
    for size in (1000, 4096, 65536, 100_000):
        usage_filter = UsageEventFilter()
        out = b"".join(usage_filter.feed(p) for p in _reads(upstream, size))
        out += usage_filter.flush()
        assert out == _FIRST + _TERMINAL + big + _STAMPED + _DONE, size
        assert usage_filter.oversized == 1


def test_a_blank_line_of_any_kind_ends_the_event_past_the_bound() -> None:
    """The end of an event that passes unheld is found with every blank line, split between
    reads anywhere: CRLF CRLF, CR CR, LF CR LF, LF LF."""
    for end in (b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\n\n"):
        big, after = b"data: " + b"y" * 100 + end, _FIRST.replace(b"\n\n", end)
        usage = _USAGE.replace(b"\n\n", end)
        upstream = _FIRST + big + after + usage + _DONE
        start = len(_FIRST) + 60  # past the bound: the event passes unheld from here
        for cut in range(start, len(_FIRST) + len(big) + 3):
            usage_filter = UsageEventFilter(max_event_bytes=50)
            reads = (upstream[:start], upstream[start:cut], upstream[cut:])
            out = [usage_filter.feed(p) for p in reads]
            out.append(usage_filter.flush())
            assert b"".join(out) == _FIRST + big + after + _DONE, (end, cut)
            assert usage_filter.oversized == 1


class _Reference:
    """The filter as the C base ran before the bound (every read, the pending bytes and the
    read copied and searched again for the last blank line), with the bound's rule: an
    unfinished event past ``max_event_bytes`` passes with the events held before it, then as
    it comes until its first blank line."""

    _USAGE = UsageEventFilter._USAGE
    _TERMINAL = UsageEventFilter._TERMINAL

    def __init__(self, max_event_bytes: int) -> None:
        self._pending = b""
        self._held: list[bytes] = []
        self._done = False
        self.max_event_bytes = max_event_bytes
        self.passing = False
        self.before = b""
        self.oversized = 0

    def _marked(self, complete: bytes) -> bytes:
        return UsageEventFilter._marked(self, complete)  # type: ignore[arg-type]

    @staticmethod
    def _ends(data: bytes) -> list[int]:
        """Where each blank line of ``data`` ends, by its pair of line ends (LF LF, LF CR,
        CR CR), a CR ending one taking the LF after it."""
        return [i + 1 + (data[i] == _CR and data[i + 1:i + 2] == b"\n")
                for i in range(1, len(data))
                if (data[i - 1] == _LF and data[i] in (_LF, _CR))
                or (data[i - 1] == _CR and data[i] == _CR)]

    def feed(self, chunk: bytes) -> bytes:
        if self._done:
            out, self._pending = self._pending + chunk, b""
            return out
        out = b""
        if self.passing:
            ends = self._ends(self.before + chunk)
            if not ends:
                self.before = (self.before + chunk)[-1:]
                return chunk
            self.passing = False
            cut = ends[0] - len(self.before)
            out, chunk = chunk[:cut], chunk[cut:]
            if not chunk:
                return out
        data = self._pending + chunk
        ends = self._ends(data)
        if not ends:
            if len(data) <= self.max_event_bytes:
                self._pending = data
                return out
            return out + self._give_up(data)
        complete, rest = data[:ends[-1]], data[ends[-1]:]
        over = len(rest) > self.max_event_bytes
        self._pending = b"" if over else rest
        if self._held or any(m in complete for m in (*self._USAGE, *self._TERMINAL)):
            out += self._marked(complete)
        else:
            out += complete
        if over:
            out += rest if self._done else self._give_up(rest)
        return out

    def _give_up(self, data: bytes) -> bytes:
        out = b"".join(self._held) + data
        self._held, self._pending = [], b""
        self.passing, self.before = True, data[-1:]
        self.oversized += 1
        return out


_TOKENS = [b"a", b"\n", b"\r", b"\r\n", b'"choices":[]', b'"finish_reason":"', b"data: {",
           b'"system_fingerprint":"f"', b"}"]


def _splits(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)])]


@FUZZ
@given(tokens=st.lists(st.sampled_from(_TOKENS), max_size=120),
       cuts=st.lists(st.integers(0, 1 << 16), max_size=40),
       bound=st.integers(1, 80) | st.just(MAX_EVENT_BYTES))
def test_the_filter_writes_what_the_old_search_with_the_bound_writes(
    tokens: list[bytes], cuts: list[int], bound: int,
) -> None:
    """Property 1 and 2, for any bytes, split (empty reads included) and bound."""
    data = b"".join(tokens)
    usage_filter, reference = UsageEventFilter(bound), _Reference(bound)
    fed = 0
    for piece in _splits(data, cuts):
        assert usage_filter.feed(piece) == reference.feed(piece)
        fed += len(piece)
        assert usage_filter._pending == reference._pending
        assert len(usage_filter._pending) <= bound
        assert usage_filter._held == reference._held
        assert usage_filter._done == reference._done
        assert usage_filter._scanned <= fed
    assert usage_filter.oversized == reference.oversized


@asynccontextmanager
async def _upstream(before: Sequence[bytes], after: bytes,
                    more: asyncio.Event) -> AsyncIterator[str]:
    """A chunked SSE answer: each of ``before`` as a chunk, then ``after`` once ``more`` is
    set (or 5 s passed)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_HEAD)
        for piece in before:
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await writer.drain()
        try:
            async with asyncio.timeout(5):
                await more.wait()
        except TimeoutError:
            pass
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(after), after))
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_the_relay_streams_an_event_past_the_bound_and_still_drops_usage() -> None:
    """Over a socket, the gateway having asked for usage: 4 KiB reads of an event three times
    the bound reach the client before the upstream ends it (the old filter held them all
    until its blank line), the usage event after it is dropped, and the event is counted."""
    big = _content(3 * MAX_EVENT_BYTES)
    sent = _FIRST + big[:2 * MAX_EVENT_BYTES]
    more = asyncio.Event()
    async with _upstream(_reads(sent, 4096), big[len(sent) - len(_FIRST):] + _TERMINAL
                         + _USAGE + _DONE, more) as url, \
            run_gateway(url) as gw, aiohttp.ClientSession() as http, \
            http.post(gw.base_url + "/chat/completions", json=_REQUEST) as resp:
        try:
            async with asyncio.timeout(2):  # before the upstream sends the rest
                got = await resp.content.readexactly(len(sent))
        finally:
            more.set()
        got += await resp.content.read()
        assert got == _FIRST + big + _STAMPED + _DONE
        assert gw.metric("understudy_usage_filter_oversized_events_total") == 1
