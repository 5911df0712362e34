"""The simulator's faults, cancellation accounting, metrics and CLI, seen from a client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from click.testing import CliRunner

from backends.sim import RunningSim, SimConfig, SimStats, running_sim, sim_command
from tests.utils import leave_stream_after

FAST: dict[str, Any] = {"port": 0, "ttft_ms": 2.0, "itl_ms": 1.0, "tokens": 8}
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story"}]
# How long a test waits for the server to notice a departed client (poll is <= 0.1 s).
NOTICE_TIMEOUT_S = 3.0


def fast(**overrides: Any) -> SimConfig:
    return SimConfig(**{**FAST, **overrides})


def client(sim: RunningSim | str, timeout: float = 5.0) -> openai.AsyncOpenAI:
    base_url = sim if isinstance(sim, str) else sim.base_url
    return openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=timeout)


async def wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + NOTICE_TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def outcomes(stats: SimStats) -> tuple[int, int, int, int, int]:
    return stats.started, stats.completed, stats.cancelled, stats.faulted, stats.in_flight


async def stream_contents(api: openai.AsyncOpenAI, into: list[str]) -> None:
    stream = await api.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            into.append(chunk.choices[0].delta.content)


@pytest.mark.parametrize(
    ("status", "error"), [(500, openai.InternalServerError), (429, openai.RateLimitError)]
)
async def test_error_fault_returns_configured_status(
    status: int, error: type[openai.APIStatusError]
) -> None:
    async with running_sim(fast(fault="error", error_status=status)) as sim, client(sim) as api:
        with pytest.raises(error) as caught:
            await api.chat.completions.create(model="sim-model", messages=MESSAGES)
        with pytest.raises(error):
            await api.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
        assert outcomes(sim.stats) == (2, 0, 0, 2, 0)
        assert sim.stats.faults_injected == 2
    assert caught.value.status_code == status
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == status


async def test_hang_before_first_byte_times_out_and_counts_cancelled() -> None:
    async with running_sim(fast(fault="hang_before_first_byte")) as sim:
        async with client(sim, timeout=0.3) as api:
            began = time.monotonic()
            with pytest.raises(openai.APITimeoutError):
                await api.chat.completions.create(model="sim-model", messages=MESSAGES)
            assert time.monotonic() - began >= 0.3
        await wait_for(lambda: sim.stats.in_flight == 0)
        assert outcomes(sim.stats) == (1, 0, 1, 0, 0)


async def test_hang_mid_stream_stalls_after_n_chunks() -> None:
    async with running_sim(fast(fault="hang_mid_stream", fault_after_chunks=3)) as sim:
        contents: list[str] = []
        async with client(sim, timeout=0.3) as api:
            with pytest.raises(openai.APITimeoutError):
                await stream_contents(api, contents)
        assert len(contents) == 3
        await wait_for(lambda: sim.stats.in_flight == 0)
        assert outcomes(sim.stats) == (1, 0, 1, 0, 0)


async def test_reset_mid_stream_resets_the_connection() -> None:
    async with running_sim(fast(fault="reset_mid_stream", fault_after_chunks=2)) as sim:
        contents: list[str] = []
        async with client(sim) as api:
            with pytest.raises(openai.APIConnectionError):
                await stream_contents(api, contents)
            with pytest.raises(openai.APIConnectionError):
                await api.chat.completions.create(model="sim-model", messages=MESSAGES)
        assert len(contents) == 2
        assert outcomes(sim.stats) == (2, 0, 0, 2, 0)
        body = {"messages": MESSAGES, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(sim.base_url + "/chat/completions", json=body) as resp:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()


async def test_malformed_chunks_are_interleaved_and_stream_still_ends() -> None:
    config = fast(fault="malformed_chunks", fault_after_chunks=1, tokens=3)
    async with running_sim(config) as sim:
        body = {"messages": MESSAGES, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(sim.base_url + "/chat/completions", json=body) as resp:
                raw = await resp.read()
        async with client(sim) as api:
            with pytest.raises(json.JSONDecodeError):
                await stream_contents(api, [])
    events = raw.split(b"\n\n")
    assert b"data: {not json" in events
    assert any(event and not event.startswith(b"data: ") for event in events)
    assert raw.endswith(b"data: [DONE]\n\n")
    valid = [json.loads(e[6:]) for e in events if e.startswith(b'data: {"')]
    assert sum(1 for event in valid if event["choices"][0]["delta"].get("content")) == 3


async def test_fault_rate_is_deterministic_by_counter() -> None:
    async with running_sim(fast(fault="error", fault_rate=0.5)) as sim, client(sim) as api:
        results: list[bool] = []
        for _ in range(6):
            try:
                await api.chat.completions.create(model="sim-model", messages=MESSAGES)
                results.append(True)
            except openai.InternalServerError:
                results.append(False)
    assert results == [True, False] * 3


async def test_client_disconnect_mid_stream_is_counted_cancelled() -> None:
    async with running_sim(fast(tokens=200, itl_ms=5.0)) as sim, client(sim) as api:
        stream = await api.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True
        )
        await leave_stream_after(stream, 3)
        await wait_for(lambda: sim.stats.in_flight == 0)
        assert outcomes(sim.stats) == (1, 0, 1, 0, 0)


async def test_metrics_use_vllm_names_and_a_registry_per_app() -> None:
    async with running_sim(fast(cached_tokens=2)) as one, running_sim(fast()) as two:
        async with client(one) as api:
            await api.chat.completions.create(model="sim-model", messages=MESSAGES)
            stream = await api.chat.completions.create(
                model="sim-model", messages=MESSAGES, stream=True, max_tokens=3
            )
            assert len([chunk async for chunk in stream]) == 4
        async with aiohttp.ClientSession() as session:
            async with session.get(one.root_url + "/metrics") as resp:
                assert resp.headers["Content-Type"].startswith("text/plain")
                first = await resp.text()
            async with session.get(two.root_url + "/metrics") as resp:
                second = await resp.text()
    labels = '{engine="0",model_name="sim-model"}'
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert f"{name}{labels} 2.0" in first
        assert f"{name}{labels} 0.0" in second
    # 8 words + end-of-sequence, then 3 words cut by max_tokens: 12 tokens, 10 gaps.
    assert f"vllm:inter_token_latency_seconds_count{labels} 10.0" in first
    assert f"vllm:generation_tokens_total{labels} 12.0" in first
    assert 'finished_reason="stop",model_name="sim-model"} 1.0' in first
    assert 'finished_reason="length",model_name="sim-model"} 1.0' in first
    assert f"vllm:prompt_tokens_total{labels} 16.0" in first
    assert f"vllm:prefix_cache_queries_total{labels} 16.0" in first
    assert f"vllm:prefix_cache_hits_total{labels} 4.0" in first
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"vllm:{gauge}{labels} 0.0" in first


async def test_shutdown_ends_hung_requests_promptly() -> None:
    contents: list[str] = []
    async with running_sim(fast(fault="hang_mid_stream", fault_after_chunks=1)) as sim:
        async with client(sim, timeout=10.0) as api:
            task = asyncio.create_task(stream_contents(api, contents))
            await wait_for(lambda: bool(contents))
            began = time.monotonic()
            await sim.app.shutdown()  # what runner.cleanup() starts with
            with pytest.raises(openai.APIConnectionError):
                await task
            assert time.monotonic() - began < 2.0
        assert outcomes(sim.stats) == (1, 0, 1, 0, 0)


def test_cli_rejects_invalid_settings() -> None:
    result = CliRunner().invoke(sim_command, ["--fault-rate", "2"])
    assert result.exit_code == 2
    result = CliRunner().invoke(sim_command, ["--fault", "explode"])
    assert result.exit_code == 2
    help_text = CliRunner().invoke(sim_command, ["--help"]).output
    for flag in ("--ttft-ms", "--itl-ms", "--cached-tokens", "--variant", "--fault-after-chunks"):
        assert flag in help_text


async def test_cli_serves_until_sigterm() -> None:
    code = "from backends.sim import sim_command; sim_command()"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "--port", "0", "--tokens", "3",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), timeout=20)).decode()
        root = line.rsplit(" ", 1)[-1].strip()
        assert root.startswith("http://127.0.0.1:")
        async with client(root + "/v1") as api:
            answer = await api.completions.create(model="sim-model", prompt="hi")
        assert answer.usage is not None and answer.usage.completion_tokens == 3 + 1
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
