"""The relay's C byte path (gateway/_relaycore.c) through the Python classes built on it.

The wire tests (test_wire.py) and the relay tests drive it over real sockets; these check
what they cannot see: the generic (non-C) callee paths, the chunk framing byte for byte,
the capture appended in C as ``Capture.add_chunk`` appends it, and that connection/tee
cycles are collected.
"""

from __future__ import annotations

import asyncio
import gc
import random

import pytest

from evaluators import Capture
from gateway._relay import MAX_HELD_BYTES, UsageEventFilter
from gateway._relaycore import BodyFraming, ClientSink, Tee
from gateway._upstream import BodyTee
from gateway._wire import Connection, ConnectionPool


class RecordingTransport(asyncio.Transport):
    """An in-memory transport: what was written, and whether it is closing."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing


class Protocol:
    def __init__(self) -> None:
        self._paused = False


class Framing(BodyFraming):
    """A BodyFraming outside a connection: the callbacks it makes, recorded."""

    def __init__(self) -> None:
        self._time = lambda: 12.5
        self.events: list[tuple[str, object]] = []

    def _end_body(self) -> None:
        self.events.append(("end", None))
        self._in_body = False

    def _malformed(self, why: str) -> None:
        self.events.append(("malformed", why))

    def _hold(self, piece: bytes) -> None:
        self.events.append(("held", piece))

    def _outside_body(self, data: bytes) -> None:
        self.events.append(("outside", data))


def test_chunked_pieces_go_to_any_callable_and_are_held_without_one() -> None:
    framing = Framing()
    framing._framing, framing._in_body = 2, True  # chunked
    framing.data_received(b"3\r\nabc\r\n")
    assert framing.events == [("held", b"abc")] and framing.last_read == 12.5
    got: list[bytes] = []
    framing.on_piece = got.append
    framing.data_received(b"2\r\nde\r")
    framing.data_received(b"\n0\r\n\r\n")
    assert got == [b"de"] and framing.events[-1] == ("end", None)
    framing.data_received(b"after")
    assert framing.events[-2:] == [("end", None), ("outside", b"after")]


def test_content_length_past_the_end_is_not_reusable() -> None:
    framing = Framing()
    got: list[bytes] = []
    framing.on_piece = got.append
    framing._framing, framing._in_body, framing._remaining = 1, True, 4
    framing._keep_alive = True
    framing.data_received(b"ab")
    framing.data_received(b"cdEXTRA")
    assert got == [b"ab", b"cd"] and framing.events == [("end", None)]
    assert not framing._keep_alive


@pytest.mark.parametrize("line", [b"g\r\n", b"\r\n", b"ffffffffffffffff\r\n", b" 1\r\n"])
def test_bad_chunk_sizes(line: bytes) -> None:
    framing = Framing()
    framing._framing, framing._in_body = 2, True
    framing.data_received(line)
    assert framing.events == [("malformed", "bad chunk size")]


def test_client_sink_frames_chunks_and_holds_until_live() -> None:
    transport, protocol = RecordingTransport(), Protocol()

    class Sink(ClientSink):
        def go_live(self) -> None:
            held, self._held = self._held, None
            assert held is not None
            self.write(b"".join(held))

    sink = Sink(transport, protocol, True, 8)
    assert sink.write(b"12345") is False and transport.written == []
    assert sink.write(b"6789") is False  # past max_held: live, written as one chunk
    assert transport.written == [b"9\r\n123456789\r\n"]
    protocol._paused = True
    assert sink.write(b"x" * 300) is True
    assert transport.written[-1] == b"12c\r\n" + b"x" * 300 + b"\r\n"
    protocol._paused, transport.closing = False, True
    assert sink.write(b"y") is True
    plain = ClientSink(transport, protocol, False, MAX_HELD_BYTES)
    plain._held = None
    plain.write(b"as is")
    assert transport.written[-1] == b"as is"


def test_tee_with_python_writer_and_filter_stops_reading_when_behind() -> None:
    framing = Framing()
    framing.last_read = 3.0
    capture = Capture(started=0.0, max_bytes=1024, max_chunk_times=16)

    class Writer:
        def __init__(self) -> None:
            self.got: list[bytes] = []
            self.behind = False

        def write(self, piece: bytes) -> bool:
            self.got.append(piece)
            return self.behind

    class Upper:
        def feed(self, chunk: bytes) -> bytes:
            return chunk.upper()

    class Stopping(Tee):
        stops = 0

        def _stop_reading(self) -> None:
            self.stops += 1
            self.paused = True

    writer = Writer()
    tee = Stopping(framing, capture.add_chunk, writer, Upper())
    tee(b"ab")
    writer.behind = True
    tee.piece(b"cd")
    tee(b"ef")  # paused already: no second stop
    assert writer.got == [b"AB", b"CD", b"EF"] and tee.stops == 1
    assert bytes(capture.body) == b"abcdef" and capture.chunk_times == [3.0, 3.0, 3.0]


def test_usage_filter_pending_and_held_through_the_c_base() -> None:
    filt = UsageEventFilter()
    assert filt.feed(b"data: 1\n\nda") == b"data: 1\n\n"
    assert filt._pending == b"da"
    done = b'ta: {"choices":[{"finish_reason":"stop"}]}\n\n'
    assert filt.feed(done) == b"" and filt._held
    usage = b'data: {"choices":[],"system_fingerprint":"fp"}\n\nrest'
    assert filt.feed(usage) == b'data: {"choices":[{"finish_reason":"stop"}],' \
        b'"system_fingerprint":"fp"}\n\n'
    assert filt._done and filt.feed(b"!") == b"rest!" and filt.flush() == b""


def test_usage_filter_holds_a_finished_choice_only_until_the_next_event() -> None:
    """With n > 1 the choices finish apart: every event after the first terminal one was
    held until the usage event, so the client got the rest of a longer choice only when all
    had finished. Now a terminal event waits only for the next event: the usage event stamps
    it, any other passes it on first, as it came."""
    filt = UsageEventFilter()
    first_done = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    later = b'data: {"choices":[{"index":1,"delta":{"content":"more"},"finish_reason":null}]}\n\n'
    second_done = b'data: {"choices":[{"index":1,"delta":{},"finish_reason":"length"}]}\n\n'
    assert filt.feed(first_done) == b""
    assert filt.feed(later) == first_done + later
    assert filt.feed(second_done) == b""
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1},"system_fingerprint":"fp"}\n\n'
    stamped = second_done[:-3] + b',"system_fingerprint":"fp"}\n\n'
    assert filt.feed(usage + b"data: [DONE]\n\n") == stamped + b"data: [DONE]\n\n"


@pytest.mark.parametrize("seed", range(40))
def test_capture_appended_in_c_as_add_chunk_appends(seed: int) -> None:
    """Rule 4 of _relaycore.c: a piece that fits is appended on the Capture's slots, one
    that does not (and every piece once truncated) goes to add_chunk; either way the
    capture ends as add_chunk alone leaves it, piece by piece."""
    rng = random.Random(seed)
    max_bytes, max_times = rng.choice([0, 1, 64, 700, 5000]), rng.choice([0, 1, 3, 1000])
    in_c = Capture(started=0.0, max_bytes=max_bytes, max_chunk_times=max_times)
    in_python = Capture(started=0.0, max_bytes=max_bytes, max_chunk_times=max_times)
    called: list[bytes] = []

    def add_chunk(now: float, chunk: bytes) -> None:
        called.append(chunk)
        in_c.add_chunk(now, chunk)

    framing = Framing()
    tee = Tee(framing, add_chunk, None, None, in_c)
    for i in range(rng.randint(1, 80)):
        piece = rng.randbytes(rng.choice([0, 1, 9, 64, 300, 20_000]))
        fits = not in_c.truncated and len(in_c.body) + len(piece) <= in_c.max_bytes
        framing.last_read = float(i)
        tee.piece(piece)
        in_python.add_chunk(float(i), piece)
        assert in_c == in_python  # every field: a change to add_chunk shows here
        assert (called[-1:] == [piece]) is not fits  # here when it fits, else add_chunk
        called.clear()


def test_capture_of_another_class_is_only_called() -> None:
    class Counting(Capture):
        calls = 0

        def add_chunk(self, now: float, chunk: bytes) -> None:
            self.calls += 1
            super().add_chunk(now, chunk)

    capture = Counting(started=0.0, max_bytes=64, max_chunk_times=8)
    tee = BodyTee(Framing(), capture, None, None)  # type: ignore[arg-type]
    tee.piece(b"abc")
    tee(b"de")
    assert capture.calls == 2 and bytes(capture.body) == b"abcde"
    plain = Capture(started=0.0, max_bytes=64, max_chunk_times=8)
    bare = Tee(Framing(), plain.add_chunk, None, None, object())  # no such slots: called
    bare.piece(b"xyz")
    assert bytes(plain.body) == b"xyz" and plain.total_bytes == 3


def test_capture_slots_found_per_class() -> None:
    """Rule 4 keeps the slot offsets of the last class it saw: a class with the same slot
    names at other offsets (it has none of Capture's others), seen after Capture (and Capture
    after it), is written at its own offsets."""

    class Reordered:
        __slots__ = ("body", "chunk_times", "max_bytes", "max_chunk_times", "total_bytes",
                     "truncated")

        def __init__(self) -> None:
            self.body, self.max_bytes, self.truncated = bytearray(), 64, False
            self.total_bytes, self.max_chunk_times = 0, 8
            self.chunk_times: list[float] = []

        def add_chunk(self, now: float, chunk: bytes) -> None:
            raise AssertionError("a piece that fits is appended in C")

    captures: list[Capture | Reordered] = [
        Capture(started=0.0, max_bytes=64, max_chunk_times=8), Reordered(),
        Capture(started=0.0, max_bytes=64, max_chunk_times=8)]
    framing = Framing()
    for capture in captures:
        framing.last_read = 2.5
        Tee(framing, capture.add_chunk, None, None, capture).piece(b"abc")
        assert (bytes(capture.body), capture.total_bytes, capture.chunk_times,
                capture.truncated) == (b"abc", 3, [2.5], False)


async def test_connection_and_tee_cycles_are_collected() -> None:
    pool = ConnectionPool.__new__(ConnectionPool)
    pool.loop = asyncio.get_running_loop()
    capture = Capture(started=0.0, max_bytes=16, max_chunk_times=4)

    def count() -> int:
        return sum(isinstance(o, Connection) for o in gc.get_objects())

    gc.collect()
    before = count()
    for _ in range(200):
        conn = Connection(pool)
        conn.on_piece = BodyTee(conn, capture, None, None)  # a cycle through C members
    del conn
    gc.collect()
    assert count() == before
