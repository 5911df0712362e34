"""Disaggregated serving with bidirectional KV gives exactly the tokens of a unified engine.

Three ways of serving the same weights -- one engine computing every prompt from scratch, one
engine reusing its prefix cache, and a router over prefill and decode nodes that move KV blocks
both ways over TCP -- must answer every turn of a conversation with the same tokens, greedy or
seeded sampling alike, also when the KV a turn would reuse was evicted, when a transfer is
corrupted or cut, and when the prefill node is gone.  Every test serves the real model on
loopback sockets; prompts stay short so the suite stays quick on two cores.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypedDict

import aiohttp
import openai
import orjson
import pytest
from click.testing import CliRunner
from openai.types.chat import ChatCompletionMessageParam

from backends.engine import LlamaModel, RunningEngineServer, engine_command
from backends.engine.kv._transfer import KVSource
from backends.engine.serving._router import ROUTER
from backends.engine.serving._server import ENGINE_LOOP, ENGINE_METRICS
from tests.fixtures_engine import serve_disaggregated, serve_engine
from tests.utils import eventually, free_ports, run_sim

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are the help desk of a harbour. Answer in one short sentence. " + " ".join(
    f"Pier {i} takes ships of up to {20 + 7 * i} metres; its crane lifts {i + 2} tonnes."
    for i in range(8)
)
# Long enough that a turn's new history passes the 64-token read-back threshold.
QUESTIONS = [
    "Which pier takes ships of 60 metres? "
    + " ".join(f"My ship number {i} is {30 + i} metres long and carries crates." for i in range(6)),
    "And which crane lifts four tonnes? "
    + " ".join(f"Crate {i} weighs {i + 1} tonnes and goes to pier {i % 8}." for i in range(7)),
    "Where should the longest ship go? "
    + " ".join(f"Ship {i} arrives at {8 + i} o'clock with {i * 4} crates." for i in range(7)),
]


class Sampling(TypedDict, total=False):
    temperature: float
    top_p: float
    seed: int


GREEDY: Sampling = {"temperature": 0}
SEEDED: Sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
MAX_TOKENS = 12
SMALL_KV_BYTES = 49 * 30 * 2 * 3 * 16 * 64 * 4  # 48 blocks of SmolLM2 (+ the null block)


async def _turn(
    server: RunningEngineServer, messages: list[ChatCompletionMessageParam], sampling: Sampling
) -> tuple[str, int, int]:
    """``(answer, completion tokens, cached prompt tokens)`` of one streamed turn."""
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, max_tokens=MAX_TOKENS,
            stream_options={"include_usage": True}, **sampling,
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            assert chunk.model_extra is None or "kv_transfer_params" not in chunk.model_extra
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return text, usage.completion_tokens, cached


async def _conversation(
    server: RunningEngineServer,
    sampling: Sampling,
    questions: list[str] = QUESTIONS,
    before_turn: Callable[[int], Awaitable[None]] | None = None,
) -> list[tuple[str, int, int]]:
    """Each turn's ``_turn`` over one conversation; ``before_turn(turn)`` runs ahead of each
    (a fault to set, other traffic to send)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for turn, question in enumerate(questions):
        if before_turn is not None:
            await before_turn(turn)
        messages.append({"role": "user", "content": question})
        turns.append(await _turn(server, messages, sampling))
        messages.append({"role": "assistant", "content": turns[-1][0]})
    return turns


async def _from_scratch(
    engine_model: LlamaModel,
    sampling: Sampling,
    questions: list[str] = QUESTIONS,
    **engine: Any,
) -> list[tuple[str, int, int]]:
    """The turns of a unified engine computing every prompt from scratch (no prefix cache):
    the tokens every other way of serving must give."""
    async with serve_engine(engine_model, enable_prefix_caching=False, **engine) as recompute:
        return await _conversation(recompute, sampling, questions)


