"""The KV transfer wire format: frames, their checksums, and every message round-tripped.

Pure: a tiny layout and synthetic K/V, frames fed to an ``asyncio.StreamReader`` or sent over a
socket pair; no model is loaded.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from backends.engine import KVBlock, KVLayout, hash_block
from backends.engine.kv._blockpool import ExtraKey
from backends.engine.kv._wire import (
    MAX_FRAME_BYTES,
    ErrorCode,
    Frame,
    FrameKind,
    KVWireError,
    PullRequest,
    decode_begin,
    decode_block,
    decode_end,
    decode_error,
    decode_pull,
    encode_begin,
    encode_block,
    encode_end,
    encode_error,
    encode_pull,
    frame_header,
    read_frame,
    write_frame,
)
from tests.utils import fuzz_settings

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4)
SEED = bytes(range(32))  # a model fingerprint: sha256-sized, as the engine's is
HEADER = struct.Struct("<4sBBHIQ")  # the documented 20-byte frame header


def _block(
    tokens: Sequence[int] = (5, 6, 7, 8),
    extra_keys: Sequence[ExtraKey] = (),
    *,
    parent: bytes = SEED,
    seed: int = 0,
) -> KVBlock:
    data = np.random.default_rng(seed).standard_normal(LAYOUT.block_shape, dtype=np.float32)
    return KVBlock(
        block_id=7,
        block_hash=hash_block(parent, tokens, extra_keys),
        parent_hash=parent,
        token_ids=tuple(tokens),
        extra_keys=tuple(extra_keys),
        data=data,
    )


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def _frame_bytes(kind: FrameKind, payload: bytes, flags: int = 0) -> bytes:
    return frame_header(kind, payload, flags) + payload


async def _through_wire(kind: FrameKind, payload: bytes, flags: int = 0) -> Frame:
    return await read_frame(_reader(_frame_bytes(kind, payload, flags)))


def _assert_same_block(got: KVBlock, want: KVBlock) -> None:
    assert got.block_hash == want.block_hash and got.parent_hash == want.parent_hash
    assert got.token_ids == want.token_ids
    assert got.extra_keys == want.extra_keys
    assert [type(k) for k in got.extra_keys] == [type(k) for k in want.extra_keys]
    assert got.data.dtype == np.float32 and got.data.shape == LAYOUT.block_shape
    assert got.data.tobytes() == want.data.tobytes()  # bitwise, not approximately
    got.verify()


# -- blocks -----------------------------------------------------------------------------------


async def test_a_block_round_trips_bitwise_through_a_frame() -> None:
    block = _block()
    frame = await _through_wire(FrameKind.BLOCK, encode_block(block))
    assert frame.kind is FrameKind.BLOCK and frame.flags == 0
    decoded = decode_block(frame, LAYOUT)
    _assert_same_block(decoded, block)
    assert decoded.block_id == -1  # the owner's id means nothing here


def test_a_chained_block_keeps_its_parent() -> None:
    first = _block((1, 2, 3, 4))
    second = _block((9, 9, 9, 9), parent=first.block_hash, seed=1)
    decoded = decode_block(Frame(FrameKind.BLOCK, 0, encode_block(second)), LAYOUT)
    _assert_same_block(decoded, second)
    assert decoded.parent_hash == first.block_hash


def test_extra_keys_of_every_type_round_trip_with_their_type() -> None:
    extras: tuple[ExtraKey, ...] = ("tenant-a", "café ☕", "", 42, -7, 0, b"\x00\xff", b"", "42")
    block = _block(extra_keys=extras)
    decoded = decode_block(Frame(FrameKind.BLOCK, 0, encode_block(block)), LAYOUT)
    _assert_same_block(decoded, block)
    assert decoded.extra_keys[3] == 42 and decoded.extra_keys[-1] == "42"  # int vs its text


_EXTRA_KEYS = st.one_of(st.text(max_size=12), st.integers(-(2**70), 2**70), st.binary(max_size=12))


@fuzz_settings(100)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=LAYOUT.block_size * 2),
    extra_keys=st.lists(_EXTRA_KEYS, max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_block_round_trips_and_still_verifies(
    tokens: list[int], extra_keys: list[ExtraKey], seed: int
) -> None:
    block = _block(tokens, extra_keys, seed=seed)
    decoded = decode_block(Frame(FrameKind.BLOCK, 0, encode_block(block)), LAYOUT)
    _assert_same_block(decoded, block)


def test_a_block_payload_of_the_wrong_size_is_a_protocol_error() -> None:
    payload = encode_block(_block(extra_keys=("salt",)))
    bad_payloads = {
        "one value short": payload[:-4],
        "one byte too many": payload + b"\x00",
        "shorter than its head": payload[:40],
        "cut inside an extra key": payload[: 32 + 32 + 2 + 1 + 3 + 2],
    }
    for what, bad in bad_payloads.items():
        with pytest.raises(KVWireError) as caught:
            decode_block(Frame(FrameKind.BLOCK, 0, bad), LAYOUT)
        assert caught.value.reason == "protocol", what
    other_layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=4, block_size=4)
    with pytest.raises(KVWireError, match="BLOCK payload"):
        decode_block(Frame(FrameKind.BLOCK, 0, payload), other_layout)


def test_a_malformed_extra_key_is_a_protocol_error() -> None:
    payload = bytearray(encode_block(_block(extra_keys=(12,))))
    tag_at = 32 + 32 + 2 + 1
    assert payload[tag_at : tag_at + 1] == b"i"
    not_a_tag = bytearray(payload)
    not_a_tag[tag_at] = ord("x")
    not_a_number = bytearray(payload)
    not_a_number[tag_at + 3 : tag_at + 5] = b"zz"  # the key's two digits
    for bad in (not_a_tag, not_a_number):
        with pytest.raises(KVWireError) as caught:
            decode_block(Frame(FrameKind.BLOCK, 0, bytes(bad)), LAYOUT)
        assert caught.value.reason == "protocol"


# -- frames -----------------------------------------------------------------------------------


async def test_the_header_is_the_documented_twenty_bytes() -> None:
    payload = b"some payload"
    header = frame_header(FrameKind.END, payload, flags=3)
    assert len(header) == 20
    magic, kind, flags, zero, length, checksum = HEADER.unpack(header)
    assert (magic, kind, flags, zero, length) == (b"UKV1", FrameKind.END, 3, 0, len(payload))
    assert checksum == xxhash.xxh3_64_intdigest(payload)


async def test_a_flipped_payload_byte_fails_the_checksum() -> None:
    data = bytearray(_frame_bytes(FrameKind.BLOCK, encode_block(_block())))
    data[-1] ^= 0x01
    with pytest.raises(KVWireError) as caught:
        await read_frame(_reader(bytes(data)))
    assert caught.value.reason == "checksum"


async def test_a_flipped_checksum_byte_fails_the_checksum() -> None:
    data = bytearray(_frame_bytes(FrameKind.END, encode_end(3)))
    data[12] ^= 0x80  # the checksum's first byte
    with pytest.raises(KVWireError) as caught:
        await read_frame(_reader(bytes(data)))
    assert caught.value.reason == "checksum"


def _header(magic: bytes, kind: int, length: int, payload: bytes) -> bytes:
    return HEADER.pack(magic, kind, 0, 0, length, xxhash.xxh3_64_intdigest(payload))


async def test_a_bad_header_is_a_protocol_error_before_any_payload_is_read() -> None:
    payload = encode_end(1)
    bad_headers = {
        "bad magic": _header(b"UKV2", FrameKind.END, len(payload), payload) + payload,
        "unknown kind": _header(b"UKV1", 9, len(payload), payload) + payload,
        "kind zero": _header(b"UKV1", 0, len(payload), payload) + payload,
        # No payload follows: reading one would be an IncompleteReadError, not this.
        "oversize": _header(b"UKV1", FrameKind.BLOCK, MAX_FRAME_BYTES + 1, b""),
    }
    for what, data in bad_headers.items():
        with pytest.raises(KVWireError) as caught:
            await read_frame(_reader(data))
        assert caught.value.reason == "protocol", what


async def test_a_frame_of_exactly_the_limit_is_not_refused_for_its_size() -> None:
    header = _header(b"UKV1", FrameKind.BLOCK, MAX_FRAME_BYTES, b"")
    with pytest.raises(asyncio.IncompleteReadError):  # it went on to read the payload
        await read_frame(_reader(header))


def test_an_oversize_frame_is_never_written() -> None:
    with pytest.raises(ValueError, match="frame of"):
        frame_header(FrameKind.BLOCK, bytes(MAX_FRAME_BYTES + 1))


async def test_a_truncated_stream_is_an_incomplete_read() -> None:
    data = _frame_bytes(FrameKind.BLOCK, encode_block(_block()))
    for cut in (0, 5, 19, 20, len(data) - 1):
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(_reader(data[:cut]))


async def test_frames_follow_each_other_on_one_stream() -> None:
    data = _frame_bytes(FrameKind.BEGIN, encode_begin(LAYOUT, 2)) + _frame_bytes(
        FrameKind.END, encode_end(2)
    )
    reader = _reader(data)
    assert (await read_frame(reader)).kind is FrameKind.BEGIN
    assert decode_end(await read_frame(reader)) == 2
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader)


# -- messages ---------------------------------------------------------------------------------


@pytest.mark.parametrize("release_after", [False, True])
async def test_pull_round_trips_with_its_release_flag(release_after: bool) -> None:
    pull = PullRequest(bytes(range(16)), 3, 70_000, b"\xab" * 32, b"\xcd" * 32, release_after)
    payload, flags = encode_pull(pull)
    frame = await _through_wire(FrameKind.PULL, payload, flags)
    assert frame.kind is FrameKind.PULL
    assert decode_pull(frame) == pull


async def test_begin_end_and_error_round_trip() -> None:
    begin = await _through_wire(FrameKind.BEGIN, encode_begin(LAYOUT, 65_536))
    assert decode_begin(begin) == (LAYOUT, 65_536)
    end = await _through_wire(FrameKind.END, encode_end(2**32 - 1))
    assert decode_end(end) == 2**32 - 1
    error = await _through_wire(FrameKind.ERROR, encode_error(ErrorCode.BAD_RANGE, "blocks ✗"))
    assert decode_error(error) == (ErrorCode.BAD_RANGE, "blocks ✗")


def test_an_error_with_an_unknown_code_keeps_its_message() -> None:
    assert decode_error(Frame(FrameKind.ERROR, 0, b"\xc8lost")) == (None, "lost")
    assert decode_error(Frame(FrameKind.ERROR, 0, b"\x01\xff")) == (
        ErrorCode.UNKNOWN_TICKET,
        "\ufffd",  # invalid UTF-8 is replaced, not raised
    )
    with pytest.raises(KVWireError) as caught:
        decode_error(Frame(FrameKind.ERROR, 0, b""))
    assert caught.value.reason == "protocol"


def test_fixed_size_messages_of_the_wrong_size_are_protocol_errors() -> None:
    pull, _ = encode_pull(PullRequest(bytes(16), 0, 1, bytes(32), bytes(32)))
    cases: list[tuple[Callable[[Frame], object], Frame]] = [
        (decode_pull, Frame(FrameKind.PULL, 0, pull[:-1])),
        (decode_begin, Frame(FrameKind.BEGIN, 0, encode_begin(LAYOUT, 1) + b"\x00")),
        (decode_end, Frame(FrameKind.END, 0, b"")),
        # A layout no model has: zero layers.
        (decode_begin, Frame(FrameKind.BEGIN, 0, struct.pack("<HHHHI", 0, 1, 4, 4, 1))),
    ]
    for decode, frame in cases:
        with pytest.raises(KVWireError) as caught:
            decode(frame)
        assert caught.value.reason == "protocol", frame


# -- over a real socket -----------------------------------------------------------------------


@pytest.fixture
async def socket_pair() -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    left, right = socket.socketpair()
    reader, reader_side = await asyncio.open_connection(sock=left)
    _, writer = await asyncio.open_connection(sock=right)
    try:
        yield reader, writer
    finally:
        for side in (writer, reader_side):
            side.close()
            await side.wait_closed()


async def test_written_frames_are_read_back_in_order(
    socket_pair: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = socket_pair
    blocks = [_block(seed=1), _block((1, 1, 1, 1), ("salt", 3), seed=2)]
    write_frame(writer, FrameKind.BEGIN, encode_begin(LAYOUT, len(blocks)))
    for block in blocks:
        write_frame(writer, FrameKind.BLOCK, encode_block(block))
    write_frame(writer, FrameKind.END, encode_end(len(blocks)))
    await writer.drain()
    writer.close()
    assert decode_begin(await read_frame(reader)) == (LAYOUT, 2)
    for block in blocks:
        _assert_same_block(decode_block(await read_frame(reader), LAYOUT), block)
    assert decode_end(await read_frame(reader)) == 2
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader)
