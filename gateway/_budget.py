"""MemoryBudget: the single account of bytes held for mirroring and evaluation.

Rules (DESIGN.md invariant 2):
1. Every byte held for mirroring is charged here before it is held: request payloads
   queued in candidate buffers, and observations waiting for their join.
2. A payload is interned by content hash: offered to three candidates it is stored and
   charged once, with a reference per holder. The bytes return when the last holder
   releases it.
3. A charge that would pass the limit is refused, never waited for: the caller drops
   the item and counts ``reason=budget``. Nothing here awaits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["PAYLOAD_OVERHEAD_BYTES", "MemoryBudget", "Payload", "payload_key"]

# Bookkeeping charged per interned payload on top of its body (object, dict entry, key).
PAYLOAD_OVERHEAD_BYTES = 256


@dataclass(slots=True, eq=False)
class Payload:
    """An interned request body shared by every buffer that holds it."""

    key: bytes
    body: bytes
    refs: int = 0

    @property
    def charged_bytes(self) -> int:
        """What holding it costs the budget: its body and the bookkeeping around it."""
        return len(self.body) + PAYLOAD_OVERHEAD_BYTES


def payload_key(method: str, path: str, body: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(method.encode())
    digest.update(b"\0")
    digest.update(path.encode())
    digest.update(b"\0")
    digest.update(body)
    return digest.digest()


class MemoryBudget:
    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError("memory budget must be >= 0")
        self.limit = limit_bytes
        self.used = 0
        self._payloads: dict[bytes, Payload] = {}

    @property
    def interned(self) -> int:
        return len(self._payloads)

    def intern(self, key: bytes, body: bytes) -> Payload | None:
        """A new reference to the payload under ``key``, or None if it does not fit."""
        payload = self._payloads.get(key)
        if payload is None:
            payload = Payload(key, body)
            if not self.charge(payload.charged_bytes):
                return None
            self._payloads[key] = payload
        payload.refs += 1
        return payload

    def release_payload(self, payload: Payload) -> None:
        if payload.refs <= 0:
            raise RuntimeError("payload released more often than interned")
        payload.refs -= 1
        if payload.refs == 0:
            del self._payloads[payload.key]
            self.release(payload.charged_bytes)

    def charge(self, nbytes: int) -> bool:
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        if nbytes > self.used:
            raise RuntimeError(f"released {nbytes} bytes but only {self.used} are charged")
        self.used -= nbytes
