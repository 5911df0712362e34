"""Units of mirroring with in-memory fakes: sampler, budget, buffer, joiner."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from evaluators import Capture, MemorySink, Observation, observe
from gateway._budget import PAYLOAD_OVERHEAD_BYTES, MemoryBudget, payload_key
from gateway._buffer import BufferClosed, CandidateBuffer, MirrorRequest
from gateway._config import CandidateConfig, CaptureConfig, MirrorConfig
from gateway._join import Joiner, observation_charge
from gateway._metrics import GatewayMetrics
from gateway._mirror import Mirror
from gateway._routing import Backend, Canary, Routing
from gateway._sampler import mirror_sampled, sampled, session_key


def _headers(**values: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(values))


# -- sampler --------------------------------------------------------------------------

def test_sampling_rate_is_respected_and_deterministic() -> None:
    keys = [f"session-{i}" for i in range(4000)]
    chosen = [k for k in keys if sampled("cand", k, 0.25)]
    assert 0.22 < len(chosen) / len(keys) < 0.28
    assert chosen == [k for k in keys if sampled("cand", k, 0.25)]
    # Different candidates sample independently.
    other = {k for k in keys if sampled("other", k, 0.25)}
    assert other != set(chosen)
    assert all(sampled("c", k, 1.0) for k in keys[:50])
    assert not any(sampled("c", k, 0.0) for k in keys[:50])


@pytest.mark.parametrize("name", ["canary", "record", "c"])
def test_a_candidate_named_as_a_fixed_sampler_gets_an_unbiased_sample(name: str) -> None:
    """Candidates were salted with their name, the canary's routing with "canary" and the
    recorder with "record": a candidate named ``canary`` sampled exactly the sessions the
    canary serves, none of which reach the mirror (0 of 9,000 mirrored while a 10 % canary
    of another candidate ran), and one named ``record`` the recorder's very sample."""
    keys = [f"h:session-{i}" for i in range(10_000)]
    routing = Routing.configured(Backend("primary", "http://127.0.0.1:8")).with_canary(
        Canary(Backend("other", "http://127.0.0.1:9"), (10.0, 100.0), 0, 60.0, 0.0))
    reaching_mirror = [k for k in keys if not routing.chooses_canary(k)]
    assert 8_800 < len(reaching_mirror) < 9_200  # the canary's own routing is unchanged
    mirrored = sum(mirror_sampled(name, k, 0.1) for k in reaching_mirror)
    # Binomial(~9,000, 0.1): mean ~900, sd ~28; five sd either side.
    assert abs(mirrored - 0.1 * len(reaching_mirror)) < 5 * (0.09 * len(reaching_mirror)) ** 0.5
    recorded = {k for k in keys if sampled("record", k, 0.1)}
    overlap = sum(mirror_sampled(name, k, 0.1) for k in recorded)
    assert overlap < 0.1 * len(recorded) + 5 * (0.09 * len(recorded)) ** 0.5  # independent
    # The fixed samplers keep their hash (a rolling upgrade moves no live session).
    assert sampled("canary", "h:s", 0.5) == (routing.with_canary(Canary(
        Backend("other", "http://127.0.0.1:9"), (50.0, 100.0), 0, 60.0, 0.0)
    ).chooses_canary("h:s"))


async def test_the_mirror_samples_a_candidate_named_canary_beside_a_canary() -> None:
    """The same through ``Mirror.offer``: what ``not_sampled`` counts for ``canary``."""
    metrics = GatewayMetrics()
    mirror = Mirror(MirrorConfig(), (CandidateConfig(
        name="canary", url="http://127.0.0.1:9", sample_rate=0.1, buffer_items=10_000),),
        CaptureConfig(), metrics, MemorySink(10))
    routing = Routing.configured(Backend("primary", "http://127.0.0.1:8")).with_canary(
        Canary(Backend("other", "http://127.0.0.1:9"), (10.0, 100.0), 0, 60.0, 0.0))
    offered = queued = 0
    for i in range(3_000):
        session = f"h:s{i}"
        if routing.chooses_canary(session):
            continue  # served live by the canary (the relay's order)
        offered += 1
        body = b'{"model": "m", "messages": [{"role": "user", "content": "%d"}]}' % i
        queued += mirror.offer("chat_completions", "POST", "/v1/chat/completions",
                               CIMultiDict(), body, None, f"r{i}", session)
    mirror.joiner.close()
    assert abs(queued - 0.1 * offered) < 5 * (0.09 * offered) ** 0.5, (queued, offered)


