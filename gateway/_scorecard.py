"""The scorecard page at /admin/ui and the read-only data its plots need.

Rules:
1. The page is three static files (HTML, JS, CSS) read from ``gateway/static`` once, when
   the admin app is built; no build step, nothing fetched from outside at run time. They
   hold no data, so they are served without the token (a browser cannot send a bearer
   header when it navigates); every number the page shows comes from the admin API with
   the operator's token, which the page asks for (or takes from the URL's fragment, which
   never reaches a server or its logs) and keeps in the tab's ``sessionStorage``.
2. The page's files are served with a Content-Security-Policy that allows scripts, styles
   and fetches from the admin listener only: no inline script, no other origin.
3. Every answer is bounded whatever the store holds: a distribution reads at most the
   newest :data:`MAX_DISTRIBUTION_VALUES` scores per metric and backend (as the judge
   does) and returns :data:`CDF_POINTS` quantiles or :data:`HISTOGRAM_BINS` bins; the
   traffic series covers at most :data:`MAX_TRAFFIC_SPAN_S` of ``traffic_counts``
   windows. Each read is one store call within the admin's ``store_timeout_s``; a store
   that does not answer in time, or fails, is a 503 with the reason.
4. A candidate's report (``GET /candidates/NAME/report``) is judged as the promoter
   judges: its reads and its verdict's write are each one store call within
   ``store_timeout_s``, the statistics between them bounded by the gates' cap; a store
   that does not answer in time, or fails, is a 503 with the reason, never a 500.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Final

import numpy as np
from pydantic import BaseModel

from evaluators import METRICS, Report
from evaluators.store import (
    TRAFFIC_SEEN,
    StoredSamples,
    StoreError,
    load_samples,
    load_traffic,
    newest_scores_start,
    session_factory,
)
from gateway._exceptions import ChangeNotStored, Conflict
from gateway._scorekeeper import Scorekeeper
from gateway._state import GatewayState
from gateway._traffic import TRAFFIC_WINDOW_S

__all__ = [
    "CDF_POINTS",
    "HISTOGRAM_BINS",
    "MAX_DISTRIBUTION_VALUES",
    "MAX_TRAFFIC_SPAN_S",
    "SCORECARD_PATH",
    "Distributions",
    "TrafficSeries",
    "distributions",
    "judged_report",
    "scorecard_files",
    "traffic_series",
]

SCORECARD_PATH: Final = "/admin/ui"
MAX_DISTRIBUTION_VALUES: Final = 2_000
"""Rule 3: the newest scores per metric and backend a distribution is drawn from."""
CDF_POINTS: Final = 51
"""Rule 3: quantiles per latency distribution (0, 2 %, ..., 100 %)."""
HISTOGRAM_BINS: Final = 20
"""Rule 3: equal bins over [0, 1] per quality histogram."""
MAX_TRAFFIC_SPAN_S: Final = 86_400
"""Rule 3: the longest span of traffic windows one answer covers (a day of minutes)."""
DEFAULT_TRAFFIC_SPAN_S: Final = 3_600

_CSP: Final = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_FILES: Final = {"": ("scorecard.html", "text/html"),
                 "/scorecard.js": ("scorecard.js", "application/javascript"),
                 "/scorecard.css": ("scorecard.css", "text/css")}
_LATENCY: Final = tuple(name for name, spec in METRICS.items()
                        if name.startswith("latency.") and spec.kind == "per_backend")
_QUALITY: Final = tuple(name for name, spec in METRICS.items()
                        if name.startswith("quality.") and spec.kind == "pairwise")


# -- views ------------------------------------------------------------------------------

class LatencyDistribution(BaseModel):
    """A latency metric's quantiles per backend: the CDF primary vs candidate vs floor."""

    metric: str
    unit: str
    quantiles: list[float]
    """The probabilities the values below are taken at, 0 to 1."""
    primary: list[float] | None
    candidate: list[float] | None
    floor: list[float] | None
    """The noise-floor replica's own values (its latency measured like the candidate's)."""
    samples: dict[str, int]


class QualityHistogram(BaseModel):
    """A pairwise quality metric (candidate vs primary) binned over [0, 1], with the same
    metric between the noise-floor replica and the primary."""

    metric: str
    unit: str
    edges: list[float]
    candidate: list[int]
    floor: list[int] | None
    candidate_mean: float | None
    floor_mean: float | None
    samples: dict[str, int]


