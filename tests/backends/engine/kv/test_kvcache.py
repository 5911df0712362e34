"""The paged KV block pool: hash chain, reference counts, LRU eviction, counters, exchange.

These tests use a tiny layout and synthetic K/V; no model is loaded.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.engine import BlockPool, KVBlock, KVLayout, NoFreeBlocksError, hash_block
from backends.engine.kv._blockpool import hash_blocks
from backends.engine.kv._store import NULL_BLOCK, KVStorage
from backends.engine.model._attention import QUERY_TILE, attend, attend_decode
from backends.engine.model._lanes import RowLanes
from backends.engine.model._numerics import attention_rows_independent

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
SEED = b"model-fingerprint"


def _raw(pool: BlockPool) -> KVStorage:
    """An fp32 pool's storage (a pool under a codec holds a CodedKVStorage)."""
    assert isinstance(pool.storage, KVStorage)
    return pool.storage


def _fill(pool: BlockPool, block: int, value: float) -> None:
    data = np.full(LAYOUT.block_shape, value, dtype=np.float32)
    _raw(pool).write_block(block, data)


def _cache_sequence(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate, 'compute' and register the full blocks of ``tokens``; return the block table."""
    hashes = hash_blocks(pool.seed, tokens, pool.block_size)
    blocks = pool.allocate(len(hashes))
    parent = pool.seed
    for index, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
        _fill(pool, block, float(index))
        chunk = tokens[index * pool.block_size : (index + 1) * pool.block_size]
        assert pool.register(block, block_hash, parent, chunk)
        parent = block_hash
    return blocks


# -- hashing --------------------------------------------------------------------------------


def test_block_hash_chains_parent_tokens_and_extra_keys() -> None:
    base = hash_block(SEED, [1, 2, 3, 4])
    assert base == hash_block(SEED, [1, 2, 3, 4])
    assert len(base) == 32
    assert base != hash_block(b"other-model", [1, 2, 3, 4])
    assert base != hash_block(SEED, [1, 2, 3, 5])
    assert base != hash_block(SEED, [1, 2, 3, 4], ("salt",))
    assert hash_block(SEED, [1], (1,)) != hash_block(SEED, [1], ("1",))
    with pytest.raises(TypeError):
        hash_block(SEED, [1], (1.5,))  # type: ignore[arg-type]


def test_hash_blocks_covers_full_blocks_only_and_extends() -> None:
    tokens = list(range(11))
    hashes = hash_blocks(SEED, tokens, 4)
    assert len(hashes) == 2  # the partial third block is never hashed
    assert hashes[0] == hash_block(SEED, tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    longer = [*tokens, 11]
    assert hash_blocks(SEED, longer, 4, parents=hashes) == hash_blocks(SEED, longer, 4)
    salted = hash_blocks(SEED, tokens, 4, ("tenant-a",))
    assert salted[0] == hash_block(SEED, tokens[:4], ("tenant-a",))
    assert salted[1] == hash_block(salted[0], tokens[4:8])  # the salt rides on the chain
    assert salted[1] != hashes[1]


# -- storage ----------------------------------------------------------------------------------


def test_storage_write_gather_and_exchange_layout_agree() -> None:
    storage = KVStorage(LAYOUT, 4)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, LAYOUT.num_kv_heads, LAYOUT.head_dim), dtype=np.float32)
    v = rng.standard_normal((6, LAYOUT.num_kv_heads, LAYOUT.head_dim), dtype=np.float32)
    table = np.array([3, 1], dtype=np.intp)
    pos = np.arange(6)
    storage.write(1, (table[pos // 4], pos % 4), k, v)
    keys_t, values = storage.gather(1, np.array([3, 1, NULL_BLOCK], dtype=np.intp))
    assert keys_t.shape == (2, 4, 12) and values.shape == (2, 12, 4)
    np.testing.assert_array_equal(keys_t[:, :, :6], k.transpose(1, 2, 0))
    np.testing.assert_array_equal(values[:, :6], v.transpose(1, 0, 2))
    assert not keys_t[:, :, 8:].any() and not values[:, 8:].any()  # the null block is zero
    block = storage.read_block(1)
    assert block.shape == LAYOUT.block_shape == (2, 2, 2, 4, 4)
    np.testing.assert_array_equal(block[1, 0, :, :2], k[4:].transpose(1, 0, 2))
    np.testing.assert_array_equal(block[1, 1, :, :2], v[4:].transpose(1, 0, 2))
    storage.write_block(2, block)
    np.testing.assert_array_equal(storage.read_block(2), block)
    with pytest.raises(ValueError, match="float32"):
        storage.write_block(2, block.astype(np.float64))


@pytest.mark.parametrize("block_size", [16, 8])
def test_decode_attention_over_a_group_is_a_lone_prefill_query(block_size: int) -> None:
    """Scores made block by block (or, for widths the probe refuses, over one copied ``K^T``)
    have the bits of ``attend`` over ``gather``: rule 3 of ``_attention``."""
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, block_size=block_size)
    span = 2 * QUERY_TILE
    per_seq = span // block_size
    storage = KVStorage(layout, 1 + 3 * per_seq)
    if attention_rows_independent(64) and block_size % 16 == 0:
        assert storage.blockwise_scores  # SkylakeX-like kernels: blocks of 16 columns are exact
    rng = np.random.default_rng(block_size)
    positions = np.array([QUERY_TILE, QUERY_TILE + 57, span - 1], dtype=np.intp)
    tables = np.zeros((3, per_seq), dtype=np.intp)
    free = list(rng.permutation(np.arange(1, 1 + 3 * per_seq)))
    for seq, last in enumerate(positions):
        used = int(last) // block_size + 1
        tables[seq, :used] = [free.pop() for _ in range(used)]  # scattered, NULL-padded
        pos = np.arange(last + 1)
        kv = rng.standard_normal((2, pos.size, 3, 64), dtype=np.float32)
        storage.write(1, (tables[seq][pos // block_size], pos % block_size), kv[0], kv[1])
    q = rng.standard_normal((3, 3, 3, 64), dtype=np.float32)
    key_blocks, values = storage.gather_group(1, tables)
    together = attend_decode(q, positions, key_blocks, values)
    native = attention_rows_independent(64)
    lanes = RowLanes()
    for seq, last in enumerate(positions):
        keys_t, vals = storage.gather(1, tables[seq])
        alone = attend(q[seq : seq + 1], int(last), keys_t, vals)[0]
        if native:  # the engine decodes with attend_decode only on such kernels
            assert together[seq].tobytes() == alone.tobytes(), seq
        # lane-mapped (every kernel): a query alone has the bits it has inside a prefill chunk
        chunk = rng.standard_normal((9, 3, 3, 64), dtype=np.float32)
        chunk[-1] = q[seq]
        in_chunk = attend(chunk, int(last) - 8, keys_t, vals, lanes)[-1]
        lone = attend(q[seq : seq + 1], int(last), keys_t, vals, lanes)[0]
        assert in_chunk.tobytes() == lone.tobytes(), seq
        np.testing.assert_allclose(lone, alone, rtol=1e-4, atol=1e-5)



def test_pool_size_from_memory_limit() -> None:
    per_block = LAYOUT.bytes_per_block
    assert per_block == 2 * 2 * 2 * 4 * 4 * 4
    pool = BlockPool.for_memory(LAYOUT, 10 * per_block + per_block // 2)
    assert pool.num_blocks == 9  # one of the ten pays for the null block
    assert _raw(pool).keys.nbytes + _raw(pool).values.nbytes == 10 * per_block
    with pytest.raises(ValueError):
        BlockPool.for_memory(LAYOUT, per_block)


# -- reference counts and eviction ------------------------------------------------------------


def test_refcounts_and_usage() -> None:
    pool = BlockPool(LAYOUT, 4, seed=SEED)
    blocks = pool.allocate(3)
    assert NULL_BLOCK not in blocks
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.acquire(blocks[:1])
    assert pool.ref_count(blocks[0]) == 2
    pool.release(blocks)
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free_blocks == 3
    pool.release(blocks[:1])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(RuntimeError):
        pool.release(blocks[:1])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)
    assert pool.num_free_blocks == 4  # a failed allocation changes nothing


def test_prefix_lookup_reuses_cached_blocks() -> None:
    pool = BlockPool(LAYOUT, 8, seed=SEED)
    tokens = list(range(100, 113))  # 3 full blocks + 1 token
    table = _cache_sequence(pool, tokens)
    assert len(table) == 3
    other = [*tokens[:8], 7, 7, 7, 7]
    hashes = hash_blocks(pool.seed, other, 4)
    assert pool.lookup(hashes) == table[:2]  # the longest cached prefix, then a miss
    pool.acquire(table[:2])
    assert pool.ref_count(table[0]) == 2
    pool.release(table)
    pool.release(table[:2])
    assert pool.lookup(hash_blocks(pool.seed, tokens, 4)) == table  # still cached when free
    assert pool.stats().num_cached_blocks == 3


def test_lru_eviction_under_a_tight_limit() -> None:
    pool = BlockPool(LAYOUT, 4, seed=SEED)
    first = _cache_sequence(pool, list(range(8)))  # blocks A0 A1
    pool.release(first)  # freed tail first: A1 is evicted before A0
    second = _cache_sequence(pool, list(range(50, 58)))  # takes the two never-used blocks
    pool.release(second)
    assert pool.stats().num_cached_blocks == 4 and pool.num_free_blocks == 4
    (fresh,) = pool.allocate(1)  # evicts the least recently used: first's tail block
    assert fresh == first[1]
    assert pool.lookup(hash_blocks(pool.seed, list(range(8)), 4)) == first[:1]
    assert pool.block_hash(fresh) is None
    pool.acquire(second)  # a hit revives blocks from the free queue
    assert pool.num_free_blocks == 1
    (next_fresh,) = pool.allocate(1)
    assert next_fresh == first[0]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.release([fresh, next_fresh])  # uncached blocks go to the front of the queue
    pool.release(second)
    assert set(pool.allocate(2)) == {fresh, next_fresh}
    assert pool.lookup(hash_blocks(pool.seed, list(range(50, 58)), 4)) == second


def test_register_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(LAYOUT, 4, seed=SEED)
    a, b = pool.allocate(2)
    block_hash = hash_block(SEED, [1, 2, 3, 4])
    assert pool.register(a, block_hash, SEED, [1, 2, 3, 4])
    assert not pool.register(b, block_hash, SEED, [1, 2, 3, 4])
    assert pool.cached_block(block_hash) == a and pool.block_hash(b) is None


def test_disabled_prefix_caching_never_hits() -> None:
    pool = BlockPool(LAYOUT, 4, seed=SEED, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    assert not pool.register(block, hash_block(SEED, [1, 2, 3, 4]), SEED, [1, 2, 3, 4])
    assert pool.lookup([hash_block(SEED, [1, 2, 3, 4])]) == []


def test_query_and_hit_counters() -> None:
    pool = BlockPool(LAYOUT, 4, seed=SEED)
    pool.record_query(13, 0)
    pool.record_query(20, 16)
    stats = pool.stats()
    assert (stats.queries, stats.hits) == (33, 16)
    assert stats.hit_rate == pytest.approx(16 / 33)
    assert BlockPool(LAYOUT, 1).stats().hit_rate == 0.0


# -- export / import --------------------------------------------------------------------------


def test_export_import_round_trip() -> None:
    source = BlockPool(LAYOUT, 8, seed=SEED)
    tokens = list(range(12))
    table = _cache_sequence(source, tokens)
    rng = np.random.default_rng(1)
    for block in table:
        _raw(source).write_block(block, rng.standard_normal(LAYOUT.block_shape, dtype=np.float32))
    exported = source.export_blocks(table)
    assert [b.block_id for b in exported] == table
    assert exported[1].parent_hash == exported[0].block_hash
    assert exported[2].token_ids == (8, 9, 10, 11)

    target = BlockPool(LAYOUT, 5, seed=SEED)
    ids = target.import_blocks(exported)
    assert len(ids) == 3 and target.num_free_blocks == 5  # cached, unreferenced
    assert target.lookup(hash_blocks(SEED, tokens, 4)) == ids
    for block, original in zip(ids, exported, strict=True):
        np.testing.assert_array_equal(_raw(target).read_block(block), original.data)
    assert target.import_blocks(exported) == ids  # already cached: skipped
    assert target.stats().num_cached_blocks == 3


def test_import_rejects_bad_blocks_without_changing_anything() -> None:
    source = BlockPool(LAYOUT, 4, seed=SEED)
    (block,) = _cache_sequence(source, [1, 2, 3, 4])
    (good,) = source.export_blocks([block])
    target = BlockPool(LAYOUT, 4, seed=SEED)
    forged = KVBlock(
        block_id=good.block_id,
        block_hash=good.block_hash,
        parent_hash=good.parent_hash,
        token_ids=(1, 2, 3, 5),
        extra_keys=(),
        data=good.data,
    )
    with pytest.raises(ValueError, match="hash"):
        target.import_blocks([forged])
    poisoned = good.data.copy()
    poisoned[0, 1, 0, 0, 0] = np.nan
    bad = KVBlock(good.block_id, good.block_hash, good.parent_hash, good.token_ids, (), poisoned)
    with pytest.raises(ValueError, match="finite"):
        target.import_blocks([bad])
    assert target.stats().num_cached_blocks == 0
    with pytest.raises(KeyError):
        source.export_blocks([NULL_BLOCK])
    tiny = BlockPool(LAYOUT, 1, seed=SEED)
    two_blocks = source.export_blocks(_cache_sequence(source, list(range(8))))
    with pytest.raises(NoFreeBlocksError):
        tiny.import_blocks(two_blocks)
    assert tiny.stats().num_cached_blocks == 0


def test_import_never_evicts_what_it_needs() -> None:
    source = BlockPool(LAYOUT, 8, seed=SEED)
    exported = source.export_blocks(_cache_sequence(source, list(range(12))))
    # A pool whose only free blocks are cached copies of the first two: importing the third
    # must not evict them (the prefix it extends), and there is no other room.
    target = BlockPool(LAYOUT, 2, seed=SEED)
    kept = target.import_blocks(exported[:2])
    with pytest.raises(NoFreeBlocksError):
        target.import_blocks(exported[2:], keep=kept)
    assert target.lookup(hash_blocks(SEED, list(range(12)), 4)) == kept
    # Blocks already cached among those imported are held too: importing [A, B] into a
    # one-block pool that holds A cannot evict A to make room for B.
    one = BlockPool(LAYOUT, 1, seed=SEED)
    (a,) = one.import_blocks(exported[:1])
    with pytest.raises(NoFreeBlocksError):
        one.import_blocks(exported[:2])
    assert one.lookup([exported[0].block_hash]) == [a]
