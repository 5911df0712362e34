"""``understudy demo`` end to end, smaller: the real model in every engine, the real
gateway and store, the official openai client; the scorecard must tell the three
candidates apart as the issue says."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from demo import DemoSpec, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_demo_tells_the_candidates_apart_and_promotes(tmp_path: Path) -> None:
    out = io.StringIO()
    card = run_demo(DemoSpec(sessions=6, turns=3, minutes=6, rate=1.0, min_samples=12,
                             workdir=tmp_path),
                    console=Console(file=out, width=160))
    cards = {c.name: c for c in card.cards}
    assert set(cards) == {"replica", "bidir-kv", "kivi-4", "kivi-2"}
    assert card.turns == 18 and card.sessions == 6
    # Exact engines answer exactly as the primary does; the worse one visibly does not.
    assert cards["replica"].exact_match == 1.0
    assert cards["bidir-kv"].exact_match == 1.0
    worse, kivi4 = cards["kivi-2"], cards["kivi-4"]
    assert worse.verdict == "FAIL"
    assert any(r.startswith("quality.") for r in worse.reasons), worse.reasons
    assert worse.similarity is not None and kivi4.similarity is not None
    assert worse.similarity < kivi4.similarity
    # The quantized engines hold a fraction of fp32's KV bytes per token.
    fp32 = cards["bidir-kv"].kv_bytes_per_token
    assert fp32 is not None and kivi4.kv_bytes_per_token is not None
    assert kivi4.kv_bytes_per_token < fp32 / 4 and worse.kv_bytes_per_token is not None
    assert worse.kv_bytes_per_token < kivi4.kv_bytes_per_token
    # The disaggregated engine reuses KV across turns: later turns' TTFT drops.
    later = [r for d, r in cards["bidir-kv"].ttft_ratio_by_depth.items() if d > 0]
    assert later and max(later) < 1.0, cards["bidir-kv"].ttft_ratio_by_depth
    # Every candidate reached a verdict; what passes is promoted through the admin API.
    assert cards["replica"].verdict == "-"  # the yardstick, not judged
    assert all(c.verdict in ("PASS", "MARGINAL", "FAIL") for c in card.cards
               if c.name != "replica"), [(c.name, c.verdict, c.reasons[:2]) for c in card.cards]
    if card.promoted is not None:
        assert card.routing is not None and card.routing["primary"]["name"] == card.promoted
    saved = json.loads((tmp_path / "scorecard.json").read_text())
    assert {c["name"] for c in saved["cards"]} == set(cards)
    assert "scorecard" in out.getvalue()
