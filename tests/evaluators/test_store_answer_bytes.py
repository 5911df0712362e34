"""Answers and names a backend chose, with what a database refuses, are stored escaped.

A model's byte-fallback token ``<0x00>`` detokenizes to NUL, which PostgreSQL refuses in
text; a lone surrogate no driver can encode. Either lost the whole exchange, its scores
too, as ``rejected``.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import Exchange
from evaluators.store import ExchangeRow, ObservationRow, ScoreWriter, session_factory
from tests.evaluators.test_store import SCORES, make_exchange, make_observation, quick_config


async def test_nul_and_lone_surrogates_in_answers_and_names_are_stored_escaped(
        engine: AsyncEngine) -> None:
    odd = dataclasses.replace(make_observation("odd", "cand-a"), model="m\x00x",
                              finish_reason="st\x00op", error="cut \x00 here",
                              text="an\x00swer \ud800 😀")
    exchange = Exchange("odd", "session-1", "chat_completions", "cand-a",
                        make_observation("odd", "primary", text="fine"), odd)
    async with ScoreWriter(engine, quick_config(engine, store_answers=True,
                                                store_prompts=True)) as writer:
        assert writer.submit(exchange, SCORES, prompt="say \x00")
        assert writer.submit(make_exchange("plain"), SCORES)
    assert writer.stats.dropped["rejected"] == 0 and writer.stats.written_records == 2
    async with session_factory(engine)() as session:
        stored = (await session.scalars(
            select(ObservationRow).where(ObservationRow.model == "m\\x00x"))).one()
        prompt = (await session.scalars(
            select(ExchangeRow.prompt).where(ExchangeRow.request_id == "odd"))).one()
    assert stored.answer == "an\\x00swer \\ud800 😀"
    assert (stored.model, stored.finish_reason, stored.error) == (
        "m\\x00x", "st\\x00op", "cut \\x00 here")
    assert prompt == "say \\x00"


async def test_a_lone_surrogate_in_a_tool_call_costs_nothing_of_its_batch(
        engine: AsyncEngine) -> None:
    # On PostgreSQL the insert's JSON encoder (orjson) refused the surrogate: the batch,
    # every record of it, was dropped as "failed".
    calls = ({"name": "write\ud800", "arguments": '{"path": "a\ud83d"}'},)
    async with ScoreWriter(engine, quick_config(engine, store_answers=True)) as writer:
        assert writer.submit(make_exchange("before"), SCORES)
        assert writer.submit(make_exchange("odd", tool_calls=calls), SCORES)
        assert writer.submit(make_exchange("after"), SCORES)
    assert writer.stats.written_records == 3, writer.stats.dropped
    async with session_factory(engine)() as session:
        stored = (await session.scalars(
            select(ObservationRow.tool_calls).join(ExchangeRow)
            .where(ExchangeRow.request_id == "odd"))).all()
    assert [calls for calls in stored if calls] == [
        [{"name": "write\\ud800", "arguments": '{"path": "a\\ud83d"}'}]]


async def test_tool_calls_count_against_the_queues_text_bound(engine: AsyncEngine) -> None:
    # queue_text_chars bounds the stored text a writer holds; an answer that is only a
    # tool call (a file in its arguments) counted as no text at all, so during an outage
    # such records piled up past the bound.
    big_call = ({"name": "write_file", "arguments": "x" * 600},)
    config = quick_config(engine, store_answers=True, queue_text_chars=1000)
    async with ScoreWriter(engine, config, hold=True) as writer:  # held: nothing written
        assert writer.submit(make_exchange("first", text="", tool_calls=big_call), SCORES)
        assert not writer.submit(make_exchange("second", text="", tool_calls=big_call),
                                 SCORES)
        assert writer.submit(make_exchange("no-text", text=""), SCORES)
    assert writer.stats.dropped["queue_text"] == 1