@pytest.mark.parametrize("function", ["sampled", "mirror_sampled"])
def test_sampling_is_the_same_in_another_process(function: str) -> None:
    """Replicas agree on every sampler: the canary's and recorder's, and candidates'."""
    keys = [f"k{i}" for i in range(300)]
    sample: Callable[[str, str, float], bool] = (
        sampled if function == "sampled" else mirror_sampled)
    here = "".join("1" if sample("cand", k, 0.3) else "0" for k in keys)
    code = (f"from gateway._sampler import {function}; "
            f"print(''.join('1' if {function}('cand', k, 0.3) else '0' for k in {keys!r}))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "12345"}).stdout.strip()
    assert there == here


def test_session_key_sources_and_every_turn_of_a_conversation_agrees() -> None:
    turn1 = {"model": "m", "messages": [{"role": "system", "content": "S"},
                                        {"role": "user", "content": "Q1"}]}
    turn2 = {"model": "m", "messages": [*turn1["messages"],
                                        {"role": "assistant", "content": "A1"},
                                        {"role": "user", "content": "Q2"}]}
    k1 = session_key(_headers(), turn1, "X-Session-Id", "r1")
    assert k1 == session_key(_headers(), turn2, "X-Session-Id", "r2")
    assert k1 != session_key(_headers(), {**turn1, "model": "n"}, "X-Session-Id", "r1")
    assert session_key(_headers(**{"X-Session-Id": "abc"}), turn1, "X-Session-Id", "r") == "h:abc"
    assert session_key(_headers(), {**turn1, "user": "u7"}, "X-Session-Id", "r") == "u:u7"
    assert session_key(_headers(), None, "X-Session-Id", "r9") == "r:r9"


# -- budget and buffer ------------------------------------------------------------------

def _request(rid: str = "r") -> MirrorRequest:
    return MirrorRequest(rid, "s", "chat_completions", "POST", "/v1/chat/completions",
                         CIMultiDict(), 0.0)


def test_payload_shared_by_buffers_is_interned_and_counted_once() -> None:
    budget = MemoryBudget(10_000)
    buffers = [CandidateBuffer(f"c{i}", 10, 10_000, budget) for i in range(3)]
    body = b"x" * 1000
    key = payload_key("POST", "/v1/chat/completions", body)
    assert [b.offer(_request(), key, body) for b in buffers] == ["queued"] * 3
    assert budget.used == 1000 + PAYLOAD_OVERHEAD_BYTES
    assert budget.interned == 1


async def test_buffer_dedup_then_requeue_after_taken() -> None:
    budget = MemoryBudget(10_000)
    buffer = CandidateBuffer("c", 10, 10_000, budget)
    body = b'{"a":1}'
    key = payload_key("POST", "/p", body)
    assert buffer.offer(_request("1"), key, body) == "queued"
    assert buffer.offer(_request("2"), key, body) == "dedup"
    item = await buffer.get()
    assert item.request.request_id == "1"
    assert buffer.offer(_request("3"), key, body) == "queued"  # no longer queued: accepted
    budget.release_payload(item.payload)
    assert budget.used == len(body) + PAYLOAD_OVERHEAD_BYTES
    buffer.close()
    assert budget.used == 0


def test_buffer_full_by_items_and_by_bytes_and_budget() -> None:
    budget = MemoryBudget(10_000)
    by_items = CandidateBuffer("c", 2, 10_000, budget)
    outcomes = [by_items.offer(_request(), bytes([i]), bytes([i]) * 10) for i in range(3)]
    assert outcomes == ["queued", "queued", "buffer_full"]
    by_bytes = CandidateBuffer("d", 100, 25, budget)
    outcomes = [by_bytes.offer(_request(), bytes([i + 10]), b"y" * 10) for i in range(3)]
    assert outcomes == ["queued", "queued", "buffer_full"]
    tight = CandidateBuffer("e", 100, 100_000, MemoryBudget(PAYLOAD_OVERHEAD_BYTES + 100))
    assert tight.offer(_request(), b"k1", b"z" * 100) == "queued"
    assert tight.offer(_request(), b"k2", b"z" * 100) == "budget"
    for buffer in (by_items, by_bytes):
        buffer.close()
    assert budget.used == 0


async def test_closed_buffer_wakes_workers_and_refuses_offers() -> None:
    buffer = CandidateBuffer("c", 10, 1000, MemoryBudget(10_000))
    import asyncio

    waiter = asyncio.create_task(buffer.get())
    await asyncio.sleep(0)
    buffer.close()
    with pytest.raises(BufferClosed):
        await waiter
    assert buffer.offer(_request(), b"k", b"v") == "closed"


def test_budget_refuses_double_release() -> None:
    budget = MemoryBudget(100)
    assert budget.charge(60)
    assert not budget.charge(50)
    budget.release(60)
    with pytest.raises(RuntimeError):
        budget.release(1)


# -- joiner -------------------------------------------------------------------------------

def _observation(rid: str, backend: str, text: str = "hello") -> Observation:
    capture = Capture(started=0.0, max_bytes=1 << 16, max_chunk_times=64, status=200)
    capture.add_chunk(0.1, b'{"choices":[{"message":{"content":"' + text.encode() + b'"}}]}')
    capture.ended = 0.2
    return observe(capture, request_id=rid, backend=backend, route="chat_completions",
                   wall_started=0.0)


def _joiner(limit: int = 1 << 20) -> tuple[Joiner, MemoryBudget, MemorySink, list[tuple[str, str]]]:
    budget = MemoryBudget(limit)
    sink = MemorySink(100)
    drops: list[tuple[str, str]] = []
    joiner = Joiner(budget, sink, 10.0, on_drop=lambda c, r, _: drops.append((c, r)),
                    on_join=lambda e: None)
    return joiner, budget, sink, drops


def test_join_in_either_order_releases_all_bytes() -> None:
    joiner, budget, sink, drops = _joiner()
    joiner.expect("r1", "a", "s", "chat_completions", 0.0)
    joiner.expect("r1", "b", "s", "chat_completions", 0.0)
    joiner.candidate("a", _observation("r1", "a"))          # before the primary: waits
    assert budget.used > 0
    joiner.primary(_observation("r1", "primary"))          # joins a; b still expected
    assert [e.candidate for e in sink.snapshot()] == ["a"]
    joiner.candidate("b", _observation("r1", "b"))          # after the primary
    assert [e.candidate for e in sink.snapshot()] == ["a", "b"]
    assert budget.used == 0 and len(joiner) == 0 and drops == []


def test_join_timeout_and_budget_drops_are_counted() -> None:
    joiner, budget, _, drops = _joiner()
    joiner.expect("r1", "a", "s", "chat_completions", 0.0)
    joiner.primary(_observation("r1", "primary"))
    assert joiner.expire(5.0) == 0
    assert joiner.expire(11.0) == 1
    assert drops == [("a", "join_timeout")] and budget.used == 0

    small, small_budget, _, small_drops = _joiner(limit=10)
    small.expect("r2", "a", "s", "chat_completions", 0.0)
    small.primary(_observation("r2", "primary"))
    assert small_drops == [("a", "budget")] and small_budget.used == 0 and len(small) == 0


def test_observation_charge_grows_with_text() -> None:
    assert observation_charge(_observation("r", "p", "x" * 500)) > observation_charge(
        _observation("r", "p", "x"))


def test_observation_charge_counts_an_embeddings_answers_vectors() -> None:
    """An embeddings answer's vectors are held while it waits to be joined: 40 vectors of
    1,024 float32 (160 KiB) were charged 1 KiB, outside the budget's bound."""
    rows = ",".join(f'{{"index":{i},"embedding":[{",".join(["0.5"] * 1024)}]}}'
                    for i in range(40))
    capture = Capture(started=0.0, max_bytes=1 << 20, max_chunk_times=8, status=200)
    capture.add_chunk(0.1, b'{"object":"list","data":[' + rows.encode() + b"]}")
    capture.ended = 0.2
    observation = observe(capture, request_id="r", backend="p", route="embeddings",
                          wall_started=0.0)
    assert observation.embeddings is not None
    assert observation_charge(observation) >= 40 * 1024 * 4


def test_rewritten_body_owns_no_more_memory_than_its_length() -> None:
    """The budget charges a payload's length: the body must not own much more than that."""
    import tracemalloc

    import orjson

    from gateway._relay import plan_request

    body = orjson.dumps({"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "x" * 65536}]})
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        plan = plan_request("chat_completions", "POST", body)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert plan.injected_usage
    assert held < 2 * len(plan.body) + 64 * 1024
    # The same for a body rewritten for a candidate, mirrored or live.
    from gateway._body_coding import with_fields

    plain = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 65536}]})
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        rewritten = with_fields(plain, {"model": "cand"})
        named = plan_request("chat_completions", "POST", plain).naming("cand", None)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2 * (len(rewritten) + len(named.body)) + 64 * 1024


