"""The KV codec interface: a block of keys or values in, an encoded block out, and back.

Rules every codec keeps
-----------------------
1. ``encode(x, role)`` takes one block of K or V, float32 ``[tokens, kv_heads, head_dim]``, and
   returns an ``EncodedBlock``: plain numpy arrays (codes, scales, zeros) plus the shape.  The
   block is encoded on its own: nothing is carried from one block to the next, so blocks can be
   cached, retained, moved between nodes and decoded in any order.
2. ``decode(encode(x, role))`` is float32 of ``x``'s shape, and encoding is deterministic: the
   same input gives the same bits, on every call and in every process (a codec holds no state
   that encoding changes; its random rotation comes from the seed it was built with).
3. The size of a block is measured, never declared: ``EncodedBlock.nbytes`` sums the arrays it
   holds, and ``bits_per_element`` divides that by the elements.  The shape and the codec's name
   are not counted: a paged cache knows them from its layout, once for all blocks.  Per-layer
   constants (E8's key mean, key scale and rotation signs) are not counted either: they are a
   few KB per model, the same for every block and every sequence.
4. A codec is a write-time transform of one block.  What a cache keeps at full precision beside
   it -- the attention-sink token (position 0) and a recent window of ``window_tokens`` tokens
   -- is the cache's read-time policy, not the codec's: the codec states the window it was
   designed with (KIVI's 128) and the cache keeps those tokens' raw K/V and reads them in place
   of the decoded ones.
5. How much a block holds matters for codecs whose scales span tokens (KIVI keys are quantized
   per channel over the block's tokens): ``DEFAULT_ENCODE_TOKENS`` (32, KIVI's group, two
   16-token paged blocks) is the unit the quality measurement encodes and the bits are quoted
   at.  A cache that encodes single 16-token blocks pays KIVI one more bit per key element.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..._arrays import Float32Array as Float32Array  # re-exported: codecs import it here

__all__ = [
    "DEFAULT_ENCODE_TOKENS",
    "DEFAULT_SEED",
    "BlockCodec",
    "CodecSpec",
    "EncodedBlock",
    "KVCodec",
    "Role",
    "block_shape",
    "measured_bits_per_element",
]

Role = Literal["key", "value"]
ROLES: tuple[Role, Role] = ("key", "value")

DEFAULT_ENCODE_TOKENS = 32
"""Tokens per encoded block in the quality measurement and in the bits quoted (rule 5)."""
DEFAULT_SEED = 0x5EED_E8
"""Seed of the E8 codec's random signs when none is given."""


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """One encoded block of K or V: the arrays a cache stores, and the shape it came from.

    ``codes``: the quantized elements (any dtype; bit-packed codes are uint8).
    ``scales`` / ``zeros``: per-group metadata (may be empty arrays).
    """

    codec: str
    role: Role
    shape: tuple[int, int, int]
    codes: npt.NDArray[Any]
    scales: npt.NDArray[Any]
    zeros: npt.NDArray[Any]

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be 'key' or 'value', got {self.role!r}")
        if len(self.shape) != 3 or min(self.shape) <= 0:
            raise ValueError(f"an encoded block needs a positive 3-d shape, got {self.shape}")

    @property
    def elements(self) -> int:
        tokens, heads, dim = self.shape
        return tokens * heads * dim

    @property
    def nbytes(self) -> int:
        """Bytes a cache holds for this block: codes, scales and zeros (rule 3)."""
        return int(self.codes.nbytes + self.scales.nbytes + self.zeros.nbytes)

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / self.elements


@runtime_checkable
class KVCodec(Protocol):
    """A way to store blocks of K and V (see the module comment for the rules)."""

    @property
    def name(self) -> str: ...

    @property
    def window_tokens(self) -> int:
        """Recent tokens the cache should keep at full precision (0: none, rule 4)."""
        ...

    def encode(self, x: Float32Array, role: Role) -> EncodedBlock: ...

    def decode(self, encoded: EncodedBlock) -> Float32Array: ...

    def nbytes(self, encoded: EncodedBlock) -> int: ...

    def bits_per_element(
        self, kv_heads: int, head_dim: int, tokens: int = DEFAULT_ENCODE_TOKENS
    ) -> float:
        """True bits per element of K and V (their mean) for blocks of this shape, measured."""
        ...


def measured_bits_per_element(
    codec: KVCodec, kv_heads: int, head_dim: int, tokens: int = DEFAULT_ENCODE_TOKENS
) -> float:
    """Encode a block of K and one of V of this shape and measure them (rule 3).

    The data is random: no codec here sizes its output by content, and a test holds them to it.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
    sizes = [codec.nbytes(codec.encode(x, role)) for role in ROLES]
    return 8.0 * sum(sizes) / (2 * x.size)


def block_shape(x: npt.NDArray[Any]) -> tuple[int, int, int]:
    """``x``'s [tokens, kv_heads, head_dim] as plain ints, for ``EncodedBlock.shape``."""
    tokens, heads, dim = x.shape
    return (int(tokens), int(heads), int(dim))


class BlockCodec(ABC):
    """What every codec here does the same way around its own math.

    ``encode`` checks the block (rule 1) and ``decode`` the codec name before handing over to
    ``_encode`` / ``_decode``; the size is the encoded arrays' bytes, measured (rule 3).
    """

    __slots__ = ()
    name: str
    window_tokens: int

    def encode(self, x: Float32Array, role: Role) -> EncodedBlock:
        if role not in ROLES:
            raise ValueError(f"role must be 'key' or 'value', got {role!r}")
        if x.ndim != 3 or min(x.shape) <= 0:
            raise ValueError(f"a KV block is [tokens, kv_heads, head_dim], got shape {x.shape}")
        if x.dtype != np.float32:
            raise ValueError(f"a KV block is float32, got {x.dtype}")
        return self._encode(x, role)

    def decode(self, encoded: EncodedBlock) -> Float32Array:
        if encoded.codec != self.name:
            raise ValueError(f"a {encoded.codec} block cannot be decoded by the {self.name} codec")
        return self._decode(encoded)

    def nbytes(self, encoded: EncodedBlock) -> int:
        return encoded.nbytes

    def bits_per_element(
        self, kv_heads: int, head_dim: int, tokens: int = DEFAULT_ENCODE_TOKENS
    ) -> float:
        return measured_bits_per_element(self, kv_heads, head_dim, tokens)

    @abstractmethod
    def _encode(self, x: Float32Array, role: Role) -> EncodedBlock: ...

    @abstractmethod
    def _decode(self, encoded: EncodedBlock) -> Float32Array: ...


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """A registry entry: how to build the codec named ``name`` for one layer.

    ``build(layer, seed, key_mean, key_scale)``: ``key_mean`` and ``key_scale`` [kv_heads,
    head_dim] (or None) are the layer's calibrated key mean and per-channel key multipliers,
    used by codecs that centre and weigh keys (E8); others ignore them and the seed.
    """

    name: str
    summary: str
    build: Callable[[int, int, Float32Array | None, Float32Array | None], KVCodec]
