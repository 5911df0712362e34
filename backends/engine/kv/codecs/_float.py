"""Floating-point codecs: ``fp32`` (the reference, stored as is), ``fp16`` and ``fp8``.

``fp8`` is e4m3 (``ml_dtypes.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, largest finite
448, no infinities) with one float32 scale per KV head per block, ``amax / 448``, as vLLM's
``--kv-cache-dtype fp8`` with per-head scales: the block's largest magnitude of each head maps to
e4m3's largest finite value, so nothing saturates and a head of small values keeps its precision.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..._arrays import Float32Array
from ._codec import BlockCodec, EncodedBlock, Role, block_shape

__all__ = ["Float8Codec", "Float16Codec", "Float32Codec"]

FP8_MAX = 448.0
"""The largest finite e4m3fn value (a test checks it against ``ml_dtypes.finfo``)."""
_EMPTY = np.zeros(0, dtype=np.float32)


class _CastCodec(BlockCodec):
    """A codec that stores every element cast to one dtype, with no metadata."""

    __slots__ = ()
    name = ""
    dtype: Any = np.float32
    window_tokens = 0

    def _encode(self, x: Float32Array, role: Role) -> EncodedBlock:
        codes = np.ascontiguousarray(x, dtype=self.dtype)
        return EncodedBlock(self.name, role, block_shape(x), codes, _EMPTY, _EMPTY)

    def _decode(self, encoded: EncodedBlock) -> Float32Array:
        return np.asarray(encoded.codes, dtype=np.float32).reshape(encoded.shape)


class Float32Codec(_CastCodec):
    """The reference: the block as it is (a copy)."""

    __slots__ = ()
    name = "fp32"
    dtype = np.float32


class Float16Codec(_CastCodec):
    """IEEE half precision, round to nearest even."""

    __slots__ = ()
    name = "fp16"
    dtype = np.float16


class Float8Codec(BlockCodec):
    """e4m3 with a float32 scale per KV head per block (see the module comment)."""

    __slots__ = ()
    name = "fp8"
    window_tokens = 0

    def _encode(self, x: Float32Array, role: Role) -> EncodedBlock:
        amax = np.abs(x).max(axis=(0, 2)).astype(np.float32)  # [kv_heads]
        scales = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
        scaled = np.clip(x / scales[None, :, None], -FP8_MAX, FP8_MAX)  # no NaN from a rounding
        codes = scaled.astype(ml_dtypes.float8_e4m3fn)
        return EncodedBlock(self.name, role, block_shape(x), codes, scales, _EMPTY)

    def _decode(self, encoded: EncodedBlock) -> Float32Array:
        values: Float32Array = encoded.codes.astype(np.float32)
        values *= encoded.scales[None, :, None]
        return values