class Distributions(BaseModel):
    candidate: str
    secondary: str | None
    since: datetime | None
    max_values: int
    latency: list[LatencyDistribution]
    quality: list[QualityHistogram]


class DropSeries(BaseModel):
    candidate: str
    reason: str
    counts: list[int]
    """One count per window, aligned with ``TrafficSeries.windows``."""


class TrafficSeries(BaseModel):
    """All traffic seen and every candidate's drops, per ``traffic_counts`` window."""

    window_s: int
    windows: list[int]
    """Each window's start, in seconds since the epoch, oldest first."""
    seen: list[int]
    drops: list[DropSeries]


# -- the page ---------------------------------------------------------------------------

def scorecard_files() -> dict[str, tuple[bytes, dict[str, str]]]:
    """Rules 1-2: each page path with its body and headers, read from ``gateway/static``."""
    static = resources.files("gateway").joinpath("static")
    headers = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
               "Cache-Control": "no-store"}
    return {SCORECARD_PATH + suffix: (static.joinpath(name).read_bytes(),
                                      {**headers, "Content-Type": f"{kind}; charset=utf-8"})
            for suffix, (name, kind) in _FILES.items()}


# -- distributions ----------------------------------------------------------------------

async def distributions(state: GatewayState, candidate: str,
                        since: datetime | None) -> Distributions:
    """Rule 3: ``candidate``'s latency CDFs and quality histograms, and the floor's."""
    scorekeeper = _scorekeeper(state)
    secondary = scorekeeper.secondary
    floor_name = secondary if secondary is not None and secondary != candidate else None
    with _store_read(state, "the distributions"):
        async with asyncio.timeout(state.config.admin.store_timeout_s):
            mine = await _newest(scorekeeper, candidate, since)
            floor = await _newest(scorekeeper, floor_name, since) if floor_name else {}
    quantiles = np.linspace(0.0, 1.0, CDF_POINTS)
    latency = []
    for metric in _LATENCY:
        c, p, f = _values(mine, metric, 0), _values(mine, metric, 1), _values(floor, metric, 0)
        if not c:  # nothing of this candidate's to compare (never scored, or not streamed)
            continue
        latency.append(LatencyDistribution(
            metric=metric, unit=METRICS[metric].unit, quantiles=_rounded(quantiles),
            primary=_quantiles(p, quantiles), candidate=_quantiles(c, quantiles),
            floor=_quantiles(f, quantiles) if floor_name else None,
            samples={"primary": len(p), "candidate": len(c), "floor": len(f)}))
    edges = np.linspace(0.0, 1.0, HISTOGRAM_BINS + 1)
    quality = []
    for metric in _QUALITY:
        c, f = _values(mine, metric, 0), _values(floor, metric, 0)
        if not c:
            continue
        quality.append(QualityHistogram(
            metric=metric, unit=METRICS[metric].unit, edges=_rounded(edges),
            candidate=_histogram(c, edges), floor=_histogram(f, edges) if floor_name else None,
            candidate_mean=float(np.mean(c)) if c else None,
            floor_mean=float(np.mean(f)) if f else None,
            samples={"candidate": len(c), "floor": len(f)}))
    return Distributions(candidate=candidate, secondary=floor_name, since=since,
                         max_values=MAX_DISTRIBUTION_VALUES, latency=latency, quality=quality)


async def _newest(scorekeeper: Scorekeeper, backend: str,
                  since: datetime | None) -> dict[str, StoredSamples]:
    metrics = (*_LATENCY, *_QUALITY)
    engine = scorekeeper.engine
    assert engine is not None  # _scorekeeper checked it
    async with session_factory(engine)() as session, session.begin():
        start = await newest_scores_start(session, backend, metrics, MAX_DISTRIBUTION_VALUES)
        if start is not None and (since is None or start > since):
            since = start
        return await load_samples(session, backend, metrics, since=since)


def _values(samples: dict[str, StoredSamples], metric: str, side: int) -> list[float]:
    found = samples.get(metric)
    # A metric stored since ``start`` may still hold a few more than the bound (ties).
    return [] if found is None else found[side][-MAX_DISTRIBUTION_VALUES:]


