"""The store's side of rates (``evaluators._report`` rule 6): a rate metric's values are
counted in the store over the whole window, past the cap on the values the other metrics
read, so a rate can be ruled within its limit where the cap would never allow it (SQLite
and PostgreSQL)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import numpy as np
import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import Gates, Outcome, Score, build_report
from evaluators._rates import RateCounts
from evaluators.store import (
    ScoreRow,
    ScoreWriter,
    load_samples,
    load_value_counts,
    session_factory,
)
from gateway._cli_eval import _print as print_report
from tests.evaluators.test_store import make_exchange, quick_config, written

SUCCESS = "reliability.success"
JSON_VALID = "quality.json_valid"
TTFT = "latency.ttft_s"


async def _store(engine: AsyncEngine, scores: list[list[Score]], first: int = 0) -> None:
    """One exchange per list of scores, request ids from ``first`` on."""
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        for i, exchange_scores in enumerate(scores, start=first):
            assert writer.submit(make_exchange(f"r{i}"), exchange_scores)
        await written(writer, len(scores))


async def test_a_rate_reads_the_whole_window_past_the_cap(engine: AsyncEngine,
                                                          capsys: pytest.CaptureFixture[str],
                                                          ) -> None:
    """400 exchanges without errors on either side, the cap at 50: the latency reads the
    newest 50, the rate all 400, which rule a 3-point worsening out (about 175 a side
    needed). Capped at 50 it was INCONCLUSIVE, asking for values the cap never gave."""
    await _store(engine, [[Score(SUCCESS, 1.0, 1.0), Score(TTFT, 0.2 + i / 1e4, 0.2)]
                          for i in range(400)])
    gates = Gates(max_judged_exchanges=50, max_error_rate_increase=0.03)
    async with session_factory(engine)() as session:
        report = await build_report(session, "cand-a", gates, record=False)
    assert report.capped_at == 50
    assert report.samples == {TTFT: 50, SUCCESS: 400}
    metric = report.verdict.metric(SUCCESS)
    assert metric.rates is not None
    assert (metric.rates.n_candidate, metric.rates.n_baseline) == (400, 400)
    assert metric.outcome is Outcome.PASS, metric.reasons
    assert "over the whole window (400/400 against 400/400" in metric.reasons[0]
    assert metric.statistics is None  # a rate's figures are its counts, no bootstrap
    data = report.to_dict()
    assert data["rates_counted"] == [SUCCESS] and data["rates_since"] is None
    json.dumps(data, allow_nan=False)  # what the admin API answers
    print_report(report)  # the CLI's scorecard renders a rate without a bootstrap
    out = " ".join(capsys.readouterr().out.split())
    assert "judged the newest 50 scored exchanges" in out
    assert f"rates counted over the whole window, n per metric as shown: {SUCCESS}" in out
    assert "+0.0 pts" in out


async def test_the_scorecard_names_the_gates_confidence(engine: AsyncEngine,
                                                       capsys: pytest.CaptureFixture[str],
                                                       ) -> None:
    """The intervals' column says the confidence they are at; it said 98 % whatever the
    gates' ``confidence``."""
    await _store(engine, [[Score(SUCCESS, 1.0, 1.0), Score(TTFT, 0.2 + i / 1e4, 0.2)]
                          for i in range(40)])
    async with session_factory(engine)() as session:
        report = await build_report(session, "cand-a", Gates(confidence=0.9), record=False)
    print_report(report)
    out = capsys.readouterr().out
    assert "[90% CI]" in out and "98%" not in out


async def test_the_window_as_asked_bounds_the_counts(engine: AsyncEngine) -> None:
    """The counts start where the window was asked to, not where the cap moved it."""
    await _store(engine, [[Score(SUCCESS, 1.0, 0.0)] for _ in range(5)])
    since = datetime.now(UTC)
    await _store(engine, [[Score(SUCCESS, 0.0, 1.0)] for _ in range(7)], first=5)
    async with session_factory(engine)() as session:
        report = await build_report(session, "cand-a", Gates(max_judged_exchanges=3),
                                    since=since, record=False)
        counts = await load_value_counts(session, "cand-a", [SUCCESS], since=since)
    assert counts[SUCCESS].candidate == (7, 0, 0) and counts[SUCCESS].primary == (7, 7, 0)
    assert report.rates_since == since and report.capped_at == 3
    rates = report.verdict.metric(SUCCESS).rates
    assert rates is not None and (rates.ones_candidate, rates.n_candidate) == (0, 7)


