"""The report: a candidate's stored scores judged over a window, every statistic kept.

Rules:
1. Per-backend metrics compare the candidate's values with the primary's (two samples).
2. Pairwise metrics (similarities, agreements, ratios) are judged against their gate and,
   when a ``secondary`` replica of the primary was mirrored, against the same metric
   measured between secondary and primary: the noise floor (Diffy's idea). A quality
   difference counts only beyond that floor.
3. The judge's arithmetic (bootstraps) runs in a worker thread; every report is recorded
   as a verdict row.
4. Conditions (the judge's rule 6): the latency and throughput metrics
   (:data:`CONDITIONED_METRICS`) are loaded with the concurrency,
   prompt and cached tokens of each observation. When the secondary is mirrored at the
   candidate's rate (``replica_at_same_rate``) its own latencies are the baseline (and
   its own rates, counted as rule 6 counts the candidate's: a candidate at a tenth of
   the primary's load has its errors measured against a replica at that load too),
   unless the judge finds that replica broken on a pairwise metric (its rule 11: then
   the primary is, and the basis says so); otherwise the judge compares at matched
   load. The load a value is matched on is the
   larger of the gateway's in-flight count at its backend and the backend's own
   ``vllm:num_requests_running`` scraped by the gateway (``backend_running``; load from
   clients the gateway does not see), the gateway's count alone where the backend does
   not export it. ``conditions`` shows, per latency metric, each backend's
   latency-vs-concurrency curve (on that load; ``<backend> by the gateway's count`` and
   ``<backend> by its own count`` beside it where scraped), and for TTFT the comparison
   within cache strata and each backend's cache hit rate side by side.
5. Sample bias: the evaluated requests' prompt sizes (body bytes over
   :data:`BYTES_PER_TOKEN_ESTIMATE`, binned as the gateway bins all traffic), routes,
   streamed flags and turn depths are compared with the gateway's histograms of all
   traffic and of the drops (``traffic_counts``); at most :data:`MAX_SEEN_VALUES` seen
   values are expanded from the histograms (counts scaled down past that, shares kept).
6. A judgement reads at most the newest ``gates.max_judged_exchanges`` scored exchanges
   of its window (the window's start moves later, and the report says so), so its cost
   is bounded however long traffic has flowed. A rate (a metric whose gate is a rate's,
   gates rule 3) is not capped: the store counts its values over the whole window as
   asked (``rates_since``), per side the known values, the ones and those neither 0 nor
   1, in one grouped read, and the judge reads those counts alone (its rule 1), at a cost
   that does not grow with them. Capped, a rate could not pass where it needed more
   values than the cap gave: ruling out a 1-point worsening at a 5 % error rate takes
   some 5,200 a side, the default cap is 2,000. The rate check's reason says it counted
   the whole window, ``samples`` gives the candidate's count there and ``rates_counted``
   names the rates. The three steps are separate calls (read, judge, record) so a caller
   bounds each store step on its own: the statistics take seconds on thousands of
   values, the reads and the write far less.
7. Reweighting (the judge's rule 9): each latency value carries its exchange's prompt
   size, measured as in rule 5, so that when the sample-bias check flags a skew below
   its refusal bound the judge weights each value by its size bucket's traffic share over
   its evaluated share; each such metric's verdict shows ``reweighting`` (the weights,
   the effective sizes and the same metric judged unweighted).
8. Unscored quality: ``unscored`` counts, by reason, the exchanges of the window with no
   quality values for a reason the gateway knows: ``capture_truncated``, an answer (the
   candidate's, the primary's or both) that outgrew ``[capture] max_bytes``, from the
   stored ``capture.truncated``. Absent reasons are left out.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncSession

from evaluators._gates import Gates
from evaluators._judge import judge
from evaluators._matching import cache_hit_rate, compare_within_cache_strata, load_curve
from evaluators._rates import RateCounts
from evaluators._sample_bias import SampleBias, check_sample_bias, turn_depth_bucket
from evaluators._score import METRICS
from evaluators._verdicts import LoadConditions, MetricSamples, RateSamples, Verdict
from evaluators.store import (
    TRAFFIC_SEEN,
    ConditionedSamples,
    EvaluatedRequests,
    StoredCounts,
    StoredSamples,
    TrafficCount,
    load_conditioned_samples,
    load_evaluated_requests,
    load_samples,
    load_traffic,
    load_value_counts,
    newest_scores_start,
    record_verdict,
)

__all__ = [
    "BYTES_PER_TOKEN_ESTIMATE",
    "CONDITIONED_METRICS",
    "Report",
    "ReportInputs",
    "build_report",
    "judge_inputs",
    "load_report_inputs",
    "record_report",
]

_DIRECTIONS = {name: spec.direction for name, spec in METRICS.items()}
CONDITIONED_METRICS: Final = (
    "latency.ttft_s", "latency.itl_mean_s", "latency.itl_p99_s", "latency.e2e_s",
    "throughput.output_tps",
)  # fmt: skip
"""The per-backend metrics judged at matched load (rule 4): the latencies and the decode
throughput, which falls with load as they rise (at a 50 % canary step the candidate serves
its sessions live and the rest as replays, twice the primary's load)."""
CACHE_METRIC: Final = "latency.ttft_s"
CAPTURE_METRIC: Final = "capture.truncated"
BYTES_PER_TOKEN_ESTIMATE: Final = 4
"""Rule 5: the gateway's estimate of prompt tokens from body bytes (``gateway/_traffic.py``)."""
MAX_SEEN_VALUES: Final = 200_000
UNSAMPLED: Final = "not_sampled"
RATE_SCOPE: Final = "the whole window"
"""Rule 6: what a rate's counts cover, as its check's reason says."""


@dataclass(frozen=True, slots=True)
class Report:
    candidate: str
    secondary: str | None
    since: datetime | None
    generated_at: datetime
    samples: dict[str, int]
    verdict: Verdict
    verdict_id: int | None
    conditions: dict[str, Any] = field(default_factory=dict)
    sample_bias: SampleBias | None = None
    capped_at: int | None = None
    """Rule 6: the cap on scored exchanges, where it moved ``since`` later."""
    rates_since: datetime | None = None
    """Rule 6: the window's start as asked, from which the rates are counted whole."""
    rates_counted: tuple[str, ...] = ()
    """Rule 6: the metrics judged as rates, on their counts over the whole window."""
    unscored: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Rule 8: why exchanges of the window have no quality values, counted by reason."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "noise_floor_from": self.secondary,
            "since": self.since.isoformat() if self.since else None,
            "newest_exchanges_only": self.capped_at,
            "rates_since": self.rates_since.isoformat() if self.rates_since else None,
            "rates_counted": list(self.rates_counted),
            "generated_at": self.generated_at.isoformat(),
            "samples": self.samples,
            "verdict_id": self.verdict_id,
            **self.verdict.to_dict(),
            "conditions": self.conditions,
            "sample_bias": None if self.sample_bias is None else self.sample_bias.to_dict(),
            "unscored": self.unscored,
        }


