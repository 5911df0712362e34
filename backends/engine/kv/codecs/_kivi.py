"""KIVI: asymmetric integer quantization, keys per channel and values per token (Liu et al. 2024).

Rules
-----
1. Keys are quantized per channel over the block's tokens: for each (head, channel) the block's
   minimum and maximum define ``zero = min`` and ``scale = (max - min) / (2^bits - 1)``.  Post-RoPE
   keys have a few outlier channels of large magnitude; a per-channel range confines them.
2. Values are quantized per token over groups of ``VALUE_GROUP`` (32) channels: the value rows
   are mixed by the attention weights, so the error of each token's row is what matters.
3. Scale and zero are stored as float16 and codes are computed against the stored (rounded)
   scale and zero, so decoding ``code * scale + zero`` is what encoding aimed at.
4. Codes are bit-packed little-endian within each byte (``bits`` 2: four codes per byte), so a
   2-bit code costs 2 bits: ``EncodedBlock.nbytes`` is the real size.
5. KIVI keeps the most recent ``KIVI_WINDOW`` (128) tokens at full precision; here that is the
   cache's read-time window (``window_tokens``), not the codec's business.

Bits per element, tokens ``T`` per block: keys ``bits + 32 / T``, values ``bits + 32 / 32``; at
the 32-token unit both are ``bits + 1`` (kivi-2: 3.0, kivi-4: 5.0, kivi-8: 9.0).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..._arrays import Float32Array, UInt8Array
from ._codec import BlockCodec, EncodedBlock, Role, block_shape

__all__ = ["KIVI_WINDOW", "VALUE_GROUP", "KiviCodec", "pack_codes", "unpack_codes"]

VALUE_GROUP = 32
"""Channels per value group (KIVI's group size)."""
KIVI_WINDOW = 128
"""KIVI's full-precision window of the most recent tokens."""
_PACKABLE_BITS = (1, 2, 4, 8)


def _unpack_table(bits: int) -> npt.NDArray[np.unsignedinteger[Any]]:
    """For each byte value, the ``8 // bits`` codes packed in it (lowest bits first) as one
    little-endian integer of that many bytes, so that ``table[packed]`` viewed as bytes is the
    codes in order."""
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    mask = np.uint8((1 << bits) - 1)
    codes = (np.arange(256, dtype=np.uint8)[:, None] >> shifts) & mask  # [256, per_byte]
    return np.ascontiguousarray(codes).view(f"<u{per_byte}").reshape(256)


_UNPACK = {bits: _unpack_table(bits) for bits in _PACKABLE_BITS if bits < 8}
"""Rule 4's unpacking as one table lookup per byte: a block's decode unpacks every layer's
codes on each decoded-cache miss, and the shifts and masks cost ~40 µs a block there."""


def pack_codes(codes: UInt8Array, bits: int) -> UInt8Array:
    """Flatten ``codes`` (each < 2**bits) and pack ``8 // bits`` of them per byte (rule 4)."""
    if bits not in _PACKABLE_BITS:
        raise ValueError(f"codes pack at {_PACKABLE_BITS} bits, not {bits}")
    flat = codes.ravel()
    if bits == 8:
        return flat.copy()
    per_byte = 8 // bits
    padded = np.zeros(-(-flat.size // per_byte) * per_byte, dtype=np.uint8)
    padded[: flat.size] = flat
    lanes = padded.reshape(-1, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    packed: UInt8Array = np.bitwise_or.reduce(lanes << shifts, axis=1).astype(np.uint8)
    return packed


def unpack_codes(packed: UInt8Array, bits: int, count: int) -> UInt8Array:
    """The first ``count`` codes of ``pack_codes``'s output."""
    if bits not in _PACKABLE_BITS:
        raise ValueError(f"codes pack at {_PACKABLE_BITS} bits, not {bits}")
    if bits == 8:
        return packed[:count].copy()
    codes: UInt8Array = np.take(_UNPACK[bits], packed).view(np.uint8)[:count]
    return codes


def _quantize(
    x: Float32Array, axis: tuple[int, ...], bits: int
) -> tuple[UInt8Array, npt.NDArray[np.float16], npt.NDArray[np.float16]]:
    """Asymmetric quantization of ``x`` with one (scale, zero) per slice reduced over ``axis``."""
    levels = (1 << bits) - 1
    low = x.min(axis=axis, keepdims=True)
    high = x.max(axis=axis, keepdims=True)
    zero = low.astype(np.float16)
    scale = ((high - zero.astype(np.float32)) / np.float32(levels)).astype(np.float16)
    # Rounding scale and zero to float16 can leave the range a hair short; clip is the bound.
    scale32 = scale.astype(np.float32)
    safe = np.where(scale32 > 0, scale32, np.float32(1.0))
    q = np.rint((x - zero.astype(np.float32)) / safe)
    codes = np.clip(q, 0, levels).astype(np.uint8)
    return codes, scale, zero


class KiviCodec(BlockCodec):
    """KIVI at ``bits`` (2, 4 or 8) bits per code (see the module comment)."""

    __slots__ = ("bits", "name", "window_tokens")

    def __init__(self, bits: int, *, window_tokens: int = KIVI_WINDOW) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"KIVI codes are 2, 4 or 8 bits, not {bits}")
        self.bits = bits
        self.name = f"kivi-{bits}"
        self.window_tokens = window_tokens

    def _encode(self, x: Float32Array, role: Role) -> EncodedBlock:
        tokens, heads, dim = x.shape
        if role == "key":
            codes, scale, zero = _quantize(x, (0,), self.bits)  # scale [1, heads, dim]
        else:
            if dim % VALUE_GROUP:
                raise ValueError(f"head_dim {dim} is not a multiple of {VALUE_GROUP}")
            grouped = x.reshape(tokens, heads, dim // VALUE_GROUP, VALUE_GROUP)
            codes, scale, zero = _quantize(grouped, (3,), self.bits)  # [tokens, heads, groups, 1]
        return EncodedBlock(
            self.name,
            role,
            block_shape(x),
            pack_codes(codes, self.bits),
            np.ascontiguousarray(scale.reshape(-1)),
            np.ascontiguousarray(zero.reshape(-1)),
        )

    def _decode(self, encoded: EncodedBlock) -> Float32Array:
        tokens, heads, dim = encoded.shape
        codes = unpack_codes(encoded.codes, self.bits, encoded.elements).astype(np.float32)
        scale = encoded.scales.astype(np.float32)
        zero = encoded.zeros.astype(np.float32)
        if encoded.role == "key":
            out = codes.reshape(tokens, heads, dim) * scale.reshape(1, heads, dim)
            out += zero.reshape(1, heads, dim)
            return out
        groups = dim // VALUE_GROUP
        grouped = codes.reshape(tokens, heads, groups, VALUE_GROUP)
        grouped *= scale.reshape(tokens, heads, groups, 1)
        grouped += zero.reshape(tokens, heads, groups, 1)
        return grouped.reshape(tokens, heads, dim)
