"""The engine behind vLLM's OpenAI API: an aiohttp app per role, and serving one on a socket.

Roles (``EngineRole``): ``unified`` answers OpenAI requests from one engine; ``decode`` does the
same and exchanges KV with prefill nodes (``_kv_node``); ``prefill`` only computes prompts' KV
for decode nodes; ``router`` is the OpenAI front of prefill and decode nodes (``_router``).

All state lives on the ``web.Application`` under typed keys, so several engine servers (a
primary without prefix caching and a candidate with it, in one test) run side by side in one
process, sharing nothing but, if the caller wishes, the loaded model (read-only weights).

The engine thread starts and stops in a ``cleanup_ctx``.  At shutdown the listening socket
closes first, in-flight answers get ``serve_app``'s shutdown timeout to finish (the engine keeps
stepping), then the engine loop stops and what is left is aborted.  A prefill node, between the
two, keeps its KV listener serving the sets its answers retained until they are pulled, at most
``SHUTDOWN_PULL_GRACE_S`` (``_transfer`` rule 5): stopped right after answering, it still hands
the decode node that answer's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from backends.openai_wire import (
    ClientGone,
    RequestError,
    RequestKind,
    ResponseIdentity,
    ServedApp,
    ServedModel,
    decode_body,
    install_openai_app,
    invalid_value,
    json_response,
    metrics_response,
    response_id,
    serve_app,
)

from ..kv._peers import KVPeers
from ..kv._plan import KVPlan
from ..model._model import LlamaModel
from ._answer import EngineAnswer
from ._engine import Engine
from ._engine_loop import EngineLoop, EngineServerError
from ._kv_node import KV_SERVER, PREFILL_ROUTE, KVNode, install_kv_node, prefill, receive_prompt_kv
from ._metrics import EngineMetrics
from ._openai import ENGINE_VERSION, parse_generation_request
from ._router import build_router_app
from ._server_config import (
    DecodeServerConfig,
    EngineNodeConfig,
    EngineServerConfig,
    KVNodeConfig,
    PrefillServerConfig,
    RouterServerConfig,
)

__all__ = [
    "ENGINE_LOOP",
    "ENGINE_METRICS",
    "MAX_REQUEST_BODY_BYTES",
    "ContextWindowError",
    "RunningEngineServer",
    "build_engine_app",
    "running_engine_server",
]

log = logging.getLogger(__name__)

MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# A step cannot be interrupted; the engine thread gets this long to notice the stop.
ENGINE_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class _Serving:
    """What the handlers of one app read: fixed when the app is built."""

    config: EngineServerConfig
    model: LlamaModel
    max_model_len: int
    fingerprint: str
    created: int


_SERVING = web.AppKey("engine_serving", _Serving)
ENGINE_LOOP = web.AppKey("engine_loop", EngineLoop)
ENGINE_METRICS = web.AppKey("engine_metrics", EngineMetrics)

def build_engine_app(
    config: EngineServerConfig, model: LlamaModel, kv_plan: KVPlan | None = None
) -> web.Application:
    """The aiohttp app of ``config.role``, serving ``model``.

    ``kv_plan``: the plan of ``config.kv_plan`` as the caller already read and checked it (the
    command line does, before the model loads), so that the engine serves that plan and not
    what the file holds by the time the engine is built; None reads the file here.
    """
    if kv_plan is not None and (config.role == "router" or config.kv_plan is None):
        raise ValueError("a parsed KV plan is the plan of the config's kv_plan file")
    match config:
        case RouterServerConfig():
            return build_router_app(config, model)
        case PrefillServerConfig():
            return _build_prefill_app(config, model, kv_plan)
        case DecodeServerConfig():
            return _build_decode_app(config, model, kv_plan)
        case _:
            return _build_unified_app(config, model, kv_plan)


def _build_unified_app(
    config: EngineNodeConfig, model: LlamaModel, kv_plan: KVPlan | None
) -> web.Application:
    """Prefill and decode in one engine, behind vLLM's OpenAI routes."""
    app = _engine_app(config, model, kv_plan)
    _add_openai_routes(app)
    return app


def _build_decode_app(
    config: DecodeServerConfig, model: LlamaModel, kv_plan: KVPlan | None
) -> web.Application:
    """A unified engine that takes prompts' KV from prefill nodes and keeps each turn's KV
    for the next turn's prefill to read back."""
    app = _build_unified_app(config, model, kv_plan)
    _install_kv(app, config, readback_min_tokens=0)  # a decode node reads nothing back
    return app


