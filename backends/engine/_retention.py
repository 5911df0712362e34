"""KV blocks kept past the end of their request, for another node to pull.

Rules
-----
1. A retained set is the full, computed (hence cached) blocks of one finished request, under a
   random ticket: a prefill node keeps a prompt's blocks until its decode node has pulled them;
   a decode node keeps prompt + answer blocks for a TTL, so that the next turn's prefill can
   read them back.
2. Retaining takes one reference on every block, so LRU eviction cannot touch them; dropping a
   retained set (expiry, release, reclaim) gives the references back, and the blocks stay in
   the prefix cache as ordinary evictable blocks.
3. Retention is bounded: at most ``max_blocks`` blocks are held.  A new set makes room by
   dropping the oldest sets; a set larger than the bound is not retained at all.  When the
   scheduler needs blocks that only retained sets hold, it reclaims the oldest set first
   (``reclaim_oldest``): serving a running request beats keeping a transfer possible.
4. A set that extends another (the next turn of a conversation: same blocks first, more
   after) supersedes it: the older set is dropped when the newer is retained, so a long
   conversation holds one set, not one per turn.  (A referenced block holds one hash, and
   hashes chain, so the same block at the same position means the same prefix.)
5. Expiry is lazy: sets past their deadline are dropped whenever the owner looks (``expire``),
   which the engine does before every step and every export.  A dropped ticket is answered as
   unknown; the puller then recomputes -- never uses stale or foreign blocks.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._blockpool import BlockHash, BlockPool

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
    expires_at: float


class KVRetention:
    """Tickets to reference-held block sets of one ``BlockPool``."""

    __slots__ = ("_clock", "_ends", "_held", "max_blocks", "num_blocks", "pool")

    def __init__(
        self, pool: BlockPool, max_blocks: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")
        self.pool = pool
        self.max_blocks = max_blocks
        self.num_blocks = 0
        self._clock = clock
        self._held: OrderedDict[bytes, _Held] = OrderedDict()  # oldest first
        self._ends: dict[tuple[int, int], bytes] = {}  # (last block, length) -> ticket

    def __len__(self) -> int:
        return len(self._held)

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
        self.pool.acquire(ids)  # first, so that dropping a superseded set frees nothing shared
        for length, block in enumerate(ids, start=1):
            superseded = self._ends.get((block, length))
            if superseded is not None:
                self.release(superseded)
        while self.num_blocks + len(ids) > self.max_blocks:
            self.reclaim_oldest()
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._held[ticket] = _Held(ids, self._clock() + ttl_s)
        self._ends[(ids[-1], len(ids))] = ticket
        self.num_blocks += len(ids)
        return RetainedKV(ticket, len(ids), block_hashes[-1], ttl_s)

    def blocks(self, ticket: bytes, start: int, count: int) -> list[int]:
        """Block ids ``[start, start + count)`` of a retained set."""
        self.expire()
        held = self._held.get(ticket)
        if held is None:
            raise UnknownTicketError(ticket.hex())
        if start < 0 or count < 0 or start + count > len(held.block_ids):
            raise IndexError(
                f"blocks [{start}, {start + count}) outside a set of {len(held.block_ids)}"
            )
        return held.block_ids[start : start + count]

    def release(self, ticket: bytes) -> bool:
        """Drop a set now (its puller has it); False if it is already gone."""
        held = self._held.pop(ticket, None)
        if held is None:
            return False
        self._drop(ticket, held)
        return True

    def expire(self) -> int:
        """Drop every set past its deadline; how many were dropped."""
        now = self._clock()
        expired = [t for t, held in self._held.items() if held.expires_at <= now]
        for ticket in expired:
            self._drop(ticket, self._held.pop(ticket))
        return len(expired)

    def reclaim_oldest(self) -> bool:
        """Drop the oldest set to free its blocks; False if nothing is retained."""
        if not self._held:
            return False
        ticket, held = self._held.popitem(last=False)
        self._drop(ticket, held)
        return True

    def _drop(self, ticket: bytes, held: _Held) -> None:
        self.pool.release(held.block_ids)
        self.num_blocks -= len(held.block_ids)
        end = (held.block_ids[-1], len(held.block_ids))
        if self._ends.get(end) == ticket:
            del self._ends[end]