def _quantiles(values: list[float], at: np.ndarray) -> list[float] | None:
    return _rounded(np.quantile(np.asarray(values), at)) if values else None


def _histogram(values: list[float], edges: np.ndarray) -> list[int]:
    clipped = np.clip(np.asarray(values, dtype=float), 0.0, 1.0)
    return [int(n) for n in np.histogram(clipped, bins=edges)[0]]


def _rounded(values: np.ndarray) -> list[float]:
    return [round(float(v), 9) for v in values]


# -- traffic ----------------------------------------------------------------------------

async def traffic_series(state: GatewayState, since: datetime | None) -> TrafficSeries:
    """Rule 3: requests seen and drops by candidate and reason per window since ``since``
    (the last hour without one; a day at most), oldest first."""
    scorekeeper = _scorekeeper(state)
    now = datetime.now(UTC)
    earliest = now - timedelta(seconds=MAX_TRAFFIC_SPAN_S)
    since = now - timedelta(seconds=DEFAULT_TRAFFIC_SPAN_S) if since is None else since
    since = max(since, earliest)
    names = sorted(state.mirror.candidates)
    engine = scorekeeper.engine
    with _store_read(state, "the traffic counts"):
        async with asyncio.timeout(state.config.admin.store_timeout_s):
            await scorekeeper.flush_traffic()
            assert engine is not None  # _scorekeeper checked it
            async with session_factory(engine)() as session, session.begin():
                rows = [*await load_traffic(session, "", since=since)]
                for name in names:  # each call also returns the seen rows: taken once
                    rows += [r for r in await load_traffic(session, name, since=since)
                             if r.candidate]
    seen: defaultdict[int, int] = defaultdict(int)
    dropped: defaultdict[tuple[str, str], defaultdict[int, int]] = defaultdict(
        lambda: defaultdict(int))
    for row in rows:
        if row.dimension != "size":  # every request counts once under each dimension
            continue
        if row.outcome == TRAFFIC_SEEN and not row.candidate:
            seen[row.window_start] += row.count
        elif row.candidate:
            dropped[(row.candidate, row.outcome)][row.window_start] += row.count
    windows = sorted({*seen, *(w for per in dropped.values() for w in per)})
    return TrafficSeries(
        window_s=TRAFFIC_WINDOW_S, windows=windows, seen=[seen[w] for w in windows],
        drops=[DropSeries(candidate=c, reason=r, counts=[per[w] for w in windows])
               for (c, r), per in sorted(dropped.items())])


async def judged_report(state: GatewayState, candidate: str,
                        since: datetime | None) -> Report:
    """Rule 4: ``candidate``'s report on its scores since ``since``, its verdict recorded."""
    scorekeeper = state.scorekeeper
    if scorekeeper is None:
        raise Conflict("evaluation is disabled in this gateway ([evaluation] enabled = false)")
    # As the promoter judges: a call that overruns is left to unwind in the background
    # (a black-holed connection can take long to), the answer does not wait for it.
    inputs = await state.sync.store_call(f"reading {candidate}'s scores",
                                         lambda _: scorekeeper.read(candidate, since),
                                         if_late=None)
    if inputs is None:
        raise ChangeNotStored("the store is not attached", "unavailable")
    report = await scorekeeper.judge(inputs)
    recorded = await state.sync.store_call(f"recording the verdict on {candidate}",
                                           lambda _: scorekeeper.record(report),
                                           if_late=None)
    return report if recorded is None else recorded


def _scorekeeper(state: GatewayState) -> Scorekeeper:
    scorekeeper = state.scorekeeper
    if scorekeeper is None:
        raise Conflict("evaluation is disabled in this gateway ([evaluation] enabled = false)")
    if scorekeeper.engine is None or scorekeeper.store_status.state != "up":
        raise ChangeNotStored("the store is not reached yet: "
                              f"{scorekeeper.store_status.reason or 'connecting'}", "unavailable")
    return scorekeeper


@contextmanager
def _store_read(state: GatewayState, what: str) -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise ChangeNotStored(f"reading {what}: the store did not answer within "
                              f"{state.config.admin.store_timeout_s} s", "timeout") from exc
    except StoreError as exc:
        raise ChangeNotStored(f"reading {what}: the store is unavailable ({exc})",
                              "unavailable") from exc
