"""A client's ``X-Request-Id`` of any length: relayed as sent, and its exchange joined,
scored and stored under an id of bounded size (``_sampler`` rule 6)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from sqlalchemy import func, select

from evaluators.store import ExchangeRow, ScoreRow, create_engine
from gateway._sampler import MAX_REQUEST_ID_CHARS, exchange_request_id
from tests.utils import RunningGateway, answering_once, eventually, run_gateway, run_sim

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


NOT_UTF8_IDS = (b"req-\xff\xfe-1", b"req-\xc3\xa9-2", b"req-\xe9-3")
"""Ids whose bytes are not all ASCII: not UTF-8, UTF-8 (an e acute), Latin-1."""


async def _exchange_raw(port: int, request: bytes, *,
                        after: bytes = b"") -> tuple[list[bytes], bytes]:
    """Send ``after`` (a request answered first, on the same connection) and then
    ``request`` (which asks to close); the last answer's head lines, as bytes, and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if after:
            writer.write(after)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n"), body


def _chat_request(request_id: bytes) -> bytes:
    body = json.dumps(CHAT).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
            b"Content-Type: application/json\r\nX-Request-Id: " + request_id +
            b"\r\nContent-Length: " + str(len(body)).encode() +
            b"\r\nConnection: close\r\n\r\n" + body)


def _request_id_of(head: list[bytes]) -> bytes:
    ids = [line.partition(b":")[2].strip() for line in head
           if line.lower().startswith(b"x-request-id:")]
    assert len(ids) == 1, head
    return ids[0]


async def test_a_request_id_not_in_utf8_comes_back_as_the_client_sent_it() -> None:
    """The primary and the candidate were sent the id's bytes as they came, but the client
    got them back as '?' for each byte that is not UTF-8 (and an e acute sent as UTF-8
    back as Latin-1's one byte): RFC 9110 5.5 makes such octets opaque, and nginx and
    vLLM (Starlette's Latin-1 headers) give them back unchanged. Now every one of them
    gets the bytes the client sent, on a connection the front serves and on one handed
    to aiohttp (its first request /health), answered or refused (502)."""
    health = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=4) as primary, \
            run_sim(ttft_ms=1, itl_ms=1, tokens=4) as cand, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": cand.url}]) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        sent: list[bytes] = []
        for after in (b"", health):
            for request_id in NOT_UTF8_IDS:
                request_id += b"-handed" if after else b"-front"
                head, _ = await _exchange_raw(port, _chat_request(request_id), after=after)
                assert head[0].startswith(b"HTTP/1.1 200"), head
                assert _request_id_of(head) == request_id
                sent.append(request_id)
        await eventually(lambda: len(gw.sink) == len(sent), within_s=30)
        stored = {exchange.request_id for exchange in gw.sink.snapshot()}
    for backend in (primary, cand):
        got = [r.headers["X-Request-Id"].encode("utf-8", "surrogateescape")
               for r in backend.stats.requests]
        assert got == sent
    # The exchange is kept under the id as aiohttp read it (_sampler rule 6): its bytes.
    assert {rid.encode("utf-8", "surrogateescape") for rid in stored} == set(sent)
    async with answering_once(b"") as dead, run_gateway(dead) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        for after in (b"", health):
            head, body = await _exchange_raw(port, _chat_request(NOT_UTF8_IDS[0]), after=after)
            assert head[0].startswith(b"HTTP/1.1 502"), (head, body)
            assert _request_id_of(head) == NOT_UTF8_IDS[0]
            assert json.loads(body)["error"]["type"]
