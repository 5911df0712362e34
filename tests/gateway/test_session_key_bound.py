"""A session key a client sends (``X-Session-Id``, the body's ``user``) is held, and its
exchange stored, at a bounded size whatever its length (``_sampler`` rule 5)."""

from __future__ import annotations

import io

import aiohttp
import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from evaluators import Exchange, Observation
from evaluators.store._rows import build_record
from gateway._sampler import MAX_SESSION_KEY_CHARS, session_key
from tests.utils import eventually, run_gateway, run_sim

CHAT: dict[str, object] = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
OBSERVATION = Observation(
    request_id="r1", backend="primary", route="chat_completions", status=200, streamed=False,
    started_at=1_700_000_000.0, ttft_s=None, chunk_gaps_s=(), e2e_s=0.1, usage=None,
    finish_reason="stop", text="hi", tool_calls=(), model="m", bytes=10, truncated=False,
    error=None)


def _key(payload: dict[str, object] | None, **headers: str) -> str:
    return session_key(CIMultiDictProxy(CIMultiDict(headers)), payload, "X-Session-Id", "r1")


def test_a_long_session_key_is_a_digest_of_bounded_size() -> None:
    long_user, other_user = "u" * 1_000_000, "u" * 999_999 + "v"
    assert len(_key({**CHAT, "user": long_user})) <= MAX_SESSION_KEY_CHARS
    # The same on every call (every replica), distinct for distinct values and kinds.
    assert _key({**CHAT, "user": long_user}) == _key({**CHAT, "user": long_user})
    assert _key({**CHAT, "user": long_user}) != _key({**CHAT, "user": other_user})
    assert _key(CHAT, **{"X-Session-Id": long_user}) != _key({**CHAT, "user": long_user})
    # A key within the bound is kept as it was (no live session moves at an upgrade).
    fits = "s" * (MAX_SESSION_KEY_CHARS - 2)
    assert _key(CHAT, **{"X-Session-Id": fits}) == "h:" + fits
    assert len(_key(CHAT, **{"X-Session-Id": fits + "s"})) <= MAX_SESSION_KEY_CHARS
    # A header's bytes that are not UTF-8 (lone surrogates) are hashed, never raise.
    assert len(_key(CHAT, **{"X-Session-Id": "\udcff" * 500})) <= MAX_SESSION_KEY_CHARS


def test_a_session_key_is_bounded_as_the_store_keeps_it() -> None:
    """100 bytes that are not UTF-8 were a 102-character key kept whole, which the store
    escapes to 602 characters and refused (the exchange dropped as invalid)."""
    key = _key(CHAT, **{"X-Session-Id": "\udcff" * 100})
    assert key.startswith("h#")
    build_record(Exchange("r1", key, "chat_completions", "cand", OBSERVATION, OBSERVATION),
                 (), prompt=None, store_prompts=False, store_answers=False, queued_at=0.0,
                 hash_key=b"k" * 32)
    # UTF-8 text is kept as the store keeps it, whole.
    assert _key(CHAT, **{"X-Session-Id": "é" * 100}) == "h:" + "é" * 100


async def test_a_client_sending_a_huge_user_field_holds_no_copy_of_it_per_exchange() -> None:
    sessions: tuple[dict[str, str], ...] = ({"X-Session-Id": "s" * 6000}, {})
    async with run_sim() as primary, run_sim() as cand, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": cand.url}]) as gw, \
            aiohttp.ClientSession() as session:
        for headers in sessions:
            body = io.BytesIO(orjson.dumps({**CHAT, "user": "u" * 4_000_000}))
            async with session.post(gw.url + "/v1/chat/completions", data=body, headers={
                    **headers, "Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                await resp.read()
        await eventually(lambda: len(gw.sink) == len(sessions))
        exchanges = gw.sink.snapshot()
    # Before: the whole header (6,000 chars) and the whole user field (4,000,000), kept per
    # exchange in the join and in the evaluation queue (10,000 exchanges, counted, not
    # charged to the budget), then dropped by the store as an invalid record.
    assert [len(e.session_key) <= MAX_SESSION_KEY_CHARS for e in exchanges] == [True, True]
    for exchange in exchanges:
        build_record(exchange, (), prompt=None, store_prompts=False, store_answers=False,
                     queued_at=0.0, hash_key=b"k" * 32)
