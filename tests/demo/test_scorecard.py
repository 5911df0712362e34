"""The scorecard's rendering and choice, on made-up cards (fast; the real run is
test_demo.py)."""

from __future__ import annotations

import io

from rich.console import Console

from demo import CandidateCard, Scorecard
from demo._scorecard import card_from_report, render, would_promote


def _card(name: str, verdict: str, ttft: float, reasons: tuple[str, ...] = ()) -> CandidateCard:
    return CandidateCard(name, "a [dim] description", verdict, reasons, 30, 0.9, 1.0, 0.5,
                         {0: ttft, 1: ttft / 2}, {0: 1.0}, 1.0, 0.01, 0.5, 5040.0)


def test_every_verdict_and_text_renders_as_written() -> None:
    """Verdicts, names and reasons are text, never markup: brackets in them are shown."""
    cards = [_card("replica", "-", 1.0), _card("a", "PASS", 0.5),
             _card("b", "FAIL", 0.4, ("quality.x: mean [0.1, 0.2] below [/]",)),
             _card("c", "SOMETHING NEW", 0.9)]
    out = io.StringIO()
    render(Console(file=out, width=160), Scorecard(cards, turns=60, sessions=20), "replica")
    text = out.getvalue()
    assert "quality.x: mean [0.1, 0.2] below [/]" in text
    assert "a [dim] description" in text and "SOMETHING NEW" in text
    assert "0.50 0.25" in text  # TTFT ratios by turn


def test_the_passing_candidate_with_the_lowest_ttft_ratio_is_promoted() -> None:
    cards = [_card("replica", "-", 0.1), _card("slow", "PASS", 0.9), _card("fast", "PASS", 0.3),
             _card("faster", "FAIL", 0.1), _card("unsure", "MARGINAL", 0.2)]
    assert would_promote(cards, "replica") == "fast"
    assert would_promote([c for c in cards if c.verdict != "PASS"], "replica") is None


def test_the_scorecard_says_each_failing_family_quality_first() -> None:
    """Rule 4: the judge lists reasons worst first, then in metric order, so cost and latency
    can fill the first lines; the card orders them quality first among equal verdicts and the
    scorecard shows one line per family, then points to the report for the rest."""
    reasons = ["cost.usd: ratio 1.7", "cost.usd_per_mtok: ratio 1.7", "latency.e2e_s: p99 1.7",
               "quality.edit_similarity: beyond the floor", "quality.exact_match: beyond",
               "throughput.output_tps: slower", "quality.finish_reason_match: in the band"]
    verdicts = {"cost.usd": "FAIL", "cost.usd_per_mtok": "FAIL", "latency.e2e_s": "FAIL",
                "quality.edit_similarity": "FAIL", "quality.exact_match": "FAIL",
                "throughput.output_tps": "FAIL", "quality.finish_reason_match": "MARGINAL"}
    report = {"verdict": "FAIL", "reasons": reasons,
              "metrics": [{"metric": m, "verdict": v} for m, v in verdicts.items()]}
    card = card_from_report("worse", "", report, ttft_by_depth={}, itl_by_depth={},
                            turns_per_session=3.0, kv_bytes_per_token=None)
    assert card.reasons == (
        "quality.edit_similarity: beyond the floor", "quality.exact_match: beyond",
        "latency.e2e_s: p99 1.7", "throughput.output_tps: slower", "cost.usd: ratio 1.7",
        "cost.usd_per_mtok: ratio 1.7", "quality.finish_reason_match: in the band")
    out = io.StringIO()
    render(Console(file=out, width=200), Scorecard([_card("replica", "-", 1.0), card]),
           "replica")
    lines = [line.strip() for line in out.getvalue().splitlines()]
    shown = [line[2:] for line in lines if line.startswith("- ")]
    assert shown == ["quality.edit_similarity: beyond the floor", "latency.e2e_s: p99 1.7",
                     "throughput.output_tps: slower", "cost.usd: ratio 1.7"]
    assert "(+3 more in report-worse.json)" in lines
