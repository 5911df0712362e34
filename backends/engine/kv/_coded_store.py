"""Paged K/V storage under a codec: the pool holds codes, attention reads through a bounded cache.

Rules
-----
1. A complete block's content is its codes (``PagedCodec``; a first block adds its raw sink row).
   No float32 copy of a complete block is kept beside them except in the decoded-block cache.
2. Float32 rows live in one arena of ``(layer, block)`` slots, laid out as ``KVStorage``'s
   arrays with the layer axis dropped, so ``gather`` and ``gather_group`` are the same ``take``
   over slot ids that ``KVStorage`` does over block ids.  Slot 0 is the null block (zeros).
3. A slot is either RAW -- a block still being filled at that layer (each running sequence's own
   block, and for the length of one layer the blocks a prefill chunk completes) -- or DECODED, an
   entry of the LRU cache.  Raw slots are pinned; decoded ones are evicted least recently used once
   more than ``cache_bytes`` of them are held (``cache_bytes`` is the named bound; 0 caches none).
3b. A block decoded on a miss enters the cache at its least recent end, and one such block in
   ``BIMODAL_EVERY`` at its most recent (a hit still moves a block to the most recent end).  Why:
   every step reads each running sequence's blocks, layer by layer, in the same order, so when
   they outnumber the cache an LRU that puts every miss on top evicts each block just before it
   is read again and nothing ever hits -- a kivi-4 engine over a 3,175-token prompt at the
   default 64 MiB: 30 hits in 77,460 reads, 21-25 s of CPU for 24 tokens, 6.5-6.9 s with this
   rule (44 % hits), 3.1-3.9 s with a cache that holds every block.  Entering at the bottom
   keeps what the cache held, so a step finds the cache's share of its blocks; the few that
   enter on top let a working set that changed take the cache over (the bimodal insertion of
   Qureshi et al., "Adaptive insertion policies for high-performance caching", ISCA 2007).  A
   sealed block enters on top (rule 4): the next step reads it.
4. ``seal`` encodes a raw slot's block and overwrites the slot with its decoded rows, which then
   becomes the cache's most recent entry: the block is decoded once, by the pass that completes it.
5. A read of a block that is neither raw nor cached is a miss: the block's layer is decoded from
   its codes straight into the gather's output (and cached).  Decoding is deterministic, so a
   miss gives the bits a hit gives -- the cache bounds memory without changing any result.
6. ``forget`` drops everything of a block (raw rows, cached rows, codes, sink): the pool calls it
   when a block is handed out again or released uncached, so no stale row or code is ever read.
7. Writing rows into a block that has codes but no raw slot (a write over a sealed block) starts
   the raw slot from the decoded block, the content ``KVStorage`` would hold.
8. Under a codec with a recent window (``PagedCodec.window_blocks`` > 1, ``_paged_codec`` rule
   9) the raw rows are held at float16, in an arena of their own: ``write`` rounds them, a raw
   slot is a float16 slot, and ``seal`` encodes the block from those values and keeps the slot
   as a WINDOW slot in place of the codes (pinned, not a cache entry; ``_paged_codec`` rule 9:
   the codes are not kept while the rows are), caching the decoded rows in a float32 slot.
   The codes are made again from the window rows, to the same bytes, when the block's decoded
   rows are read and not cached (a miss), when it is exported, and -- kept -- when its rows
   are dropped (``drop_window``), so at every moment each layer of a sealed block holds its
   codes or its window rows.  A query reads its window from ``raw_rows`` (raw and window
   slots alike), so ``gather`` gives a raw block the null slot's zeros: a query never reads its
   own block's stored rows (``_attention`` rule 5) and later blocks are masked.  A block
   missing from ``raw_rows`` is a broken invariant, never a silent decode.  Window slots are
   dropped only when asked (``drop_window``: the pool, when no running sequence's window holds
   the block and it is no cached conversation's tail) or with the block (rule 6).
9. The blocks one ``seal`` call completes (one per running sequence at a decode step) are
   encoded on the model's decode threads (``TileWorkers``), a contiguous run of them each:
   encoding is a pure function of a block's rows (``_paged_codec`` rule 11), so the bytes are
   the same on any number of threads, and the bookkeeping after it -- codes kept, slots
   cached -- runs on the caller's thread in the blocks' order.  Why: at 8 streams a step that
   completes a block encodes 8 blocks per layer and role, serially ~1 ms a layer under
   ``e8-2`` (its codebook search, in C with the GIL released), while the other decode thread
   waited.
10. The arenas give memory back.  Each grows by doubling when it has no free slot; once
    ``forget`` or ``drop_window`` leaves an arena of more than ``SHRINK_MIN_SLOTS`` slots
    with at most a quarter of them in use, its slots in use are moved to the lowest ids, in
    their order, and it is cut to twice their number.  Why: a burst of long contexts (many
    blocks raw for a layer at once, a full decoded cache) left an arena at its high-water
    mark, its rows written and so resident, for the life of the engine.  Half full after a
    cut and cut again only at a quarter, an arena moves each slot's rows at most once per
    doubling or halving of what it holds (amortised O(1) per slot; the check is O(1)).
    Slot ids live only in ``_raw``, ``_decoded`` and ``_window`` between calls, so moving
    rows between calls changes no result.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from ..model._attention import blockwise_scores_exact
from ..model._linear import TileWorkers
from ._paged_codec import PagedCodec, SealedLayer
from ._store import NULL_BLOCK, GroupScratch, KVLayout

__all__ = ["DEFAULT_DECODED_CACHE_BYTES", "CodedKVStorage", "DecodedCacheStats"]

MiB = 1 << 20
_HALF_MAX = float(np.finfo(np.float16).max)
DEFAULT_DECODED_CACHE_BYTES = 64 * MiB
"""Bound of the decoded-block cache of an engine with a codec (rule 3)."""
BIMODAL_EVERY = 32
"""One block decoded on a miss in this many enters the cache on top (rule 3b)."""
SHRINK_MIN_SLOTS = 64
"""An arena this small is never cut (rule 10): a few MiB at most, and no churn at idle."""

Float32Array = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.intp]
_Key = tuple[int, int]  # (layer, block)
Float16Array = npt.NDArray[np.float16]


def _to_half(x: Float32Array) -> Float16Array:
    """``x`` as float16 (rule 8), finite: values beyond float16's range are clipped to it."""
    return np.clip(x, -_HALF_MAX, _HALF_MAX).astype(np.float16)


