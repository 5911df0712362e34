"""The store's side of issue 13: the conditions each value was measured under, the
evaluated requests, and the all-traffic histograms (SQLite and PostgreSQL)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import Gates, Score, build_report
from evaluators.store import (
    TRAFFIC_SEEN,
    ScoreRow,
    ScoreWriter,
    TrafficCount,
    load_conditioned_samples,
    load_evaluated_requests,
    load_traffic,
    record_traffic,
    session_factory,
)
from tests.evaluators.test_store import make_exchange, make_observation, quick_config, written


async def test_conditions_are_stored_and_loaded_with_their_values(engine: AsyncEngine) -> None:
    config = quick_config(engine)
    async with ScoreWriter(engine, config) as writer:
        for i in range(3):
            rid = f"r{i}"
            primary = dataclasses.replace(make_observation(rid, "primary"), concurrency=8 + i)
            candidate = dataclasses.replace(make_observation(rid, "cand-a"), concurrency=1)
            exchange = dataclasses.replace(
                make_exchange(rid, primary=primary), candidate_observation=candidate,
                prompt_bytes=100 * (i + 1), turn_depth=i)
            assert writer.submit(exchange, [Score("latency.ttft_s", 0.1 + i, 0.2 + i)])
        await written(writer, 3)
    async with session_factory(engine)() as session:
        loaded = await load_conditioned_samples(session, "cand-a", ["latency.ttft_s"])
        evaluated = await load_evaluated_requests(session, "cand-a")
    ttft = loaded["latency.ttft_s"]
    assert ttft.candidate == [0.1, 1.1, 2.1] and ttft.primary == [0.2, 1.2, 2.2]
    assert ttft.candidate_concurrency == [1, 1, 1] and ttft.primary_concurrency == [8, 9, 10]
    assert ttft.primary_prompt_tokens == [12, 12, 12]
    assert ttft.candidate_cached_tokens == [None, None, None]  # unknown stays unknown
    assert evaluated.prompt_bytes == [100, 200, 300] and evaluated.turn_depth == [0, 1, 2]
    assert evaluated.streamed == [True, True, True]


async def test_traffic_counts_add_up_across_flushes(engine: AsyncEngine) -> None:
    window = 1_764_633_600  # a whole minute
    first = [TrafficCount(window, "", TRAFFIC_SEEN, "size", "64", 3),
             TrafficCount(window, "cand-a", "buffer_full", "size", "512", 2)]
    second = [TrafficCount(window, "", TRAFFIC_SEEN, "size", "64", 4),
              TrafficCount(window, "cand-b", "buffer_full", "size", "512", 9)]
    for counts in (first, second):
        async with session_factory(engine)() as session, session.begin():
            await record_traffic(session, counts)
    async with session_factory(engine)() as session:
        loaded = sorted(await load_traffic(session, "cand-a"), key=lambda c: c.outcome)
    assert loaded == [TrafficCount(window, "cand-a", "buffer_full", "size", "512", 2),
                      TrafficCount(window, "", TRAFFIC_SEEN, "size", "64", 7)]


async def test_a_judgement_reads_the_newest_exchanges_up_to_the_cap(engine: AsyncEngine) -> None:
    """``evaluators._report`` rule 6: however many scores are stored, a report reads the
    newest ``max_judged_exchanges`` and says the cap moved its window's start."""
    config = quick_config(engine)
    async with ScoreWriter(engine, config) as writer:
        for i in range(45):
            rid = f"r{i}"
            assert writer.submit(make_exchange(rid), [Score("latency.ttft_s", float(i), 1.0)])
            await written(writer, i + 1)  # one by one: each its own created_at
    capped = Gates(max_judged_exchanges=30)
    async with session_factory(engine)() as session:
        report = await build_report(session, "cand-a", capped, record=False)
        uncapped = await build_report(session, "cand-a", Gates(), record=False)
    assert report.samples == {"latency.ttft_s": 30} and report.capped_at == 30
    assert report.since is not None and report.to_dict()["newest_exchanges_only"] == 30
    stats = report.to_dict()["metrics"][0]["statistics"]
    assert stats["median_candidate"] == 29.5  # the newest 30: 15..44
    assert uncapped.samples == {"latency.ttft_s": 45} and uncapped.capped_at is None


async def test_a_stored_value_that_is_no_finite_number_is_unknown(engine: AsyncEngine) -> None:
    """A score written as NaN or an infinity (PostgreSQL stored them so before the writer
    refused them, ``_rows`` rule 2) is read as unknown, like NULL: it made the judge's
    ``_as_sample`` raise, so the report (the CLI's, the admin API's) was a traceback."""
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        for i in range(40):
            assert writer.submit(make_exchange(f"r{i}"), [
                Score("latency.ttft_s", 0.2 + i / 1000, 0.2 + i / 1000),
                Score("quality.token_f1", 1.0, None)])
        await written(writer, 40)
    async with session_factory(engine)() as session, session.begin():
        def rows(metric: str) -> Any:
            return select(ScoreRow.id).where(ScoreRow.metric == metric).order_by(ScoreRow.id)
        ttft = list((await session.execute(rows("latency.ttft_s"))).scalars())
        f1 = list((await session.execute(rows("quality.token_f1"))).scalars())
        for row, column, value in ((ttft[0], ScoreRow.candidate_value, math.nan),
                                   (ttft[1], ScoreRow.primary_value, math.inf),
                                   (f1[0], ScoreRow.candidate_value, -math.inf)):
            await session.execute(update(ScoreRow).where(ScoreRow.id == row)
                                  .values({column: value}))
    async with session_factory(engine)() as session:
        report = await build_report(session, "cand-a", Gates(), record=False)
        loaded = await load_conditioned_samples(session, "cand-a", ["latency.ttft_s"])
    conditioned = loaded["latency.ttft_s"]
    assert (len(conditioned.candidate), len(conditioned.primary)) == (39, 39)
    assert len(conditioned.candidate_concurrency) == len(conditioned.primary_prompt_bytes) == 39
    assert report.samples == {"latency.ttft_s": 39, "quality.token_f1": 39}
    assert report.verdict.metric("latency.ttft_s").statistics is not None
    json.dumps(report.to_dict(), allow_nan=False)
