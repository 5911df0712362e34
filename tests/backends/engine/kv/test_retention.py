"""Retained KV: tickets to reference-held block sets, their TTL, their bound, reclaiming.

A tiny ``BlockPool`` with cached blocks and a fake clock; no model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from backends.engine import BlockPool, KVLayout
from backends.engine.kv._blockpool import BlockHash, hash_blocks
from backends.engine.kv._retention import (
    TICKET_BYTES,
    KVRetention,
    RetainedKV,
    UnknownTicketError,
)
from backends.engine.kv._store import KVStorage
from tests.backends.engine.kv.fake_clock import FakeClock

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4)
SEED = bytes(32)
TTL_S = 30.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(LAYOUT, 8, seed=SEED)


@pytest.fixture
def retention(pool: BlockPool, clock: FakeClock) -> KVRetention:
    """Retention over ``pool`` bounded at 8 blocks, on the fake clock."""
    return KVRetention(pool, 8, clock=clock)


def _compute(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[BlockHash]]:
    """What a request leaves behind: its full blocks allocated and cached, still referenced."""
    hashes = hash_blocks(pool.seed, tokens, pool.block_size)
    blocks = pool.allocate(len(hashes))
    parent = pool.seed
    for index, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
        chunk = tokens[index * pool.block_size : (index + 1) * pool.block_size]
        assert pool.register(block, block_hash, parent, chunk)
        parent = block_hash
    return blocks, hashes


def _finished(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[BlockHash]]:
    """A request's blocks once it finished: cached, unreferenced (what retention then holds)."""
    blocks, hashes = _compute(pool, tokens)
    pool.release(blocks)
    return blocks, hashes


def _retain(
    retention: KVRetention, blocks: list[int], hashes: list[BlockHash], ttl_s: float = TTL_S
) -> RetainedKV:
    retained = retention.retain(blocks, hashes, ttl_s)
    assert retained is not None
    return retained


def _ids(retention: KVRetention, ticket: bytes, start: int, count: int) -> list[int]:
    return [block.block_id for block in retention.export(ticket, start, count)]


def _refs(pool: BlockPool, blocks: list[int]) -> list[int]:
    return [pool.ref_count(b) for b in blocks]


def test_retaining_holds_a_reference_on_every_block(
    pool: BlockPool, retention: KVRetention
) -> None:
    blocks, hashes = _compute(pool, list(range(12)))
    retained = _retain(retention, blocks, hashes)
    assert len(retained.ticket) == TICKET_BYTES
    assert (retained.num_blocks, retained.last_block_hash) == (3, hashes[-1])
    assert retained.ttl_s == TTL_S
    assert _refs(pool, blocks) == [2, 2, 2]
    pool.release(blocks)  # the request finishes
    assert _refs(pool, blocks) == [1, 1, 1]
    assert pool.num_free_blocks == 5
    assert (len(retention), retention.num_blocks) == (1, 3)
    # Every other block can be taken, and none of the retained ones is evicted for it.
    fresh = pool.allocate(pool.num_free_blocks)
    assert not set(fresh) & set(blocks)
    assert pool.lookup(hashes) == blocks
    assert _ids(retention, retained.ticket, 0, 3) == blocks


def test_tickets_are_distinct_and_sets_may_share_blocks(
    pool: BlockPool, retention: KVRetention
) -> None:
    blocks, hashes = _finished(pool, list(range(8)))
    first = retention.retain(blocks, hashes, TTL_S)
    second = retention.retain(blocks[:1], hashes[:1], TTL_S)
    assert first is not None and second is not None
    assert first.ticket != second.ticket
    assert _refs(pool, blocks) == [2, 1]
    assert retention.release(first.ticket)
    assert _refs(pool, blocks) == [1, 0]
    assert retention.release(second.ticket)
    assert _refs(pool, blocks) == [0, 0] and retention.num_blocks == 0


def test_a_set_expires_at_its_deadline_and_gives_its_references_back(
    pool: BlockPool, clock: FakeClock, retention: KVRetention
) -> None:
    blocks, hashes = _compute(pool, list(range(8)))
    retained = _retain(retention, blocks, hashes)
    clock.now += TTL_S - 0.001
    assert retention.expire() == 0
    assert _ids(retention, retained.ticket, 0, 2) == blocks
    clock.now += 0.001
    assert retention.expire() == 1
    assert _refs(pool, blocks) == [1, 1]  # what the still-running request holds, as before
    assert (len(retention), retention.num_blocks) == (0, 0)
    with pytest.raises(UnknownTicketError):
        _ids(retention, retained.ticket, 0, 1)
    pool.release(blocks)
    assert pool.num_free_blocks == 8
    assert pool.lookup(hashes) == blocks  # still cached: ordinary evictable blocks now


