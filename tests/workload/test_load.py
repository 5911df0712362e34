"""``run_workload`` and ``understudy load`` against the simulator, directly and through a
real gateway (real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from backends.sim import RecordedRequest
from gateway.cli import main
from tests.utils import answering_once, eventually, run_gateway, run_sim
from workload import TurnResult, WorkloadSpec, run_workload

FAST = {"ttft_ms": 5.0, "itl_ms": 1.0, "tokens": 8}
# Answers far slower than any bound below: a run that waited for one would overrun it,
# while the bound leaves a loaded CI machine seconds of slack for what the README
# promises (a stop cancels what is in flight and ends the run; well under 1 s idle).
SLOW = {"ttft_ms": 60_000, "tokens": 4}
AT_ONCE_S = 10.0


def _by_session(requests: list[RecordedRequest]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for request in requests:
        if request.path.endswith("/chat/completions"):
            assert isinstance(request.body, dict)
            out[request.headers["x-session-id"]].append(request.body)
    for bodies in out.values():
        bodies.sort(key=lambda b: len(b["messages"]))
    return out


def _assert_growing_histories(bodies: list[dict[str, Any]], turns: int) -> None:
    assert len(bodies) == turns
    for earlier, later in itertools.pairwise(bodies):
        old, new = earlier["messages"], later["messages"]
        assert new[: len(old)] == old  # the history is carried whole
        assistant, result = new[len(old):]
        assert assistant["role"] == "assistant" and assistant["content"]
        assert result["role"] == "user" and result["content"].startswith("Tool result (")
    for body in bodies:
        assert body["messages"][0]["role"] == "system"
        assert {t["function"]["name"] for t in body["tools"]} >= {"search_logs", "run_query"}
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_turns_carry_answers_and_tool_results() -> None:
    seen: list[TurnResult] = []
    async with run_sim(**FAST) as sim:
        spec = WorkloadSpec(sessions=3, turns=3, rate=50, think_s=0.02, duration_s=30)
        summary = await run_workload(spec, sim.url, on_turn=seen.append)
        histories = _by_session(list(sim.stats.requests))
    assert summary.turns == 9 and summary.errors == 0 and summary.sessions_completed == 3
    assert sorted(seen, key=lambda r: r.started_s) == list(summary.results)
    assert len(histories) == 3
    for bodies in histories.values():
        _assert_growing_histories(bodies, 3)
    for depth in summary.by_depth:
        assert depth.turns == 3 and depth.ttft_p50_s is not None
    prompts = [d.prompt_tokens_mean or 0 for d in summary.by_depth]
    assert prompts == sorted(prompts) and prompts[0] < prompts[-1]


async def test_through_a_gateway_sessions_are_sampled_whole() -> None:
    async with run_sim(**FAST) as primary, run_sim(**FAST) as candidate:
        half = [{"name": "cand", "url": candidate.url, "sample_rate": 0.5}]
        async with run_gateway(primary.url, candidates=half) as gateway:
            spec = WorkloadSpec(sessions=8, turns=3, rate=100, think_s=0.02, duration_s=30)
            summary = await run_workload(spec, gateway.base_url)
            # The mirror's replays finish off the hot path, after the client's answers:
            # wait until each of the 24 requests is mirrored and joined or not sampled.
            await eventually(lambda: gateway.metric(
                "understudy_mirror_joined_total", candidate="cand") + gateway.metric(
                "understudy_mirror_dropped_total", candidate="cand",
                reason="not_sampled") == 24)
        seen_primary = _by_session(list(primary.stats.requests))
        seen_candidate = _by_session(list(candidate.stats.requests))
    assert summary.turns == 24 and summary.errors == 0
    assert len(seen_primary) == 8
    for bodies in seen_primary.values():
        _assert_growing_histories(bodies, 3)
    # Session-consistent sampling by the header: a mirrored session is mirrored whole.
    assert 0 < len(seen_candidate) < 8
    for session, bodies in seen_candidate.items():
        assert [b["messages"] for b in bodies] == [b["messages"] for b in seen_primary[session]]


async def test_poisson_arrivals_and_think_time_bounds() -> None:
    spec = WorkloadSpec(sessions=12, turns=3, rate=20, think_s=0.15, duration_s=30, seed=7)
    async with run_sim(**FAST) as sim:
        summary = await run_workload(spec, sim.url)
    assert summary.errors == 0
    gaps = random.Random(spec.seed)
    expected, at = [], 0.0
    for index in range(spec.sessions):
        at += gaps.expovariate(spec.rate) if index else 0.0
        expected.append(at)
    turns: dict[str, list[TurnResult]] = defaultdict(list)
    for result in summary.results:
        turns[result.session].append(result)
    firsts = sorted(min(r.started_s for r in rs) for rs in turns.values())
    for got, want in zip(firsts, expected, strict=True):
        assert want - 0.005 <= got <= want + 0.15  # an arrival is never early, rarely late
    for results in turns.values():
        results.sort(key=lambda r: r.turn)
        for done, after in itertools.pairwise(results):
            think = after.started_s - (done.started_s + done.e2e_s)
            assert 0.5 * spec.think_s - 0.005 <= think <= 1.5 * spec.think_s + 0.15


async def test_concurrency_bound() -> None:
    spec = WorkloadSpec(sessions=6, turns=2, rate=1000, think_s=0.0, concurrency=2,
                        duration_s=30)
    async with run_sim(ttft_ms=60, itl_ms=1, tokens=4) as sim:
        summary = await run_workload(spec, sim.url)
    assert summary.turns == 12 and summary.errors == 0
    spans: dict[str, tuple[float, float]] = {}
    for r in summary.results:
        start, end = spans.get(r.session, (r.started_s, r.started_s + r.e2e_s))
        spans[r.session] = (min(start, r.started_s), max(end, r.started_s + r.e2e_s))
    for start, _ in spans.values():
        overlapping = sum(1 for s, e in spans.values() if s <= start < e)
        assert overlapping <= 2


async def test_duration_bound_and_drain() -> None:
    loop = asyncio.get_running_loop()
    async with run_sim(**FAST) as sim:
        spec = WorkloadSpec(sessions=200, turns=4, rate=40, think_s=0.1, duration_s=0.5)
        summary = await run_workload(spec, sim.url)
    assert summary.not_sent > 0 and summary.errors == 0
    assert all(r.started_s < 0.5 for r in summary.results)
    async with run_sim(**SLOW) as slow:
        spec = WorkloadSpec(sessions=2, turns=2, rate=100, think_s=0, duration_s=0.2,
                            drain_s=0.3)
        began = loop.time()
        summary = await run_workload(spec, slow.url)
        took = loop.time() - began
    assert took < AT_ONCE_S  # 0.2 s of arrivals, 0.3 s of drain: not the 60 s answers
    assert summary.turns == 2 and {r.error for r in summary.results} == {"cancelled"}


async def test_cli_json_and_table() -> None:
    async with run_sim(**FAST) as sim:
        args = ["load", "--url", sim.url, "--sessions", "2", "--turns", "2", "--rate", "50",
                "--think-s", "0.01", "--duration-s", "20"]
        as_json = await asyncio.to_thread(CliRunner().invoke, main, [*args, "--json"])
        table = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output.strip().splitlines()[-1])
    assert doc["turns"] == 4 and doc["errors"] == 0 and len(doc["by_depth"]) == 2
    assert table.exit_code == 0, table.output
    assert "TTFT" in table.output and "2 sessions (2 completed), 4 turns, 0 errors" in table.output


async def test_the_summary_table_shows_every_header_and_cell_whole() -> None:
    """At 80 columns (a pipe, CliRunner) the summary cut its headers with an ellipsis:
    "requests" read "reque…". As ``candidates list`` (f84295d): a cell folds where it must,
    and output that is no terminal is as wide as the table needs. Found walking the README
    on a fresh clone."""
    async with run_sim(**FAST) as sim:
        args = ["load", "--url", sim.url, "--sessions", "2", "--turns", "2", "--rate", "50",
                "--think-s", "0.01", "--duration-s", "20"]
        result = await asyncio.to_thread(CliRunner().invoke, main, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "\u2026" not in result.output, result.output  # nothing cut with an ellipsis
    header = next(line for line in result.output.splitlines() if "turn" in line)
    assert [cell.strip() for cell in header.strip("\u2503").split("\u2503")] == [
        "turn", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms", "e2e p99 ms",
        "prompt tok", "cached tok"], result.output
    rows = [line for line in result.output.splitlines() if line.startswith("\u2502")]
    assert [[cell.strip() for cell in row.split("\u2502")[1:3]] for row in rows] == [
        ["0", "2"], ["1", "2"]], result.output


async def test_cli_unreachable_server_is_a_clear_error() -> None:
    from tests.utils import free_port

    url = f"http://127.0.0.1:{free_port()}"
    result = await asyncio.to_thread(CliRunner().invoke, main, ["load", "--url", url,
                                                                 "--timeout-s", "5"])
    assert result.exit_code == 1 and "Error:" in result.output


async def test_a_model_lookup_refused_names_the_url_it_asked() -> None:
    async with run_sim(**FAST) as sim:
        args = ["load", "--url", f"{sim.url}/not-openai", "--sessions", "1", "--turns", "1"]
        result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: GET {sim.url}/not-openai/models: Error code: 404")


async def test_stop_ends_a_run_at_once_with_its_summary() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    async with run_sim(**SLOW) as slow:
        spec = WorkloadSpec(sessions=20, turns=2, rate=10, think_s=0, duration_s=120)
        run = asyncio.create_task(run_workload(spec, slow.url, stop=stop))
        await eventually(lambda: len(slow.stats.requests) >= 2)
        stop.set()
        began = loop.time()
        summary = await asyncio.wait_for(run, 2 * AT_ONCE_S)
        took = loop.time() - began
    assert took < AT_ONCE_S  # not the 60 s answers, not the 120 s run
    assert summary.turns >= 2 and {r.error for r in summary.results} == {"cancelled"}
    assert summary.errors_by_kind == (("cancelled", summary.turns),)


async def test_turns_waiting_for_a_slot_at_the_end_are_counted_not_sent() -> None:
    async with run_sim(ttft_ms=5000, tokens=4) as slow:
        spec = WorkloadSpec(sessions=4, turns=2, rate=1000, think_s=0, concurrency=1,
                            duration_s=0.2, drain_s=0.3)
        summary = await run_workload(spec, slow.url)
    assert summary.turns == 1 and summary.errors_by_kind == (("cancelled", 1),)
    assert summary.not_sent == 7  # the cancelled session's second turn, 3 sessions' two


async def test_stop_ends_a_run_still_looking_up_its_model() -> None:
    held: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    async with server:
        spec = WorkloadSpec(sessions=3, turns=2, duration_s=120, request_timeout_s=60)
        run = asyncio.create_task(run_workload(spec, f"http://127.0.0.1:{port}", stop=stop))
        await eventually(lambda: bool(held))
        stop.set()
        summary = await asyncio.wait_for(run, AT_ONCE_S)  # not the 60 s the lookup may take
        for writer in held:
            writer.close()
    assert summary.turns == 0 and summary.not_sent == 6


async def test_a_session_cut_short_by_the_duration_is_not_completed() -> None:
    async with run_sim(**FAST) as sim:
        spec = WorkloadSpec(sessions=3, turns=3, rate=100, think_s=2, duration_s=0.5)
        summary = await run_workload(spec, sim.url)
    assert summary.turns == 3 and summary.errors == 0 and summary.not_sent == 6
    assert summary.sessions == 3 and summary.sessions_completed == 0  # 1 of 3 turns each


def _answer(content_type: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


@pytest.mark.parametrize(("stream", "answer"), [
    (True, _answer(b"text/event-stream", b"data: {not json\n\n")),
    (True, _answer(b"text/event-stream", b"data: \xff\xfe\n\n")),
    (True, _answer(b"text/event-stream", b'data: {"choices": [{"delta": null}]}\n\n')),
    (True, _answer(b"text/event-stream", b'data: {"choices": [], "usage": "x"}\n\n')),
    (True, _answer(b"text/event-stream", b'data: {"choices": [{"delta": {"content": 5}}]}\n\n')),
    (False, _answer(b"application/json", b"{not json")),
    (False, _answer(b"application/json", b"[]")),
    (False, _answer(b"application/json", b'{"choices": [{"message": null}]}')),
    (False, _answer(b"application/json", b'{"choices": [{"message": {"content": 5}}]}')),
], ids=["sse-not-json", "sse-not-utf8", "sse-delta-null", "sse-usage-str", "sse-content-int",
        "not-json", "a-list", "message-null", "content-int"])
async def test_a_malformed_answer_is_an_error_of_its_turn_not_the_end_of_the_run(
        stream: bool, answer: bytes) -> None:
    async with answering_once(answer) as url:
        spec = WorkloadSpec(sessions=2, turns=2, rate=100, think_s=0, duration_s=10,
                            model="m", stream=stream)
        summary = await run_workload(spec, url)
    assert summary.errors_by_kind == (("malformed_response", 2),)
    assert summary.turns == 2 and summary.not_sent == 2  # a session ends at its first failure


@pytest.mark.parametrize(("flag", "field"), [
    ("--timeout-s", "request_timeout_s"), ("--drain-s", "drain_s"),
])
@pytest.mark.parametrize("replay", [False, True])
def test_an_infinite_time_bound_is_refused(tmp_path: Path, flag: str, field: str,
                                           replay: bool) -> None:
    result = _load(tmp_path, [flag, "inf"], replay=replay)
    assert result.exit_code == 2
    assert result.output.splitlines() == [f"Error: {field}: Input should be a finite number"]


@pytest.mark.parametrize(("flag", "field", "replay"), [
    ("--rate", "rate", False), ("--think-s", "think_s", False),
    ("--duration-s", "duration_s", False), ("--timeout-s", "request_timeout_s", False),
    ("--drain-s", "drain_s", True), ("--speed", "speed", True),
])
def test_nan_is_refused_as_no_number(tmp_path: Path, flag: str, field: str,
                                     replay: bool) -> None:
    """``--rate nan`` was refused as "rate: Input should be less than or equal to 10000",
    which reads as if the value were too large. Found walking the README."""
    result = _load(tmp_path, [flag, "nan"], replay=replay)
    assert result.exit_code == 2
    assert result.output.splitlines() == [f"Error: {field}: Input should be a finite number"]


@pytest.mark.parametrize("header", ["X Session", "X-Session:", "Sitzung-Ä"])
@pytest.mark.parametrize("replay", [False, True])
def test_a_session_header_that_is_no_header_name_is_refused(tmp_path: Path, header: str,
                                                            replay: bool) -> None:
    result = _load(tmp_path, ["--session-header", header], replay=replay)
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "Error: session_header: must be an HTTP header name: letters, digits and "
        "!#$%&'*+-.^_`|~"]


def _load(tmp_path: Path, flags: list[str], *, replay: bool) -> Result:
    """``understudy load`` with ``flags`` against a closed port, replaying a one-record file
    (``replay``) or generating."""
    args = ["load", "--url", "http://127.0.0.1:1", *flags]
    if replay:
        path = tmp_path / "rec.jsonl"
        path.write_text('{"offset_s": 0, "route": "/v1/completions", "body": {}}\n')
        args += ["--replay", str(path)]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize(("url", "words"), [
    ("http://[::1", "--url is not a valid URL"),
    ("http://127.0.0.1:99999", "--url is not a valid URL"),
    ("http://127.0.0.1:port", "--url is not a valid URL"),
    ("http://:8080", "--url names no host"),
    ("http://127.0.0.1:1?key=1", "--url must carry no query or fragment"),
    ("http://127.0.0.1:1/v1#top", "--url must carry no query or fragment"),
    ("http://127.0.0.1:1/v\x01", "--url holds a space or a control character"),
    ("http://127.0.0.1:1/a b", "--url holds a space or a control character"),
])
@pytest.mark.parametrize("replay", [False, True])
def test_a_url_the_client_cannot_use_is_a_usage_error(tmp_path: Path, url: str, words: str,
                                                      replay: bool) -> None:
    # Each was a traceback (ValueError, OverflowError, httpx's InvalidURL), a "Connection
    # error" for a server never asked, or a request to a mangled URL ('/?key=1/v1models').
    result = _load(tmp_path, ["--url", url, "--sessions", "1", "--turns", "1"], replay=replay)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.output.splitlines()[-1].startswith(f"Error: {words}"), result.output


@pytest.mark.parametrize("key", ["sk-1\n", "sk\x00", "schlüssel"])
@pytest.mark.parametrize("replay", [False, True])
def test_an_api_key_no_header_can_carry_is_a_usage_error(tmp_path: Path, key: str,
                                                         replay: bool) -> None:
    # A line break (a key read from a file) failed every request as 'connection': "cannot
    # reach" a server that was never asked. The key itself is not echoed.
    result = _load(tmp_path, ["--api-key", key, "--sessions", "1", "--turns", "1"],
                   replay=replay)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (
        "Error: --api-key (or OPENAI_API_KEY) must be printable ASCII: a header carries it")
