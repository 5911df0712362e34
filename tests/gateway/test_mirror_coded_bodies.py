"""A request body sent gzip- or deflate-coded: relayed as sent, read by the mirror.

Real aiohttp upstreams (aiohttp's server decodes a coded request body, as a backend behind
a decoding proxy would), a real aiohttp client sending the coded body to the gateway.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway._body_coding import MAX_DECODED_BODY_BYTES, decode, encode
from tests.utils import eventually, run_gateway, serving

ANSWER = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "Paris."}}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


@asynccontextmanager
async def _upstream(seen: list[dict[str, Any]]) -> AsyncIterator[str]:
    """A chat server that answers ANSWER and keeps each request's (decoded) body."""
    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(web.AppRunner(app)) as url:
        yield url


def _turn(depth: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Capital of France?"}]
    for i in range(depth):
        messages += [{"role": "assistant", "content": f"Paris ({i})."},
                     {"role": "user", "content": "And then?"}]
    return {"model": "m", "user": "alice@example.com", "messages": messages}


CODINGS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": lambda body: gzip.compress(body), "deflate": lambda body: zlib.compress(body)}


@pytest.mark.parametrize("coding", sorted(CODINGS))
async def test_a_coded_body_is_read_for_its_session_and_recorded(
        coding: str, tmp_path: Path) -> None:
    primary_seen: list[dict[str, Any]] = []
    candidate_seen: list[dict[str, Any]] = []
    record = tmp_path / "traffic.jsonl"
    async with _upstream(primary_seen) as primary_url, \
            _upstream(candidate_seen) as candidate_url, \
            run_gateway(primary_url, candidates=[{"name": "cand", "url": candidate_url,
                                                  "model": "cand-model"}],
                        record={"path": str(record)}) as gw:
        async with aiohttp.ClientSession() as client:
            for depth in (0, 1):
                async with client.post(
                        f"{gw.base_url}/chat/completions",
                        data=CODINGS[coding](orjson.dumps(_turn(depth))),
                        headers={"Content-Type": "application/json",
                                 "Content-Encoding": coding}) as response:
                    assert response.status == 200
                    assert (await response.json())["choices"][0]["message"]["content"] == \
                        "Paris."
        await eventually(lambda: len(gw.sink) == 2)
        exchanges = gw.sink.snapshot()
    # One session across the turns (the body's user, as for a plain body), each turn's depth.
    assert {e.session_key for e in exchanges} == {"u:alice@example.com"}
    assert sorted(e.turn_depth or 0 for e in exchanges) == [0, 1]
    assert all(e.requested_choices == 1 for e in exchanges)
    assert all(e.prompt_bytes == len(orjson.dumps(_turn(e.turn_depth or 0)))
               for e in exchanges)
    # The primary got the body as sent; the candidate its model rewrite, coded again.
    assert [b["model"] for b in primary_seen] == ["m", "m"]
    assert [b["model"] for b in candidate_seen] == ["cand-model", "cand-model"]
    assert [len(b["messages"]) for b in candidate_seen] == [1, 3]
    lines = [orjson.loads(line) for line in record.read_bytes().splitlines()]
    assert len(lines) == 2 and all(len(line["body"]["messages"]) in (1, 3) for line in lines)


async def test_a_coded_body_past_the_bound_is_relayed_as_sent_and_counted() -> None:
    seen: list[dict[str, Any]] = []
    bomb = _turn(0)
    bomb["messages"][0]["content"] = "x" * MAX_DECODED_BODY_BYTES  # ~8 KiB gzip-coded
    async with _upstream(seen) as primary_url, _upstream([]) as candidate_url, \
            run_gateway(primary_url, candidates=[{"name": "cand", "url": candidate_url}]) as gw:
        async with aiohttp.ClientSession() as client:
            for coding, body in (("gzip", gzip.compress(orjson.dumps(bomb))),
                                 ("gzip", b"not gzip at all"), ("br", b"\x0b\x02\x80")):
                async with client.post(f"{gw.base_url}/chat/completions", data=body,
                                       headers={"Content-Type": "application/json",
                                                "Content-Encoding": coding}) as response:
                    assert response.status in (200, 400, 413, 415, 500)
        counts = {reason: gw.metric("understudy_mirror_undecoded_total", reason=reason)
                  for reason in ("too_large", "corrupt", "unsupported")}
    assert counts == {"too_large": 1.0, "corrupt": 1.0, "unsupported": 1.0}


@pytest.mark.parametrize("body", [b"", b"{}", b'{"model": "m"}' * 1000])
@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate", " GZIP "])
def test_decode_undoes_encode(body: bytes, coding: str) -> None:
    assert decode(coding, encode(coding, body)).body == body


def test_decode_takes_raw_deflate_and_refuses_trailing_bytes() -> None:
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode("deflate", raw.compress(b"{}") + raw.flush()).body == b"{}"
    assert decode("gzip", gzip.compress(b"{}") + b"junk").reason == "corrupt"
    assert decode("gzip", gzip.compress(b"{}")[:-4]).reason == "corrupt"
    assert decode("gzip, gzip", gzip.compress(gzip.compress(b"{}"))).reason == "unsupported"
    assert decode("gzip", gzip.compress(b"x" * 101), limit=100).reason == "too_large"
    assert decode("gzip", gzip.compress(b"x" * 100), limit=100).body == b"x" * 100
