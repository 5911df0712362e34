"""The demo's scorecard: per candidate, what the judge said and the numbers behind it.

Rules:
1. Everything shown comes from the gateway's admin report (verdict, reasons, quality against
   the noise floor, throughput, cost, cache hit rate), from the store (latency by turn
   depth) or from the engines' ``/metrics`` (KV bytes per token): the demo computes ratios,
   never a verdict of its own.
2. Latency by turn depth is the ratio of medians, candidate over primary, per depth; the
   replica's own row shows what load alone does to that ratio.
3. What the demo would promote: among the candidates the judge PASSes, the one with the
   lowest TTFT ratio (nothing when none passes).
4. A card keeps every reason of the judge's, ordered by its metric's verdict (worst first),
   then by family -- quality, reliability, latency, throughput, cost: what a switch must not
   lose first -- then as the judge listed them. The printed scorecard shows the first reason
   of each family and points to the report for the rest: a candidate that fails on quality
   and on cost says both, whichever the judge's metric order put first.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["CandidateCard", "Scorecard", "card_from_report", "render", "would_promote"]

SIMILARITY = "quality.semantic_similarity"
EXACT = "quality.exact_match"
TTFT = "latency.ttft_s"
ITL = "latency.itl_mean_s"
THROUGHPUT = "throughput.output_tps"
COST = "cost.usd"
FAMILIES = ("quality", "reliability", "latency", "throughput", "cost")
"""Rule 4's order of metric families (a metric's family is its name up to the first dot)."""
_SEVERITY = {"FAIL": 3, "INCONCLUSIVE": 2, "MARGINAL": 1, "PASS": 0}
_STYLE = {"PASS": "green", "MARGINAL": "yellow", "FAIL": "red", "INCONCLUSIVE": "magenta"}


def _verdict(verdict: str) -> str:
    """``verdict`` in its colour (rich markup); the floor's "-" dimmed."""
    return f"[{_STYLE.get(verdict, 'dim')} bold]{escape(verdict)}[/]"


@dataclass(frozen=True, slots=True)
class CandidateCard:
    name: str
    description: str
    verdict: str
    reasons: tuple[str, ...]
    """The judge's reasons, in rule 4's order."""
    samples: int
    similarity: float | None
    similarity_floor: float | None
    exact_match: float | None
    ttft_ratio_by_depth: dict[int, float]
    itl_ratio_by_depth: dict[int, float]
    throughput_ratio: float | None
    cost_per_session_usd: float | None
    cache_hit_rate: float | None
    kv_bytes_per_token: float | None


@dataclass
class Scorecard:
    cards: list[CandidateCard] = field(default_factory=list)
    promoted: str | None = None
    promotion: dict[str, Any] | None = None
    routing: dict[str, Any] | None = None
    wall_s: float = 0.0
    turns: int = 0
    sessions: int = 0
    cpu: str = ""
    """How the deployments shared the machine's CPU (``_cpu_slices``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _metric(report: Mapping[str, Any], name: str) -> dict[str, Any]:
    for metric in report.get("metrics", []):
        if metric.get("metric") == name:
            stats = metric.get("statistics")
            return stats if isinstance(stats, dict) else {}
    return {}


def _family(reason: str) -> str:
    """The family of a reason's metric: ``quality`` of ``quality.exact_match: ...``."""
    return reason.partition(":")[0].partition(".")[0]


def _ordered_reasons(report: Mapping[str, Any]) -> tuple[str, ...]:
    """Rule 4's order of the report's reasons."""
    severity = {m.get("metric"): _SEVERITY.get(str(m.get("verdict")), 0)
                for m in report.get("metrics") or ()}
    rank = {family: i for i, family in enumerate(FAMILIES)}
    reasons = [str(r) for r in report.get("reasons") or ()]
    return tuple(sorted(reasons, key=lambda r: (-severity.get(r.partition(":")[0], 0),
                                                rank.get(_family(r), len(rank)))))


def _headline(reasons: Sequence[str]) -> tuple[str, ...]:
    """Rule 4: the first reason of each family, in the card's order."""
    first: dict[str, str] = {}
    for reason in reasons:
        first.setdefault(_family(reason), reason)
    return tuple(first.values())


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median_ratio(by_depth: Mapping[int | None, tuple[Sequence[float], Sequence[float]]],
                  ) -> dict[int, float]:
    out = {}
    for depth, (candidate, primary) in sorted(by_depth.items(), key=lambda x: x[0] or 0):
        if depth is not None and candidate and primary:
            ratio = _ratio(statistics.median(candidate), statistics.median(primary))
            if ratio is not None:
                out[depth] = ratio
    return out


