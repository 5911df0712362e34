"""The gateway's ``[record]`` file: credentials never, prompts only when configured, the size
and queue bounds counted (real gateway, real simulator, real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway._record import redact
from tests.utils import eventually, free_port, run_gateway, run_sim

SECRET_KEY = "sk-live-credential-0123456789"
SECRET_PROMPT = "the launch code is PURPLE-ELEPHANT-42"
E_MAIL = "alice@example.com"


def _chat(turn: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": SECRET_PROMPT},
    ]
    for i in range(turn):
        messages += [
            {"role": "assistant", "content": f"answer {i}",
             "tool_calls": [{"id": f"call-{i}", "type": "function",
                             "function": {"name": "search_logs", "arguments": '{"q": "x"}'}}]},
            {"role": "tool", "tool_call_id": f"call-{i}", "content": f"result {i} {SECRET_PROMPT}"},
        ]
    return {"model": "sim-model", "messages": messages, "max_tokens": 4, "user": E_MAIL}


async def _send(url: str, turns: int, session: str = E_MAIL) -> None:
    headers = {"Authorization": f"Bearer {SECRET_KEY}", "X-Session-Id": session,
               "Cookie": f"sid={SECRET_KEY}", "X-Api-Key": SECRET_KEY}
    async with aiohttp.ClientSession() as client:
        for turn in range(turns):
            async with client.post(f"{url}/v1/chat/completions?api-key={SECRET_KEY}",
                                   json=_chat(turn), headers=headers) as response:
                assert response.status == 200
                await response.read()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _files(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in folder.iterdir()}


async def test_recording_redacts_prompts_and_writes_no_credentials(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    async with run_sim(tokens=4) as sim, run_gateway(sim.url, record={"path": str(path)}) as gw:
        await _send(gw.url, 3)
        await eventually(lambda: gw.metric("understudy_record_written_total") == 3)
    text = path.read_text()
    for secret in (SECRET_KEY, SECRET_PROMPT, "PURPLE", E_MAIL, "Bearer", "answer 0"):
        assert secret not in text
    lines = _lines(path)
    assert [line["route"] for line in lines] == ["/v1/chat/completions"] * 3
    assert len({line["session"] for line in lines}) == 1  # one pseudonym per session
    offsets = [line["offset_s"] for line in lines]
    assert offsets == sorted(offsets) and offsets[0] >= 0
    sent, recorded = _chat(2), lines[2]["body"]
    assert recorded["user"] != E_MAIL and recorded["max_tokens"] == 4
    for original, kept in zip(sent["messages"], recorded["messages"], strict=True):
        assert kept["role"] == original["role"]
        assert len(kept["content"]) == len(original["content"])  # sizes survive for replay
    assert recorded["messages"][2]["tool_calls"][0]["function"]["name"] == "search_logs"
    assert recorded["messages"][3]["tool_call_id"] == "call-0"


async def test_recording_keeps_prompts_when_configured(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    config = {"path": str(path), "prompts": True}
    async with run_sim(tokens=4) as sim, run_gateway(sim.url, record=config) as gw:
        await _send(gw.url, 2)
        await eventually(lambda: gw.metric("understudy_record_written_total") == 2)
    text = path.read_text()
    assert SECRET_PROMPT in text
    for secret in (SECRET_KEY, E_MAIL, "Bearer", "sid="):
        assert secret not in text
    assert _lines(path)[1]["body"]["messages"] == _chat(1)["messages"]


async def test_a_recording_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """The file was opened with the process's umask, world-readable under the usual 022:
    with ``prompts = true`` any user on the host could read every recorded prompt."""
    path = tmp_path / "traffic.jsonl"
    old = os.umask(0o022)
    try:
        async with run_sim(tokens=4) as sim, \
                run_gateway(sim.url, record={"path": str(path), "prompts": True}) as gw:
            await _send(gw.url, 1)
            await eventually(lambda: gw.metric("understudy_record_written_total") == 1)
    finally:
        os.umask(old)
    assert SECRET_PROMPT in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600


_PRIVATE = "tenant-acme-7731"
"""In every field of the bodies below that is not a parameter: none may reach the file."""


def _private_fields() -> list[tuple[str, dict[str, Any]]]:
    """A chat and a completion whose texts and identifiers sit outside the messages."""
    chat = {
        "model": "sim-model", "max_tokens": 4, "temperature": 0.5, "top_k": 7,
        "stop": ["###"], "messages": [{"role": "user", "content": "hi"}],
        "user": f"{_PRIVATE}@example.com", "safety_identifier": f"{_PRIVATE}@example.com",
        "prompt_cache_key": _PRIVATE, "cache_salt": _PRIVATE, "request_id": _PRIVATE,
        "metadata": {"customer": _PRIVATE}, "prediction": {"type": "content",
                                                           "content": _PRIVATE},
        "documents": [{"title": _PRIVATE, "text": _PRIVATE}],
        "web_search_options": {"user_location": {"type": "approximate",
                                                 "approximate": {"city": _PRIVATE}}},
        "a_field_no_one_listed": _PRIVATE,
    }
    completion = {"model": "sim-model", "max_tokens": 4, "prompt": _PRIVATE,
                  "suffix": _PRIVATE, "user": _PRIVATE}
    return [("/v1/chat/completions", chat), ("/v1/completions", completion)]


@pytest.mark.parametrize("prompts", [False, True])
async def test_no_text_or_identifier_outside_the_messages_is_written(
        tmp_path: Path, prompts: bool) -> None:
    path = tmp_path / "traffic.jsonl"
    async with run_sim(tokens=4) as sim, \
            run_gateway(sim.url, record={"path": str(path), "prompts": prompts}) as gw:
        async with aiohttp.ClientSession() as client:
            for route, body in _private_fields():
                async with client.post(gw.url + route, json=body,
                                       headers={"X-Session-Id": "s"}) as response:
                    await response.read()
        await eventually(lambda: gw.metric("understudy_record_written_total") == 2)
    chat, completion = (line["body"] for line in _lines(path))
    if not prompts:
        assert _PRIVATE not in path.read_text()
        assert len(chat["prediction"]["content"]) == len(_PRIVATE)  # sizes survive
        assert len(completion["suffix"]) == len(_PRIVATE)
    for key in ("user", "safety_identifier", "prompt_cache_key", "cache_salt", "request_id"):
        assert _PRIVATE not in chat[key]  # a pseudonym, with or without prompts
    assert chat["prompt_cache_key"] == chat["cache_salt"] == chat["request_id"]  # equal stay
    assert chat["user"] == chat["safety_identifier"] != chat["cache_salt"]
    sent = _private_fields()[0][1]
    for key in ("model", "max_tokens", "temperature", "top_k", "stop"):
        assert chat[key] == sent[key]  # parameters are written as sent


async def test_size_bound_exceeded_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    async with run_sim(tokens=4) as sim, \
            run_gateway(sim.url, record={"path": str(path), "max_bytes": 2000}) as gw:
        await _send(gw.url, 6)
        await eventually(lambda: gw.metric("understudy_record_written_total")
                         + gw.metric("understudy_record_dropped_total", reason="max_bytes") == 6)
        written = gw.metric("understudy_record_written_total")
    assert 0 < written < 6
    assert path.stat().st_size <= 2000 and len(_lines(path)) == written


async def test_full_queue_drops_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    async with run_sim(tokens=4) as sim, \
            run_gateway(sim.url, record={"path": str(path), "queue_bytes": 10}) as gw:
        await _send(gw.url, 3)
        assert gw.metric("understudy_record_dropped_total", reason="queue_full") == 3
    assert path.read_text() == ""


async def test_sampling_by_session_records_whole_sessions(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    config = {"path": str(path), "sample_rate": 0.5}
    async with run_sim(tokens=4) as sim, run_gateway(sim.url, record=config) as gw:
        for index in range(12):
            await _send(gw.url, 2, session=f"session-{index}")
        await eventually(lambda: gw.metric("understudy_record_written_total") > 0)
        await gw.state.mirror.stop()  # drains the writer: everything sampled is written
    sessions: dict[str, int] = {}
    for line in _lines(path):
        sessions[line["session"]] = sessions.get(line["session"], 0) + 1
    assert 0 < len(sessions) < 12 and set(sessions.values()) == {2}


async def test_a_write_still_going_at_the_drain_timeout_is_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "traffic.jsonl"
    config = {"path": str(path), "drain_timeout_s": 0.1}
    async with run_sim(tokens=4) as sim, run_gateway(sim.url, record=config) as gw:
        recorder = gw.state.mirror.recorder
        assert recorder is not None
        append = recorder._append

        def stalling_disk(file: Any, data: bytes) -> None:  # fault injection: a slow write
            time.sleep(0.5)
            append(file, data)

        monkeypatch.setattr(recorder, "_append", stalling_disk)
        await _send(gw.url, 3)
        await gw.state.mirror.stop()  # the first batch is still being written: cancelled

        def counted() -> float:
            return (gw.metric("understudy_record_written_total")
                    + gw.metric("understudy_record_dropped_total", reason="shutdown"))

        await eventually(lambda: counted() == 3)
        written = gw.metric("understudy_record_written_total")
    assert written >= 1 and len(_lines(path)) == written


async def test_an_existing_recording_is_kept_as_dot_one(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"old": true}\n')
    async with run_sim(tokens=4) as sim, run_gateway(sim.url, record={"path": str(path)}) as gw:
        await _send(gw.url, 1)
        await eventually(lambda: gw.metric("understudy_record_written_total") == 1)
    assert (tmp_path / "traffic.jsonl.1").read_text() == '{"old": true}\n'
    assert len(_lines(path)) == 1


async def test_a_second_restart_keeps_the_first_recording(tmp_path: Path) -> None:
    # Each run is told apart by the max_tokens it sent (sampling parameters are kept as sent).
    path = tmp_path / "traffic.jsonl"
    async with run_sim(tokens=4) as sim:
        for run in (1, 2, 3):
            async with run_gateway(sim.url, record={"path": str(path)}) as gw:
                async with aiohttp.ClientSession() as client, client.post(
                        f"{gw.url}/v1/chat/completions",
                        json={**_chat(0), "max_tokens": run}) as response:
                    assert response.status == 200
                    await response.read()
                await eventually(lambda: gw.metric("understudy_record_written_total") == 1)
    kept = {name: [json.loads(line)["body"]["max_tokens"] for line in text.splitlines()]
            for name, text in _files(tmp_path).items()}
    assert kept == {"traffic.jsonl": [3], "traffic.jsonl.1": [2], "traffic.jsonl.2": [1]}


async def test_kept_recordings_move_up_to_a_gap_and_no_further(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    for name, text in [("traffic.jsonl", "newest"), ("traffic.jsonl.1", "older"),
                       ("traffic.jsonl.2", "oldest"), ("traffic.jsonl.4", "by hand")]:
        (tmp_path / name).write_text(text + "\n")
    async with run_sim(tokens=4) as sim, run_gateway(sim.url, record={"path": str(path)}):
        pass
    assert _files(tmp_path) == {
        "traffic.jsonl": "", "traffic.jsonl.1": "newest\n", "traffic.jsonl.2": "older\n",
        "traffic.jsonl.3": "oldest\n", "traffic.jsonl.4": "by hand\n"}


def test_redact_keeps_structure_and_sizes() -> None:
    body = {"model": "m", "prompt": "secret words", "input": [[101, 2023]],
            "messages": [{"role": "user", "name": "Alice",
                          "content": [{"type": "text", "text": "hello there"}]}],
            "tools": [{"type": "function", "function": {"name": "t", "description": "d"}}]}
    out = redact(body)
    assert out["model"] == "m" and out["tools"] == body["tools"]
    assert len(out["prompt"]) == len("secret words") and "secret" not in out["prompt"]
    assert out["input"] == [[0, 0]]
    part = out["messages"][0]["content"][0]
    assert part["type"] == "text" and len(part["text"]) == 11 and "hello" not in part["text"]
    assert out["messages"][0]["name"] != "Alice"


@pytest.mark.parametrize("arguments", ['{"q": "the launch code"}', '{"q": 1}', "{}", " {} "])
def test_redacted_tool_call_arguments_stay_a_json_object(arguments: str) -> None:
    call = {"id": "call-0", "type": "function",
            "function": {"name": "search_logs", "arguments": arguments}}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    kept = redact(body)["messages"][0]["tool_calls"][0]["function"]
    assert kept["name"] == "search_logs" and len(kept["arguments"]) == len(arguments)
    assert isinstance(json.loads(kept["arguments"]), dict)  # a server parses them (vLLM)
    assert "launch" not in kept["arguments"]


async def test_a_directory_as_the_path_is_refused_not_moved_aside(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "keep.txt").write_text("kept")
    async with run_sim(tokens=4) as sim:
        with pytest.raises(IsADirectoryError):
            async with run_gateway(sim.url, record={"path": str(folder)}):
                pass
    assert (folder / "keep.txt").read_text() == "kept"
    assert not (tmp_path / "logs.1").exists()


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:  # in the child: writes past ``limit`` fail with EFBIG, mid-line too
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


async def test_a_failed_write_leaves_whole_lines_and_a_clean_stop(tmp_path: Path) -> None:
    path, config, port = tmp_path / "traffic.jsonl", tmp_path / "gw.toml", free_port()
    config.write_text(f'[record]\npath = "{path}"\n[evaluation]\nenabled = false\n')
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "x" * 4000}],
            "max_tokens": 4}
    async with run_sim(tokens=4) as sim:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
            "--primary", sim.url, "--port", str(port), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, preexec_fn=_file_size_limit(10_000))
        try:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as client:
                await _until_up(client, url)
                for sent in range(1, 5):  # ~4.2 kB lines: the third crosses the 10 kB limit
                    async with client.post(f"{url}/v1/chat/completions", json=body) as answer:
                        assert answer.status == 200
                    # One line per write: the next is sent once this one is written or
                    # dropped (a fixed 0.3 s could let a loaded recorder take two at once).
                    metrics = await _once_recorded(client, url, sent)
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(60):
                out, _ = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, out.decode()[-2000:]
    assert "understudy_record_written_total 2.0" in metrics
    assert 'understudy_record_dropped_total{reason="write_error"} 2.0' in metrics
    assert len(_lines(path)) == 2  # whole lines only: no half line to fail a replay
    assert b"Traceback" not in out and out.count(b"WARNING understudy.record") == 1


def _recorded(metrics: str) -> float:
    """Requests the recorder has written or dropped, from a /metrics text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(("understudy_record_written_total ",
                                   "understudy_record_dropped_total{")))


