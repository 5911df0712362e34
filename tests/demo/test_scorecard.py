"""The scorecard's rendering and choice, on made-up cards (fast; the real run is
test_demo.py)."""

from __future__ import annotations

import io

from rich.console import Console

from demo import CandidateCard, Scorecard
from demo._scorecard import render, would_promote


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