async def test_stopping_survives_a_candidate_removed_meanwhile() -> None:
    """A routing adopted while the gateway stops (another replica promoted a candidate:
    ``serve_routing`` removes it from the mirror) changed the candidates while ``stop``
    iterated over them: RuntimeError, and the rest of the stop (the other candidates'
    drain, the sweeper, the joiner, the recorder) never ran."""
    metrics = GatewayMetrics()
    configs = tuple(CandidateConfig(name=n, url="http://127.0.0.1:9") for n in "abc")
    mirror = Mirror(MirrorConfig(), configs, CaptureConfig(), metrics, MemorySink(10))
    await mirror.start()
    stopping = mirror._stop_candidate
    stopped: list[str] = []

    async def stop_one(candidate: object, *args: object, **kwargs: object) -> None:
        if not stopped and "c" in mirror.candidates:  # the first await of the stop
            await mirror.remove_candidate("c")
        stopped.append(candidate.name)  # type: ignore[attr-defined]
        await stopping(candidate, *args, **kwargs)  # type: ignore[arg-type]

    mirror._stop_candidate = stop_one  # type: ignore[method-assign]
    candidates = list(mirror.candidates.values())
    await mirror.stop()
    assert sorted(stopped) == ["a", "b", "c"]  # c by its removal, a and b by the stop
    assert all(not c.workers for c in candidates)


