"""Paged KV blocks with automatic prefix caching (the vLLM design).

Rules
-----
1. A block holds ``block_size`` consecutive positions of one sequence, all layers, K and V.
   Block 0 is the null block (see ``_store``); ``num_blocks`` counts the usable ones, so the
   memory limit pays for ``num_blocks + 1`` blocks.
2. Only a FULL block whose K/V are all computed is cached.  Its hash chains the whole prefix:
   ``hash = H(parent hash, the block's token ids, extra keys)``, the first block's parent being the
   pool's seed (the model's fingerprint), so equal hashes mean equal prefixes of the same model.
3. Every block has a reference count: the number of sequences whose block table holds it.  A
   block with count 0 sits in the free queue; if it is cached it keeps its hash and can be
   revived by a prefix hit until it is evicted.
4. The free queue is LRU: ``allocate`` takes from the front, evicting the hash of a cached block
   it takes; released cached blocks go to the back (a sequence's blocks are released tail first,
   so the tail of a prefix is evicted before its head); released uncached blocks go to the front.
5. Allocation is all or nothing: ``allocate(n)`` raises ``NoFreeBlocksError`` without changing
   anything when fewer than ``n`` blocks are free.
6. A cached block's content never changes: writes only go to blocks a sequence allocated for
   positions not yet computed, and an imported block's hash is checked against its tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._store import KVLayout, KVStorage

if TYPE_CHECKING:
    from ._paged_codec import PagedCodec

__all__ = [
    "BlockHash",
    "BlockPool",
    "CachedBlock",
    "ExtraKey",
    "KVBlock",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "hash_block",
    "hash_blocks",
]

BlockHash = bytes
ExtraKey = str | int | bytes
Float32Array = npt.NDArray[np.float32]

_HASH_DOMAIN = b"understudy.kv-block.v1\x00"


class NoFreeBlocksError(RuntimeError):
    """Fewer free KV blocks than an allocation needs."""


def _encode_extra(key: ExtraKey) -> bytes:
    if isinstance(key, bytes):
        tag, payload = b"b", key
    elif isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(f"extra key must be str, int or bytes, not {type(key).__name__}")
    elif isinstance(key, int):
        tag, payload = b"i", str(key).encode()
    else:
        tag, payload = b"s", key.encode("utf-8")
    return tag + struct.pack("<Q", len(payload)) + payload


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> BlockHash:
    """``sha256(domain, parent, len, token ids as little-endian int64, extra keys)``."""
    digest = hashlib.sha256(_HASH_DOMAIN)
    digest.update(struct.pack("<Q", len(parent)) + parent)
    digest.update(struct.pack("<Q", len(token_ids)))
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    digest.update(struct.pack("<Q", len(extra_keys)))
    for key in extra_keys:
        digest.update(_encode_extra(key))
    return digest.digest()


def hash_blocks(
    seed: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    first_extra_keys: Sequence[ExtraKey] = (),
    *,
    parents: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``.

    ``first_extra_keys`` (e.g. a cache salt) enter the first block only; the chain carries them.
    ``parents`` are hashes already known for the leading blocks (they are extended, not redone).
    """
    hashes = list(parents)
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else seed
        extra = first_extra_keys if index == 0 else ()
        block = token_ids[index * block_size : (index + 1) * block_size]
        hashes.append(hash_block(parent, block, extra))
    return hashes


@dataclass(frozen=True, slots=True)
class KVBlock:
    """One cached block, as exported to (or imported from) another node.

    ``data``: [layers, 2, kv_heads, block_size, head_dim] float32 (axis 1: K then V), keys in the
    Hugging Face rotary layout -- or, from a pool with a codec, the packed encoded block (uint8,
    ``PagedCodec.export``).  ``block_id`` is the id on the exporting node (informative).
    """

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...]
    data: npt.NDArray[Any] = field(repr=False)

    @property
    def encoded(self) -> bool:
        return self.data.dtype == np.uint8

    def verify(self) -> None:
        """Raise ``ValueError`` unless the hash matches the tokens and the data is finite
        (packed blocks are checked as they are decoded)."""
        if hash_block(self.parent_hash, self.token_ids, self.extra_keys) != self.block_hash:
            raise ValueError(f"KV block {self.block_id}: hash does not match its tokens")
        if not self.encoded and not np.isfinite(self.data).all():
            raise ValueError(f"KV block {self.block_id}: non-finite values")


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters of a pool (cumulative queries/hits in tokens, like vLLM's metrics)."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    queries: int
    hits: int

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What identifies a cached block's content: its chained hash and what it was made of."""

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...]

    def with_data(self, block_id: int, data: npt.NDArray[Any]) -> KVBlock:
        """The exported form of this block, holding ``data``."""
        return KVBlock(
            block_id, self.block_hash, self.parent_hash, self.token_ids, self.extra_keys, data
        )


