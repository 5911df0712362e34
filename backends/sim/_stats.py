"""What one simulator app has seen, for tests to assert on.

Rules:
1. Every request to an inference route is recorded (method, path, headers, parsed
   body) in a ring of `MAX_RECORDED_REQUESTS`; older records are evicted and counted in
   `requests_evicted`, so the record never grows without bound.
2. Each inference request that passes validation is `started` once and ends exactly once
   as `completed` (the whole answer was written), `cancelled` (the client went away, or
   the server shut down, before the answer ended) or `faulted` (an injected error, reset
   or malformed answer ended it). `in_flight` is started minus ended.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["MAX_RECORDED_REQUESTS", "RecordedRequest", "SimStats"]

MAX_RECORDED_REQUESTS = 1024


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request as it arrived. `body` is the decoded JSON, or None if it was not JSON."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: object

    @classmethod
    def capture(
        cls, method: str, path: str, headers: Mapping[str, str], body: object
    ) -> RecordedRequest:
        # A case-insensitive, read-only copy: lookups like headers["authorization"] work.
        return cls(method, path, CIMultiDictProxy(CIMultiDict(headers)), body)


@dataclass(slots=True)
class SimStats:
    """Counters of one app; see the module rules for how they add up."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    faulted: int = 0
    rejected: int = 0
    faults_injected: int = 0
    requests_seen: int = 0
    requests_evicted: int = 0
    requests: deque[RecordedRequest] = field(
        default_factory=lambda: deque(maxlen=MAX_RECORDED_REQUESTS)
    )

    @property
    def in_flight(self) -> int:
        return self.started - self.completed - self.cancelled - self.faulted

    def count_outcome(self, outcome: Literal["completed", "cancelled", "faulted"]) -> None:
        if outcome == "completed":
            self.completed += 1
        elif outcome == "cancelled":
            self.cancelled += 1
        else:
            self.faulted += 1

    def record(self, request: RecordedRequest) -> None:
        if len(self.requests) == self.requests.maxlen:
            self.requests_evicted += 1
        self.requests.append(request)
        self.requests_seen += 1