async def test_the_counts_are_those_of_the_values_read(engine: AsyncEngine) -> None:
    """Counted in SQL as the values are counted when read: unknown values (NULL, NaN, an
    infinity) left out, 0.5 neither a 0 nor a 1."""
    rng = np.random.default_rng(3)
    values = [[Score(SUCCESS, float(rng.random() < 0.9), float(rng.random() < 0.95)),
               Score(JSON_VALID, float(rng.choice([0.0, 1.0, 0.5])),
                     None if i % 7 == 0 else float(rng.random() < 0.8))]
              for i in range(120)]
    await _store(engine, values)
    async with session_factory(engine)() as session, session.begin():
        ids = list((await session.execute(
            select(ScoreRow.id).where(ScoreRow.metric == SUCCESS).order_by(ScoreRow.id)
        )).scalars())
        for row, column, value in ((ids[0], ScoreRow.candidate_value, math.nan),
                                   (ids[1], ScoreRow.primary_value, math.inf),
                                   (ids[2], ScoreRow.candidate_value, -math.inf)):
            await session.execute(update(ScoreRow).where(ScoreRow.id == row)
                                  .values({column: value}))
    async with session_factory(engine)() as session:
        counts = await load_value_counts(session, "cand-a", [SUCCESS, JSON_VALID, TTFT])
        samples = await load_samples(session, "cand-a", [SUCCESS, JSON_VALID])
    assert set(counts) == {SUCCESS, JSON_VALID}  # a metric without rows is absent
    for metric in (SUCCESS, JSON_VALID):
        for counted, listed in zip(counts[metric], samples[metric], strict=True):
            assert RateCounts(*counted) == RateCounts.of(listed), metric
    assert counts[SUCCESS].candidate.n == 118 and counts[SUCCESS].primary.n == 119
    assert counts[JSON_VALID].candidate.others > 0 and counts[JSON_VALID].primary.n < 120


async def test_a_rate_with_other_values_is_not_judged_as_a_rate(engine: AsyncEngine) -> None:
    await _store(engine, [[Score(JSON_VALID, 0.5 if i % 3 == 0 else 1.0, 1.0)]
                          for i in range(60)])
    async with session_factory(engine)() as session:
        report = await build_report(session, "cand-a", Gates(), record=False)
    metric = report.verdict.metric(JSON_VALID)
    assert metric.outcome is Outcome.INCONCLUSIVE
    assert "not judged as a rate" in metric.reasons[0]
    assert report.samples[JSON_VALID] == 60


async def test_a_replica_at_the_same_rate_is_a_rates_baseline(engine: AsyncEngine) -> None:
    """Mirrored at the candidate's rate, the replica's own errors are the baseline of the
    candidate's (the report's rule 4), counted over the whole window as the candidate's
    are: a candidate failing 5 % of requests at a tenth of the load, where the replica at
    that load fails none and the loaded primary 10 %, PASSed against the primary."""
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        for i in range(600):
            assert writer.submit(make_exchange(f"c{i}"),
                                 [Score(SUCCESS, float(i % 20 != 0), float(i % 10 != 0))])
            assert writer.submit(make_exchange(f"s{i}", "replica"),
                                 [Score(SUCCESS, 1.0, float(i % 10 != 0))])
        await written(writer, 1200)
    gates = Gates(max_judged_exchanges=50)
    async with session_factory(engine)() as session:
        same_rate = await build_report(session, "cand-a", gates, secondary="replica",
                                       record=False, replica_at_same_rate=True)
        primary = await build_report(session, "cand-a", gates, secondary="replica",
                                     record=False)
    metric = same_rate.verdict.metric(SUCCESS)
    assert metric.basis == "replica at the same rate"
    assert metric.outcome is Outcome.FAIL, metric.reasons
    assert "(570/600 against 600/600" in metric.reasons[0]
    assert metric.rates is not None and metric.rates.n_baseline == 600  # past the cap
    against_primary = primary.verdict.metric(SUCCESS)
    assert against_primary.basis == "primary"
    assert against_primary.outcome is Outcome.PASS, against_primary.reasons