class BlockPool:
    """Reference-counted KV blocks, a hash-to-block prefix cache and an LRU free queue."""

    __slots__ = (
        "_cached",
        "_free",
        "_hits",
        "_queries",
        "_refs",
        "_table",
        "enable_prefix_caching",
        "layout",
        "num_blocks",
        "seed",
        "storage",
    )

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        seed: BlockHash = b"",
        enable_prefix_caching: bool = True,
        codec: PagedCodec | None = None,
    ) -> None:
        """``codec``: complete blocks are stored encoded (None: raw float32, fp32); the hash
        chain then starts from ``H(seed, codec fingerprint)``, so blocks of different codecs
        never match (rule 2)."""
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        self.seed = seed if codec is None else hash_block(seed, (), (codec.fingerprint,))
        self.enable_prefix_caching = enable_prefix_caching
        self.storage = KVStorage(layout, num_blocks + 1, codec)
        self._refs = [0] * (num_blocks + 1)
        self._free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(1, num_blocks + 1)
        )
        self._table: dict[BlockHash, int] = {}
        self._cached: dict[int, CachedBlock] = {}
        self._queries = 0
        self._hits = 0

    @classmethod
    def for_memory(
        cls,
        layout: KVLayout,
        kv_limit_bytes: int,
        *,
        seed: BlockHash = b"",
        enable_prefix_caching: bool = True,
        codec: PagedCodec | None = None,
        raw_blocks: int = 0,
    ) -> BlockPool:
        """As many blocks as ``kv_limit_bytes`` pays for (the null block included).

        With a codec a block costs what it holds resident: its encoded bytes and, until the
        float32 store becomes a bounded cache of decoded blocks, its decoded copy too (so a codec
        bounds memory like fp32 and does not yet buy more blocks); ``raw_blocks`` (one per
        running sequence) are paid for with a raw sink row each: the block being filled."""
        block_bytes = (
            layout.bytes_per_block
            if codec is None
            else layout.bytes_per_block + codec.block_bytes
        )
        reserved = 0 if codec is None else raw_blocks * (layout.bytes_per_block + codec.sink_bytes)
        num_blocks = (kv_limit_bytes - reserved) // block_bytes - 1
        if num_blocks < 1:
            raise ValueError(
                f"kv_limit_bytes={kv_limit_bytes} holds fewer than 2 blocks of {block_bytes} bytes"
            )
        return cls(
            layout,
            num_blocks,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            codec=codec,
        )

    @property
    def codec(self) -> PagedCodec | None:
        return self.storage.codec

    @property
    def bytes_per_token(self) -> float:
        """True bytes of a complete block's K and V per token, all layers."""
        if self.storage.codec is None:
            return self.layout.bytes_per_block / self.layout.block_size
        return self.storage.codec.bytes_per_token()

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=len(self._free),
            num_cached_blocks=len(self._table),
            queries=self._queries,
            hits=self._hits,
        )

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup of ``num_tokens`` prompt tokens."""
        self._queries += num_tokens
        self._hits += num_hit_tokens

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash``, if any."""
        return self._table.get(block_hash)

    def cached_entry(self, block_id: int) -> CachedBlock:
        """The identity of a cached block (``KeyError`` if it is not cached)."""
        return self._cached[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        entry = self._cached.get(block_id)
        return None if entry is None else entry.block_hash

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (references unchanged)."""
        found: list[int] = []
        if not self.enable_prefix_caching:
            return found
        for block_hash in hashes:
            block = self._table.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (found by ``lookup``)."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks with one reference each, evicting LRU cached blocks."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"need {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            entry = self._cached.pop(block, None)
            if entry is not None:
                del self._table[entry.block_hash]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a block table (released tail first)."""
        for block in reversed(block_ids):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"block {block} released more often than acquired")
            self._refs[block] = refs
            if refs == 0:
                self._free[block] = None
                if block not in self._cached:
                    self._free.move_to_end(block, last=False)

    def register(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent_hash: BlockHash,
        token_ids: Sequence[int],
        extra_keys: Sequence[ExtraKey] = (),
    ) -> bool:
        """Cache a full, computed block under its hash; False if the hash is already cached."""
        if not self.enable_prefix_caching or block_hash in self._table:
            return False
        if block_id in self._cached:
            raise RuntimeError(f"block {block_id} is already cached under another hash")
        self._table[block_hash] = block_id
        self._cached[block_id] = CachedBlock(
            block_hash, parent_hash, tuple(token_ids), tuple(extra_keys)
        )
        return True

    def export_blocks(self, block_ids: Sequence[int]) -> list[KVBlock]:
        """Copies of cached blocks with their hashes, tokens and K/V."""
        exported = []
        for block in block_ids:
            entry = self._cached.get(block)
            if entry is None:
                raise KeyError(f"block {block} is not a cached block")
            codec = self.storage.codec
            data = self.storage.read_block(block) if codec is None else codec.export(block)
            exported.append(entry.with_data(block, data))
        return exported

    def import_blocks(self, blocks: Sequence[KVBlock], *, keep: Sequence[int] = ()) -> list[int]:
        """Register blocks from another node as cached, unreferenced (most recently used).

        Blocks whose hash is already cached are skipped.  Returns the ids now holding each
        block's hash, in order.  Every block is verified before anything changes.  The cached
        blocks among ``blocks``, and the cached blocks ``keep`` (the prefix they extend), are
        held while the others are allocated, so the import never evicts what it needs.
        """
        codec = self.storage.codec
        for kv_block in blocks:
            kv_block.verify()
            if kv_block.encoded != (codec is not None):
                raise ValueError("KV blocks of another codec")
            if codec is not None:
                first = kv_block.parent_hash == self.seed
                if kv_block.data.size != codec.packed_bytes(first):
                    raise ValueError(f"a packed KV block of {kv_block.data.size} bytes")
            elif kv_block.data.shape != self.layout.block_shape:
                raise ValueError(
                    f"KV block shape {kv_block.data.shape} != {self.layout.block_shape}"
                )
        if not self.enable_prefix_caching:
            raise RuntimeError("importing KV blocks needs prefix caching")
        hashes = {b.block_hash for b in blocks}
        held = [*keep, *(self._table[h] for h in hashes if h in self._table)]
        self.acquire(held)
        try:
            new = {h for h in hashes if h not in self._table}
            if len(new) > len(self._free):
                raise NoFreeBlocksError(f"importing {len(new)} KV blocks, {len(self._free)} free")
            ids = []
            for kv_block in blocks:
                existing = self._table.get(kv_block.block_hash)
                if existing is not None:
                    ids.append(existing)
                    continue
                (block,) = self.allocate(1)
                if codec is None:
                    self.storage.write_block(block, kv_block.data.astype(np.float32, copy=False))
                else:
                    self._load_encoded(block, kv_block)
                self.register(
                    block,
                    kv_block.block_hash,
                    kv_block.parent_hash,
                    kv_block.token_ids,
                    kv_block.extra_keys,
                )
                self.release([block])
                ids.append(block)
        finally:
            self.release(held)
        return ids

    def _load_encoded(self, block: int, kv_block: KVBlock) -> None:
        codec = self.storage.codec
        assert codec is not None
        try:
            decoded = codec.load(block, kv_block.data, kv_block.parent_hash == self.seed)
        except ValueError:
            self.release([block])
            raise
        for layer, (k, v) in enumerate(decoded):
            self.storage.keys[layer][:, block] = k
            self.storage.values[layer][:, block] = v
