"""A client's ``X-Request-Id`` of any length: relayed as sent, and its exchange joined,
scored and stored under an id of bounded size (``_sampler`` rule 6)."""

from __future__ import annotations

import aiohttp
from sqlalchemy import func, select

from evaluators.store import ExchangeRow, ScoreRow, create_engine
from gateway._sampler import MAX_REQUEST_ID_CHARS, exchange_request_id
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

CHAT: dict[str, object] = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
LONG_IDS = ("req-" + "0123456789" * 30, "req-" + "0123456789" * 30 + "x")
"""Two client ids past the store's 200 characters, alike in their first 300."""


def test_a_request_id_is_kept_within_the_bound_and_digested_past_it() -> None:
    fits = "i" * MAX_REQUEST_ID_CHARS
    assert exchange_request_id(fits) == fits
    assert exchange_request_id("0af7651916cd43dd8448eb211c80319c") == \
        "0af7651916cd43dd8448eb211c80319c"
    digests = {exchange_request_id(rid) for rid in (*LONG_IDS, fits + "i")}
    assert len(digests) == 3  # distinct ids stay distinct
    assert all(len(d) <= MAX_REQUEST_ID_CHARS and d.startswith("#") for d in digests)
    assert exchange_request_id(LONG_IDS[0]) == exchange_request_id(LONG_IDS[0])
    # A header's bytes that are not UTF-8 (lone surrogates) are stored as 6-character
    # escapes: 30 of them would be 180 characters, so such an id is digested.
    assert exchange_request_id("\udcff" * 30).startswith("#")
    assert exchange_request_id("é" * 30) == "é" * 30


async def _chat(http: aiohttp.ClientSession, gw: RunningGateway, request_id: str) -> None:
    async with http.post(gw.url + "/v1/chat/completions", json=CHAT,
                         headers={"X-Request-Id": request_id}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == request_id  # relayed as the client sent it
        await resp.read()


async def test_an_exchange_with_a_long_request_id_is_scored_and_stored(db_url: str) -> None:
    """Before: the store refused a request id over 200 characters (InvalidRecord), so the
    exchange was dropped as invalid, its scores with it."""
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=4) as primary, \
            run_sim(ttft_ms=1, itl_ms=1, tokens=4) as cand, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": cand.url}],
                        evaluation={"enabled": True, "store": {"url": db_url}}) as gw, \
            aiohttp.ClientSession() as http:
        for request_id in LONG_IDS:
            await _chat(http, gw, request_id)
        scorekeeper = gw.state.scorekeeper
        assert scorekeeper is not None

        def settled() -> bool:
            stats = scorekeeper.writer_stats
            return stats is not None and stats.written_records + sum(
                stats.dropped.values()) >= len(LONG_IDS)

        await eventually(settled, within_s=30)
        stats = scorekeeper.writer_stats
        assert stats is not None
        assert stats.written_records == len(LONG_IDS), stats
        assert sum(stats.dropped.values()) == 0, stats.dropped
    # Both backends were sent the client's id as it came.
    for backend in (primary, cand):
        assert [r.headers["X-Request-Id"] for r in backend.stats.requests] == list(LONG_IDS)
    engine = create_engine(db_url)
    try:
        async with engine.connect() as connection:
            stored = set((await connection.execute(select(ExchangeRow.request_id))).scalars())
            scores = (await connection.execute(
                select(func.count()).select_from(ScoreRow))).scalar_one()
    finally:
        await engine.dispose()
    assert stored == {exchange_request_id(rid) for rid in LONG_IDS}
    assert scores > 0


async def test_a_long_request_id_still_joins_and_is_still_a_duplicate() -> None:
    """A reused long id is refused while its first request's join is open, as a short one
    is (``_mirror`` rule 2); the primary's answer and the candidate's pair under one id."""
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=4) as primary, \
            run_sim(ttft_ms=400, itl_ms=1, tokens=4) as cand, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": cand.url}]) as gw, \
            aiohttp.ClientSession() as http:
        for request_id in (LONG_IDS[0], LONG_IDS[0], LONG_IDS[1]):
            await _chat(http, gw, request_id)
        await eventually(lambda: len(gw.sink) == 2)
        exchanges = gw.sink.snapshot()
        assert gw.metric("understudy_mirror_dropped_total", candidate="cand",
                         reason="duplicate_id") == 1
    assert sorted(e.request_id for e in exchanges) == sorted(
        exchange_request_id(rid) for rid in LONG_IDS)
    for exchange in exchanges:
        assert exchange.primary.request_id == exchange.candidate_observation.request_id == \
            exchange.request_id
        assert exchange.primary.ok and exchange.candidate_observation.ok