_Arena = TypeVar("_Arena", Float32Array, Float16Array)


def _compacted(
    keys: _Arena, values: _Arena, maps: list[dict[_Key, int]], reserved: int
) -> tuple[_Arena, _Arena, list[int]] | None:
    """Rule 10: ``keys``/``values`` cut to twice the slots in use, those moved to the lowest
    ids after the ``reserved`` ones (the null slot) and renumbered in ``maps`` in place (an
    ``OrderedDict`` keeps its order); the new arrays and free list, or None where the arena
    is small or more than a quarter full."""
    size = keys.shape[1]
    used = reserved + sum(len(m) for m in maps)
    if size <= SHRINK_MIN_SLOTS or used * 4 > size:
        return None
    new_size = max(SHRINK_MIN_SLOTS // 2, 2 * used)
    old_ids = list(range(reserved))
    for mapping in maps:
        for key, slot in mapping.items():
            mapping[key] = len(old_ids)
            old_ids.append(slot)
    new_keys = np.zeros((keys.shape[0], new_size, *keys.shape[2:]), keys.dtype)
    new_values = np.zeros((values.shape[0], new_size, *values.shape[2:]), values.dtype)
    new_keys[:, :used] = keys[:, old_ids]
    new_values[:, :used] = values[:, old_ids]
    return new_keys, new_values, list(range(new_size - 1, used - 1, -1))


@dataclass(frozen=True, slots=True)
class DecodedCacheStats:
    """Counters of the decoded-block cache (a hit or miss is one layer of one block read)."""

    hits: int
    misses: int
    entries: int
    capacity: int
    entry_bytes: int
    raw_slots: int

    @property
    def bytes(self) -> int:
        return self.entries * self.entry_bytes


class CodedKVStorage:
    """Codes of ``num_blocks`` blocks, the raw rows being written and a bounded decoded cache."""

    __slots__ = (
        "_arena_keys",
        "_arena_values",
        "_decoded",
        "_free",
        "_group",
        "_half",
        "_hits",
        "_missed_entries",
        "_misses",
        "_raw",
        "_window",
        "_window_free",
        "_window_keys",
        "_window_values",
        "blockwise_scores",
        "cache_entries",
        "codec",
        "entry_bytes",
        "layout",
        "num_blocks",
    )

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        codec: PagedCodec,
        *,
        cache_bytes: int = DEFAULT_DECODED_CACHE_BYTES,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("KV storage needs at least one block besides the null block")
        if cache_bytes < 0:
            raise ValueError("cache_bytes must be >= 0")
        self.layout = layout
        self.codec = codec
        self.num_blocks = num_blocks
        self.blockwise_scores = blockwise_scores_exact(layout.head_dim, layout.block_size)
        self.entry_bytes = layout.bytes_per_block // layout.num_layers
        self.cache_entries = cache_bytes // self.entry_bytes
        self._raw: dict[_Key, int] = {}
        self._window: dict[_Key, int] = {}
        self._decoded: OrderedDict[_Key, int] = OrderedDict()
        self._free: list[int] = []
        self._hits = 0
        self._misses = 0
        self._missed_entries = 0
        lay = layout
        self._arena_keys: Float32Array = np.zeros(
            (lay.num_kv_heads, 1, lay.head_dim, lay.block_size), dtype=np.float32
        )
        self._arena_values: Float32Array = np.zeros(
            (lay.num_kv_heads, 1, lay.block_size, lay.head_dim), dtype=np.float32
        )
        self._window_keys: Float16Array = np.zeros(
            (lay.num_kv_heads, 0, lay.head_dim, lay.block_size), np.float16
        )
        self._window_values: Float16Array = np.zeros(
            (lay.num_kv_heads, 0, lay.block_size, lay.head_dim), np.float16
        )
        self._window_free: list[int] = []
        self._half = codec.window_blocks > 1
        """Raw rows at float16 in the window arena (rule 8)."""
        self._group = GroupScratch(layout, num_blocks)

    # -- accounting ------------------------------------------------------------------------

    def stats(self) -> DecodedCacheStats:
        return DecodedCacheStats(
            self._hits,
            self._misses,
            len(self._decoded),
            self.cache_entries,
            self.entry_bytes,
            len(self._raw),
        )

    @property
    def arena_bytes(self) -> int:
        """Bytes of rows held now: float32 raw and decoded slots (the null slot and free slots
        among them) and float16 window slots (rule 8)."""
        return sum(
            a.nbytes
            for a in (self._arena_keys, self._arena_values, self._window_keys, self._window_values)
        )

    # -- slots -----------------------------------------------------------------------------

    def _slot(self) -> int:
        if self._free:
            return self._free.pop()
        used = self._arena_keys.shape[1]
        grown = max(8, used)
        keys, values = self._arena_keys, self._arena_values
        self._arena_keys = np.zeros((keys.shape[0], used + grown, *keys.shape[2:]), np.float32)
        self._arena_values = np.zeros(
            (values.shape[0], used + grown, *values.shape[2:]), np.float32
        )
        self._arena_keys[:, :used] = keys
        self._arena_values[:, :used] = values
        self._free.extend(range(used + grown - 1, used - 1, -1))
        return self._free.pop()

    def _window_slot(self) -> int:
        """A free slot of the float16 window arena (rule 8), growing it as ``_slot`` does."""
        if not self._window_free:
            used = self._window_keys.shape[1]
            grown = max(8, used)
            for name in ("_window_keys", "_window_values"):
                old = getattr(self, name)
                new = np.zeros((old.shape[0], used + grown, *old.shape[2:]), np.float16)
                new[:, :used] = old
                setattr(self, name, new)
            self._window_free.extend(range(used + grown - 1, used - 1, -1))
        return self._window_free.pop()

    def _cache(self, key: _Key, slot: int, *, missed: bool = False) -> None:
        """Make ``slot`` a decoded entry, the most recent one -- or, decoded on a ``missed``
        read, the least recent but for one in ``BIMODAL_EVERY`` (rule 3b) -- evicting beyond the
        bound (rule 3; callers cache only with a bound of at least one entry)."""
        decoded = self._decoded
        on_top = True
        if missed:
            self._missed_entries += 1
            on_top = self._missed_entries % BIMODAL_EVERY == 0
        while len(decoded) >= self.cache_entries:  # evict first: the new entry is no victim
            _, old = decoded.popitem(last=False)
            self._free.append(old)
        decoded[key] = slot
        if not on_top:
            decoded.move_to_end(key, last=False)

    def _decode(self, layer: int, block: int) -> tuple[Float32Array, Float32Array]:
        """One layer of a sealed block decoded: from its codes, or from codes made again from its
        window rows (rule 8)."""
        if self.codec.has_layer(layer, block):
            return self.codec.decode_block_layer(layer, block)
        slot = self._window.get((layer, block))
        if slot is None:
            raise RuntimeError(f"block {block} layer {layer}: neither codes nor window rows")
        blob = self._encode_window(layer, block, slot, store=False)
        return self.codec.decode_blob(layer, block, blob)

    def _encode_window(self, layer: int, block: int, slot: int, *, store: bool) -> bytes:
        """The codes of a block held as window rows, made from the rows in ``slot`` (rule 8)."""
        return self.codec.encode_rows(
            layer,
            block,
            self._window_keys[:, slot].astype(np.float32),
            self._window_values[:, slot].astype(np.float32),
            store=store,
        )

    def _raw_slot(self, layer: int, block: int) -> int:
        key = (layer, block)
        slot = self._raw.get(key)
        if slot is not None:
            return slot
        if self._half:  # rule 8: a float16 slot, the window's rows themselves where held
            slot = self._window.pop(key, None)
            if slot is None:
                slot = self._window_slot()
                if self.codec.has_layer(layer, block):  # rule 7
                    k, v = self._decode(layer, block)
                    self._window_keys[:, slot] = _to_half(k)
                    self._window_values[:, slot] = _to_half(v)
                else:
                    self._window_keys[:, slot] = 0.0
                    self._window_values[:, slot] = 0.0
            self._raw[key] = slot
            return slot
        window = self._window.pop(key, None)  # rule 8: the raw rows themselves
        slot = self._decoded.pop(key, None)
        if window is not None:
            if slot is None:
                slot = self._slot()
            self._arena_keys[:, slot] = self._window_keys[:, window]
            self._arena_values[:, slot] = self._window_values[:, window]
            self._window_free.append(window)
        elif slot is None:
            slot = self._slot()
            if self.codec.has_layer(layer, block):  # rule 7
                k, v = self._decode(layer, block)
                self._arena_keys[:, slot] = k
                self._arena_values[:, slot] = v
            else:
                self._arena_keys[:, slot] = 0.0
                self._arena_values[:, slot] = 0.0
        self._raw[key] = slot
        return slot

    def forget(self, block: int) -> None:
        """Drop every row and code of ``block`` (rule 6)."""
        for layer in range(self.layout.num_layers):
            key = (layer, block)
            slot = self._raw.pop(key, None)
            if slot is not None:
                (self._window_free if self._half else self._free).append(slot)
            slot = self._decoded.pop(key, None)
            if slot is not None:
                self._free.append(slot)
            slot = self._window.pop(key, None)
            if slot is not None:
                self._window_free.append(slot)
        self.codec.forget(block)
        self._shrink()

    def _shrink(self) -> None:
        """Rule 10, for each arena that holds a quarter of its slots or fewer."""
        raw = [] if self._half else [self._raw]
        cut = _compacted(self._arena_keys, self._arena_values, [self._decoded, *raw], 1)
        if cut is not None:
            self._arena_keys, self._arena_values, self._free = cut
        raw = [self._raw] if self._half else []
        half = _compacted(self._window_keys, self._window_values, [self._window, *raw], 0)
        if half is not None:
            self._window_keys, self._window_values, self._window_free = half

    # -- the recent window (rule 8) ---------------------------------------------------------

    def window_blocks(self) -> set[int]:
        """The sealed blocks holding raw window rows now."""
        return {block for layer, block in self._window if layer == 0}

    def drop_window(self, block: int) -> None:
        """Drop ``block``'s raw window rows (it left every window that reads it), keeping the
        codes made from them first (rule 8)."""
        for layer in range(self.layout.num_layers):
            slot = self._window.get((layer, block))
            if slot is None:
                continue
            if not self.codec.has_layer(layer, block):
                self._encode_window(layer, block, slot, store=True)
            del self._window[layer, block]
            self._window_free.append(slot)
        self._shrink()

    def raw_rows(self, layer: int, blocks: IntArray) -> tuple[Float32Array, Float32Array]:
        """``(K^T [kv_heads, head_dim, n * bs], V [kv_heads, n * bs, head_dim])``: copies of the
        raw rows of ``blocks``, each being filled (float32 slots) or sealed within a window
        (float16 slots holding the same values, rule 8)."""
        lay = self.layout
        n = blocks.size
        keys = np.empty((lay.num_kv_heads, lay.head_dim, n, lay.block_size), np.float32)
        values = np.empty((lay.num_kv_heads, n, lay.block_size, lay.head_dim), np.float32)
        for index, block in enumerate(blocks.tolist()):
            key = (layer, block)
            slot = self._raw.get(key)
            if slot is not None and not self._half:
                keys[:, :, index] = self._arena_keys[:, slot]
                values[:, index] = self._arena_values[:, slot]
                continue
            if slot is None:
                slot = self._window.get(key)
            if slot is None:
                raise RuntimeError(f"block {block} layer {layer}: raw rows read after they left")
            keys[:, :, index] = self._window_keys[:, slot]
            values[:, index] = self._window_values[:, slot]
        tokens = n * lay.block_size
        return (
            keys.reshape(lay.num_kv_heads, lay.head_dim, tokens),
            values.reshape(lay.num_kv_heads, tokens, lay.head_dim),
        )

    def export(self, block: int) -> npt.NDArray[np.uint8]:
        """The packed block (``PagedCodec.export``), with its raw window rows if it holds them;
        the codes of a block held as rows are made from them for the export (rule 8)."""
        layers = range(self.layout.num_layers)
        ids = [self._window.get((layer, block)) for layer in layers]
        codes = [
            self.codec.export_layer(layer, block)
            if slot is None or self.codec.has_layer(layer, block)
            else self._encode_window(layer, block, slot, store=False)
            for layer, slot in zip(layers, ids, strict=True)
        ]
        if not all(slot is not None for slot in ids):
            return self.codec.export(block, codes=codes)
        rows = b"".join(
            self._window_keys[:, slot].astype("<f2").tobytes()
            + self._window_values[:, slot].astype("<f2").tobytes()
            for slot in ids
            if slot is not None
        )
        return self.codec.export(block, rows, codes)

    def _resolve(self, layer: int, table: IntArray) -> tuple[IntArray, list[tuple[int, int]]]:
        """Slot ids of ``table`` (0 where a block must be decoded) and the misses
        ``(index in table, block)``."""
        slots = np.zeros(table.size, dtype=np.intp)
        misses: list[tuple[int, int]] = []
        raw, decoded, half = self._raw, self._decoded, self._half
        for index, block in enumerate(table.tolist()):
            if block == NULL_BLOCK:
                continue
            key = (layer, block)
            slot = raw.get(key)
            if slot is not None and half:  # rule 8: zeros, never read
                continue
            if slot is None:
                slot = decoded.get(key)
                if slot is None:
                    misses.append((index, block))
                    continue
                decoded.move_to_end(key)
                self._hits += 1
            slots[index] = slot
        self._misses += len(misses)
        return slots, misses

    def _fill(
        self, layer: int, misses: list[tuple[int, int]], keys: Float32Array, values: Float32Array
    ) -> None:
        """Decode missed blocks into ``keys`` [heads, n, dim, bs] / ``values`` (rule 5)."""
        for index, block in misses:
            k, v = self._decode(layer, block)
            keys[:, index] = k
            values[:, index] = v
            if self.cache_entries:
                slot = self._slot()
                self._arena_keys[:, slot] = k
                self._arena_values[:, slot] = v
                self._cache((layer, block), slot, missed=True)

    # -- the KVStorage interface the model uses ---------------------------------------------

    def write(
        self, layer: int, slots: tuple[IntArray, IntArray], k: Float32Array, v: Float32Array
    ) -> None:
        """Store K and V ([n, kv_heads, head_dim]) of ``n`` tokens at ``slots`` (block, offset)."""
        blocks, offsets = slots
        ids = np.fromiter(
            (self._raw_slot(layer, b) for b in blocks.tolist()), dtype=np.intp, count=blocks.size
        )
        if self._half:  # rule 8
            self._window_keys[:, ids, :, offsets] = _to_half(k)
            self._window_values[:, ids, offsets] = _to_half(v).transpose(1, 0, 2)
            return
        self._arena_keys[:, ids, :, offsets] = k
        self._arena_values[:, ids, offsets] = v.transpose(1, 0, 2)

    def gather(self, layer: int, table: IntArray) -> tuple[Float32Array, Float32Array]:
        """``(K^T [kv_heads, head_dim, tokens], V [kv_heads, tokens, head_dim])`` of a table."""
        lay = self.layout
        tokens = table.size * lay.block_size
        slots, misses = self._resolve(layer, table)
        blocks = np.take(self._arena_keys, slots, axis=1)
        values = np.take(self._arena_values, slots, axis=1)
        self._fill(layer, misses, blocks, values)
        keys_t = np.ascontiguousarray(blocks.transpose(0, 2, 1, 3))
        return (
            keys_t.reshape(lay.num_kv_heads, lay.head_dim, tokens),
            values.reshape(lay.num_kv_heads, tokens, lay.head_dim),
        )

    def gather_group(self, layer: int, tables: IntArray) -> tuple[Float32Array, Float32Array]:
        """As ``KVStorage.gather_group``: views of scratch arrays, valid until the next call."""
        flat = tables.ravel()
        keys, values = self._group.take_into(flat)
        slots, misses = self._resolve(layer, flat)
        np.take(self._arena_keys, slots, axis=1, out=keys, mode="clip")
        np.take(self._arena_values, slots, axis=1, out=values, mode="clip")
        self._fill(layer, misses, keys, values)
        return self._group.views(keys, values, tables, self.blockwise_scores)

    def seal(
        self,
        layer: int,
        blocks: IntArray,
        firsts: npt.NDArray[np.bool_],
        queries: Float32Array | None = None,
        workers: TileWorkers | None = None,
    ) -> None:
        """Encode one layer of complete ``blocks``; their raw slots become decoded cache entries
        (rule 4); ``firsts``: which are a sequence's first block (sink); ``queries``: [blocks,
        heads, head_dim], each block's last query, which chooses its heavy hitters
        (``_paged_codec`` rule 10; needed only when the codec keeps some).  ``workers``: the
        model's decode threads, which share the blocks' encoding (rule 9)."""
        pending: list[tuple[int, int, bool, Float32Array | None, Float32Array, Float32Array]] = []
        for index, (block, first) in enumerate(zip(blocks.tolist(), firsts.tolist(), strict=True)):
            query = None if queries is None else queries[index]
            key = (layer, block)
            slot = self._raw.pop(key)
            if self._half:  # rule 8: the float16 rows stay as the window's
                self._window[key] = slot
                keys_t = self._window_keys[:, slot].astype(np.float32)
                values = self._window_values[:, slot].astype(np.float32)
            else:
                keys_t, values = self._arena_keys[:, slot], self._arena_values[:, slot]
            pending.append((block, slot, bool(first), query, keys_t, values))
        sealed: list[SealedLayer | None] = [None] * len(pending)

        def encode(start: int, stop: int) -> None:
            for index in range(start, stop):
                _, _, first, query, keys_t, values = pending[index]
                sealed[index] = self.codec.encode_layer(layer, keys_t, values, first, query)

        if workers is None:
            encode(0, len(pending))
        else:
            workers.run(encode, len(pending))
        for (block, slot, _, _, _, _), layer_sealed in zip(pending, sealed, strict=True):
            assert layer_sealed is not None
            k, v = self.codec.keep_sealed(layer, block, layer_sealed, keep=not self._half)
            if self._half:
                if self.cache_entries:
                    slot = self._slot()
                    self._arena_keys[:, slot] = k
                    self._arena_values[:, slot] = v
                    self._cache((layer, block), slot)
                continue
            if self.cache_entries:
                self._arena_keys[:, slot] = k
                self._arena_values[:, slot] = v
                self._cache((layer, block), slot)
            else:
                self._free.append(slot)

    def load(self, block: int, packed: npt.NDArray[np.uint8], first: bool) -> None:
        """Take a packed block from another node as ``block``'s codes (``PagedCodec.load``
        checks its size and that it decodes to finite values)."""
        self.forget(block)
        self.codec.load(block, packed, first)
        if packed.size == self.codec.packed_bytes(first, True) and self.codec.window_bytes:
            rows = np.frombuffer(
                np.ascontiguousarray(packed[packed.size - self.codec.window_bytes :]).tobytes(),
                dtype="<f2",
            )
            if not np.isfinite(rows).all():
                self.forget(block)
                raise ValueError("a packed block's window rows are not finite")
            lay = self.layout
            per_role = lay.num_kv_heads * lay.head_dim * lay.block_size
            for layer, start in enumerate(range(0, rows.size, 2 * per_role)):
                slot = self._window_slot()
                self._window_keys[:, slot] = rows[start : start + per_role].reshape(
                    self._window_keys.shape[0], *self._window_keys.shape[2:]
                )
                self._window_values[:, slot] = rows[
                    start + per_role : start + 2 * per_role
                ].reshape(self._window_values.shape[0], *self._window_values.shape[2:])
                self._window[layer, block] = slot
            if self._half:  # rule 8: the rows are held, not the codes
                self.codec.release_codes(block)
