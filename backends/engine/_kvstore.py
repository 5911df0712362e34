"""Paged K/V storage: the float32 arrays that hold every block of every layer.

Layout (one array for keys, one for values, allocated once):

* ``keys``:   [layers, kv_heads, head_dim, num_blocks, block_size] -- keys stored transposed, so
  that gathering a sequence's blocks yields ``K^T`` ready for the ``q @ K^T`` product.
* ``values``: [layers, kv_heads, num_blocks, block_size, head_dim].

Block ``NULL_BLOCK`` (id 0) is never handed out and stays zero: block tables are padded with it up
to the key span attention reads, so the padding is finite and masked.

The exchange format (``read_block`` / ``write_block``) is the layout-neutral
[layers, 2, kv_heads, block_size, head_dim] float32, index 0 of axis 1 = K, 1 = V, with keys in
the Hugging Face rotary layout (RoPE rotates the halves of each head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._gguf import ModelConfig

__all__ = ["DEFAULT_BLOCK_SIZE", "NULL_BLOCK", "KVLayout", "KVStorage"]

DEFAULT_BLOCK_SIZE = 16
NULL_BLOCK = 0

Float32Array = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.intp]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError("KV layout dimensions must be positive")

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE) -> KVLayout:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block in the exchange format."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.block_shape)) * 4


class KVStorage:
    """The K/V arrays of ``num_blocks`` blocks (block 0 is the null block)."""

    __slots__ = ("keys", "layout", "num_blocks", "values")

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("KV storage needs at least one block besides the null block")
        self.layout = layout
        self.num_blocks = num_blocks
        lay = layout
        self.keys: Float32Array = np.zeros(
            (lay.num_layers, lay.num_kv_heads, lay.head_dim, num_blocks, lay.block_size),
            dtype=np.float32,
        )
        self.values: Float32Array = np.zeros(
            (lay.num_layers, lay.num_kv_heads, num_blocks, lay.block_size, lay.head_dim),
            dtype=np.float32,
        )

    def write(
        self, layer: int, slots: tuple[IntArray, IntArray], k: Float32Array, v: Float32Array
    ) -> None:
        """Store K and V ([n, kv_heads, head_dim]) of ``n`` tokens at ``slots`` (block, offset)."""
        blocks, offsets = slots
        self.keys[layer][:, :, blocks, offsets] = k.transpose(1, 2, 0)
        self.values[layer][:, blocks, offsets] = v.transpose(1, 0, 2)

    def gather(self, layer: int, table: IntArray) -> tuple[Float32Array, Float32Array]:
        """``(K^T [kv_heads, head_dim, tokens], V [kv_heads, tokens, head_dim])`` of a table."""
        lay = self.layout
        tokens = table.size * lay.block_size
        keys_t = np.take(self.keys[layer], table, axis=2)
        values = np.take(self.values[layer], table, axis=1)
        return (
            keys_t.reshape(lay.num_kv_heads, lay.head_dim, tokens),
            values.reshape(lay.num_kv_heads, tokens, lay.head_dim),
        )

    def gather_group(self, layer: int, tables: IntArray) -> tuple[Float32Array, Float32Array]:
        """Views ``(K^T [seqs, kv_heads, head_dim, tokens], V [seqs, kv_heads, tokens, head_dim])``.

        ``tables``: [seqs, blocks], one equally long block table per sequence.
        """
        lay = self.layout
        seqs, blocks = tables.shape
        tokens = blocks * lay.block_size
        keys_t = np.take(self.keys[layer], tables.ravel(), axis=2)
        values = np.take(self.values[layer], tables.ravel(), axis=1)
        return (
            keys_t.reshape(lay.num_kv_heads, lay.head_dim, seqs, tokens).transpose(2, 0, 1, 3),
            values.reshape(lay.num_kv_heads, seqs, tokens, lay.head_dim).transpose(1, 0, 2, 3),
        )

    def read_block(self, block_id: int) -> Float32Array:
        """A copy of one block in the exchange format."""
        out = np.empty(self.layout.block_shape, dtype=np.float32)
        out[:, 0] = self.keys[:, :, :, block_id, :].transpose(0, 1, 3, 2)
        out[:, 1] = self.values[:, :, block_id]
        return out

    def write_block(self, block_id: int, data: Float32Array) -> None:
        """Overwrite one block from the exchange format."""
        if data.shape != self.layout.block_shape or data.dtype != np.float32:
            raise ValueError(
                f"KV block must be float32 {self.layout.block_shape}, got {data.dtype} {data.shape}"
            )
        self.keys[:, :, :, block_id, :] = data[:, 0].transpose(0, 1, 3, 2)
        self.values[:, :, block_id] = data[:, 1]
