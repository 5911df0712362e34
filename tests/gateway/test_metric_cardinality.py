"""Label values a client, a backend or an operator controls map to a bounded set (STYLE.md 8).

Each test sends many distinct values of one such input through a real gateway on loopback
and counts the series its ``/metrics`` exports; a candidate's name is bounded by the
backends the gateway knows now (``_metrics`` rules 1-3).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import aiohttp
import openai

from gateway._metrics import MAX_RETIRED_BACKENDS, STATUS_LABELS, GatewayMetrics, status_label
from tests.utils import eventually, run_gateway, run_sim


@asynccontextmanager
async def answering_statuses(codes: Iterator[int]) -> AsyncIterator[str]:
    """A keep-alive upstream answering each POST with the next status of ``codes`` (the
    rest, the gateway's own probes, with 404)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST "):
                    await reader.readexactly(int(head.lower().split(b"content-length:")[1]
                                                 .split(b"\r\n")[0]))
                code = next(codes) if head.startswith(b"POST ") else 404
                writer.write(b"HTTP/1.1 %03d X\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\n\r\n{}" % code)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _series(session: aiohttp.ClientSession, url: str, name: str) -> list[str]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


async def test_a_backend_sending_every_status_code_adds_a_bounded_set_of_series() -> None:
    # Every final status a backend may send: three digits from 200 (1xx are interim).
    codes = list(range(200, 1000))
    async with answering_statuses(iter(codes)) as upstream, run_gateway(upstream) as gw, \
            aiohttp.ClientSession() as session:
        for _ in codes:
            async with session.post(gw.url + "/v1/completions", json={"prompt": "x"}) as resp:
                await resp.read()
        series = await _series(session, gw.url, "understudy_requests_total")
    assert len(series) <= len(STATUS_LABELS)
    assert 'understudy_requests_total{route="completions",status="200"} 1.0' in series
    assert 'understudy_requests_total{route="completions",status="503"} 1.0' in series
    # 529 and 999 are no HTTP status the gateway knows: counted by class, or as "other".
    assert 'understudy_requests_total{route="completions",status="5xx"} 89.0' in series
    assert 'understudy_requests_total{route="completions",status="other"} 400.0' in series


def test_status_labels() -> None:
    assert [status_label(s) for s in (200, 404, 429, 499, 503)] == \
        ["200", "404", "429", "499", "503"]
    assert [status_label(s) for s in (0, 42, 150, 299, 418, 420, 529, 600, 999)] == \
        ["other", "other", "other", "2xx", "418", "4xx", "5xx", "other", "other"]
    assert {status_label(s) for s in range(-5, 2000)} <= STATUS_LABELS


# -- a backend's name: bounded by the backends the gateway knows now (_metrics rules 1-3) --

async def _chats(gw_url: str, n: int, tag: str) -> None:
    client = openai.AsyncOpenAI(base_url=gw_url + "/v1", api_key="x", max_retries=0)
    for i in range(n):
        await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": f"{tag} {i}"}])
    await client.close()


async def _exported(session: aiohttp.ClientSession, url: str, name: str) -> list[str]:
    """The series of /metrics that carry ``name`` as a label's value."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return [line for line in text.splitlines()
            if not line.startswith("#") and f'="{name}"' in line]


async def test_a_removed_candidate_leaves_no_series_and_comes_back_fresh() -> None:
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=3) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=3) as cand, \
            run_gateway(primary.url) as gw, aiohttp.ClientSession() as http:
        async with http.post(gw.admin_url + "/candidates",
                             json={"name": "tried", "url": cand.url}) as resp:
            assert resp.status == 201
        await _chats(gw.url, 3, "a")
        await eventually(lambda: gw.metric("understudy_mirror_joined_total",
                                           candidate="tried") == 3)
        series = await _exported(http, gw.url, "tried")
        assert any(s.startswith("understudy_candidate_ttft_seconds_bucket") for s in series)
        assert any(s.startswith("understudy_mirror_buffer_items") for s in series)
        async with http.delete(gw.admin_url + "/candidates/tried") as resp:
            assert resp.status == 200
        assert await _exported(http, gw.url, "tried") == []
        await _chats(gw.url, 2, "b")  # counted for no candidate
        assert await _exported(http, gw.url, "tried") == []
        # The primary's series stay.
        assert await _exported(http, gw.url, "primary")

        async with http.post(gw.admin_url + "/candidates",
                             json={"name": "tried", "url": cand.url}) as resp:
            assert resp.status == 201
        await _chats(gw.url, 1, "c")
        await eventually(lambda: gw.metric("understudy_mirror_joined_total",
                                           candidate="tried") == 1)  # from zero
        assert gw.metric("understudy_mirror_queued_total", candidate="tried") == 1


async def test_a_join_completing_after_the_removal_does_not_bring_its_series_back() -> None:
    # The candidate answers at once, the primary after a second: the candidate's answer
    # waits for the primary's in the joiner while the candidate is removed.
    async with run_sim(ttft_ms=1000, itl_ms=0, tokens=3) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=3) as cand, \
            run_gateway(primary.url, candidates=[{"name": "racing", "url": cand.url}]) as gw, \
            aiohttp.ClientSession() as http:
        answer = asyncio.create_task(_chats(gw.url, 1, "late"))
        await eventually(lambda: gw.metric("understudy_mirror_completed_total",
                                           candidate="racing") == 1)
        assert not answer.done()
        async with http.delete(gw.admin_url + "/candidates/racing") as resp:
            assert resp.status == 200
        assert await _exported(http, gw.url, "racing") == []
        await answer  # the primary answers: the join completes, its exchange evaluated
        assert [e.candidate for e in gw.sink.snapshot()] == ["racing"]
        assert await _exported(http, gw.url, "racing") == []


async def test_a_backend_the_routing_left_behind_leaves_no_series() -> None:
    # A promoted candidate's series stay while it is live (primary, then rollback target);
    # a promotion that leaves it out of the routing takes them away.
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=3) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=3) as first, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=3) as second, \
            run_gateway(primary.url, candidates=[{"name": "first", "url": first.url},
                                                 {"name": "second", "url": second.url}]) as gw, \
            aiohttp.ClientSession() as http:
        await _chats(gw.url, 2, "a")
        await eventually(lambda: gw.metric("understudy_mirror_joined_total",
                                           candidate="first") == 2)
        forced = {"force": True, "reason": "test"}
        async with http.post(gw.admin_url + "/candidates/first/promote", json=forced) as resp:
            assert resp.status == 200
        assert gw.metric("understudy_mirror_joined_total", candidate="first") == 2
        async with http.post(gw.admin_url + "/rollback", json={}) as resp:
            assert resp.status == 200  # primary again; "first" the rollback target
        assert await _exported(http, gw.url, "first")
        async with http.post(gw.admin_url + "/candidates/second/promote", json=forced) as resp:
            assert (await resp.json())["routing"]["previous"]["name"] == "primary"
        assert await _exported(http, gw.url, "first") == []
        assert await _exported(http, gw.url, "second")
        assert await _exported(http, gw.url, "primary")


def test_a_retired_backend_gets_no_series_until_admitted() -> None:
    metrics = GatewayMetrics()
    metrics.mirror_dropped.labels("gone", "paused").inc()
    metrics.retire_backend("gone")
    # Late work for it: a scrape in flight, a live request to a backend left behind.
    metrics.backend_scrapes.labels(backend="gone", outcome="ok").inc()
    metrics.upstream_errors.labels("gone", "connect").inc()
    metrics.candidate_e2e.labels("gone").observe(0.5)
    assert b'"gone"' not in metrics.exposition()
    metrics.admit_backend("gone")
    metrics.mirror_dropped.labels("gone", "paused").inc()
    assert metrics.registry.get_sample_value(
        "understudy_mirror_dropped_total", {"candidate": "gone", "reason": "paused"}) == 1


def test_retired_names_are_bounded() -> None:
    metrics = GatewayMetrics()
    for i in range(MAX_RETIRED_BACKENDS + 10):
        metrics.retire_backend(f"c{i}")
    metrics.mirror_queued.labels("c0").inc()  # forgotten: the oldest retirement
    metrics.mirror_queued.labels(f"c{MAX_RETIRED_BACKENDS + 9}").inc()
    assert metrics.registry.get_sample_value("understudy_mirror_queued_total",
                                             {"candidate": "c0"}) == 1
    assert metrics.registry.get_sample_value(
        "understudy_mirror_queued_total", {"candidate": f"c{MAX_RETIRED_BACKENDS + 9}"}) is None
