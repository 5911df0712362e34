"""The router's own checks: it refuses what its nodes would refuse, without asking them.

Real nodes with a small KV pool (fewer tokens than the model's window) on loopback sockets.
"""

from __future__ import annotations

import socket

import aiohttp
import orjson
import pytest

from backends.engine import LlamaModel, RunningEngineServer
from backends.engine.serving import _router
from backends.engine.serving._router import ROUTER
from tests.fixtures_engine import serve_disaggregated, serve_engine
from tests.utils import eventually, free_ports

MODEL = "SmolLM2-135M-Instruct"
SMALL_KV_BYTES = 49 * 30 * 2 * 3 * 16 * 64 * 4  # 48 blocks of SmolLM2 (+ the null block)
TOO_LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Pier 3 takes ships of 41 metres. " * 120}],
    "max_tokens": 4,
}


def _router_count(router: RunningEngineServer, name: str, **labels: str) -> float:
    registry = router.app[ROUTER].metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


async def _refused_alike(
    node: RunningEngineServer, router: RunningEngineServer, http: aiohttp.ClientSession
) -> None:
    """The router answers ``TOO_LONG`` with the node's own 400, and routes nothing."""
    limit = node.max_model_len
    answers = []
    for server in (node, router):
        async with http.post(server.base_url + "/chat/completions", json=TOO_LONG) as resp:
            answers.append((resp.status, orjson.loads(await resp.read())))
    assert answers[0] == answers[1] and answers[0][0] == 400
    assert f"maximum context length is {limit} tokens" in answers[0][1]["error"]["message"]
    # Neither node saw it: nothing was routed, no prefill failed.
    assert _router_count(router, "understudy_router_prefill_failures_total") == 0
    routed = _router_count(router, "understudy_router_requests_total", prefill="0", decode="0")
    assert routed == 0
    assert router.app[ROUTER].max_model_len == limit


async def test_the_router_refuses_a_prompt_its_nodes_cannot_hold(
    engine_model: LlamaModel,
) -> None:
    async with serve_disaggregated(
        engine_model, node={"kv_limit_bytes": SMALL_KV_BYTES}
    ) as cluster, aiohttp.ClientSession() as http:  # fmt: skip
        assert cluster.decode[0].max_model_len < engine_model.max_model_len
        await _refused_alike(cluster.decode[0], cluster.router, http)


async def test_a_node_not_up_leaves_the_others_limit_standing(engine_model: LlamaModel) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening
        async with serve_engine(
            engine_model, role="decode", kv_limit_bytes=SMALL_KV_BYTES
        ) as decode, serve_engine(
            engine_model, role="router", prefill_urls=(dead,), decode_urls=(decode.root_url,)
        ) as router, aiohttp.ClientSession() as http:  # fmt: skip
            await _refused_alike(decode, router, http)


async def test_nodes_that_come_up_later_are_asked_when_requests_arrive(
    engine_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_router, "NODE_LIMIT_RETRY_S", 0.0)
    prefill_port, decode_port = free_ports(2)
    async with serve_engine(
        engine_model,
        role="router",
        prefill_urls=(f"http://127.0.0.1:{prefill_port}",),
        decode_urls=(f"http://127.0.0.1:{decode_port}",),
    ) as router:
        state = router.app[ROUTER]
        assert state.max_model_len == engine_model.max_model_len  # nobody to ask yet
        async with serve_engine(
            engine_model, role="prefill", port=prefill_port, kv_limit_bytes=SMALL_KV_BYTES
        ) as prefill, serve_engine(
            engine_model, role="decode", port=decode_port, kv_limit_bytes=SMALL_KV_BYTES
        ) as decode, aiohttp.ClientSession() as http:  # fmt: skip
            # Not asked yet: the nodes refuse for themselves, as before; a request sets the
            # router asking them.
            async with http.post(router.base_url + "/chat/completions", json=TOO_LONG) as resp:
                assert resp.status == 400
            await eventually(lambda: state.max_model_len == decode.max_model_len)
            assert prefill.max_model_len == decode.max_model_len
            labels = {"prefill": "0", "decode": "0"}
            routed = _router_count(router, "understudy_router_requests_total", **labels)
            async with http.post(router.base_url + "/chat/completions", json=TOO_LONG) as resp:
                assert resp.status == 400
            assert _router_count(router, "understudy_router_requests_total", **labels) == routed