def _build_prefill_app(
    config: PrefillServerConfig, model: LlamaModel, kv_plan: KVPlan | None
) -> web.Application:
    """Computes prompts' KV for decode nodes to pull; no OpenAI generation routes."""
    app = _engine_app(config, model, kv_plan)
    _install_kv(app, config, readback_min_tokens=config.kv_readback_min_tokens)
    app.router.add_post(PREFILL_ROUTE, prefill)
    app.cleanup_ctx.append(_kv_pulls_drained)
    return app


def _install_kv(app: web.Application, config: KVNodeConfig, *, readback_min_tokens: int) -> None:
    node = KVNode(
        app[ENGINE_LOOP],
        app[ENGINE_METRICS],
        retain_s=config.retain_s,
        readback_min_tokens=readback_min_tokens,
        listen_host=config.host,
        listen_port=config.kv_port,
        peers=KVPeers.of(config.kv_peers),
        max_serves=config.kv_max_serves,
    )
    install_kv_node(app, node)


def _engine_app(
    config: EngineNodeConfig, model: LlamaModel, kv_plan: KVPlan | None
) -> web.Application:
    """An app running one engine: its thread, metrics, /health and /metrics."""
    if kv_plan is None and config.kv_plan is not None:
        kv_plan = KVPlan.load(config.kv_plan)
    engine = Engine(
        model,
        config.kv_limit_bytes,
        enable_prefix_caching=config.enable_prefix_caching,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
        kv_codec=config.kv_codec if kv_plan is None else kv_plan,
        kv_decoded_cache_bytes=config.kv_decoded_cache_bytes,
    )
    max_model_len = _context_window(config, model, engine)
    metrics = EngineMetrics(config.served_model_name)
    # The engine's gauges (its codec's bytes per token, the decoded cache's bound) hold from
    # the start, not from its first step: a candidate compared before traffic reads its own.
    metrics.observe_stats(engine.stats())
    # The plan's file name beside the codec: a mixed plan's codec name is its digest only.
    metrics.serves_kv_codec(engine.kv_codec, "" if config.kv_plan is None else config.kv_plan.name)
    app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES)
    app[_SERVING] = _Serving(
        config=config,
        model=model,
        max_model_len=max_model_len,
        fingerprint=f"understudy-engine-{model.fingerprint[:4].hex()}",
        created=int(time.time()),
    )
    app[ENGINE_METRICS] = metrics
    app[ENGINE_LOOP] = EngineLoop(
        engine, metrics, capacity=config.max_num_seqs + config.max_waiting_requests
    )
    app.cleanup_ctx.append(_engine_thread)
    install_openai_app(
        app,
        ServedModel(config.served_model_name, max_model_len, created=app[_SERVING].created),
        version=ENGINE_VERSION,
    )
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


class ContextWindowError(ValueError):
    """A ``max_model_len`` the engine cannot honour: beyond the model's context window, or
    more tokens than its KV pool holds."""


def _context_window(config: EngineNodeConfig, model: LlamaModel, engine: Engine) -> int:
    """The engine's ``max_model_len``: every accepted request must fit in the pool on its own,
    or the engine could not run it.  Unset, the model's window capped by the pool; set, it is
    refused past either, as vLLM refuses it at start -- never served shorter than asked, where
    a candidate would refuse the long prompts its primary serves."""
    pool_tokens = engine.pool.num_blocks * engine.block_size
    window = min(model.max_model_len, pool_tokens)
    asked = config.max_model_len
    if asked is None:
        return window
    if asked > model.max_model_len:
        raise ContextWindowError(
            f"{asked} is more than the model's context window ({model.max_model_len} tokens)"
        )
    if asked > pool_tokens:
        raise ContextWindowError(
            f"{asked} tokens is more than the KV pool holds: {pool_tokens} tokens in "
            f"kv_limit_bytes={config.kv_limit_bytes} under KV codec {engine.kv_codec} (give "
            "more KV memory or a smaller max_model_len)"
        )
    return asked


def _add_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)


async def _engine_thread(app: web.Application) -> AsyncIterator[None]:
    loop = app[ENGINE_LOOP]
    loop.start()
    try:
        yield
    finally:
        await loop.stop(ENGINE_STOP_TIMEOUT_S)


