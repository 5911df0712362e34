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
