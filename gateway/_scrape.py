"""Each backend's own concurrency, scraped from its ``vllm:num_requests_running``.

The gateway counts the requests it has in flight at each backend, but a backend may also
serve clients that do not pass through this gateway (another gateway replica, a batch
job, a direct client): load the gateway cannot see and the judge must condition on. vLLM
(and this project's simulator and engines) export the backend's own count.

Theory of operation:
1. One background task scrapes ``<backend url>/metrics`` of the primary and of every
   runtime candidate every :data:`SCRAPE_INTERVAL_S`, each scrape bounded by
   :data:`SCRAPE_TIMEOUT_S` and :data:`MAX_SCRAPE_BYTES`, at most
   :data:`MAX_SCRAPE_TARGETS` backends per round, all of a round concurrently. Nothing
   here runs on the request path: the relay and the mirror only read the last value
   (:meth:`BackendLoad.running`, a dict lookup).
2. The value is the sum of ``vllm:num_requests_running`` over its label sets (one per
   engine). A sample that is no finite number (``NaN``, ``+Inf``, which the exposition
   format allows) is skipped, and a sum past :data:`MAX_RUNNING_COUNT` is no count: the
   store's column holds no more, and one such value on the primary cost every record of
   its batch. A scrape that fails (connection, timeout, a status other than 200, a body
   without the series) is counted by outcome (``understudy_backend_scrapes_total``) and
   leaves no value: a backend that does not export the series is simply unknown.
3. A value older than :data:`MAX_SCRAPE_AGE_S` is unknown (None), never a stale count.
4. The count is the backend's running batch when last scraped, which may lag the
   request's own send by up to the interval; the judge takes the larger of it and the
   gateway's own in-flight count (``evaluators._report`` rule 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Final, Literal

import aiohttp

from gateway._metrics import GatewayMetrics

__all__ = [
    "MAX_RUNNING_COUNT",
    "MAX_SCRAPE_AGE_S",
    "MAX_SCRAPE_BYTES",
    "MAX_SCRAPE_TARGETS",
    "RUNNING_SERIES",
    "SCRAPE_INTERVAL_S",
    "SCRAPE_TIMEOUT_S",
    "BackendLoad",
    "parse_running",
]

log = logging.getLogger("understudy.scrape")

SCRAPE_INTERVAL_S: Final = 0.5
SCRAPE_TIMEOUT_S: Final = 0.25
MAX_SCRAPE_AGE_S: Final = 3 * SCRAPE_INTERVAL_S
MAX_SCRAPE_BYTES: Final = 1024 * 1024
MAX_SCRAPE_TARGETS: Final = 64
RUNNING_SERIES: Final = "vllm:num_requests_running"
MAX_RUNNING_COUNT: Final = 2**31 - 1
"""The largest running count taken from a backend (rule 2)."""

ScrapeOutcome = Literal["ok", "error", "timeout", "status", "absent", "too_large"]


def parse_running(text: str) -> int | None:
    """Rule 2: the sum of ``vllm:num_requests_running`` over its label sets; None when the
    exposition has no such sample."""
    total: float | None = None
    for line in text.splitlines():
        if not line.startswith(RUNNING_SERIES):
            continue
        rest = line[len(RUNNING_SERIES):]
        if rest[:1] not in ("{", " "):
            continue  # another series sharing the prefix
        value = rest.rsplit("}", 1)[-1].split()
        try:
            sample = float(value[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(sample):
            total = (total or 0.0) + sample
    if total is None or total > MAX_RUNNING_COUNT:
        return None
    return max(0, round(total))


class BackendLoad:
    """The scraped running count per backend (rules 1-3), read without waiting."""

    def __init__(self, targets: Callable[[], Mapping[str, str]], metrics: GatewayMetrics,
                 interval_s: float = SCRAPE_INTERVAL_S,
                 timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self._targets = targets
        self._metrics = metrics
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._values: dict[str, tuple[float, int]] = {}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def running(self, backend: str) -> int | None:
        """Rule 3: the last scraped count, None when unknown or older than the bound."""
        found = self._values.get(backend)
        if found is None or time.monotonic() - found[0] > MAX_SCRAPE_AGE_S:
            return None
        return found[1]

    async def start(self) -> None:
        if self._task is not None:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            connector=aiohttp.TCPConnector(limit=MAX_SCRAPE_TARGETS))
        self._task = asyncio.create_task(self._scrape_periodically(),
                                         name="understudy-backend-scrape")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def scrape_once(self) -> None:
        """One round of rule 1 (the periodic task's body; tests call it directly)."""
        targets = list(self._targets().items())[:MAX_SCRAPE_TARGETS]
        await asyncio.gather(*(self._scrape(name, url) for name, url in targets))
        live = {name for name, _ in targets}
        for gone in set(self._values) - live:
            del self._values[gone]

    async def _scrape_periodically(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.scrape_once()
            except Exception:  # never let one bad round stop the scraping
                log.exception("backend scrape round failed")
            await asyncio.sleep(max(0.0, self._interval_s - (time.monotonic() - started)))

    async def _scrape(self, name: str, url: str) -> None:
        outcome: ScrapeOutcome = "ok"
        value: int | None = None
        session = self._session
        if session is None:
            return
        try:
            async with session.get(url.rstrip("/") + "/metrics") as resp:
                if resp.status != 200:
                    outcome = "status"
                else:
                    body = await resp.content.read(MAX_SCRAPE_BYTES + 1)
                    if len(body) > MAX_SCRAPE_BYTES:
                        outcome = "too_large"
                    else:
                        value = parse_running(body.decode("utf-8", "replace"))
                        outcome = "ok" if value is not None else "absent"
        except TimeoutError:
            outcome = "timeout"
        except (aiohttp.ClientError, OSError, ValueError):
            outcome = "error"
        self._metrics.backend_scrapes.labels(backend=name, outcome=outcome).inc()
        if value is None:
            self._values.pop(name, None)
        else:
            self._values[name] = (time.monotonic(), value)
