"""The aiohttp application: routes, lifecycle, and the serve loop.

The proxy's socket is served by the front (``_front.py``): ``/v1/`` requests are read and
relayed there; a connection whose request is for anything else is handed to this app,
whose ``/v1/`` route (``_proxy``) relays the rest of that connection's requests.

Lifecycle (one place): ``cleanup_ctx`` opens the upstream pools at start and closes them
last. Shutdown order (``serve``): every listener stops accepting at once; the admin API's
requests in flight, then the proxy's, finish within ``shutdown_timeout_s`` each (kept by
aiohttp's runners), the rest are cancelled; then the app's state closes, the pools last.
SIGINT and SIGTERM are handled from before the start: one that comes while the app starts
(the store, the scoring child) lets the start finish, listens on nothing, and shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import HttpVersion11, web

from evaluators import EvaluationSink, MemorySink
from gateway._admin import admin_tls, build_admin_app, check_admin_binding, warn_if_in_clear
from gateway._config import GatewayConfig
from gateway._connections import ConnectionGuard, GatewayRunner, openai_error_body
from gateway._destinations import masked_url
from gateway._front import FrontRunner
from gateway._headers import credential_headers
from gateway._memory import return_large_buffers
from gateway._metrics import EvaluationCollector, GatewayMetrics
from gateway._mirror import Mirror
from gateway._promotion import Promoter
from gateway._relay import AiohttpClient, relay
from gateway._routing import Backend, Routing, Upstreams
from gateway._scorekeeper import Scorekeeper
from gateway._scrape import BackendLoad
from gateway._state import GatewayState, RecentObservations
from gateway._sync import RoutingSync

__all__ = ["STATE", "build_app", "make_admin_runner", "make_runner", "run", "serve"]

log = logging.getLogger("understudy.gateway")

STATE = web.AppKey("state", GatewayState)


def build_app(config: GatewayConfig, sink: EvaluationSink | None = None) -> web.Application:
    """The gateway app. Joined exchanges go to ``sink`` if given; otherwise to the
    evaluation pipeline and its store (``[evaluation]``), or, with evaluation disabled,
    to a bounded in-memory sink."""
    app = web.Application(client_max_size=config.server.max_body_bytes)
    metrics = GatewayMetrics()
    scorekeeper = Scorekeeper(config) if sink is None and config.evaluation.enabled else None
    if scorekeeper is not None:
        metrics.registry.register(EvaluationCollector(
            lambda: scorekeeper.pipeline_stats, lambda: scorekeeper.writer_stats,
            lambda: (scorekeeper.store_status, scorekeeper.scoring_state)))
    routing = Routing.configured(Backend(config.primary.name, config.primary.url))
    mirror = Mirror(config.mirror, config.candidates, config.capture, metrics,
                    scorekeeper or sink or MemorySink(config.mirror.sink_capacity),
                    record=config.record)
    if scorekeeper is not None:
        scorekeeper.attach_traffic(mirror.traffic)
        scorekeeper.attach_candidates(lambda: [c.config for c in mirror.candidates.values()])

    async def serve_routing(new: Routing) -> None:
        if new.primary.name in mirror.candidates:  # a primary is not its own candidate
            await mirror.remove_candidate(new.primary.name)
        promoter.served(new)  # its backends' series kept, a left one's retired
        promoter.follow(new)  # a canary it holds is driven here too (Promoter rule 5)

    upstreams = Upstreams(config.primary, config.candidates, metrics,  # _routing rule 5
                          credentials=credential_headers(config.mirror.credential_headers))
    sync = RoutingSync(routing, serve_routing, metrics,
                       config.admin.routing_poll_interval_s, config.admin.store_timeout_s,
                       settings_models=upstreams.models)
    promoter = Promoter(sync, mirror, metrics, scorekeeper, upstreams)
    if scorekeeper is not None:  # its rule 6: no replica is at a live canary's load
        scorekeeper.attach_canary(
            lambda: None if (canary := sync.routing.canary) is None else canary.backend.name)

    def scrape_targets() -> dict[str, str]:
        primary = sync.routing.primary
        return {primary.name: primary.url,
                **{c.name: c.config.url for c in mirror.candidates.values()}}

    backend_load = BackendLoad(scrape_targets, metrics)
    mirror.backend_load = backend_load
    app[STATE] = GatewayState(
        config=config,
        metrics=metrics,
        sync=sync,
        upstreams=upstreams,
        observations=RecentObservations(config.capture.recent_observations),
        mirror=mirror,
        scorekeeper=scorekeeper,
        promoter=promoter,
        backend_load=backend_load,
    )
    # Entered in this order, left in reverse: the mirror drains into evaluation, which
    # flushes into the store, before the pools close.
    app.on_startup.append(_count_tasks)
    app.cleanup_ctx.append(_upstream_pools)
    app.cleanup_ctx.append(_evaluating)
    app.cleanup_ctx.append(_routing_sync)
    app.cleanup_ctx.append(_mirroring)
    app.router.add_get("/health", _health)
    app.router.add_route("*", "/health", _method_not_allowed)
    app.router.add_get("/metrics", _metrics)
    app.router.add_route("*", "/metrics", _method_not_allowed)
    app.router.add_route("*", "/v1/{tail:.*}", _proxy, expect_handler=_continue_within_bound)
    # Routes, not a middleware: aiohttp's own 404/405 are plain text, and a middleware
    # would sit on every relayed request too.
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app


async def _count_tasks(app: web.Application) -> None:
    loop = asyncio.get_running_loop()
    app[STATE].metrics.event_loop_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))


async def _upstream_pools(app: web.Application) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await app[STATE].upstreams.close()


async def _evaluating(app: web.Application) -> AsyncIterator[None]:
    scorekeeper = app[STATE].scorekeeper
    if scorekeeper is not None:
        # The routing is loaded once the store is reached, which may be after serving
        # begins (a store outage at start); meanwhile routing changes go to the store.
        app[STATE].sync.attach(scorekeeper.engine)
        await scorekeeper.start(on_store=app[STATE].sync.start)
    try:
        yield
    finally:
        if scorekeeper is not None:
            await scorekeeper.stop()


async def _routing_sync(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    if state.scorekeeper is None:
        await app[STATE].sync.start(None)
    try:
        yield
    finally:
        await state.promoter.close()
        if state.scorekeeper is not None:
            await state.scorekeeper.stop_reaching_store()  # it may start the sync's tasks
        await state.sync.stop()


async def _mirroring(app: web.Application) -> AsyncIterator[None]:
    mirror, backend_load = app[STATE].mirror, app[STATE].backend_load
    await mirror.start()
    if backend_load is not None:
        await backend_load.start()
    try:
        yield
    finally:
        if backend_load is not None:
            await backend_load.stop()
        await mirror.stop()


async def _proxy(request: web.Request) -> web.StreamResponse:
    """A ``/v1/`` request on a connection the front handed to aiohttp (``_front.py``)."""
    client = AiohttpClient(request)
    await relay(client, request.app[STATE])
    assert client.response is not None
    return client.response


async def _continue_within_bound(request: web.Request) -> None:
    """``Expect`` on aiohttp's ``/v1/`` route, answered as the front answers it (``_front.py``
    rule 2): ``100 Continue`` unless the ``Content-Length`` is past ``max_body_bytes``, whose
    413 the relay sends at once (aiohttp's default handler invited the body first); another
    expectation is ignored, as RFC 9110 §10.1.1 allows (aiohttp's default answered it with a
    plain-text 417), and ``Expect`` is never forwarded (``_headers.py``)."""
    if request.version >= HttpVersion11 \
            and request.headers.get("Expect", "").lower() == "100-continue":
        length = request.content_length
        if length is None or length <= request.app[STATE].config.server.max_body_bytes:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # as aiohttp's: the answer has not begun


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body: dict[str, Any] = {"status": "ok", "primary": state.routing.primary.name,
                            "routing_version": state.routing.version}
    if state.scorekeeper is not None:  # 200 either way: the proxy itself is serving
        well, parts = state.scorekeeper.health()
        body.update(parts, status="ok" if well else "degraded")
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def _method_not_allowed(request: web.Request) -> web.Response:
    """``/health`` and ``/metrics`` asked with another method than GET (or HEAD)."""
    return web.Response(status=405, headers={"Allow": "GET, HEAD"}, content_type="application/json",
                        body=openai_error_body(f"{request.path} answers only GET and HEAD",
                                               "invalid_request_error", 405))


async def _not_found(request: web.Request) -> web.Response:
    return web.Response(status=404, content_type="application/json", body=openai_error_body(
        "not found: the gateway serves /v1/..., /health and /metrics", "not_found_error", 404))


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner every gateway is served by (CLI and tests alike): ``/v1/`` requests
    are served by the front (``_front.py``), the rest by aiohttp; client connections are
    bounded as ``_connections.py`` says, in both."""
    state = app[STATE]
    config = state.config
    closed = state.metrics.connections_closed
    guard = ConnectionGuard(config.server, lambda reason: closed.labels(reason).inc())
    state.metrics.connections_open.set_function(lambda: guard.open)
    runner = FrontRunner(
        app,
        guard,
        state,
        handler_cancellation=True,  # a client that goes away cancels its upstream call
        shutdown_timeout=config.server.shutdown_timeout_s,
        access_log=None,
    )
    state.listeners.append(runner)
    return runner


def make_admin_runner(app: web.Application) -> web.AppRunner:
    """The admin listener's runner: the proxy's connection bounds (header and keep-alive
    timeouts, connection limits, header sizes) with slots of its own, closings counted
    in the same series."""
    state = app[STATE]
    closed = state.metrics.connections_closed
    guard = ConnectionGuard(state.config.server, lambda reason: closed.labels(reason).inc())
    # aiohttp's default drain is 60 s: an admin request in flight held the exit that long.
    runner = GatewayRunner(build_admin_app(state), guard, access_log=None,
                           shutdown_timeout=state.config.server.shutdown_timeout_s)
    state.listeners.append(runner)
    return runner


async def serve(
    config: GatewayConfig,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], Awaitable[None] | None] | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM), then shut down gracefully."""
    check_admin_binding(config.admin)
    return_large_buffers()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    # Before the start, which reaches the store and spawns the scoring child (seconds): a
    # signal meanwhile ends the start cleanly, listening on nothing (SIGTERM killed the
    # process and left its child behind; SIGINT was a KeyboardInterrupt).
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await _serve_until(config, stop, on_ready)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


async def _serve_until(config: GatewayConfig, stop: asyncio.Event,
                       on_ready: Callable[[int], Awaitable[None] | None] | None) -> None:
    app = build_app(config)
    runner = make_runner(app)
    await runner.setup()
    admin_runner: web.AppRunner | None = None
    try:
        if stop.is_set():  # asked to stop while starting
            return
        # The admin listener first: once the proxy's port answers /health, every port does.
        if config.admin.port is not None:
            admin_runner = make_admin_runner(app)
            await admin_runner.setup()
            tls = admin_tls(config.admin)
            await web.TCPSite(admin_runner, config.admin.host, config.admin.port,
                              ssl_context=tls).start()
            log.info("understudy admin API on %s://%s:%s/admin/v1",
                     "http" if tls is None else "https", config.admin.host,
                     admin_runner.addresses[0][1])
            warn_if_in_clear(config.admin)
        site = web.TCPSite(runner, config.server.host, config.server.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else config.server.port
        log.info("understudy gateway on http://%s:%s -> primary %s",
                 config.server.host, port, masked_url(config.primary.url))
        # Everything built so far lives until shutdown: keep the collector from scanning it.
        gc.freeze()
        if on_ready is not None:
            result = on_ready(port)
            if result is not None:
                await result
        await stop.wait()
    finally:
        # Every listener stops accepting at once; then the admin API drains (its changes
        # use the app's state, closed by the proxy's cleanup), then the proxy: each within
        # shutdown_timeout_s, the proxy's answers going on meanwhile.
        for listener in (runner, admin_runner):
            for listening in list(listener.sites if listener is not None else ()):
                await listening.stop()
        if admin_runner is not None:
            await admin_runner.cleanup()
        await runner.cleanup()


def run(config: GatewayConfig) -> None:
    """Blocking entry point: uvloop when available, asyncio otherwise."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