def _metric_samples(stored: dict[str, StoredSamples], floor: dict[str, StoredSamples],
                    conditioned: dict[str, ConditionedSamples],
                    counts: dict[str, StoredCounts], floor_counts: dict[str, StoredCounts],
                    replica: bool) -> dict[str, MetricSamples]:
    out: dict[str, MetricSamples] = {}
    for metric, count in counts.items():  # rule 6: a rate's counts are all the judge reads
        if count.candidate.n and metric in METRICS:
            same_rate = floor_counts.get(metric) if replica else None
            out[metric] = MetricSamples(
                candidate=[], baseline=[],
                rates=RateSamples(RateCounts(*count.candidate), RateCounts(*count.primary),
                                  replica=(RateCounts(*same_rate.candidate)
                                           if same_rate and same_rate.candidate.n else None),
                                  scope=RATE_SCOPE))
    for metric, (candidate, primary) in stored.items():
        if metric in counts:
            continue
        spec = METRICS.get(metric)
        if spec is None or not candidate:  # never measured (e.g. cost without prices)
            continue
        noise = floor.get(metric)
        if spec.kind == "per_backend":
            c = conditioned.get(metric)
            if c is None or not c.candidate:
                out[metric] = MetricSamples(candidate=candidate, baseline=primary)
                continue
            out[metric] = MetricSamples(
                candidate=c.candidate, baseline=c.primary,
                replica=noise.candidate if replica and noise and noise.candidate else None,
                conditions=LoadConditions(
                    _load(c.candidate_concurrency, c.candidate_backend_running),
                    _load(c.primary_concurrency, c.primary_backend_running),
                    tuple(c.candidate_prompt_tokens), tuple(c.candidate_cached_tokens),
                    tuple(c.primary_prompt_tokens), tuple(c.primary_cached_tokens),
                    cache=metric == CACHE_METRIC,
                    candidate_prompt_size=_sizes(c.candidate_prompt_bytes),
                    baseline_prompt_size=_sizes(c.primary_prompt_bytes)))
        else:
            out[metric] = MetricSamples(candidate=candidate,
                                        noise_floor=noise.candidate if noise else None)
    return out


