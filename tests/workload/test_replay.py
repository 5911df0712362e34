"""``replay_workload``: recorded traffic sent again with its relative timing, bounded; and
the round trip gateway ``[record]`` -> ``understudy load --replay`` -> gateway."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tracemalloc
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

import workload._replay
from gateway.cli import main
from tests.utils import eventually, free_port, run_gateway, run_sim
from workload import ReplaySpec, WorkloadSpec, read_records, replay_workload, run_workload

FAST = {"ttft_ms": 5.0, "itl_ms": 1.0, "tokens": 8}
TIMING_TOLERANCE_S = 0.08


def _chat(text: str) -> dict[str, object]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}],
            "max_tokens": 4, "stream": True}


def _write(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


async def test_replay_keeps_relative_timing_and_bounds(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    _write(path, [
        {"offset_s": 10.6, "route": "/v1/chat/completions", "session": "b", "body": _chat("c")},
        {"offset_s": 10.0, "route": "/v1/chat/completions", "session": "a", "body": _chat("a")},
        {"offset_s": 10.3, "route": "/v1/completions", "session": "a",
         "body": {"model": "sim-model", "prompt": "hello", "max_tokens": 4}},
        {"offset_s": 10.4, "route": "/v1/models", "session": "a", "body": {}},
        {"offset_s": 15.0, "route": "/v1/chat/completions", "session": "a", "body": _chat("d")},
    ])
    async with run_sim(**FAST) as sim:
        summary = await replay_workload(path, sim.url, spec=ReplaySpec(speed=2, duration_s=1))
        seen = [r.headers.get("x-session-id") for r in sim.stats.requests]
    assert summary.turns == 3 and summary.errors == 0
    assert summary.not_sent == 2  # /v1/models is not replayable; 15.0 s is past duration_s
    starts = [r.started_s for r in summary.results]
    for got, want in zip(starts, [0.0, 0.15, 0.3], strict=True):
        assert want <= got + 0.005 and got <= want + TIMING_TOLERANCE_S
    assert seen == ["a", "a", "b"]


async def test_a_file_that_is_not_a_recording_fails_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"offset_s": 0, "route": "/v1/completions", "body": {}}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        read_records(path, 10)
    assert len(read_records(path, 1)) == 1  # max_requests bounds the read


async def test_record_then_replay_round_trip(tmp_path: Path) -> None:
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    spec = WorkloadSpec(sessions=4, turns=3, rate=8, think_s=0.2, duration_s=30, seed=3)
    async with run_sim(**FAST) as sim:
        record = {"path": str(first), "prompts": True}
        async with run_gateway(sim.url, record=record) as gw:
            original = await run_workload(spec, gw.base_url)
            await eventually(lambda: gw.metric("understudy_record_written_total") == 12)
        record = {"path": str(second), "prompts": True}
        async with run_gateway(sim.url, record=record) as gw:
            replayed = await replay_workload(first, gw.url)
            await eventually(lambda: gw.metric("understudy_record_written_total") == 12)
    assert original.errors == 0 and replayed.errors == 0 and replayed.turns == 12
    before, after = read_records(first, 100), read_records(second, 100)
    assert [r.body for r in before] == [r.body for r in after]  # the same requests
    assert [r.turn for r in after] == [r.turn for r in before]
    # Seen by the second gateway, the replay keeps the recorded spacing. Each request's
    # shift is read against the typical one (not the first request's, which a late start
    # would make every other look early); on a loaded machine a few arrive a scheduling
    # slice late, so the typical drift is held to the tolerance. A replay that ignored the
    # offsets would send the 12 at once: half of them half the recording's span early.
    shifts = sorted(new.offset_s - old.offset_s for old, new in zip(before, after, strict=True))
    typical = shifts[len(shifts) // 2]
    drifts = sorted(abs(shift - typical) for shift in shifts)
    assert drifts[len(drifts) // 2] <= TIMING_TOLERANCE_S, drifts
    assert before[-1].offset_s - before[0].offset_s > 6 * TIMING_TOLERANCE_S  # spacing to keep
    # Sessions stay sessions (each file has its own pseudonyms).
    pairs = {(old.session, new.session) for old, new in zip(before, after, strict=True)}
    assert len(pairs) == len({s for s, _ in pairs}) == len({s for _, s in pairs}) == 4


async def test_the_summary_says_what_the_errors_were(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    _write(path, [{"offset_s": i * 0.01, "route": "/v1/chat/completions", "session": "a",
                   "body": _chat("x")} for i in range(4)])
    async with run_sim(fault="error", error_status=503, fault_rate=0.5, **FAST) as sim:
        summary = await replay_workload(path, sim.url, spec=ReplaySpec(concurrency=1))
        args = ["load", "--url", sim.url, "--replay", str(path), "--concurrency", "1"]
        table = await asyncio.to_thread(CliRunner().invoke, main, args)
        as_json = await asyncio.to_thread(CliRunner().invoke, main, [*args, "--json"])
    refused = await replay_workload(path, f"http://127.0.0.1:{free_port()}")
    assert summary.errors == 2 and summary.errors_by_kind == (("http_503", 2),)
    assert refused.errors_by_kind == (("connection", 4),)
    assert "2 errors (http_503: 2)" in table.output
    assert json.loads(as_json.output.splitlines()[-1])["errors_by_kind"] == {"http_503": 2}


async def test_ctrl_c_stops_a_replay_and_prints_what_was_sent(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    _write(path, [{"offset_s": i * 0.05, "route": "/v1/chat/completions", "session": "a",
                   "body": _chat("x")} for i in range(400)])  # 20 s of traffic
    async with run_sim(**FAST) as sim:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "load", "--url", sim.url, "--replay",
            str(path), "--json", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            await eventually(lambda: len(sim.stats.requests) >= 5, within_s=60)
            process.send_signal(signal.SIGINT)
            async with asyncio.timeout(10):  # prompt: not the 20 s the file would take
                out, err = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 128 + signal.SIGINT, err.decode()
    doc = json.loads(out.decode().splitlines()[-1])
    assert doc["turns"] >= 5 and doc["turns"] + doc["not_sent"] == 400
    assert b"Stopped by SIGINT" in err and b"Traceback" not in err


async def test_records_waiting_for_a_slot_at_the_end_are_counted_not_sent(
        tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    _write(path, [{"offset_s": 0, "route": "/v1/chat/completions", "session": f"s{i}",
                   "body": _chat("x")} for i in range(4)])
    async with run_sim(ttft_ms=5000, tokens=4) as slow:
        spec = ReplaySpec(concurrency=1, drain_s=0.3)
        summary = await replay_workload(path, slow.url, spec=spec)
    assert summary.turns == 1 and summary.errors_by_kind == (("cancelled", 1),)
    assert summary.not_sent == 3


@pytest.mark.parametrize("line", [
    b'{"offset_s": Infinity, "route": "/v1/completions", "body": {}}',
    b'{"offset_s": "1e400", "route": "/v1/completions", "body": {}}',
    b'{"offset_s": 0, "route": ["/v1/completions"], "body": {}}',
    b'{"offset_s": 0, "route": "/v1/completions", "body": {"prompt": "\xff\xfe"}}',
    b'{"offset_s": 0, "route": "/v1/completions", "body": {"prompt": "a \\ud800 b"}}',
    b'{"offset_s": "5", "route": "/v1/completions", "body": {}}',
    b'{"offset_s": true, "route": "/v1/completions", "body": {}}',
])
async def test_a_line_that_is_not_a_record_is_named(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b'{"offset_s": 0, "route": "/v1/completions", "body": {}}\n' + line + b"\n")
    with pytest.raises(ValueError, match=r"odd\.jsonl:2: not a traffic record"):
        read_records(path, 10)


async def test_an_empty_recording_is_an_error_not_an_empty_replay(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no traffic records"):
        await replay_workload(path, f"http://127.0.0.1:{free_port()}")
    args = ["load", "--url", "http://127.0.0.1:1", "--replay", str(path)]
    result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"Error: {path}: no traffic records"]


async def test_lines_past_max_requests_are_counted_apart_from_not_sent(
        tmp_path: Path) -> None:
    # The lines past --max-requests are not read (rule 1): records or junk (a log line, a
    # last line cut short), they were all counted as records not sent (5 here, 2 of them junk).
    path = tmp_path / "rec.jsonl"
    _write(path, [{"offset_s": i * 0.01, "route": "/v1/chat/completions", "session": "a",
                   "body": _chat("x")} for i in range(5)])
    with path.open("a") as fh:
        fh.write('replay done\n\n{"offset_s": 9, "rou')
    async with run_sim(**FAST) as sim:
        summary = await replay_workload(path, sim.url, spec=ReplaySpec(max_requests=2))
        args = ["load", "--url", sim.url, "--replay", str(path), "--max-requests", "2"]
        table = await asyncio.to_thread(CliRunner().invoke, main, args)
        as_json = await asyncio.to_thread(CliRunner().invoke, main, [*args, "--json"])
    assert summary.turns == 2 and summary.not_sent == 0  # was 5
    assert summary.lines_past_max_requests == 5  # 3 records, 2 junk lines; the blank one not
    assert summary.sessions_completed == 1  # the records read were all sent and answered
    assert "0 not sent, 5 lines past --max-requests," in " ".join(table.output.split())
    doc = json.loads(as_json.output.splitlines()[-1])
    assert (doc["turns"], doc["not_sent"], doc["lines_past_max_requests"]) == (2, 0, 5)


async def test_a_replayed_session_with_records_not_sent_is_not_completed(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    _write(path, [{"offset_s": at, "route": "/v1/chat/completions", "session": session,
                   "body": _chat("x")}
                  for at, session in [(0, "a"), (0.05, "b"), (0.1, "a"), (30, "a")]])
    async with run_sim(**FAST) as sim:
        summary = await replay_workload(path, sim.url, spec=ReplaySpec(duration_s=1))
    assert summary.turns == 3 and summary.errors == 0 and summary.not_sent == 1
    assert summary.sessions == 2 and summary.sessions_completed == 1  # b; a's third not sent


async def test_a_replay_holds_the_bodies_in_flight_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    body = _chat("x" * 50_000)
    with path.open("w") as fh:  # 20 MB of records, 0.01 s apart
        for i in range(400):
            fh.write(json.dumps({"offset_s": i * 0.01, "route": "/v1/chat/completions",
                                 "session": f"s{i % 7}", "body": body}) + "\n")
    async with run_sim(ttft_ms=5000, tokens=4) as slow:  # 100 records due, 2 in flight
        spec = ReplaySpec(duration_s=1, concurrency=2, drain_s=0.2)
        tracemalloc.start()
        try:
            summary = await replay_workload(path, slow.url, spec=spec)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert summary.turns == 2 and summary.errors_by_kind == (("cancelled", 2),)
    assert summary.not_sent == 398
    assert peak < path.stat().st_size / 4, peak  # was the whole file, parsed


async def test_a_line_over_the_bound_is_refused_without_reading_it_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A file that is no recording (a model's weights, a tarball) has lines of any length: the
    # check read each whole, 3x its size in memory (1.2 GB for a 400 MB line).
    monkeypatch.setattr(workload._replay, "MAX_RECORD_LINE_BYTES", 1000)
    record = b'{"offset_s": 0, "route": "/v1/completions", "body": {}}\n'
    path = tmp_path / "blob.jsonl"
    path.write_bytes(record + b"x" * 2_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"blob\.jsonl:2: not a traffic record \(a line "
                                             r"over 1000 bytes\)"):
            read_records(path, 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000, peak
    path.write_bytes(record + b'{"offset_s": 0, "route": "/v1/completions", "body": '
                     b'{"prompt": "' + b"y" * 1000 + b'"}}\n')
    with pytest.raises(ValueError, match=r"blob\.jsonl:2: .*a line over 1000 bytes"):
        read_records(path, 1)  # past max_requests too: not read whole to be counted


async def test_a_client_that_cannot_be_made_leaves_the_file_closed(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    _write(path, [{"offset_s": 0, "route": "/v1/completions", "body": {}}])
    with pytest.raises(Exception, match="non-printable"):  # the client's InvalidURL
        await replay_workload(path, "http://127.0.0.1:1/v\x01")
    assert str(path) not in {f.path for f in psutil.Process().open_files()}


async def test_stop_while_the_file_is_checked_ends_the_replay_at_once(tmp_path: Path) -> None:
    # The check (in a thread) ran to its end whatever the stop, so Ctrl-C or a supervisor's
    # SIGTERM waited for it: 11 s on a 137 MB recording.
    path = tmp_path / "rec.jsonl"
    with path.open("wb") as fh:
        fh.write(b'{"offset_s": 0, "route": "/v1/completions", "body": {}}\n')
        fh.write(b"x\n" * 10_000_000)  # only counted past max_requests, yet seconds
    stop = asyncio.Event()
    stop.set()  # before the check: no race between its speed and a timer
    loop = asyncio.get_running_loop()
    began = loop.time()
    summary = await replay_workload(path, f"http://127.0.0.1:{free_port()}",
                                    spec=ReplaySpec(max_requests=1), stop=stop)
    # Stopped within the check: none of the 10 M lines past max_requests was counted (the
    # whole check counted them all as not sent, in seconds); the time bound only catches a
    # hang, generous for a loaded machine (0.54 s in a CI run, 3.3 s for the whole check):
    # the counts above, not the clock, tell a stopped check from a whole one.
    assert summary.turns == 0 and summary.not_sent == 0  # none was counted, none sent
    assert summary.lines_past_max_requests == 0
    assert loop.time() - began < 30.0
