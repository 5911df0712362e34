"""Mirroring end to end over real sockets: the simulator as primary and as candidates."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway._metrics import GatewayMetrics
from tests.utils import eventually, run_gateway, run_sim

CHAT: list[ChatCompletionMessageParam] = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three prime numbers."}]


def _candidate(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": url, **extra}


async def _chat(client: openai.AsyncOpenAI, stream: bool, user: str | openai.Omit = openai.omit
                ) -> str:
    if not stream:
        answer = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                      user=user)
        return answer.choices[0].message.content or ""
    pieces = []
    async for chunk in await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                            stream=True, user=user):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces)


def _mirror_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t.get_name().startswith("mirror-")}


async def test_every_sampled_request_yields_a_joined_pair() -> None:
    async with run_sim(ttft_ms=5, itl_ms=2, tokens=8) as primary, \
            run_sim(ttft_ms=15, itl_ms=4, tokens=8, variant="b") as cand, \
            run_gateway(primary.url, candidates=[_candidate("b", cand.url)]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="secret-key")
        for i in range(6):
            await _chat(client, stream=i % 2 == 0, user=f"user-{i}")
        await client.close()
        await eventually(lambda: len(gw.sink) == 6)
        for exchange in gw.sink.snapshot():
            p, c = exchange.primary, exchange.candidate_observation
            assert p.ok and c.ok and p.request_id == c.request_id == exchange.request_id
            assert c.backend == "b" and p.backend == "primary"
            assert c.text and p.text and c.text != p.text  # variant b answers differently
            assert c.usage is not None and c.usage == p.usage
            if c.streamed:
                assert c.ttft_s is not None and c.ttft_s >= 0.015
                assert len(c.chunk_gaps_s) >= 5  # inter-token latency is measured
        # Credentials are not forwarded to candidates by default.
        assert all("Authorization" not in r.headers for r in cand.stats.requests)
        assert all("Authorization" in r.headers for r in primary.stats.requests)
        assert gw.metric("understudy_mirror_joined_total", candidate="b") == 6
        await eventually(lambda: gw.state.mirror.budget.used == 0)
        assert len(gw.state.mirror.joiner) == 0


async def test_session_sampling_mirrors_whole_conversations() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand, \
            run_gateway(primary.url, candidates=[_candidate("c", cand.url, sample_rate=0.5)]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        sessions = [f"s{i}" for i in range(16)]
        for turn in range(3):
            for session in sessions:
                await client.chat.completions.create(
                    model="sim-model", messages=[*CHAT, {"role": "user", "content": str(turn)}],
                    extra_headers={"X-Session-Id": session})
        await client.close()
        mirror = gw.state.mirror
        await eventually(lambda: mirror.budget.used == 0 and len(mirror.joiner) == 0)
        turns_by_session: dict[str, int] = {}
        for request in cand.stats.requests:
            sid = request.headers["X-Session-Id"]
            turns_by_session[sid] = turns_by_session.get(sid, 0) + 1
        assert set(turns_by_session.values()) == {3}  # all turns or none
        assert 3 <= len(turns_by_session) <= 13
        not_sampled = gw.metric("understudy_mirror_dropped_total", candidate="c",
                                reason="not_sampled")
        assert not_sampled == 3 * (16 - len(turns_by_session))


FAULTS: dict[str, dict[str, Any]] = {
    "5xx": {"fault": "error", "error_status": 503},
    "hang_before_first_byte": {"fault": "hang_before_first_byte"},
    "hang_mid_stream": {"fault": "hang_mid_stream", "fault_after_chunks": 2},
    "reset_mid_stream": {"fault": "reset_mid_stream", "fault_after_chunks": 2},
    "malformed": {"fault": "malformed_chunks"},
}


@pytest.mark.parametrize("fault", ["down", *FAULTS])
async def test_faulty_candidate_never_hurts_the_primary(fault: str) -> None:
    before = _mirror_tasks()
    async with run_sim(ttft_ms=2, itl_ms=1, tokens=6) as primary, \
            run_sim(ttft_ms=2, itl_ms=1, tokens=6, **FAULTS.get(fault, {})) as cand:
        url = cand.url
        if fault == "down":
            await cand.app.shutdown()
            url = "http://127.0.0.1:9"  # discard port: nothing listens
        candidate = _candidate("bad", url, first_byte_timeout_s=0.3, idle_timeout_s=0.3,
                               max_concurrency=2)
        async with run_gateway(primary.url, candidates=[candidate],
                               mirror={"drain_timeout_s": 0.2}) as gw:
            direct = openai.AsyncOpenAI(base_url=primary.base_url, api_key="x")
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
            expected = await _chat(direct, stream=True)
            answers = await asyncio.gather(*(_chat(client, stream=i % 2 == 0, user=f"u{i}")
                                             for i in range(10)))
            await client.close()
            await direct.close()
            assert answers == [expected] * 10
            assert gw.metric("understudy_requests_total", route="chat_completions",
                             status="200") == 10
            if fault != "malformed":  # the candidate's failures are counted as such
                await eventually(lambda: _failures(gw.state.metrics) > 0)
            mirror = gw.state.mirror
        # After the gateway stopped: nothing leaks.
        assert mirror.budget.used == 0 and mirror.budget.interned == 0
        assert len(mirror.joiner) == 0
        assert _mirror_tasks() == before


def _failures(metrics: GatewayMetrics) -> float:
    return sum(s.value for m in metrics.mirror_failed.collect()
               for s in m.samples if s.name.endswith("_total"))


async def test_overloaded_stalled_candidate_drops_and_counts(
        caplog: pytest.LogCaptureFixture) -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(fault="hang_before_first_byte") as cand, \
            run_gateway(primary.url, candidates=[_candidate("slow", cand.url, max_concurrency=1,
                                                            buffer_items=3)],
                        mirror={"drain_timeout_s": 0.1}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        for i in range(20):
            await client.chat.completions.create(model="sim-model", messages=CHAT, user=f"u{i}")
        await client.close()
        assert gw.metric("understudy_mirror_queued_total", candidate="slow") == 4
        assert gw.metric("understudy_mirror_dropped_total", candidate="slow",
                         reason="buffer_full") == 16
        assert len(gw.state.mirror.candidates["slow"].buffer) == 3
        mirror = gw.state.mirror
    assert mirror.budget.used == 0
    assert gw.metric("understudy_mirror_dropped_total", candidate="slow", reason="shutdown") == 4
    # The counter ends with the process: the stop says it in the log too.
    (said,) = [r for r in caplog.records if r.name == "understudy.mirror"
               and r.levelname == "WARNING" and "shutdown" in r.getMessage()]
    assert said.getMessage().startswith("candidate 'slow': 4 mirrored requests dropped at "
                                        "shutdown"), said.getMessage()


async def test_identical_queued_requests_are_deduplicated() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(fault="hang_before_first_byte") as cand, \
            run_gateway(primary.url, candidates=[_candidate("slow", cand.url, max_concurrency=1)],
                        mirror={"drain_timeout_s": 0.1}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        for _ in range(4):
            await client.chat.completions.create(model="sim-model", messages=CHAT, seed=1)
        await client.close()
        # The first is taken by the worker, the second queued, the rest are duplicates of it.
        assert gw.metric("understudy_mirror_dropped_total", candidate="slow",
                         reason="dedup") == 2


async def test_credentials_and_model_rewrite_are_per_candidate() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2, model="cand-model") as cand, \
            run_gateway(primary.url, candidates=[_candidate(
                "c", cand.url, forward_credentials=True, model="cand-model")]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="tok-123")
        await _chat(client, stream=False)
        await client.close()
        await eventually(lambda: len(gw.sink) == 1)
        request = cand.stats.requests[-1]
        assert request.headers["Authorization"] == "Bearer tok-123"
        assert isinstance(request.body, dict) and request.body["model"] == "cand-model"


async def test_unmirrored_routes_are_counted() -> None:
    async with run_sim() as primary, run_sim() as cand, \
            run_gateway(primary.url, candidates=[_candidate("c", cand.url)]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        await client.models.list()
        await client.close()
        assert gw.metric("understudy_mirror_dropped_total", candidate="c", reason="route") == 1
        assert cand.stats.requests_seen == 0


async def test_requests_reusing_a_request_id_are_never_paired_with_each_other() -> None:
    """The join is keyed by the request id, which a client may send. Four requests under one
    ``X-Request-Id`` at once were all replayed, one was joined (with whichever primary answer
    came first) and three were lost, counted nowhere. Now one is mirrored and joined with its
    own answer; the others are counted ``duplicate_id``. (The candidate answers after a
    second, so the first is still being joined when the last arrives, on a busy machine too.)"""
    async with run_sim(ttft_ms=5, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=1000, itl_ms=0, tokens=2) as cand, \
            run_gateway(primary.url, candidates=[_candidate("c", cand.url,
                                                            max_concurrency=4)]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        prompts = [f"question {i}" for i in range(4)]
        await asyncio.gather(*(client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": prompt}],
            extra_headers={"X-Request-Id": "same-id"}) for prompt in prompts))
        await client.close()
        mirror = gw.state.mirror
        await eventually(lambda: len(mirror.joiner) == 0 and mirror.budget.used == 0)
        queued = gw.metric("understudy_mirror_queued_total", candidate="c")
        joined = gw.metric("understudy_mirror_joined_total", candidate="c")
        duplicates = gw.metric("understudy_mirror_dropped_total", candidate="c",
                               reason="duplicate_id")
        assert (queued, joined, duplicates) == (1, 1, 3)
        assert cand.stats.requests_seen == 1
        (exchange,) = gw.sink.snapshot()
        replayed = cand.stats.requests[0].body
        assert isinstance(replayed, dict)
        # The primary answer it is paired with is the one to the same prompt.
        direct = openai.AsyncOpenAI(base_url=primary.base_url, api_key="x")
        own = await direct.chat.completions.create(model="sim-model",
                                                   messages=replayed["messages"])
        await direct.close()
        assert exchange.primary.text == own.choices[0].message.content
