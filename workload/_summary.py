"""A run's turn records folded into a summary, and the summary as a rich table."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from rich.table import Table

from workload._spec import DepthStats, TurnResult, WorkloadSummary

__all__ = ["percentile", "summarize", "summary_table"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _mean(values: Sequence[int]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(results: Iterable[TurnResult], wall_s: float, not_sent: int = 0,
              planned: Mapping[str, int] | None = None, *,
              lines_past_max_requests: int = 0) -> WorkloadSummary:
    """``results`` folded. A session is completed when every request ``planned`` for it (its
    turns; a replayed key's records) was sent and answered without error: one cut short by
    the duration, a stop or a bound is not. Without ``planned``, when none failed."""
    ordered = tuple(sorted(results, key=lambda r: r.started_s))
    by_turn: dict[int, list[TurnResult]] = defaultdict(list)
    failed_sessions: set[str] = set()
    answered: Counter[str] = Counter()
    for result in ordered:
        by_turn[result.turn].append(result)
        answered[result.session] += result.ok
        if not result.ok:
            failed_sessions.add(result.session)
    sessions = set(answered)
    if planned is not None:
        failed_sessions |= {s for s in sessions if answered[s] < planned.get(s, 0)}
    depths = []
    for turn in sorted(by_turn):
        group = by_turn[turn]
        ok = [r for r in group if r.ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s for r in ok]
        depths.append(DepthStats(
            turn=turn, turns=len(group), errors=len(group) - len(ok),
            ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
            e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99),
            prompt_tokens_mean=_mean([r.prompt_tokens for r in ok
                                      if r.prompt_tokens is not None]),
            cached_tokens_mean=_mean([r.cached_tokens for r in ok
                                      if r.cached_tokens is not None]),
        ))
    return WorkloadSummary(
        sessions=len(sessions),
        sessions_completed=len(sessions - failed_sessions),
        turns=len(ordered),
        errors=sum(1 for r in ordered if not r.ok),
        errors_by_kind=tuple(Counter(r.error for r in ordered if r.error is not None)
                             .most_common()),
        wall_s=wall_s,
        by_depth=tuple(depths),
        results=ordered,
        not_sent=not_sent,
        lines_past_max_requests=lines_past_max_requests,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _kinds(summary: WorkloadSummary) -> str:
    """`` (http_500: 3, timeout: 1)``: what the errors were, so a refused connection, a
    server's 500 and a timeout are told apart; empty without errors."""
    if not summary.errors_by_kind:
        return ""
    return " (" + ", ".join(f"{kind}: {count}" for kind, count in summary.errors_by_kind) + ")"


def _past(summary: WorkloadSummary) -> str:
    """``, 40 lines past --max-requests`` (not read: records or not); empty for none."""
    if not summary.lines_past_max_requests:
        return ""
    return f", {summary.lines_past_max_requests} lines past --max-requests"


def summary_table(summary: WorkloadSummary, title: str = "understudy load") -> Table:
    """Sessions, turns and errors (by kind) in the caption; TTFT / e2e p50 and p99 by turn
    depth."""
    table = Table(title=title, caption=(
        f"{summary.sessions} sessions ({summary.sessions_completed} completed), "
        f"{summary.turns} turns, {summary.errors} errors{_kinds(summary)}, "
        f"{summary.not_sent} not sent{_past(summary)}, {summary.wall_s:.1f} s"))
    for header in ("turn", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms",
                   "e2e p99 ms", "prompt tok", "cached tok"):
        table.add_column(header, justify="right", overflow="fold")  # never "reque…"
    for d in summary.by_depth:
        table.add_row(str(d.turn), str(d.turns), str(d.errors), _ms(d.ttft_p50_s),
                      _ms(d.ttft_p99_s), _ms(d.e2e_p50_s), _ms(d.e2e_p99_s),
                      _num(d.prompt_tokens_mean), _num(d.cached_tokens_mean))
    return table
