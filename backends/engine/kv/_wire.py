"""The KV transfer wire format: compact binary frames, each checksummed.

Every frame is a 20-byte header then its payload (integers little-endian)::

    magic    4s   b"UKV1"
    kind     u8   PULL | BEGIN | BLOCK | END | ERROR
    flags    u8   PULL: RELEASE_AFTER (the owner drops the set once it is sent)
    -        u16  zero
    length   u32  payload bytes, at most MAX_FRAME_BYTES
    checksum u64  XXH3-64 of the payload (zlib's crc32 ran at ~0.6 GB/s here, a third of a
                  4k-token transfer's time; XXH3 runs at memory speed)

A pull is one connection: the puller sends PULL; the owner answers BEGIN, one BLOCK per block,
END -- or ERROR instead of any of them.

    PULL   ticket (16) | start u32 | count u32 | model fingerprint (32) |
           numerics fingerprint (32: the BLAS paths' bits, ``_numerics``) |
           codec fingerprint (32: the KV codec and its calibration, zeros for fp32)
    BEGIN  layers u16 | kv_heads u16 | head_dim u16 | block_size u16 | count u32
    BLOCK  block hash (32) | parent hash (32) | tokens u16 | extra keys u8 | extra keys |
           token ids (i32 x tokens) | K/V (f32, the exchange layout [layers, 2, kv_heads,
           block_size, head_dim]; with a KV codec the packed encoded block instead,
           ``PagedCodec.export``, of one of the sizes the puller's codec expects)
    END    count u32
    ERROR  code u8 | utf-8 message

An extra key is a tag (``s`` str, ``i`` int, ``b`` bytes), a u16 length and its bytes.  Why
hand-written: the format is the product here (a NIXL-like transfer in miniature), and a block is
a fixed-shape float32 array plus its hash -- no serialization library would be smaller or let the
receiver verify more before trusting a byte.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import xxhash

from ._blockpool import ExtraKey, KVBlock
from ._retention import TICKET_BYTES
from ._store import KVLayout

__all__ = [
    "HASH_BYTES",
    "MAX_FRAME_BYTES",
    "PULL_BYTES",
    "ErrorCode",
    "Frame",
    "FrameKind",
    "KVWireError",
    "PullRequest",
    "decode_begin",
    "decode_block",
    "decode_end",
    "decode_error",
    "decode_pull",
    "encode_begin",
    "encode_block",
    "encode_end",
    "encode_error",
    "encode_pull",
    "frame_header",
    "read_frame",
    "write_frame",
]

MAGIC = b"UKV1"
HASH_BYTES = 32
# One block of SmolLM2 is 720 KiB; a frame this large is a broken or hostile peer.
MAX_FRAME_BYTES = 64 * 1024 * 1024
RELEASE_AFTER = 0x01

_HEADER = struct.Struct("<4sBBHIQ")
_PULL = struct.Struct(f"<{TICKET_BYTES}sII{HASH_BYTES}s{HASH_BYTES}s{HASH_BYTES}s")
_BEGIN = struct.Struct("<HHHHI")
_BLOCK_HEAD = struct.Struct(f"<{HASH_BYTES}s{HASH_BYTES}sHB")
_EXTRA_HEAD = struct.Struct("<cH")
_END = struct.Struct("<I")
# A PULL frame's payload: the most an owner reads of a connection's first frame.
PULL_BYTES = _PULL.size
_ERROR_HEAD = struct.Struct("<B")


class FrameKind(enum.IntEnum):
    PULL = 1
    BEGIN = 2
    BLOCK = 3
    END = 4
    ERROR = 5


class ErrorCode(enum.IntEnum):
    UNKNOWN_TICKET = 1  # expired, released or never issued
    BAD_RANGE = 2
    MODEL_MISMATCH = 3
    BAD_REQUEST = 4
    UNAVAILABLE = 5
    NUMERICS_MISMATCH = 6  # same model, other bits (another BLAS kernel, threads, numpy)
    CODEC_MISMATCH = 7  # same model and bits, blocks stored by another KV codec


class KVWireError(Exception):
    """A frame that cannot be trusted: ``reason`` is ``checksum`` or ``protocol``."""

    def __init__(self, reason: Literal["checksum", "protocol"], message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Frame:
    kind: FrameKind
    flags: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class PullRequest:
    ticket: bytes
    start: int
    count: int
    fingerprint: bytes
    numerics: bytes
    release_after: bool = False
    codec: bytes = bytes(HASH_BYTES)


# -- frames ----------------------------------------------------------------------------------


def frame_header(kind: FrameKind, payload: bytes, flags: int = 0) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(payload)} bytes > {MAX_FRAME_BYTES}")
    return _HEADER.pack(MAGIC, kind, flags, 0, len(payload), xxhash.xxh3_64_intdigest(payload))


def write_frame(
    writer: asyncio.StreamWriter, kind: FrameKind, payload: bytes, flags: int = 0
) -> None:
    """Queue one frame on ``writer`` (the caller drains)."""
    writer.write(frame_header(kind, payload, flags))
    writer.write(payload)


async def read_frame(reader: asyncio.StreamReader, *, max_length: int = MAX_FRAME_BYTES) -> Frame:
    """The next frame, checked; ``asyncio.IncompleteReadError`` if the peer closed.  A frame
    whose header announces more than ``max_length`` payload bytes is refused unread."""
    header = await reader.readexactly(_HEADER.size)
    magic, kind, flags, _, length, checksum = _HEADER.unpack(header)
    if magic != MAGIC:
        raise KVWireError("protocol", f"bad magic {magic!r}")
    bound = min(max_length, MAX_FRAME_BYTES)
    if length > bound:
        raise KVWireError("protocol", f"frame of {length} bytes > {bound}")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise KVWireError("protocol", f"unknown frame kind {kind}") from None
    payload = await reader.readexactly(length)
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise KVWireError("checksum", f"{frame_kind.name} frame fails its checksum")
    return Frame(frame_kind, flags, payload)


def _exact(payload: bytes, layout: struct.Struct, what: str) -> tuple[Any, ...]:
    if len(payload) != layout.size:
        raise KVWireError("protocol", f"{what} payload of {len(payload)} bytes")
    return layout.unpack(payload)


# -- messages --------------------------------------------------------------------------------


def encode_pull(pull: PullRequest) -> tuple[bytes, int]:
    """Payload and flags of a PULL frame."""
    payload = _PULL.pack(
        pull.ticket, pull.start, pull.count, pull.fingerprint, pull.numerics, pull.codec
    )
    return payload, RELEASE_AFTER if pull.release_after else 0


def decode_pull(frame: Frame) -> PullRequest:
    ticket, start, count, fingerprint, numerics, codec = _exact(frame.payload, _PULL, "PULL")
    return PullRequest(
        ticket, start, count, fingerprint, numerics, bool(frame.flags & RELEASE_AFTER), codec
    )


def encode_begin(layout: KVLayout, count: int) -> bytes:
    return _BEGIN.pack(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, count
    )


def decode_begin(frame: Frame) -> tuple[KVLayout, int]:
    layers, kv_heads, head_dim, block_size, count = _exact(frame.payload, _BEGIN, "BEGIN")
    try:
        layout = KVLayout(layers, kv_heads, head_dim, block_size)
    except ValueError as exc:
        raise KVWireError("protocol", str(exc)) from exc
    return layout, int(count)


def encode_end(count: int) -> bytes:
    return _END.pack(count)


def decode_end(frame: Frame) -> int:
    (count,) = _exact(frame.payload, _END, "END")
    return int(count)


def encode_error(code: ErrorCode, message: str) -> bytes:
    return _ERROR_HEAD.pack(code) + message.encode("utf-8", "replace")


def decode_error(frame: Frame) -> tuple[ErrorCode | None, str]:
    if len(frame.payload) < _ERROR_HEAD.size:
        raise KVWireError("protocol", "empty ERROR payload")
    try:
        code: ErrorCode | None = ErrorCode(frame.payload[0])
    except ValueError:
        code = None
    return code, frame.payload[_ERROR_HEAD.size :].decode("utf-8", "replace")


def _encode_extra(key: ExtraKey) -> bytes:
    if isinstance(key, bytes):
        tag, data = b"b", key
    elif isinstance(key, int):
        tag, data = b"i", str(key).encode()
    else:
        tag, data = b"s", key.encode("utf-8")
    return _EXTRA_HEAD.pack(tag, len(data)) + data


def encode_block(block: KVBlock) -> bytes:
    """Payload of a BLOCK frame."""
    if len(block.block_hash) != HASH_BYTES or len(block.parent_hash) != HASH_BYTES:
        raise ValueError(f"block hashes must be {HASH_BYTES} bytes")
    head = _BLOCK_HEAD.pack(
        block.block_hash, block.parent_hash, len(block.token_ids), len(block.extra_keys)
    )
    extras = b"".join(_encode_extra(key) for key in block.extra_keys)
    tokens = np.asarray(block.token_ids, dtype="<i4").tobytes()
    dtype = np.uint8 if block.encoded else np.dtype("<f4")
    data = np.ascontiguousarray(block.data, dtype=dtype).tobytes()
    return b"".join((head, extras, tokens, data))


def decode_block(
    frame: Frame, layout: KVLayout, packed_sizes: tuple[int, ...] | None = None
) -> KVBlock:
    """A BLOCK frame's block; its hash is not checked here (``KVBlock.verify`` does).

    ``packed_sizes``: the sizes a packed block of the puller's codec may have (None: fp32)."""
    payload = frame.payload
    if len(payload) < _BLOCK_HEAD.size:
        raise KVWireError("protocol", "short BLOCK payload")
    block_hash, parent_hash, num_tokens, num_extra = _BLOCK_HEAD.unpack_from(payload)
    offset = _BLOCK_HEAD.size
    extras: list[ExtraKey] = []
    for _ in range(num_extra):
        if offset + _EXTRA_HEAD.size > len(payload):
            raise KVWireError("protocol", "short BLOCK extra key")
        tag, size = _EXTRA_HEAD.unpack_from(payload, offset)
        offset += _EXTRA_HEAD.size
        data = payload[offset : offset + size]
        offset += size
        if len(data) != size or tag not in (b"s", b"i", b"b"):
            raise KVWireError("protocol", "bad BLOCK extra key")
        try:
            extras.append(data if tag == b"b" else int(data) if tag == b"i" else data.decode())
        except ValueError as exc:
            raise KVWireError("protocol", f"bad BLOCK extra key: {exc}") from exc
    data_bytes = len(payload) - offset - 4 * num_tokens
    if data_bytes not in (packed_sizes or (layout.bytes_per_block,)):
        raise KVWireError("protocol", f"BLOCK payload of {len(payload)} bytes")
    tokens = np.frombuffer(payload, dtype="<i4", count=num_tokens, offset=offset)
    offset += 4 * num_tokens
    values: np.ndarray[Any, Any]
    if packed_sizes is None:
        values = np.frombuffer(payload, dtype="<f4", offset=offset).reshape(layout.block_shape)
        values = values.astype(np.float32, copy=False)
    else:
        values = np.frombuffer(payload, dtype=np.uint8, offset=offset)
    return KVBlock(
        block_id=-1,
        block_hash=bytes(block_hash),
        parent_hash=bytes(parent_hash),
        token_ids=tuple(int(t) for t in tokens),
        extra_keys=tuple(extras),
        data=values,
    )
