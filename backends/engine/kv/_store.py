"""Paged K/V storage: the float32 arrays that hold every block of every layer.

Layout (one array for keys, one for values, allocated once):

* ``keys``:   [layers, kv_heads, num_blocks, head_dim, block_size] -- each block's keys stored
  transposed (``K^T`` of the block, contiguous), so that gathering copies whole blocks and a
  block is ready for the ``q @ K^T`` product.
* ``values``: [layers, kv_heads, num_blocks, block_size, head_dim].

Decode reads the keys block by block (``gather_group``; scores are products over ``head_dim``,
one FMA chain per score, so cutting the key axis into blocks does not change a bit -- rule 3 of
``_attention``, probed for this block size when the storage is built: where it does not hold,
``gather_group`` copies one ``K^T`` of the span instead); prefill reads one ``K^T`` of the whole
span (``gather``).

``gather_group`` copies into two scratch arrays the storage keeps (grown to the largest group
seen, so they hold at most what one call would allocate), and returns views of them: a decode
step gathers a few MB per layer, and fresh arrays of that size are returned to the OS when freed
and page-faulted back on the next layer, which cost more than the copy itself.

Block ``NULL_BLOCK`` (id 0) is never handed out and stays zero: block tables are padded with it up
to the key span attention reads, so the padding is finite and masked.

The exchange format (``read_block`` / ``write_block``) is the layout-neutral
[layers, 2, kv_heads, block_size, head_dim] float32, index 0 of axis 1 = K, 1 = V, with keys in
the Hugging Face rotary layout (RoPE rotates the halves of each head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arrays import Float32Array, IntArray
from ..model._attention import blockwise_scores_exact
from ..model._gguf import ModelConfig

__all__ = ["DEFAULT_BLOCK_SIZE", "NULL_BLOCK", "GroupScratch", "KVLayout", "KVStorage"]

DEFAULT_BLOCK_SIZE = 16
NULL_BLOCK = 0


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


class GroupScratch:
    """What a group gather does the same in every store: the block ids checked, the scratch
    arrays the blocks are taken into (grown, never shrunk), and the views handed to
    attention. The views are of the scratch: valid until the next gather."""

    __slots__ = ("_keys", "_values", "layout", "num_blocks")

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self._keys: Float32Array = np.empty(0, dtype=np.float32)
        self._values: Float32Array = np.empty(0, dtype=np.float32)

    def take_into(self, flat: IntArray) -> tuple[Float32Array, Float32Array]:
        """Scratch ``(K^T [heads, n, head_dim, block_size], V [heads, n, block_size,
        head_dim])`` for the ``n`` block ids of ``flat``, once they are checked in range."""
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.num_blocks):
            raise IndexError(f"block ids must lie in [0, {self.num_blocks})")
        lay = self.layout
        heads, dim = lay.num_kv_heads, lay.head_dim
        size = heads * flat.size * dim * lay.block_size
        if self._keys.size < size:
            self._keys = np.empty(size, dtype=np.float32)
            self._values = np.empty(size, dtype=np.float32)
        return (
            self._keys[:size].reshape(heads, flat.size, dim, lay.block_size),
            self._values[:size].reshape(heads, flat.size, lay.block_size, dim),
        )

    def views(self, keys: Float32Array, values: Float32Array, tables: IntArray,
              blockwise_scores: bool) -> tuple[Float32Array, Float32Array]:
        """``gather_group``'s answer from the filled scratch (``KVStorage.gather_group``)."""
        lay = self.layout
        heads, dim = lay.num_kv_heads, lay.head_dim
        seqs, blocks = tables.shape
        tokens = blocks * lay.block_size
        keys = keys.reshape(heads, seqs, blocks, dim, lay.block_size)
        if not blockwise_scores:
            keys_t = np.ascontiguousarray(keys.transpose(0, 1, 3, 2, 4))
            keys = keys_t.reshape(heads, seqs, 1, dim, tokens)
        return (
            keys.transpose(1, 0, 2, 3, 4),
            values.reshape(heads, seqs, tokens, dim).transpose(1, 0, 2, 3),
        )


class KVStorage:
    """The K/V arrays of ``num_blocks`` blocks (block 0 is the null block)."""

    __slots__ = (
        "_group",
        "blockwise_scores",
        "keys",
        "layout",
        "num_blocks",
        "values",
    )

    codec: None = None
    """Every block raw float32 (fp32); a codec's storage is ``_coded_store.CodedKVStorage``."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("KV storage needs at least one block besides the null block")
        self.layout = layout
        self.num_blocks = num_blocks
        self.blockwise_scores = blockwise_scores_exact(layout.head_dim, layout.block_size)
        """Whether decode scores are made block by block (bitwise one product's, probed)."""
        self._group = GroupScratch(layout, num_blocks)
        lay = layout
        self.keys: Float32Array = np.zeros(
            (lay.num_layers, lay.num_kv_heads, num_blocks, lay.head_dim, lay.block_size),
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
        # Advanced indices around a slice put the token axis first: [n, kv_heads, head_dim].
        self.keys[layer][:, blocks, :, offsets] = k
        self.values[layer][:, blocks, offsets] = v.transpose(1, 0, 2)

    def gather(self, layer: int, table: IntArray) -> tuple[Float32Array, Float32Array]:
        """``(K^T [kv_heads, head_dim, tokens], V [kv_heads, tokens, head_dim])`` of a table."""
        lay = self.layout
        tokens = table.size * lay.block_size
        blocks = np.take(self.keys[layer], table, axis=1)
        keys_t = np.ascontiguousarray(blocks.transpose(0, 2, 1, 3))
        values = np.take(self.values[layer], table, axis=1)
        return (
            keys_t.reshape(lay.num_kv_heads, lay.head_dim, tokens),
            values.reshape(lay.num_kv_heads, tokens, lay.head_dim),
        )

    def gather_group(self, layer: int, tables: IntArray) -> tuple[Float32Array, Float32Array]:
        """Views ``(K^T per block [seqs, kv_heads, blocks, head_dim, block_size],
        V [seqs, kv_heads, tokens, head_dim])``.

        ``tables``: [seqs, blocks], one equally long block table per sequence.  Without
        ``blockwise_scores`` the keys come as one block of all ``tokens`` columns (a copy).
        The views are of scratch arrays: valid until the next ``gather_group``.
        """
        flat = tables.ravel()
        keys, values = self._group.take_into(flat)
        # ``clip`` only to write straight into ``out`` (``raise`` buffers): ids checked.
        np.take(self.keys[layer], flat, axis=1, out=keys, mode="clip")
        np.take(self.values[layer], flat, axis=1, out=values, mode="clip")
        return self._group.views(keys, values, tables, self.blockwise_scores)

    def read_block(self, block_id: int) -> Float32Array:
        """A copy of one block in the exchange format."""
        out = np.empty(self.layout.block_shape, dtype=np.float32)
        out[:, 0] = self.keys[:, :, block_id].transpose(0, 1, 3, 2)
        out[:, 1] = self.values[:, :, block_id]
        return out

    def write_block(self, block_id: int, data: Float32Array) -> None:
        """Overwrite one block from the exchange format."""
        if data.shape != self.layout.block_shape or data.dtype != np.float32:
            raise ValueError(
                f"KV block must be float32 {self.layout.block_shape}, got {data.dtype} {data.shape}"
            )
        self.keys[:, :, block_id] = data[:, 0].transpose(0, 1, 3, 2)
        self.values[:, :, block_id] = data[:, 1]