def test_an_expired_set_is_refused_at_once_and_dropped_by_the_engine(
    pool: BlockPool, clock: FakeClock, retention: KVRetention
) -> None:
    blocks, hashes = _finished(pool, list(range(4)))
    retained = _retain(retention, blocks, hashes, 1.0)
    clock.now += 1.0
    with pytest.raises(UnknownTicketError):  # refused before any expire() call
        _ids(retention, retained.ticket, 0, 1)
    assert _refs(pool, blocks) == [1]  # the references go back on the engine thread
    assert retention.expire() == 1
    assert _refs(pool, blocks) == [0] and retention.num_blocks == 0
    assert not retention.release(retained.ticket)


def test_release_drops_a_set_once(pool: BlockPool, retention: KVRetention) -> None:
    blocks, hashes = _finished(pool, list(range(8)))
    retained = _retain(retention, blocks, hashes)
    assert pool.num_free_blocks == 6
    assert retention.release(retained.ticket)
    assert not retention.release(retained.ticket)  # a second release takes no reference
    assert _refs(pool, blocks) == [0, 0] and pool.num_free_blocks == 8
    assert not retention.release(b"\x00" * TICKET_BYTES)
    with pytest.raises(UnknownTicketError):
        _ids(retention, retained.ticket, 0, 1)


def test_reclaim_drops_the_oldest_set_first(
    pool: BlockPool, clock: FakeClock, retention: KVRetention
) -> None:
    tickets = []
    for start in (0, 100, 200):
        blocks, hashes = _finished(pool, list(range(start, start + 4)))
        retained = _retain(retention, blocks, hashes)
        tickets.append(retained.ticket)
        clock.now += 1.0
    for dropped in range(3):
        assert retention.reclaim_oldest()
        with pytest.raises(UnknownTicketError):
            _ids(retention, tickets[dropped], 0, 1)
        for kept in tickets[dropped + 1 :]:
            assert len(_ids(retention, kept, 0, 1)) == 1
        assert retention.num_blocks == 2 - dropped
    assert not retention.reclaim_oldest()
    assert pool.num_free_blocks == 8


def test_a_set_larger_than_the_bound_is_not_retained(pool: BlockPool, clock: FakeClock) -> None:
    retention = KVRetention(pool, 2, clock=clock)
    blocks, hashes = _finished(pool, list(range(12)))
    assert retention.retain(blocks, hashes, TTL_S) is None
    assert _refs(pool, blocks) == [0, 0, 0] and retention.num_blocks == 0
    assert retention.retain(blocks[:2], hashes[:2], TTL_S) is not None  # exactly the bound
    assert KVRetention(pool, 0, clock=clock).retain(blocks[:1], hashes[:1], TTL_S) is None


def test_a_new_set_pushes_out_the_oldest(pool: BlockPool, clock: FakeClock) -> None:
    retention = KVRetention(pool, 3, clock=clock)
    first_blocks, first_hashes = _finished(pool, list(range(8)))
    second_blocks, second_hashes = _finished(pool, list(range(50, 54)))
    third_blocks, third_hashes = _finished(pool, list(range(90, 94)))
    first = retention.retain(first_blocks, first_hashes, TTL_S)
    second = retention.retain(second_blocks, second_hashes, TTL_S)
    assert first is not None and second is not None
    assert retention.num_blocks == 3
    third = retention.retain(third_blocks, third_hashes, TTL_S)  # one block over: first goes
    assert third is not None
    assert retention.num_blocks == 2 and len(retention) == 2
    assert _refs(pool, first_blocks) == [0, 0]
    with pytest.raises(UnknownTicketError):
        _ids(retention, first.ticket, 0, 1)
    assert _ids(retention, second.ticket, 0, 1) == second_blocks
    assert _ids(retention, third.ticket, 0, 1) == third_blocks


