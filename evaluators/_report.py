"""The report: a candidate's stored scores judged over a window, every statistic kept.

Rules:
1. Per-backend metrics compare the candidate's values with the primary's (two samples).
2. Pairwise metrics (similarities, agreements, ratios) are judged against their gate and,
   when a ``secondary`` replica of the primary was mirrored, against the same metric
   measured between secondary and primary: the noise floor (Diffy's idea). A quality
   difference counts only beyond that floor.
3. The judge's arithmetic (bootstraps) runs in a worker thread; every report is recorded
   as a verdict row.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from evaluators._gates import Gates
from evaluators._judge import MetricSamples, Verdict, judge
from evaluators._score import METRICS
from evaluators.store import StoredSamples, load_samples, record_verdict

__all__ = ["Report", "build_report"]

_DIRECTIONS = {name: spec.direction for name, spec in METRICS.items()}


@dataclass(frozen=True, slots=True)
class Report:
    candidate: str
    secondary: str | None
    since: datetime | None
    generated_at: datetime
    samples: dict[str, int]
    verdict: Verdict
    verdict_id: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "noise_floor_from": self.secondary,
            "since": self.since.isoformat() if self.since else None,
            "generated_at": self.generated_at.isoformat(),
            "samples": self.samples,
            "verdict_id": self.verdict_id,
            **self.verdict.to_dict(),
        }


def _metric_samples(stored: dict[str, StoredSamples],
                    floor: dict[str, StoredSamples]) -> dict[str, MetricSamples]:
    out: dict[str, MetricSamples] = {}
    for metric, (candidate, primary) in stored.items():
        spec = METRICS.get(metric)
        if spec is None or not candidate:  # never measured (e.g. cost without prices)
            continue
        if spec.kind == "per_backend":
            out[metric] = MetricSamples(candidate=candidate, baseline=primary)
        else:
            noise = floor.get(metric)
            out[metric] = MetricSamples(candidate=candidate,
                                        noise_floor=noise.candidate if noise else None)
    return out


async def build_report(session: AsyncSession, candidate: str, gates: Gates, *,
                       secondary: str | None = None, since: datetime | None = None,
                       record: bool = True) -> Report:
    stored = await load_samples(session, candidate, since=since)
    floor = await load_samples(session, secondary, since=since) if secondary else {}
    samples = _metric_samples(stored, floor)
    verdict = await asyncio.to_thread(judge, samples, gates, _DIRECTIONS)
    verdict_id = None
    if record and stored:
        verdict_id = await record_verdict(
            session, candidate=candidate, verdict=verdict.outcome.value,
            reasons=verdict.reasons, statistics=verdict.to_dict(), window_start=since,
            window_end=datetime.now(UTC))
    return Report(candidate=candidate, secondary=secondary, since=since,
                  generated_at=datetime.now(UTC),
                  samples={m: len(s.candidate) for m, s in stored.items()},
                  verdict=verdict, verdict_id=verdict_id)
