"""Per-request output rate, and a backend's aggregate rate over a sliding window.

Rules:
1. A request's output rate is its decode rate when it was streamed: the first token
   arrives at TTFT and the other ``completion_tokens - 1`` in ``e2e - ttft``, so the rate
   is ``(completion_tokens - 1) / (e2e_s - ttft_s)`` (``None`` below two tokens). Without
   streaming only the whole is seen: ``completion_tokens / e2e_s`` (``None`` without a
   token: an embeddings request reports ``completion_tokens: 0``, and has no output rate,
   not a rate of 0).
2. A backend's aggregate rate is the completion tokens of the requests that finished in
   the window divided by the *busy* time of those requests: the length of the union of
   their ``[start, end]`` intervals. Concurrent requests share the same seconds (that is
   what batching buys); seconds in which none of them ran are not counted, so a backend
   that sees only a sample of the traffic is not charged for its idle time.
3. The window holds at most ``max_requests`` requests per backend (the oldest go first,
   counted in ``evicted``) and forgets requests that ended ``window_s`` before the newest.
   A request is recorded once per backend however many exchanges carry it (the primary's
   observation is shared by every candidate's exchange).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from evaluators._observation import Observation

__all__ = [
    "DEFAULT_WINDOW_MAX_REQUESTS",
    "DEFAULT_WINDOW_S",
    "ThroughputWindow",
    "output_tokens_per_s",
]

DEFAULT_WINDOW_S = 60.0
DEFAULT_WINDOW_MAX_REQUESTS = 1024


def output_tokens_per_s(observation: Observation) -> float | None:
    """The request's output rate (rule 1), or None when it cannot be known."""
    usage, e2e = observation.usage, observation.e2e_s
    if not observation.ok or usage is None or usage.completion_tokens is None or e2e is None:
        return None
    tokens = usage.completion_tokens
    if observation.streamed:
        ttft = observation.ttft_s
        if ttft is None or tokens < 2 or e2e <= ttft:
            return None
        return (tokens - 1) / (e2e - ttft)
    return tokens / e2e if e2e > 0 and tokens > 0 else None


@dataclass(frozen=True, slots=True)
class _Finished:
    request_id: str
    started: float
    ended: float
    tokens: int


class ThroughputWindow:
    """Aggregate output tokens/s per backend over a bounded sliding window (rules 2, 3).

    Times are the observations' wall clock (``started_at`` + ``e2e_s``). Thread-safe.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 max_requests: int = DEFAULT_WINDOW_MAX_REQUESTS) -> None:
        if window_s <= 0 or max_requests < 1:
            raise ValueError("window_s must be positive and max_requests at least 1")
        self.window_s = window_s
        self.max_requests = max_requests
        self.evicted = 0
        self._finished: dict[str, deque[_Finished]] = {}
        self._ids: dict[str, set[str]] = {}
        self._newest: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, observation: Observation) -> bool:
        """Add a finished request; False if it is unusable or already recorded."""
        usage, e2e = observation.usage, observation.e2e_s
        if (not observation.ok or usage is None or usage.completion_tokens is None
                or e2e is None or e2e < 0):
            return False
        entry = _Finished(observation.request_id, observation.started_at,
                          observation.started_at + e2e, usage.completion_tokens)
        with self._lock:
            finished = self._finished.setdefault(observation.backend, deque())
            ids = self._ids.setdefault(observation.backend, set())
            if entry.request_id in ids:
                return False
            finished.append(entry)
            ids.add(entry.request_id)
            newest = max(entry.ended, self._newest.get(observation.backend, entry.ended))
            self._newest[observation.backend] = newest
            while finished and (len(finished) > self.max_requests
                                or finished[0].ended < newest - self.window_s):
                if len(finished) > self.max_requests:
                    self.evicted += 1
                ids.discard(finished.popleft().request_id)
        return True

    def tokens_per_s(self, backend: str, at: float | None = None) -> float | None:
        """Aggregate rate of the requests that ended in ``(at - window_s, at]``.

        ``at`` defaults to the newest end recorded for ``backend``. None without data.
        """
        with self._lock:
            entries = list(self._finished.get(backend, ()))
        if not entries:
            return None
        end = at if at is not None else max(e.ended for e in entries)
        inside = sorted((e for e in entries if end - self.window_s < e.ended <= end),
                        key=lambda e: e.started)
        busy = 0.0
        run_start = run_end = None
        for e in inside:
            if run_end is None or e.started > run_end:
                if run_start is not None and run_end is not None:
                    busy += run_end - run_start
                run_start, run_end = e.started, e.ended
            else:
                run_end = max(run_end, e.ended)
        if run_start is not None and run_end is not None:
            busy += run_end - run_start
        if busy <= 0:
            return None
        return sum(e.tokens for e in inside) / busy