async def test_stopping_waits_for_a_removal_under_way() -> None:
    """A removal already draining its candidate when the stop began (``serve_routing``
    adopting a routing in its own task) was skipped by the stop, which then closed the
    joiner and returned with that candidate's replay still running and its bytes held."""
    held: list[asyncio.StreamWriter] = []  # connections it never answers

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    mirror = Mirror(MirrorConfig(drain_timeout_s=0.5), (CandidateConfig(
        name="c", url=f"http://127.0.0.1:{port}"),), CaptureConfig(), GatewayMetrics(),
        MemorySink(10))
    await mirror.start()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    assert mirror.offer("chat_completions", "POST", "/v1/chat/completions",
                        CIMultiDict({"Content-Type": "application/json"}), body, None, "r1",
                        "h:s")
    candidate = mirror.candidates["c"]
    for _ in range(100):  # the replay is under way
        if candidate.in_flight:
            break
        await asyncio.sleep(0.01)
    assert candidate.in_flight == 1
    removal = asyncio.create_task(mirror.remove_candidate("c"))
    await asyncio.sleep(0)  # the removal has taken it out of the candidates and drains it
    assert "c" not in mirror.candidates
    await mirror.stop()
    assert removal.done() and all(w.done() for w in candidate.workers)
    assert mirror.budget.used == 0
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()