def _estimated_tokens(prompt_bytes: int) -> int:
    """The gateway's size bucket: estimated tokens rounded down to a power of two."""
    tokens = prompt_bytes // BYTES_PER_TOKEN_ESTIMATE
    return 0 if tokens <= 0 else 1 << (tokens.bit_length() - 1)


def _load(gateway: Sequence[int | None],
          scraped: Sequence[int | None]) -> tuple[int | None, ...]:
    """Rule 4: the larger of the gateway's count and the backend's own, where known."""
    if len(scraped) != len(gateway):
        return tuple(gateway)
    return tuple(g if s is None else s if g is None else max(g, s)
                 for g, s in zip(gateway, scraped, strict=True))


def _sizes(prompt_bytes: Sequence[int | None]) -> tuple[float | None, ...]:
    """Rule 5's size of each value's exchange, for the judge's reweighting (rule 7)."""
    return tuple(None if b is None else float(_estimated_tokens(b)) for b in prompt_bytes)


def _expand(counts: Mapping[str, int], limit: int) -> list[str]:
    """Each value repeated as counted, scaled down to at most ``limit`` values in all."""
    total = sum(counts.values())
    scale = min(1.0, limit / total) if total else 1.0
    return [value for value, n in sorted(counts.items())
            for _ in range(max(1, round(n * scale)) if n else 0)]


def _sample_bias(evaluated: EvaluatedRequests,
                 traffic: Sequence[TrafficCount]) -> SampleBias | None:
    """Rule 5; None when the gateway recorded no traffic (or nothing was evaluated)."""
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    drops: Counter[tuple[str, str]] = Counter()
    for c in traffic:
        if c.outcome == TRAFFIC_SEEN:
            seen[c.dimension][c.value] += c.count
        elif c.dimension == "size" and c.outcome != UNSAMPLED:
            drops[(c.outcome, c.value)] += c.count
    sizes = [b for b in evaluated.prompt_bytes if b is not None]
    if not seen.get("size") or not sizes:
        return None
    seen_tokens = [float(v) for v in _expand(seen["size"], MAX_SEEN_VALUES)]
    known = [i for i, b in enumerate(evaluated.prompt_bytes) if b is not None]
    features = {
        "route": [evaluated.route[i] for i in known],
        "streamed": ["yes" if evaluated.streamed[i] else "no" for i in known],
        "turn_depth": [turn_depth_bucket(evaluated.turn_depth[i]) for i in known],
    }
    seen_features = {name: _expand(seen[name], MAX_SEEN_VALUES) for name in features}
    drop_list = [(reason, float(value)) for (reason, value), n in sorted(drops.items())
                 for _ in range(min(n, MAX_SEEN_VALUES))]
    return check_sample_bias(
        seen_tokens, [float(_estimated_tokens(b)) for b in sizes],
        seen_features={k: v for k, v in seen_features.items() if v},
        evaluated_features={k: v for k, v in features.items() if seen_features[k]},
        drops=drop_list)