def test_nothing_to_retain_is_not_retained(pool: BlockPool, retention: KVRetention) -> None:
    blocks, hashes = _finished(pool, list(range(8)))
    assert retention.retain([], [], TTL_S) is None
    assert retention.retain(blocks, hashes[:1], TTL_S) is None  # lengths differ
    assert retention.retain(blocks, hashes, 0.0) is None
    assert retention.retain(blocks, hashes, -1.0) is None
    assert _refs(pool, blocks) == [0, 0] and len(retention) == 0
    with pytest.raises(ValueError):
        KVRetention(pool, -1)


def test_ranges_of_a_set(pool: BlockPool, retention: KVRetention) -> None:
    blocks, hashes = _finished(pool, list(range(12)))
    retained = _retain(retention, blocks, hashes)
    ticket = retained.ticket
    assert _ids(retention, ticket, 1, 2) == blocks[1:]
    assert _ids(retention, ticket, 3, 0) == []
    for start, count in ((0, 4), (3, 1), (-1, 1), (1, -1), (4, 0)):
        with pytest.raises(IndexError):
            _ids(retention, ticket, start, count)
    with pytest.raises(UnknownTicketError):
        _ids(retention, bytes(TICKET_BYTES), 0, 1)
    assert issubclass(UnknownTicketError, KeyError)


def test_a_set_that_extends_another_supersedes_it(pool: BlockPool, retention: KVRetention) -> None:
    turn1, hashes1 = _compute(pool, list(range(8)))
    first = retention.retain(turn1, hashes1, TTL_S)
    pool.release(turn1)
    # The next turn: the same two blocks first (its prefix hit), one more after.
    pool.acquire(turn1)
    (extra,) = pool.allocate(1)
    tokens = list(range(12))
    hashes2 = hash_blocks(pool.seed, tokens, pool.block_size)
    assert pool.register(extra, hashes2[2], hashes2[1], tokens[8:])
    second = retention.retain([*turn1, extra], hashes2, TTL_S)
    pool.release([*turn1, extra])
    assert first is not None and second is not None
    assert (len(retention), retention.num_blocks) == (1, 3)
    with pytest.raises(UnknownTicketError):
        _ids(retention, first.ticket, 0, 1)
    assert _ids(retention, second.ticket, 0, 3) == [*turn1, extra]
    assert _refs(pool, [*turn1, extra]) == [1, 1, 1]
    # A set that shares only a prefix (another branch) does not supersede.
    other_tokens = [*range(8), 90, 91, 92, 93]
    pool.acquire(turn1)
    (branch,) = pool.allocate(1)
    other = hash_blocks(pool.seed, other_tokens, pool.block_size)
    assert pool.register(branch, other[2], other[1], other_tokens[8:])
    third = retention.retain([*turn1, branch], other, TTL_S)
    pool.release([*turn1, branch])
    assert third is not None and len(retention) == 2
    assert retention.release(second.ticket) and retention.release(third.ticket)
    assert _refs(pool, [*turn1, extra, branch]) == [0, 0, 0, 0]


class _WatchedStorage(KVStorage):
    """Storage that runs ``during_read`` while a block is being copied out."""

    __slots__ = ("during_read",)
    during_read: Callable[[], None]

    def read_block(self, block_id: int) -> Any:
        self.during_read()
        return super().read_block(block_id)


def test_a_leased_set_outlives_expiry_release_and_reclaim_until_its_export_ends(
    pool: BlockPool, clock: FakeClock, retention: KVRetention
) -> None:
    blocks, hashes = _finished(pool, list(range(8)))
    retained = _retain(retention, blocks, hashes, 1.0)
    seen: list[list[int]] = []

    def engine_drops_it() -> None:
        # What the engine thread may do while another thread copies the set out.
        clock.now += 5.0
        assert retention.expire() == 0 and not retention.reclaim_oldest()
        assert retention.release(retained.ticket)  # doomed, not dropped
        seen.append(_refs(pool, blocks))

    watched = _WatchedStorage(LAYOUT, pool.storage.num_blocks)
    watched.during_read = engine_drops_it
    pool.storage = watched
    exported = retention.export(retained.ticket, 0, 2)
    assert [b.block_id for b in exported] == blocks
    assert [b.block_hash for b in exported] == hashes
    assert seen == [[1, 1], [1, 1]]
    with pytest.raises(UnknownTicketError):
        retention.export(retained.ticket, 0, 1)
    assert retention.expire() == 1
    assert _refs(pool, blocks) == [0, 0] and len(retention) == 0
