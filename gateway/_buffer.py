"""CandidateBuffer: the bounded, deduplicated queue in front of one candidate's workers.

Rules (DESIGN.md invariants 3 and 4):
1. Capacity is named twice: ``max_items`` and ``max_bytes``. An offer that would pass
   either is refused with ``buffer_full``; one the process budget cannot hold with
   ``budget``. Nothing blocks and nothing grows without bound.
2. A payload still queued for this candidate is not queued again (``dedup``). Once a
   worker has taken it, an identical request may be queued anew.
3. ``offer`` never awaits. Workers wait in ``get``.
4. Whatever leaves the buffer without being taken by a worker (``close``) returns its
   budget bytes here; what a worker took, the worker returns.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Literal

from multidict import CIMultiDict

from gateway._budget import MemoryBudget, Payload

__all__ = [
    "BufferClosed",
    "BufferRefusal",
    "CandidateBuffer",
    "MirrorItem",
    "MirrorRequest",
    "OfferOutcome",
]

BufferRefusal = Literal["dedup", "buffer_full", "budget"]
"""Why a buffer refused an offer; each is also a mirror drop reason."""
OfferOutcome = Literal["queued", "closed", BufferRefusal]


@dataclass(frozen=True, slots=True)
class MirrorRequest:
    """What is known of a request to mirror, built once and shared by every candidate.

    The body is not held here: it lives in the interned :class:`Payload`.
    """

    request_id: str
    session_key: str
    route: str
    method: str
    raw_path: str
    headers: CIMultiDict[str]
    offered_at: float
    prompt_bytes: int = 0
    turn_depth: int | None = None


@dataclass(frozen=True, slots=True)
class MirrorItem:
    """One request queued for one candidate, holding a reference to its payload."""

    request: MirrorRequest
    payload: Payload


class BufferClosed(Exception):
    """Raised to a worker waiting on a buffer that has been closed."""


class CandidateBuffer:
    def __init__(self, name: str, max_items: int, max_bytes: int, budget: MemoryBudget) -> None:
        self.name = name
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._budget = budget
        self._items: deque[MirrorItem] = deque()
        self._queued_keys: set[bytes] = set()
        self._bytes = 0
        self._closed = False
        self._not_empty = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def offer(self, request: MirrorRequest, key: bytes, body: bytes) -> OfferOutcome:
        """Queue a replay of ``body`` unless a bound, the budget or dedup says no."""
        if self._closed:
            return "closed"
        if key in self._queued_keys:
            return "dedup"
        size = len(body)
        if len(self._items) >= self.max_items or self._bytes + size > self.max_bytes:
            return "buffer_full"
        payload = self._budget.intern(key, body)
        if payload is None:
            return "budget"
        self._items.append(MirrorItem(request, payload))
        self._queued_keys.add(key)
        self._bytes += size
        self._not_empty.set()
        return "queued"

    def pending(self) -> list[MirrorItem]:
        return list(self._items)

    async def get(self) -> MirrorItem:
        """The oldest queued item; the caller now owns its payload reference."""
        while not self._items:
            if self._closed:
                raise BufferClosed(self.name)
            self._not_empty.clear()
            await self._not_empty.wait()
        item = self._items.popleft()
        self._queued_keys.discard(item.payload.key)
        self._bytes -= len(item.payload.body)
        return item

    def close(self) -> int:
        """Refuse new offers, release every queued payload; returns how many were dropped."""
        self._closed = True
        dropped = len(self._items)
        while self._items:
            item = self._items.popleft()
            self._budget.release_payload(item.payload)
        self._queued_keys.clear()
        self._bytes = 0
        self._not_empty.set()
        return dropped