def card_from_report(name: str, description: str, report: Mapping[str, Any], *,
                     ttft_by_depth: Mapping[int | None, tuple[Sequence[float], Sequence[float]]],
                     itl_by_depth: Mapping[int | None, tuple[Sequence[float], Sequence[float]]],
                     turns_per_session: float, kv_bytes_per_token: float | None,
                     judged: bool = True) -> CandidateCard:
    """Rule 1; the noise floor's own card is not ``judged`` (its verdict is not shown: it
    is the yardstick, not a candidate)."""
    similarity = _metric(report, SIMILARITY)
    floor = similarity.get("noise_floor") or {}
    throughput = _metric(report, THROUGHPUT)
    cost = _metric(report, COST).get("mean_candidate")
    hit = ((report.get("conditions") or {}).get("cache") or {}).get("hit_rates") or {}
    samples = report.get("samples") or {}
    return CandidateCard(
        name=name, description=description,
        verdict=str(report.get("verdict")) if judged else "-",
        reasons=_ordered_reasons(report) if judged else (),
        samples=max(samples.values(), default=0),
        similarity=similarity.get("mean"), similarity_floor=floor.get("mean_baseline"),
        exact_match=_metric(report, EXACT).get("mean"),
        ttft_ratio_by_depth=_median_ratio(ttft_by_depth),
        itl_ratio_by_depth=_median_ratio(itl_by_depth),
        throughput_ratio=_ratio(throughput.get("median_candidate"),
                                throughput.get("median_baseline")),
        cost_per_session_usd=None if cost is None else cost * turns_per_session,
        cache_hit_rate=(hit.get("candidate") or {}).get("hit_rate"),
        kv_bytes_per_token=kv_bytes_per_token)


def would_promote(cards: Sequence[CandidateCard], replica: str) -> str | None:
    """Rule 3."""
    passing = [c for c in cards if c.verdict == "PASS" and c.name != replica]

    def ttft(card: CandidateCard) -> float:
        ratios = list(card.ttft_ratio_by_depth.values())
        return statistics.fmean(ratios) if ratios else float("inf")

    return min(passing, key=ttft).name if passing else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _by_turn(ratios: Mapping[int, float], depths: Sequence[int]) -> str:
    return " ".join(_fmt(ratios.get(d), ".2f") for d in depths)


def render(console: Console, card: Scorecard, replica: str) -> None:
    depths = sorted({d for c in card.cards for d in (*c.ttft_ratio_by_depth,
                                                     *c.itl_ratio_by_depth)})
    turns = " ".join(str(d) for d in depths)
    table = Table(title=f"scorecard: {card.sessions} sessions, {card.turns} turns, "
                        f"{card.wall_s:.0f} s")
    for column in ("candidate", "verdict", "n", "similarity\n(floor)", "exact",
                   f"TTFT x\nturn {turns}", f"ITL x\nturn {turns}", "tok/s x",
                   "$ / session", "cache\nhit", "KV B\n/token"):
        table.add_column(column, justify="left" if column in ("candidate", "verdict")
                         else "right")
    for c in card.cards:
        name = escape(c.name) + (f"\n[dim]{escape(c.description)}[/]" if c.description else "")
        table.add_row(
            name, _verdict(c.verdict), str(c.samples),
            f"{_fmt(c.similarity, '.3f')}\n({_fmt(c.similarity_floor, '.3f')})",
            _fmt(c.exact_match, ".0%"), _by_turn(c.ttft_ratio_by_depth, depths),
            _by_turn(c.itl_ratio_by_depth, depths), _fmt(c.throughput_ratio, ".2f"),
            _fmt(c.cost_per_session_usd, ".1e"), _fmt(c.cache_hit_rate, ".0%"),
            _fmt(c.kv_bytes_per_token, ",.0f"))
    console.print(table)
    console.print(f"[dim]x: candidate / primary medians (TTFT and ITL per turn depth); "
                  f"{replica} is a replica of the primary mirrored like the candidates: the "
                  "noise floor, and what load alone does to the ratios[/]")
    if card.cpu:
        console.print(f"[dim]CPU: {escape(card.cpu)}[/]")
    for c in card.cards:
        if c.name == replica:
            continue
        console.print(f"[bold]{escape(c.name)}[/]: {_verdict(c.verdict)}")
        shown = _headline(c.reasons)
        for reason in shown:
            console.print(f"  - {escape(reason)}")
        if len(c.reasons) > len(shown):
            console.print(f"  [dim](+{len(c.reasons) - len(shown)} more in "
                          f"report-{escape(c.name)}.json)[/]")