async def _once_recorded(client: aiohttp.ClientSession, url: str, requests: int) -> str:
    """The gateway's /metrics once its recorder has written or dropped ``requests`` requests
    (it writes in a worker thread after the answer); the bound only catches a hang."""
    async with asyncio.timeout(30):
        while True:
            async with client.get(f"{url}/metrics") as answer:
                metrics = await answer.text()
            if _recorded(metrics) >= requests:
                return metrics
            await asyncio.sleep(0.05)


async def _until_up(client: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(60):
        while True:
            try:
                async with client.get(f"{url}/v1/models") as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.2)


async def test_a_session_header_that_is_not_utf8_does_not_end_the_recording(
        tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    body = json.dumps(_chat(0)).encode()
    async with run_sim(tokens=4) as sim, run_gateway(sim.url, record={"path": str(path)}) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        for session in (b"caf\xe9\xff", b"plain", b"caf\xe9\xff"):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                         b"Content-Type: application/json\r\nX-Session-Id: " + session
                         + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                         + body)
            assert (await reader.read()).startswith(b"HTTP/1.1 200")
            writer.close()
            await writer.wait_closed()
        await eventually(lambda: gw.metric("understudy_record_written_total") == 3)
    sessions = [line["session"] for line in _lines(path)]
    assert sessions[0] == sessions[2] != sessions[1]