async def _kv_pulls_drained(app: web.Application) -> AsyncIterator[None]:
    # Appended after the KV server's context, so its exit runs first: the HTTP listener is
    # closed and the last prefills answered, while the KV listener and the engine (which
    # releases what is pulled) still run.  Decode nodes do not wait: their sets are for a next
    # turn that may never come.
    yield
    await app[KV_SERVER].server.drain()


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    arrived_at = asyncio.get_running_loop().time()
    serving, engine_loop = request.app[_SERVING], request.app[ENGINE_LOOP]
    tokenizer = serving.model.tokenizer
    kv_node = request.app.get(KV_SERVER)
    try:
        body = decode_body(await request.read())
        generation = parse_generation_request(
            kind,
            body,
            tokenizer=tokenizer,
            served_model=serving.config.served_model_name,
            max_model_len=serving.max_model_len,
        )
        if kv_node is not None:
            if generation.cache_salt is not None:  # a prefill node's cache is every tenant's
                raise invalid_value("`cache_salt` is not supported by a disaggregated node.",
                                    param="cache_salt", value=generation.cache_salt)
            await receive_prompt_kv(kv_node, body, generation.prompt_ids)
        handle = engine_loop.submit(
            generation.prompt_ids,
            generation.params,
            arrived_at=arrived_at,
            retain_kv_s=None if kv_node is None else kv_node.retain_s,
            cache_salt=generation.cache_salt,
        )
    except (RequestError, EngineServerError) as exc:
        return json_response(exc.body(), exc.status)
    identity = ResponseIdentity(
        kind=kind,
        response_id=response_id(kind, request),
        created=int(time.time()),
        model=serving.config.served_model_name,
        fingerprint=serving.fingerprint,
    )
    kv_params = None if kv_node is None else kv_node.transfer_params
    writer = EngineAnswer(request, handle, generation, identity, tokenizer, kv_params)
    try:
        if generation.stream_options.stream:
            return await writer.stream()
        return await writer.whole()
    except (ClientGone, ConnectionResetError):
        # Nothing more reaches the client; aiohttp only needs a response object.
        return writer.response or web.Response()
    finally:
        # Also on CancelledError (a runner with handler_cancellation): the engine stops too.
        engine_loop.release(handle, stopped=writer.stopped)


async def _health(request: web.Request) -> web.StreamResponse:
    # vLLM answers 200 with an empty body while its engine lives, 503 once it died.
    return web.Response(status=200 if request.app[ENGINE_LOOP].alive else 503)


async def _metrics(request: web.Request) -> web.StreamResponse:
    return metrics_response(request.app[ENGINE_METRICS].registry)


# -- serving on a socket ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunningEngineServer(ServedApp):
    """A started engine server: where it listens, its app, and its engine."""

    config: EngineServerConfig

    @property
    def engine(self) -> Engine:
        """The engine (every role but the router runs one)."""
        return self.app[ENGINE_LOOP].engine

    @property
    def max_model_len(self) -> int:
        return self.app[_SERVING].max_model_len

    @property
    def kv_port(self) -> int | None:
        """Where a prefill or decode node serves KV pulls."""
        node = self.app.get(KV_SERVER)
        return None if node is None else node.server.port

    @property
    def kv(self) -> KVNode:
        """The KV side of a prefill or decode node."""
        return self.app[KV_SERVER]

    def describe(self) -> str:
        config = self.config
        if config.role == "router":
            return (
                f"routing ({config.routing_policy}, read-back "
                f"{'on' if config.kv_readback else 'off'}) to prefill "
                f"{', '.join(config.prefill_urls)} and decode {', '.join(config.decode_urls)} "
                f"on {self.root_url}"
            )
        caching = "on" if config.enable_prefix_caching else "off"
        text = (
            f"serving {config.served_model_name!r} on {self.root_url} (max_model_len "
            f"{self.max_model_len}, prefix caching {caching}, KV codec {self.engine.kv_codec})"
        )
        if self.kv_port is not None:
            text += f", KV transfers on {config.host}:{self.kv_port}"
        return text


@asynccontextmanager
async def running_engine_server(
    config: EngineServerConfig, model: LlamaModel | None = None, kv_plan: KVPlan | None = None
) -> AsyncIterator[RunningEngineServer]:
    """Serve ``config`` on its host and port (0 picks a free one) until the block exits.

    Without ``model`` the GGUF of ``config.gguf_path`` is loaded first (seconds, off the loop);
    ``kv_plan``: ``config.kv_plan`` already read (``build_engine_app``).
    """
    if model is None:
        model = await asyncio.to_thread(LlamaModel.load, config.gguf_path)
    app = build_engine_app(config, model, kv_plan)
    async with serve_app(app, config.host, config.port, handler_cancellation=True) as served:
        yield RunningEngineServer(app=app, host=served.host, port=served.port, config=config)
