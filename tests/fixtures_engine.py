"""The ``engine_model`` fixture: the reference engine's model, loaded once per session.

Loading dequantizes the GGUF (~10 s on two idle cores); every engine server in the session
shares the one model (its weights are read-only), each with its own ``Engine`` and KV pool.

The engine computes on the CPU, and a shared two-core machine can be many times slower than
an idle one, so every test that uses ``engine_model`` gets ``ENGINE_TEST_TIMEOUT_S`` (unless it
sets its own timeout) and the ``slow`` marker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from backends.engine import LlamaModel, RunningEngineServer, engine_server_config
from backends.engine import running_engine_server as _running_engine_server
from tests.fixture_marks import mark_users

# Enough KV for a few concurrent requests of ~1k tokens; the pages are touched only as used.
TEST_KV_LIMIT_BYTES = 128 << 20
ENGINE_TEST_TIMEOUT_S = 600.0


@pytest.hookimpl(tryfirst=True)  # before -m deselection looks at the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_users(items, "engine_model", pytest.mark.slow, ENGINE_TEST_TIMEOUT_S)


@pytest.fixture(scope="session")
def engine_model() -> LlamaModel:
    return LlamaModel.load()


@asynccontextmanager
async def serve_engine(model: LlamaModel, **config: Any) -> AsyncIterator[RunningEngineServer]:
    """An engine server on an ephemeral loopback port over ``model``."""
    config.setdefault("port", 0)
    if config.get("role") != "router":  # the router holds no KV
        config.setdefault("kv_limit_bytes", TEST_KV_LIMIT_BYTES)
    async with _running_engine_server(engine_server_config(**config), model) as server:
        yield server


@dataclass(frozen=True, slots=True)
class Disaggregated:
    """A router in front of its prefill and decode nodes."""

    router: RunningEngineServer
    prefill: list[RunningEngineServer]
    decode: list[RunningEngineServer]


@asynccontextmanager
async def serve_disaggregated(
    model: LlamaModel,
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    node: dict[str, Any] | None = None,
    **router: Any,
) -> AsyncIterator[Disaggregated]:
    """A router (``router`` config) over prefill and decode nodes (``node`` config), all on
    ephemeral loopback ports over ``model``."""
    node = node or {}
    async with AsyncExitStack() as stack:
        prefill = [
            await stack.enter_async_context(serve_engine(model, role="prefill", **node))
            for _ in range(num_prefill)
        ]
        decode = [
            await stack.enter_async_context(serve_engine(model, role="decode", **node))
            for _ in range(num_decode)
        ]
        front = await stack.enter_async_context(
            serve_engine(
                model,
                role="router",
                prefill_urls=tuple(s.root_url for s in prefill),
                decode_urls=tuple(s.root_url for s in decode),
                **router,
            )
        )
        yield Disaggregated(front, prefill, decode)