def _answers(turns: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """Each turn's text and completion tokens: what must match (cached counts differ by design)."""
    return [(text, tokens) for text, tokens, _ in turns]


def _pulls(server: RunningEngineServer, outcome: str) -> float:
    registry = server.app[ENGINE_METRICS].registry
    labels = {"model_name": MODEL, "engine": "0", "outcome": outcome}
    return registry.get_sample_value("understudy_kv_pulls_total", labels) or 0.0


def _router_count(router: RunningEngineServer, name: str, **labels: str) -> float:
    registry = router.app[ROUTER].metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_unified_prefix_cached_and_disaggregated_give_the_same_tokens(
    engine_model: LlamaModel, sampling: Sampling
) -> None:
    expected = await _from_scratch(engine_model, sampling)
    async with serve_engine(engine_model) as cached:
        reused = await _conversation(cached, sampling)
    # Round robin over two prefill nodes: turn 2 lands on a node that never saw the
    # conversation and must read its history back from the decode node.
    async with serve_disaggregated(
        engine_model, num_prefill=2, routing_policy="round-robin"
    ) as cluster:
        disaggregated = await _conversation(cluster.router, sampling)
        read_back = sum(_pulls(p, "ok") for p in cluster.prefill)
        shipped = _pulls(cluster.decode[0], "ok")
    assert all(text for text, _, _ in expected)
    assert _answers(reused) == _answers(expected)
    assert _answers(disaggregated) == _answers(expected)
    assert all(cached == 0 for _, _, cached in expected)
    # Every later turn reused its whole history but the last partial block.
    for (_, _, cached_a), (_, _, cached_b) in zip(reused[1:], disaggregated[1:], strict=True):
        assert cached_a > 200 and cached_b > 200
    assert read_back >= 2  # turn 2 on the fresh node, turn 3 the newer history
    assert shipped == 3  # every turn's prompt blocks went prefill -> decode


async def test_a_windowed_codec_gives_the_unified_tokens_disaggregated(
    engine_model: LlamaModel,
) -> None:
    """e8-2w both ways: a turn's prompt blocks go prefill -> decode packed, the window's blocks
    with their raw rows, and the history comes back decode -> prefill the same way, so every
    turn has the tokens of a unified e8-2w engine computing it from scratch."""
    expected = await _from_scratch(engine_model, GREEDY, kv_codec="e8-2w")
    async with serve_disaggregated(
        engine_model, num_prefill=2, routing_policy="round-robin", node={"kv_codec": "e8-2w"}
    ) as cluster:
        disaggregated = await _conversation(cluster.router, GREEDY)
        read_back = sum(_pulls(p, "ok") for p in cluster.prefill)
        shipped = _pulls(cluster.decode[0], "ok")
    assert _answers(disaggregated) == _answers(expected)
    assert all(cached > 200 for _, _, cached in disaggregated[1:])
    assert read_back >= 2 and shipped == 3


async def test_tokens_survive_corrupted_and_cut_transfers(engine_model: LlamaModel) -> None:
    expected = await _from_scratch(engine_model, SEEDED)
    async with serve_disaggregated(
        engine_model, num_prefill=2, routing_policy="round-robin"
    ) as cluster:
        (first, second), decode = cluster.prefill, cluster.decode[0]

        async def faults(turn: int) -> None:
            if turn == 1:
                # Turn 2 goes to the second prefill node, which reads the history back from
                # the decode node -- corrupted on the way: checksum, recompute.
                decode.kv.server.fault = "corrupt"
            if turn == 2:
                # Turn 3 is back on the first node, which reads back the part it lacks (fine
                # now) and hangs up on the decode node pulling the prompt: it recomputes.
                decode.kv.server.fault = None
                first.kv.server.fault = "drop"

        got = await _conversation(cluster.router, SEEDED, before_turn=faults)
        assert _pulls(second, "checksum") == 1
        assert _pulls(first, "ok") == 1
        assert _pulls(decode, "protocol") == 1
        assert _pulls(decode, "ok") == 2
    assert _answers(got) == _answers(expected)


async def test_tokens_survive_eviction_of_everything_a_turn_would_reuse(
    engine_model: LlamaModel,
) -> None:
    expected = await _from_scratch(engine_model, SEEDED, QUESTIONS[:2])
    async with serve_disaggregated(
        engine_model, node={"kv_limit_bytes": SMALL_KV_BYTES}
    ) as cluster:
        prefill, decode = cluster.prefill[0], cluster.decode[0]

        async def fillers(turn: int) -> None:
            if turn == 1:
                # Two long conversations in between: the prefill node's LRU cache loses the
                # history, and the decode node reclaims its retained set to run them.
                for filler in range(2):
                    other: list[ChatCompletionMessageParam] = [
                        {"role": "user", "content": f"Story {filler}: " + SYSTEM * 3}
                    ]
                    await _turn(cluster.router, other, GREEDY)

        got = await _conversation(cluster.router, SEEDED, QUESTIONS[:2], before_turn=fillers)
        # The read-back was tried (the history was gone from the prefill node's cache) and
        # found the decode node's set gone too.
        assert _pulls(prefill, "unknown_ticket") == 1
        assert _pulls(decode, "ok") == 4
    assert _answers(got) == _answers(expected)


async def test_a_dead_prefill_node_means_the_decode_node_computes(
    engine_model: LlamaModel,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening
        expected = await _from_scratch(engine_model, GREEDY, QUESTIONS[:2])
        async with serve_engine(engine_model, role="decode") as decode, serve_engine(
            engine_model, role="router", prefill_urls=(dead,), decode_urls=(decode.root_url,)
        ) as router:  # fmt: skip
            got = await _conversation(router, GREEDY, QUESTIONS[:2])
            failures = _router_count(router, "understudy_router_prefill_failures_total")
    assert _answers(got) == _answers(expected)
    assert failures == 2


async def test_the_router_keeps_kv_params_to_itself_and_answers_errors_like_an_engine(
    engine_model: LlamaModel,
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi"},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
    }
    async with serve_engine(engine_model) as unified, serve_disaggregated(
        engine_model
    ) as cluster, aiohttp.ClientSession() as http:  # fmt: skip
        async with http.post(cluster.router.base_url + "/chat/completions", json=body) as resp:
            assert resp.status == 200
            whole = await resp.json()
        assert "kv_transfer_params" in whole and whole["kv_transfer_params"] is None
        async with http.post(
            cluster.router.base_url + "/chat/completions", json={**body, "stream": True}
        ) as resp:
            raw = await resp.read()
        assert b"kv_transfer_params" not in raw and raw.endswith(b"data: [DONE]\n\n")
        # The decode node did retain the turn: the router filed it for the next one.
        answer: str = whole["choices"][0]["message"]["content"]
        follow_up: list[ChatCompletionMessageParam] = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Thanks!"},
        ]
        await _turn(cluster.router, follow_up, GREEDY)
        attached = _router_count(
            cluster.router, "understudy_router_readback_total", outcome="attached"
        )
        assert attached == 1
        for bad in (
            {**body, "model": "other"},
            {**body, "max_tokens": -1},
            {**body, "messages": []},
        ):
            answers = []
            for server in (unified, cluster.router):
                async with http.post(server.base_url + "/chat/completions", json=bad) as resp:
                    answers.append((resp.status, orjson.loads(await resp.read())))
            assert answers[0] == answers[1] and 400 <= answers[0][0] < 500


# kv_transfer_params naming a host that is no KV peer of a node (TEST-NET-3: nothing answers).
FOREIGN_KV = {
    "remote_host": "203.0.113.7",
    "remote_port": 8351,
    "ticket": "00" * 16,
    "num_blocks": 12,
    "last_block_hash": "00" * 32,
}


async def test_a_node_reached_directly_pulls_from_no_host_a_client_names(
    engine_model: LlamaModel,
) -> None:
    """A decode node's ``kv_transfer_params`` and a prefill node's ``kv_source`` come in bodies
    anyone who reaches the node can send: one naming a host that is not a KV peer (by default
    this host only) is a 400, and no connection is opened."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}],
            "max_tokens": 2, "kv_transfer_params": FOREIGN_KV}  # fmt: skip
    prompt = [(i * 7919) % 20_000 + 100 for i in range(200)]  # 12 full blocks
    async with (
        serve_engine(engine_model, role="decode") as decode,
        serve_engine(engine_model, role="prefill") as prefill,
        aiohttp.ClientSession() as http,
        asyncio.timeout(5),  # refused at once: no pull waited out
    ):
        async with http.post(decode.base_url + "/chat/completions", json=chat) as resp:
            status, error = resp.status, (await resp.json())["error"]
        assert status == 400 and error["type"] == "BadRequestError" and error["code"] == 400
        assert error["param"] == "kv_transfer_params.remote_host"
        assert error["message"] == (
            "kv_transfer_params names a KV host this node does not pull from; its KV peers are "
            "127.0.0.0/8, ::1, 0.0.0.0, ::, localhost (--kv-peer) "
            "(parameter=kv_transfer_params.remote_host, value=203.0.113.7)"
        )
        body = {"prompt_token_ids": prompt, "kv_source": FOREIGN_KV}
        async with http.post(prefill.root_url + "/kv/v1/prefill", json=body) as resp:
            status, error = resp.status, (await resp.json())["error"]
        assert status == 400 and error["param"] == "kv_source.remote_host"
    for node in (decode, prefill):
        assert _pulls(node, "untrusted") == 1
        assert _pulls(node, "timeout") == _pulls(node, "connection") == 0


async def test_nodes_pull_from_the_peers_they_are_given(engine_model: LlamaModel) -> None:
    """Peers by name (an address the name resolves to is admitted) keep the router's flow
    whole; a peer list without the prefill node's host refuses its parameters."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTIONS[0]}]
    async with serve_disaggregated(engine_model, node={"kv_peers": ("localhost",)}) as cluster:
        await _turn(cluster.router, messages, GREEDY)
        assert _pulls(cluster.decode[0], "ok") == 1
    async with serve_disaggregated(
        engine_model, node={"kv_peers": ("10.0.0.0/8",)}
    ) as cluster, aiohttp.ClientSession() as http:  # fmt: skip
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        async with http.post(cluster.router.base_url + "/chat/completions", json=body) as resp:
            assert resp.status == 400  # the decode node's refusal, relayed (router rule 4)
            assert "10.0.0.0/8 (--kv-peer)" in (await resp.json())["error"]["message"]
        assert _pulls(cluster.decode[0], "untrusted") == 1


def test_cli_refuses_roles_without_what_they_need() -> None:
    runner = CliRunner()
    result = runner.invoke(engine_command, ["--role", "router"])
    assert result.exit_code == 2 and "prefill and one decode node" in result.output
    result = runner.invoke(engine_command, ["--role", "decode", "--no-prefix-caching"])
    assert result.exit_code == 2 and "prefix cache" in result.output
    result = runner.invoke(engine_command, ["--role", "unified", "--prefill", "http://127.0.0.1:1"])
    assert result.exit_code == 2 and "only the router" in result.output


async def test_the_router_relays_decode_failures_and_client_departures(
    engine_model: LlamaModel,
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with (
            run_sim(
                model=MODEL, fault="reset_mid_stream", fault_after_chunks=2, itl_ms=1
            ) as broken,
            run_sim(model=MODEL, fault="error", error_status=503) as refusing,
        ):
            for decode, stream in ((broken.url, True), (refusing.url, False)):
                async with serve_engine(
                    engine_model, role="router", prefill_urls=(dead,), decode_urls=(decode,)
                ) as router, aiohttp.ClientSession() as http:  # fmt: skip
                    url = router.base_url + "/chat/completions"
                    async with http.post(url, json={**body, "stream": stream}) as resp:
                        status, raw = resp.status, await resp.read()
                if stream:
                    # Headers were out: the failure is an error event, then [DONE].
                    assert status == 200
                    assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n")
                else:
                    assert status == 503 and b'"error"' in raw
    # A client that leaves mid-answer ends the decode node's request too.
    async with serve_disaggregated(engine_model) as cluster, aiohttp.ClientSession() as http:
        loop = cluster.decode[0].app[ENGINE_LOOP]
        long = {**body, "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with http.post(cluster.router.base_url + "/chat/completions", json=long) as resp:
            await resp.content.readline()
            assert loop.num_in_flight == 1
        await eventually(lambda: loop.num_in_flight == 0, within_s=30)


@dataclass(frozen=True, slots=True)
class _PrefillProcess:
    process: asyncio.subprocess.Process
    url: str
    http_port: int


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


@asynccontextmanager
async def _prefill_process() -> AsyncIterator[_PrefillProcess]:
    """``understudy engine --role prefill`` in a process of its own, up and healthy."""
    port, kv_port = free_ports(2)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "engine", "--role", "prefill", "--host",
        "127.0.0.1", "--port", str(port), "--kv-port", str(kv_port), "--kv-gib", "0.125",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http, asyncio.timeout(120):
            while True:
                try:
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert process.returncode is None, "the prefill node did not start"
                await asyncio.sleep(0.1)
        yield _PrefillProcess(process, url, port)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _exit_status(process: asyncio.subprocess.Process) -> tuple[int, str]:
    async with asyncio.timeout(60):
        out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace")


async def test_a_stopped_prefill_node_still_hands_over_its_last_answer(
    engine_model: LlamaModel,
) -> None:
    """SIGTERM right after a prefill: the node takes no new prefill, but its KV listener
    serves the answer's set until the decode node has pulled it, then the node exits."""
    prompt = [(i * 7919) % 20_000 + 100 for i in range(200)]  # 12 full blocks
    async with _prefill_process() as node, serve_engine(engine_model, role="decode") as decode:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                node.url + "/kv/v1/prefill", json={"prompt_token_ids": prompt}
            ) as resp:
                assert resp.status == 200
                params = (await resp.json())["kv_transfer_params"]
        source = KVSource.from_params(params)
        assert source.num_blocks == 12
        node.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):  # the HTTP side is closed: no new prefills
            while True:
                if not await _accepts(node.http_port):
                    break
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # what a router and a decode node take before the pull
        hashes = decode.kv.hashes(prompt)
        pulled = await decode.kv.pull(source, hashes, min_tokens=0, release=True)
        pulled_at = time.monotonic()
        status, out = await _exit_status(node.process)
        waited = time.monotonic() - pulled_at
    assert _pulls(decode, "connection") == 0, out[-2000:]
    assert pulled == 12 and _pulls(decode, "ok") == 1
    assert status == 0 and "Traceback" not in out, out[-2000:]
    assert waited < 3.0  # pulled and released: no grace period left to sit out


async def test_a_stopped_prefill_node_with_nothing_retained_exits_at_once() -> None:
    async with _prefill_process() as node:
        started = time.monotonic()
        node.process.send_signal(signal.SIGTERM)
        status, out = await _exit_status(node.process)
        took = time.monotonic() - started
    assert status == 0 and "Traceback" not in out, out[-2000:]
    assert took < 3.0
