"""The fault matrix (issue 12): each fault injected against a running gateway on loopback.

For every row: the client's status and an OpenAI-style body when the gateway answers for
itself; no 500 of the gateway's own; the mirroring budget back to zero, no request in
flight, the open file descriptors and asyncio tasks back to their baseline; every request
offered to a candidate joined or counted with a reason, and every exchange the store took
written or counted with a reason; ``/health`` telling the truth. The scoring child killed
and the store down at start are rows of their own (``tests/gateway/test_scoring_restart.py``,
``tests/gateway/test_store_at_start.py``). Every loop is bounded in count and time;
everything listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from multiprocessing import resource_tracker
from typing import Any

import aiohttp
import pytest

from evaluators.store import upgrade
from tests.tcp_relay import QUICK_RETRIES, relayed_database
from tests.utils import (
    RunningGateway,
    answering_once,
    eventually,
    free_port,
    run_gateway,
    run_sim,
)

REQUESTS = 4
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
QUICK_UPSTREAM = {"connect_timeout_s": 1.0, "first_byte_timeout_s": 1.0, "idle_timeout_s": 1.0}
QUICK_MIRROR = {"join_timeout_s": 5.0, "drain_timeout_s": 0.2}
CANDIDATE_TIMEOUTS = {"request_timeout_s": 1.0, **QUICK_UPSTREAM}
DROP_REASONS = ("route", "canary", "not_sampled", "paused", "dedup", "buffer_full", "budget",
                "shutdown", "removed", "internal", "join_timeout", "sink_full")


def _is_openai_error(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and {"message", "type", "code"} <= error.keys()


async def _ask(session: aiohttp.ClientSession, gw: RunningGateway, *, stream: bool,
               seed: int = 0) -> tuple[int, bytes]:
    """One request; the status and the body, or -1 when the answer was cut."""
    try:
        async with session.post(gw.url + "/v1/chat/completions",
                                json={**CHAT, "stream": stream, "seed": seed}) as r:
            return r.status, await r.read()
    except aiohttp.ClientPayloadError:
        return -1, b""


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_targets() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(targets)


@asynccontextmanager
async def _baseline() -> AsyncIterator[None]:
    """Open file descriptors and asyncio tasks after the row equal those before it (the
    multiprocessing resource tracker, one per test process for good, started first)."""
    resource_tracker.ensure_running()
    fds, tasks = _open_fds(), len(asyncio.all_tasks())
    yield
    try:
        await eventually(lambda: len(asyncio.all_tasks()) <= tasks, 10)
    except TimeoutError:
        pytest.fail(f"stray tasks: {sorted(map(repr, asyncio.all_tasks()))}")
    try:
        await eventually(lambda: _open_fds() <= fds, 10)
    except TimeoutError:
        pytest.fail(f"{_open_fds() - fds} file descriptors more than before: {_fd_targets()}")


async def _settled(gw: RunningGateway) -> None:
    """Budget and in-flight back to zero; every offered request joined or counted."""
    mirror = gw.state.mirror
    await eventually(lambda: mirror.budget.used == 0 and not mirror.joiner._pending, 10)
    assert gw.metric("understudy_requests_in_flight") == 0
    for name in mirror.candidates:
        queued = gw.metric("understudy_mirror_queued_total", candidate=name)
        joined = gw.metric("understudy_mirror_joined_total", candidate=name)
        dropped = sum(gw.metric("understudy_mirror_dropped_total", candidate=name, reason=r)
                      for r in DROP_REASONS)
        assert queued == joined + dropped - gw.metric(
            "understudy_mirror_dropped_total", candidate=name, reason="not_sampled"), name


async def _healthy(session: aiohttp.ClientSession, gw: RunningGateway) -> dict[str, Any]:
    async with session.get(gw.url + "/health") as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


# -- candidate faults: the client never notices ----------------------------------------------

CANDIDATE_FAULTS: dict[str, dict[str, Any]] = {
    "5xx": {"fault": "error"},
    "hang_before_first_byte": {"fault": "hang_before_first_byte"},
    "hang_mid_stream": {"fault": "hang_mid_stream"},
    "reset_mid_stream": {"fault": "reset_mid_stream"},
    "malformed_sse": {"fault": "malformed_chunks"},
    "slow_trickle": {"ttft_ms": 0, "itl_ms": 400, "tokens": 20},
}


@asynccontextmanager
async def _candidate(fault: str) -> AsyncIterator[str]:
    if fault in ("down", "garbage"):
        async with _primary(fault) as url:  # the same nothing / non-HTTP server
            yield url
        return
    async with run_sim(**CANDIDATE_FAULTS[fault]) as sim:
        yield sim.url


@pytest.mark.parametrize("fault", ["down", "garbage", *CANDIDATE_FAULTS])
async def test_candidate_fault_leaves_clients_untouched(fault: str) -> None:
    async with _baseline(), run_sim(ttft_ms=0, itl_ms=1, tokens=4) as primary, \
            _candidate(fault) as cand_url, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": cand_url,
                                                  **CANDIDATE_TIMEOUTS}],
                        mirror=QUICK_MIRROR) as gw, \
            aiohttp.ClientSession() as session:
        async with asyncio.timeout(30):
            answers = await asyncio.gather(*(_ask(session, gw, stream=i % 2 == 0, seed=i)
                                             for i in range(REQUESTS)))
        assert [status for status, _ in answers] == [200] * REQUESTS
        await eventually(lambda: gw.metric("understudy_mirror_joined_total", candidate="c")
                         == REQUESTS, 10)
        failed = [e.candidate_observation for e in gw.sink._items]
        # A slow trickle within the timeout is a slow success; malformed SSE events are
        # a 200 whose events the parser skips: the scorers judge that answer.
        if fault not in ("slow_trickle", "malformed_sse"):
            assert all(not o.ok for o in failed), [o.error for o in failed]
        await _settled(gw)
        assert (await _healthy(session, gw))["status"] == "ok"


# -- primary faults: the gateway answers for itself, in OpenAI JSON --------------------------

@pytest.mark.parametrize(("fault", "stream", "expected"), [
    ("down", False, 502),
    ("5xx", False, 503),            # the primary's own error, passed on as it came
    ("timeout", False, 504),
    ("timeout", True, 504),
    ("reset_mid_stream", True, -1),  # the answer had begun: cut, never ended cleanly
    ("garbage", False, 502),
])
async def test_primary_fault_answers(fault: str, stream: bool, expected: int) -> None:
    async with _baseline(), _primary(fault) as primary_url, \
            run_gateway(primary_url, primary=QUICK_UPSTREAM) as gw, \
            aiohttp.ClientSession() as session:
        async with asyncio.timeout(20):
            status, body = await _ask(session, gw, stream=stream)
        assert status == expected
        if status > 0:
            assert _is_openai_error(json.loads(body)), body
            assert b"127.0.0.1" not in body
        assert gw.metric("understudy_requests_total", route="chat_completions",
                         status="500") == 0
        await _settled(gw)
        assert (await _healthy(session, gw))["status"] == "ok"


@asynccontextmanager
async def _primary(fault: str) -> AsyncIterator[str]:
    if fault == "down":
        yield f"http://127.0.0.1:{free_port()}"
        return
    if fault == "garbage":
        async with answering_once(b"\x16\x03\x01 this is not HTTP at all\r\n\r\n") as url:
            yield url
        return
    sim_faults: dict[str, dict[str, object]] = {
        "5xx": {"fault": "error", "error_status": 503},
        "timeout": {"fault": "hang_before_first_byte"},
        "reset_mid_stream": {"fault": "reset_mid_stream", "tokens": 8}}
    async with run_sim(**sim_faults[fault]) as sim:
        yield sim.url


# -- client faults ----------------------------------------------------------------------------

async def test_client_disconnect_mid_stream_releases_everything() -> None:
    async with _baseline(), run_sim(ttft_ms=0, itl_ms=200, tokens=50) as primary, \
            run_sim() as cand, run_gateway(primary.url, candidates=[{"name": "c", "url": cand.url}],
                        mirror=QUICK_MIRROR) as gw, aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(gw.url + "/v1/chat/completions",
                                    json={**CHAT, "stream": True}) as r:
                assert r.status == 200
                await r.content.readany()
            # leaving the block closes the connection mid-answer
        await eventually(lambda: gw.metric("understudy_requests_in_flight") == 0, 5)
        assert gw.metric("understudy_requests_total", route="chat_completions",
                         status="200") == 3
        await _settled(gw)
        assert (await _healthy(session, gw))["status"] == "ok"


@pytest.mark.parametrize(("body", "headers", "expected"), [
    (b"x" * (64 * 1024 + 1), {}, 413),                          # oversized body
    (b"{}", {f"X-Pad-{i}": "v" * 1000 for i in range(40)}, 431),  # oversized headers
    (b'{"model": "sim-model", "messages": [', {}, 400),         # malformed JSON
    (b'{"model": "sim-\xff\xfe", "messages": []}', {}, 400),      # invalid UTF-8
])
async def test_client_bad_requests_get_openai_errors(body: bytes, headers: dict[str, str],
                                                     expected: int) -> None:
    async with _baseline(), run_sim() as primary, \
            run_gateway(primary.url, server={"max_body_bytes": 64 * 1024}) as gw, \
            aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json", **headers}) as r:
            assert r.status == expected
            assert _is_openai_error(await r.json(content_type=None))
        await _settled(gw)
        assert (await _healthy(session, gw))["status"] == "ok"


async def test_slowloris_is_bounded_and_counted() -> None:
    async with _baseline(), run_sim() as primary, \
            run_gateway(primary.url, server={"header_timeout_s": 0.5}) as gw, \
            aiohttp.ClientSession() as session:
        port = int(gw.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/mo")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert gw.metric("understudy_connections_closed_total", reason="header_timeout") == 1
        admin_port = int(gw.admin_url.split(":")[2].split("/")[0])  # the admin API too
        reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
        writer.write(b"GET /admin/v1/rout")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert gw.metric("understudy_connections_closed_total", reason="header_timeout") == 2
        assert (await _healthy(session, gw))["status"] == "ok"


async def test_slow_reader_is_relayed_whole_and_releases_everything() -> None:
    """A client that reads a long answer slowly: the relay waits for it (flow control),
    never holds more than its buffers, and everything is released at the end."""
    async with _baseline(), run_sim(ttft_ms=0, itl_ms=0, tokens=2000) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2000) as cand, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": cand.url}],
                        mirror=QUICK_MIRROR) as gw, \
            aiohttp.ClientSession(read_bufsize=2**10) as session:
        async with asyncio.timeout(60), session.post(
                gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            body = b""
            while chunk := await r.content.read(512):
                body += chunk
                await asyncio.sleep(0.002)
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") > 2000
        await _settled(gw)
        assert (await _healthy(session, gw))["status"] == "ok"


# -- store faults mid-run: clients never notice, the store's part waits or is counted ------

def _writer(gw: RunningGateway) -> Any:
    evaluation = gw.state.scorekeeper
    assert evaluation is not None
    return evaluation.writer_stats


def _accounted(gw: RunningGateway) -> bool:
    """Every exchange the writer took is written or counted as dropped, none held."""
    stats = _writer(gw)
    return (stats is not None and stats.queued_records == 0 and stats.held_records == 0
            and stats.written_records + sum(stats.dropped.values()) == stats.accepted)


async def _chats(session: aiohttp.ClientSession, gw: RunningGateway, n: int) -> float:
    """``n`` requests one after another, each answered 200; the slowest one's seconds."""
    slowest = 0.0
    for i in range(n):
        started = time.monotonic()
        status, _ = await _ask(session, gw, stream=i % 2 == 0, seed=i)
        assert status == 200
        slowest = max(slowest, time.monotonic() - started)
    return slowest


