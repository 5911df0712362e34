"""KV blocks kept past the end of their request, for another node to pull.

Rules
-----
1. A retained set is the full, computed (hence cached) blocks of one finished request, under a
   random ticket: a prefill node keeps a prompt's blocks until its decode node has pulled them;
   a decode node keeps prompt + answer blocks for a TTL, so that the next turn's prefill can
   read them back.
2. Retaining takes one reference on every block, so LRU eviction cannot touch them, and a
   cached block's content never changes: while a set is held its blocks may be read from any
   thread.  Dropping a set (expiry, release, reclaim) gives the references back -- on the
   engine thread, the only one that changes the pool -- and the blocks stay in the prefix
   cache as ordinary evictable blocks.
3. ``export`` runs on any thread (a transfer must not wait for the engine to finish a step):
   it leases the set, copies the blocks, and returns the lease.  A leased set is never
   dropped; one that expires or is released meanwhile is dropped by the next ``expire`` after
   its lease ends.  The bookkeeping is guarded by one lock.
4. Retention is bounded: at most ``max_blocks`` blocks are held.  A new set makes room by
   dropping the oldest unleased sets; a set larger than the bound is not retained at all.  When
   the scheduler needs blocks that only retained sets hold, it reclaims the oldest set first
   (``reclaim_oldest``): serving a running request beats keeping a transfer possible.
5. A set that extends another (the next turn of a conversation: same blocks first, more
   after) supersedes it: the older set is dropped when the newer is retained, so a long
   conversation holds one set, not one per turn.  (A referenced block holds one hash, and
   hashes chain, so the same block at the same position means the same prefix.)
6. Expiry is lazy: sets past their deadline are dropped whenever the engine looks
   (``expire``), before every step and every retain.  An expired ticket is answered as unknown
   even before it is dropped; the puller then recomputes -- never uses stale or foreign blocks.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._blockpool import BlockHash, BlockPool, CachedBlock, KVBlock

__all__ = ["TICKET_BYTES", "KVRetention", "RetainedKV", "UnknownTicketError"]

TICKET_BYTES = 16


class UnknownTicketError(KeyError):
    """The ticket was never issued here, or its blocks were dropped (expired, reclaimed)."""


@dataclass(frozen=True, slots=True)
class RetainedKV:
    """What the owner of a retained set tells the node that will pull it."""

    ticket: bytes
    num_blocks: int
    last_block_hash: BlockHash
    ttl_s: float


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    entries: list[CachedBlock]  # fixed at retain time: exports never read the pool's tables
    expires_at: float
    leases: int = field(default=0)


class KVRetention:
    """Tickets to reference-held block sets of one ``BlockPool``."""

    __slots__ = ("_clock", "_ends", "_held", "_lock", "max_blocks", "num_blocks", "pool")

    def __init__(
        self, pool: BlockPool, max_blocks: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")
        self.pool = pool
        self.max_blocks = max_blocks
        self.num_blocks = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._held: OrderedDict[bytes, _Held] = OrderedDict()  # oldest first
        self._ends: dict[tuple[int, int], bytes] = {}  # (last block, length) -> ticket

    def __len__(self) -> int:
        return len(self._held)

    # -- the engine thread ------------------------------------------------------------------

    def retain(
        self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> RetainedKV | None:
        """Hold ``block_ids`` (cached, referenced by a live request) for ``ttl_s`` seconds."""
        if not block_ids or len(block_ids) != len(block_hashes) or ttl_s <= 0:
            return None
        if len(block_ids) > self.max_blocks:
            return None
        self.expire()
        ids = list(block_ids)
        entries = [self.pool.cached_entry(block) for block in ids]
        self.pool.acquire(ids)  # first, so that dropping a superseded set frees nothing shared
        with self._lock:
            superseded = [
                ticket
                for length, block in enumerate(ids, start=1)
                if (ticket := self._ends.get((block, length))) is not None
            ]
        for ticket in superseded:
            self.release(ticket)
        while self.num_blocks + len(ids) > self.max_blocks and self.reclaim_oldest():
            pass
        if self.num_blocks + len(ids) > self.max_blocks:  # the rest is leased right now
            self.pool.release(ids)
            return None
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._held[ticket] = _Held(ids, entries, self._clock() + ttl_s)
            self._ends[(ids[-1], len(ids))] = ticket
            self.num_blocks += len(ids)
        return RetainedKV(ticket, len(ids), block_hashes[-1], ttl_s)

    def release(self, ticket: bytes) -> bool:
        """Drop a set now, or once its lease ends (its puller has it); False if it is gone."""
        with self._lock:
            held = self._held.get(ticket)
            if held is None:
                return False
            if held.leases:
                held.expires_at = -math.inf
                return True
            del self._held[ticket]
        self._drop(ticket, held)
        return True

    def expire(self) -> int:
        """Drop every unleased set past its deadline; how many were dropped."""
        now = self._clock()
        with self._lock:
            expired = [
                (ticket, held)
                for ticket, held in self._held.items()
                if held.expires_at <= now and not held.leases
            ]
            for ticket, _ in expired:
                del self._held[ticket]
        for ticket, held in expired:
            self._drop(ticket, held)
        return len(expired)

    def reclaim_oldest(self) -> bool:
        """Drop the oldest unleased set to free its blocks; False if there is none."""
        with self._lock:
            oldest = next(((t, h) for t, h in self._held.items() if not h.leases), None)
            if oldest is None:
                return False
            del self._held[oldest[0]]
        self._drop(*oldest)
        return True

    def _drop(self, ticket: bytes, held: _Held) -> None:
        self.pool.release(held.block_ids)
        with self._lock:
            self.num_blocks -= len(held.block_ids)
            end = (held.block_ids[-1], len(held.block_ids))
            if self._ends.get(end) == ticket:
                del self._ends[end]

    # -- any thread -------------------------------------------------------------------------

    def export(self, ticket: bytes, start: int, count: int) -> list[KVBlock]:
        """Copies of blocks ``[start, start + count)`` of a retained set (rule 3)."""
        with self._lock:
            held = self._held.get(ticket)
            if held is None or held.expires_at <= self._clock():
                raise UnknownTicketError(ticket.hex())
            if start < 0 or count < 0 or start + count > len(held.block_ids):
                raise IndexError(
                    f"blocks [{start}, {start + count}) outside a set of {len(held.block_ids)}"
                )
            held.leases += 1
        try:
            storage = self.pool.storage
            # With a codec the encoded block, packed (with its raw rows while in a window):
            # retention holds what the cache holds.
            read = storage.read_block if storage.codec is None else storage.export
            return [
                entry.with_data(block, read(block))
                for block, entry in zip(
                    held.block_ids[start : start + count],
                    held.entries[start : start + count],
                    strict=True,
                )
            ]
        finally:
            with self._lock:
                held.leases -= 1