def _conditions(conditioned: dict[str, ConditionedSamples],
                replica: dict[str, ConditionedSamples], replica_name: str | None,
                gates: Gates) -> dict[str, Any]:
    """Rule 4's display: load curves per backend, cache strata and hit rates."""
    out: dict[str, Any] = {"load_curves": {}, "cache": None}
    for metric in CONDITIONED_METRICS:
        c = conditioned.get(metric)
        if c is None:
            continue
        curves: dict[str, Any] = {}
        sides = (("candidate", c.candidate, c.candidate_concurrency,
                  c.candidate_backend_running),
                 ("primary", c.primary, c.primary_concurrency, c.primary_backend_running))
        for backend, values, gateway, scraped in sides:
            loads: list[tuple[str, Sequence[int | None]]] = [(backend, _load(gateway, scraped))]
            if any(s is not None for s in scraped):
                loads += [(f"{backend} by the gateway's count", gateway),
                          (f"{backend} by its own count", scraped)]
            for label, load in loads:
                known = [(v, k) for v, k in zip(values, load, strict=True) if k is not None]
                if known:
                    curves[label] = load_curve([v for v, _ in known],
                                               [float(k) for _, k in known]).to_dict()
        r = replica.get(metric)
        if r is not None and replica_name is not None:
            known = [(v, k) for v, k in zip(r.candidate, r.candidate_concurrency, strict=True)
                     if k is not None]
            if known:
                curves[f"replica {replica_name}"] = load_curve(
                    [v for v, _ in known], [float(k) for _, k in known]).to_dict()
        out["load_curves"][metric] = curves
    ttft = conditioned.get(CACHE_METRIC)
    e2e = conditioned.get("latency.e2e_s") or ttft
    if ttft is not None and ttft.candidate and ttft.primary:
        strata = compare_within_cache_strata(
            ttft.primary, ttft.primary_prompt_tokens, ttft.primary_cached_tokens,
            ttft.candidate, ttft.candidate_prompt_tokens, ttft.candidate_cached_tokens,
            confidence=gates.confidence)
        out["cache"] = {"ttft_within_cache_strata": strata.to_dict()}
    if e2e is not None:
        out.setdefault("cache", None)
        hit = {
            "candidate": cache_hit_rate(e2e.candidate_prompt_tokens,
                                        e2e.candidate_cached_tokens).to_dict(),
            "primary": cache_hit_rate(e2e.primary_prompt_tokens,
                                      e2e.primary_cached_tokens).to_dict(),
        }
        out["cache"] = {**(out["cache"] or {}), "hit_rates": hit}
    return out


@dataclass(frozen=True, slots=True)
class ReportInputs:
    """Rule 6: what a judgement reads from the store, read at once (no statistics)."""

    candidate: str
    secondary: str | None
    since: datetime | None
    """The window's start: the one asked for, or later where the cap (rule 6) moved it."""
    capped: bool
    stored: dict[str, StoredSamples]
    floor: dict[str, StoredSamples]
    conditioned: dict[str, ConditionedSamples]
    replica: dict[str, ConditionedSamples]
    evaluated: EvaluatedRequests
    traffic: list[TrafficCount]
    counts: dict[str, StoredCounts] = field(default_factory=dict)
    """Rule 6: the rates' values over the whole window, counted per side."""
    floor_counts: dict[str, StoredCounts] = field(default_factory=dict)
    """Rule 6: the secondary's rates over the same window (its side is ``candidate``)."""
    rates_since: datetime | None = None
    """The window's start as asked: the counts' (the cap does not move it)."""


def _rate_metrics(gates: Gates) -> list[str]:
    """Rule 6: the per-backend metrics whose gate is a rate's, judged on counts."""
    return [metric for metric, spec in METRICS.items() if spec.kind == "per_backend"
            and gates.gate_for(metric, pairwise=False).max_mean_worsening is not None]


