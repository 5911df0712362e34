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
7. With a codec the pool's memory is the codes (``_coded_store``): a block costs its encoded
   bytes.  A first block also holds a raw sink row; ``sink_reserve`` rows are paid for up front
   (one per running sequence), and the rows beyond them are paid for with blocks: that many
   fewer blocks count as free, so ``usage`` and admission see the sinks of cached conversations.
8. Under a codec with a recent window (``_paged_codec`` rule 9) a sealed block keeps its raw rows
   while a window reads it.  ``settle_window(live)`` drops them from every block that is not in
   ``live`` (the running sequences' windows) and is no TAIL: when a sequence's table is released,
   its blocks still holding raw rows become tails (the window its conversation's next turn, or a
   node pulling it, reads) and stay so until acquired again or evicted.  A prefix hit is cut
   back to the longest prefix whose last ``window_blocks - 1`` blocks hold raw rows, so reuse
   never reads a decoded block where a fresh prefill reads raw: a prompt that branches off
   further back than the window recomputes.  Raw rows are paid like sink rows (rule 7): the
   reserve pays ``window_blocks - 1`` blocks of them per running sequence, blocks the rest.
   A block holding raw rows holds no codes (``_paged_codec`` rule 9), yet its pool block is
   paid too: admission counts ``block_bytes`` more per such block than is held (safe, not
   tight; ``PagedCodec.context_bits_per_element`` counts what is held).
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

from ._coded_store import DEFAULT_DECODED_CACHE_BYTES, CodedKVStorage, DecodedCacheStats
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

DECODED_CACHE_SHARE = 0.25
"""The largest share of a KV memory limit the decoded-block cache may take."""

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
        "_sink_reserve",
        "_table",
        "_tails",
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
        decoded_cache_bytes: int = DEFAULT_DECODED_CACHE_BYTES,
        sink_reserve: int = 0,
    ) -> None:
        """``codec``: complete blocks are stored encoded (None: raw float32, fp32); the hash
        chain then starts from ``H(seed, codec fingerprint)``, so blocks of different codecs
        never match (rule 2).  ``decoded_cache_bytes`` bounds the decoded blocks attention reads
        through; ``sink_reserve``: sink rows paid for outside the blocks (rule 7)."""
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        self.seed = seed if codec is None else hash_block(seed, (), (codec.fingerprint,))
        self.enable_prefix_caching = enable_prefix_caching
        self.storage: KVStorage | CodedKVStorage = (
            KVStorage(layout, num_blocks + 1)
            if codec is None
            else CodedKVStorage(layout, num_blocks + 1, codec, cache_bytes=decoded_cache_bytes)
        )
        self._sink_reserve = sink_reserve
        self._tails: set[int] = set()
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
        decoded_cache_bytes: int = DEFAULT_DECODED_CACHE_BYTES,
    ) -> BlockPool:
        """As many blocks as ``kv_limit_bytes`` pays for.

        fp32 (no codec): float32 blocks, the null block included.  With a codec a block costs its
        encoded bytes (rule 7); paid first, out of the same limit: ``raw_blocks`` (one per
        running sequence) raw float32 blocks being filled, each with a sink row, and the
        decoded-block cache, at most ``decoded_cache_bytes`` and at most a quarter of the limit
        (``DECODED_CACHE_SHARE``)."""
        if codec is None:
            block_bytes, reserved, cache_bytes = layout.bytes_per_block, layout.bytes_per_block, 0
        else:
            block_bytes = codec.block_bytes
            cache_bytes = min(decoded_cache_bytes, int(kv_limit_bytes * DECODED_CACHE_SHARE))
            raw = layout.bytes_per_block + (codec.window_blocks - 1) * codec.window_bytes
            reserved = raw_blocks * (raw + codec.sink_bytes) + cache_bytes
        num_blocks = (kv_limit_bytes - reserved) // block_bytes
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
            decoded_cache_bytes=cache_bytes,
            sink_reserve=raw_blocks,
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

    def decoded_cache_stats(self) -> DecodedCacheStats | None:
        """The decoded-block cache's counters (None: fp32, every block is raw)."""
        storage = self.storage
        return None if isinstance(storage, KVStorage) else storage.stats()

    @property
    def resident_bytes(self) -> int:
        """KV bytes held now: fp32's arrays, or a codec's codes, sink rows and float32 slots."""
        storage = self.storage
        if isinstance(storage, KVStorage):
            return storage.keys.nbytes + storage.values.nbytes
        return storage.codec.resident_bytes + storage.arena_bytes

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def _sink_blocks(self, *, held_only: bool) -> int:
        """Blocks that pay for sink rows beyond the reserve (rule 7): of every first block, or
        of those held by a sequence (a free one's sink goes with its eviction)."""
        storage = self.storage
        if isinstance(storage, KVStorage):
            return 0
        codec = storage.codec
        sinks = codec.sink_blocks()
        count = sum(1 for b in sinks if self._refs[b]) if held_only else len(sinks)
        extra = max(0, count - self._sink_reserve) * codec.sink_bytes
        if codec.window_bytes:  # rule 8
            rows = storage.window_blocks()
            count = sum(1 for b in rows if self._refs[b]) if held_only else len(rows)
            reserve = self._sink_reserve * (codec.window_blocks - 1)
            extra += max(0, count - reserve) * codec.window_bytes
        return -(-extra // codec.block_bytes)

    @property
    def sink_blocks(self) -> int:
        """Blocks now paying for sink rows beyond the reserve."""
        return self._sink_blocks(held_only=False)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take (evicting cached ones and with them their sinks)."""
        return max(0, len(self._free) - self._sink_blocks(held_only=True))

    def _settle_sinks(self) -> None:
        """Evict free cached blocks, least recently used first, until the empty free blocks pay
        for the sink rows beyond the reserve (rule 7)."""
        storage = self.storage
        if isinstance(storage, KVStorage):
            return
        owed = self.sink_blocks
        if owed == 0:
            return
        empty = self._empty_free_blocks(owed)
        for block in list(self._free):
            if empty >= owed:
                break
            entry = self._cached.pop(block, None)
            if entry is None:
                continue
            del self._table[entry.block_hash]
            storage.forget(block)
            self._tails.discard(block)
            self._free.move_to_end(block, last=False)
            empty += 1
            owed = self.sink_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
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
        storage = self.storage
        if isinstance(storage, CodedKVStorage) and storage.codec.window_blocks > 1 and found:
            rows = storage.window_blocks()  # rule 8: cut back to a prefix its window can read
            window = storage.codec.window_blocks - 1
            end = len(found)
            while end and not all(b in rows for b in found[max(0, end - window) : end]):
                end -= 1
            del found[end:]
        return found

    def settle_window(self, live: Iterable[int]) -> None:
        """Drop the raw window rows of blocks neither in ``live`` nor a tail (rule 8)."""
        storage = self.storage
        if not isinstance(storage, CodedKVStorage) or storage.codec.window_blocks == 1:
            return
        keep = self._tails.union(live)
        for block in storage.window_blocks() - keep:
            storage.drop_window(block)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (found by ``lookup``)."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            self._tails.discard(block)

    def _empty_free_blocks(self, enough: int) -> int:
        """Free blocks holding no cached KV, counted up to ``enough``: empty blocks sit at the
        front of the free list (a released uncached block goes there, allocation takes from
        there), so a settled pool stops after a few, not after every free block."""
        empty = 0
        for block in self._free:
            if block not in self._cached:
                empty += 1
                if empty >= enough:
                    break
        return empty

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks with one reference each, evicting LRU cached blocks."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"need {count} KV blocks, {len(self._free)} free")
        blocks = []
        coded = self.storage if isinstance(self.storage, CodedKVStorage) else None
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            entry = self._cached.pop(block, None)
            if entry is not None:
                del self._table[entry.block_hash]
            if coded is not None:
                coded.forget(block)
                self._tails.discard(block)
            self._refs[block] = 1
            blocks.append(block)
        self._settle_sinks()
        return blocks

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a block table (released tail first); its blocks
        holding raw window rows become tails (rule 8)."""
        storage = self.storage
        if isinstance(storage, CodedKVStorage) and storage.codec.window_blocks > 1:
            self._tails.update(storage.window_blocks().intersection(block_ids))
        for block in reversed(block_ids):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"block {block} released more often than acquired")
            self._refs[block] = refs
            if refs == 0:
                self._free[block] = None
                if block not in self._cached:
                    self._free.move_to_end(block, last=False)
                    if isinstance(self.storage, CodedKVStorage):
                        self.storage.forget(block)
                        self._tails.discard(block)

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
        if not token_ids or parent_hash == self.seed:
            self._settle_sinks()
        return True

    def export_blocks(self, block_ids: Sequence[int]) -> list[KVBlock]:
        """Copies of cached blocks with their hashes, tokens and K/V."""
        exported = []
        for block in block_ids:
            entry = self._cached.get(block)
            if entry is None:
                raise KeyError(f"block {block} is not a cached block")
            storage = self.storage
            data: npt.NDArray[Any]
            if isinstance(storage, CodedKVStorage):
                data = storage.export(block)
            else:
                data = storage.read_block(block)
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
                sizes = (codec.packed_bytes(first), codec.packed_bytes(first, True))
                if kv_block.data.size not in sizes:
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
                if isinstance(self.storage, KVStorage):
                    self.storage.write_block(block, kv_block.data.astype(np.float32, copy=False))
                else:
                    self._load_encoded(self.storage, block, kv_block)
                    if block in self.storage.window_blocks():
                        self._tails.add(block)  # rule 8: the window a pulled turn reads
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

    def _load_encoded(self, storage: CodedKVStorage, block: int, kv_block: KVBlock) -> None:
        try:
            storage.load(block, kv_block.data, kv_block.parent_hash == self.seed)
        except ValueError:
            self.release([block])
            raise