@pytest.mark.parametrize("fault", ["down", "black_hole", "slow"])
async def test_store_fault_mid_run(fault: str, pg_database: str) -> None:
    await upgrade(pg_database)
    async with _baseline():  # the relay's pumps and sockets included
        await _store_fault_mid_run(fault, pg_database)


async def _store_fault_mid_run(fault: str, database_url: str) -> None:
    async with relayed_database(database_url) as (relay, through_relay):
        store = {"url": through_relay, **QUICK_RETRIES}
        async with run_sim(ttft_ms=1, itl_ms=0, tokens=4) as primary, \
                run_sim(ttft_ms=1, itl_ms=0, tokens=4) as cand, \
                run_gateway(primary.url, candidates=[{"name": "c", "url": cand.url}],
                            mirror=QUICK_MIRROR,
                            evaluation={"enabled": True, "store": store,
                                        "scorers": ["exact_match", "latency"]}) as gw, \
                aiohttp.ClientSession() as session:
            await _chats(session, gw, REQUESTS)
            await eventually(lambda: _accounted(gw) and _writer(gw).written_records
                             >= REQUESTS, 30)
            if fault == "down":
                await relay.cut()
            elif fault == "black_hole":
                relay.black_hole()
            else:
                relay.slow_down(0.3)
            assert await _chats(session, gw, 3 * REQUESTS) < 2.0  # never the client's wait
            if fault == "slow":  # late, not failing: everything is written as it comes
                await eventually(lambda: _accounted(gw) and _writer(gw).written_records
                                 >= 4 * REQUESTS, 60)
                assert (await _healthy(session, gw))["status"] == "ok"
            else:  # /health tells the truth while the batch in hand waits
                async def failing() -> bool:
                    body = await _healthy(session, gw)
                    store_state = body.get("store", {})
                    return bool(body["status"] == "degraded"
                                and store_state.get("state") == "failing")
                async with asyncio.timeout(30):
                    while not await failing():  # noqa: ASYNC110 - polling /health
                        await asyncio.sleep(0.2)
                await relay.restore()
                await eventually(lambda: _accounted(gw) and _writer(gw).written_records
                                 >= 4 * REQUESTS, 60)
                async with asyncio.timeout(30):
                    while (await _healthy(session, gw))["status"] != "ok":  # noqa: ASYNC110
                        await asyncio.sleep(0.2)
            await _settled(gw)
