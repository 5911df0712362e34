"""A clock the KV tests move by hand: retention TTLs, the router's conversation index."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Stands in for ``time.monotonic``: it reads ``now``, which only the test advances."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
