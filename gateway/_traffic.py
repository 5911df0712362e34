"""All traffic seen and what was dropped, by prompt size: the sample-bias check's reference.

The judge compares the requests it evaluated with the traffic the gateway served
(``evaluators._sample_bias``). The gateway cannot keep a row per request it did not
sample, so it keeps histograms.

Rules:
1. Each inference request that reaches the mirror (a mirrored route, not served by the
   canary) counts once as ``seen`` under every dimension: ``size`` (its prompt size in
   estimated tokens, :func:`size_bucket`), ``route``, ``streamed`` and ``turn_depth``
   (:func:`turn_depth_bucket`). Each drop for a candidate, for any reason but
   ``not_sampled`` (sampling is uniform by design: no bias to see), counts once under
   that reason and the ``size`` dimension.
2. Counts are kept per window of :data:`TRAFFIC_WINDOW_S` seconds (its start) until the
   evaluation flushes them (every :data:`TRAFFIC_FLUSH_INTERVAL_S`) as counts added to
   the ``traffic_counts`` table, never as per-request rows.
3. At most :data:`MAX_TRAFFIC_KEYS` keys (window, candidate, outcome, dimension, value)
   wait for a flush; a count that would pass that bound is lost and counted in
   ``overflowed``. A flush that fails puts its counts back (within the same bound).
4. The prompt size is the request body's bytes over :data:`BYTES_PER_TOKEN_ESTIMATE`,
   binned at powers of two: the same estimate the judge applies to the evaluated
   requests' stored ``prompt_bytes``, so the two sides are measured alike.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Final

from evaluators import turn_depth_bucket
from evaluators.store import TRAFFIC_SEEN as SEEN
from evaluators.store import TrafficCount

__all__ = [
    "BYTES_PER_TOKEN_ESTIMATE",
    "MAX_TRAFFIC_KEYS",
    "TRAFFIC_FLUSH_INTERVAL_S",
    "TRAFFIC_WINDOW_S",
    "TrafficTally",
    "size_bucket",
    "turn_depth",
]

TRAFFIC_WINDOW_S: Final = 60
TRAFFIC_FLUSH_INTERVAL_S: Final = 10.0
MAX_TRAFFIC_KEYS: Final = 20_000
BYTES_PER_TOKEN_ESTIMATE: Final = 4
UNSAMPLED: Final = "not_sampled"


def size_bucket(prompt_bytes: int) -> int:
    """Rule 4: the estimated prompt tokens rounded down to a power of two (0 for none)."""
    tokens = prompt_bytes // BYTES_PER_TOKEN_ESTIMATE
    return 0 if tokens <= 0 else 1 << (tokens.bit_length() - 1)


def turn_depth(payload: dict[str, object] | None) -> int | None:
    """Assistant messages in a chat request (the turns before this one); None otherwise."""
    messages = payload.get("messages") if payload is not None else None
    if not isinstance(messages, list):
        return None
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


_Key = tuple[int, str, str, str, str]


class TrafficTally:
    """The in-memory histograms of rules 1-3, drained by the evaluation's flush."""

    def __init__(self, max_keys: int = MAX_TRAFFIC_KEYS, window_s: int = TRAFFIC_WINDOW_S) -> None:
        self._counts: Counter[_Key] = Counter()
        self._max_keys = max_keys
        self._window_s = window_s
        self.overflowed = 0

    def __len__(self) -> int:
        return len(self._counts)

    def seen(self, route: str, streamed: bool, depth: int | None, prompt_bytes: int) -> None:
        window = self._window()
        self._add((window, "", SEEN, "size", str(size_bucket(prompt_bytes))), 1)
        self._add((window, "", SEEN, "route", route), 1)
        self._add((window, "", SEEN, "streamed", "yes" if streamed else "no"), 1)
        self._add((window, "", SEEN, "turn_depth", turn_depth_bucket(depth)), 1)

    def dropped(self, candidate: str, reason: str, prompt_bytes: int) -> None:
        if reason == UNSAMPLED:
            return
        self._add((self._window(), candidate, reason, "size", str(size_bucket(prompt_bytes))), 1)

    def drain(self) -> list[TrafficCount]:
        counts, self._counts = self._counts, Counter()
        return [TrafficCount(*key, count) for key, count in counts.items()]

    def restore(self, counts: Iterable[TrafficCount]) -> None:
        """Rule 3: a flush that failed gives its counts back."""
        for c in counts:
            self._add((c.window_start, c.candidate, c.outcome, c.dimension, c.value), c.count)

    def _add(self, key: _Key, n: int) -> None:
        if key not in self._counts and len(self._counts) >= self._max_keys:
            self.overflowed += n
            return
        self._counts[key] += n

    def _window(self) -> int:
        now = int(time.time())
        return now - now % self._window_s