async def load_report_inputs(session: AsyncSession, candidate: str, gates: Gates, *,
                             secondary: str | None = None,
                             since: datetime | None = None) -> ReportInputs:
    """Rule 6's reads: the newest ``gates.max_judged_exchanges`` scored exchanges at most,
    and the rates' counts over the whole window."""
    asked = since
    cap_start = await newest_scores_start(session, candidate, list(METRICS),
                                          gates.max_judged_exchanges)
    capped = cap_start is not None and (since is None or cap_start > since)
    if capped:
        since = cap_start
    use_floor = secondary is not None and secondary != candidate
    rates = _rate_metrics(gates)
    return ReportInputs(
        candidate=candidate, secondary=secondary, since=since, capped=capped,
        rates_since=asked,
        counts=await load_value_counts(session, candidate, rates, since=asked),
        floor_counts=(await load_value_counts(session, secondary, rates, since=asked)
                      if use_floor and secondary else {}),
        stored=await load_samples(session, candidate, since=since),
        floor=await load_samples(session, secondary, since=since) if secondary else {},
        conditioned=await load_conditioned_samples(session, candidate, CONDITIONED_METRICS,
                                                   since=since),
        replica=(await load_conditioned_samples(session, secondary, CONDITIONED_METRICS,
                                                since=since)
                 if use_floor and secondary else {}),
        evaluated=await load_evaluated_requests(session, candidate, since=since),
        traffic=await load_traffic(session, candidate, since=since))


def judge_inputs(inputs: ReportInputs, gates: Gates, *,
                 replica_at_same_rate: bool = False) -> Report:
    """Rule 3: the statistics over ``inputs`` (CPU-bound: call it in a worker thread)."""
    secondary = inputs.secondary
    use_replica = replica_at_same_rate and secondary is not None and secondary != inputs.candidate
    samples = _metric_samples(inputs.stored, inputs.floor, inputs.conditioned, inputs.counts,
                              inputs.floor_counts, use_replica)
    bias = _sample_bias(inputs.evaluated, inputs.traffic)
    verdict = judge(samples, gates, _DIRECTIONS, sample_bias=bias, noise_floor_from=secondary)
    conditions = _conditions(inputs.conditioned, inputs.replica, secondary, gates)
    return Report(candidate=inputs.candidate, secondary=secondary, since=inputs.since,
                  generated_at=datetime.now(UTC),
                  samples={**{m: len(s.candidate) for m, s in inputs.stored.items()},
                           **{m: c.candidate.n for m, c in inputs.counts.items()}},
                  verdict=verdict, verdict_id=None, conditions=conditions,
                  sample_bias=bias,
                  capped_at=gates.max_judged_exchanges if inputs.capped else None,
                  rates_since=inputs.rates_since, rates_counted=tuple(sorted(inputs.counts)),
                  unscored=_unscored(inputs.stored))


def _unscored(stored: Mapping[str, StoredSamples]) -> dict[str, dict[str, Any]]:
    """Rule 8: the exchanges whose quality went unscored because an answer outgrew the
    capture, and on which side; empty when none did."""
    samples = stored.get(CAPTURE_METRIC)
    if samples is None or len(samples.candidate) != len(samples.primary):
        return {}
    pairs = list(zip(samples.candidate, samples.primary, strict=True))
    exchanges = sum(1 for c, p in pairs if c or p)
    if not exchanges:
        return {}
    return {"capture_truncated": {
        "exchanges": exchanges,
        "candidate": sum(1 for c, _ in pairs if c),
        "primary": sum(1 for _, p in pairs if p),
        "why": "an answer outgrew [capture] max_bytes: its text is unknown, its quality "
               "not scored"}}


async def record_report(session: AsyncSession, report: Report) -> Report:
    """Rule 3: ``report`` as a verdict row; the report with its ``verdict_id``."""
    if not report.samples:
        return report
    verdict = report.verdict
    verdict_id = await record_verdict(
        session, candidate=report.candidate, verdict=verdict.outcome.value,
        reasons=verdict.reasons, statistics=verdict.to_dict(), window_start=report.since,
        window_end=report.generated_at)
    return dataclasses.replace(report, verdict_id=verdict_id)


async def build_report(session: AsyncSession, candidate: str, gates: Gates, *,
                       secondary: str | None = None, since: datetime | None = None,
                       record: bool = True, replica_at_same_rate: bool = False) -> Report:
    """Read, judge (in a worker thread) and, with ``record``, record: in one session."""
    inputs = await load_report_inputs(session, candidate, gates, secondary=secondary,
                                      since=since)
    report = await asyncio.to_thread(judge_inputs, inputs, gates,
                                     replica_at_same_rate=replica_at_same_rate)
    return await record_report(session, report) if record else report
