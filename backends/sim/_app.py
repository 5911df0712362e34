"""The simulator's aiohttp application: routes, per-request bookkeeping, fault draws.

All state lives on the `web.Application` under typed keys (`SIM_STATS` is public), so
several simulators run side by side in one process without sharing anything.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import struct
import time
import uuid
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST

from backends.sim._answer import AnswerPlan, AnswerWriter, ClientGone
from backends.sim._config import FaultMode, SimConfig
from backends.sim._errors import SimRequestError, error_body, invalid_json
from backends.sim._metrics import SimMetrics
from backends.sim._protocol import (
    SIMULATED_VLLM_VERSION,
    RequestKind,
    Usage,
    embedding_response,
    model_list,
)
from backends.sim._requests import InferenceRequest, parse_request
from backends.sim._stats import RecordedRequest, SimStats
from backends.sim._text import answer_digest, answer_tokens, embedding_vector

__all__ = ["MAX_REQUEST_BODY_BYTES", "SIM_CONFIG", "SIM_METRICS", "SIM_STATS", "build_app"]

MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
# Fault rates are compared as exact fractions, so 0.1 faults exactly 1 request in 10.
_MAX_RATE_DENOMINATOR = 1_000_000
# vLLM's request ids are a prefix and 16 hex digits (or the client's X-Request-Id).
_ID_HEX_DIGITS = 16
_ID_PREFIXES: dict[RequestKind, str] = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "embedding": "embd-",
}


@dataclass(slots=True)
class _SimState:
    closing: asyncio.Event
    fault_rate: Fraction
    fingerprint: str
    fault_draws: int = 0
    sample_nonce: int = 0

    def draw_fault(self, fault: FaultMode) -> FaultMode:
        """The k-th draw faults iff floor(k * rate) > floor((k - 1) * rate)."""
        if fault == "none":
            return "none"
        self.fault_draws += 1
        k = self.fault_draws
        hit = math.floor(k * self.fault_rate) > math.floor((k - 1) * self.fault_rate)
        return fault if hit else "none"


SIM_CONFIG = web.AppKey("sim_config", SimConfig)
SIM_STATS = web.AppKey("sim_stats", SimStats)
SIM_METRICS = web.AppKey("sim_metrics", SimMetrics)
_STATE = web.AppKey("sim_state", _SimState)


def build_app(config: SimConfig) -> web.Application:
    """An aiohttp app that answers like vLLM's OpenAI server under `config`."""
    app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES)
    app[SIM_CONFIG] = config
    app[SIM_STATS] = SimStats()
    app[SIM_METRICS] = SimMetrics(config.model)
    rate = Fraction(config.fault_rate).limit_denominator(_MAX_RATE_DENOMINATOR)
    app[_STATE] = _SimState(
        closing=asyncio.Event(), fault_rate=rate, fingerprint=_fingerprint(config)
    )
    app.on_shutdown.append(_on_shutdown)
    app.middlewares.append(_fastapi_style_http_errors)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/version", _version)
    return app


@web.middleware
async def _fastapi_style_http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Unknown routes and methods answer as FastAPI does: {"detail": "Not Found"}.
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.Response(
            body=orjson.dumps({"detail": exc.reason}),
            status=exc.status,
            content_type="application/json",
            headers=headers,
        )


def _fingerprint(config: SimConfig) -> str:
    """vLLM's ``system_fingerprint`` shape; differs between model names and variants."""
    key = f"{config.model}\0{config.variant}".encode()
    return f"vllm-{SIMULATED_VLLM_VERSION}-{hashlib.blake2b(key, digest_size=4).hexdigest()}"


async def _on_shutdown(app: web.Application) -> None:
    # Wakes hung handlers, so shutting down never waits out aiohttp's shutdown timeout.
    app[_STATE].closing.set()


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, "completion")


async def _embeddings(request: web.Request) -> web.StreamResponse:
    return await _inference(request, "embedding")


async def _health(request: web.Request) -> web.StreamResponse:
    return web.Response()


async def _models(request: web.Request) -> web.StreamResponse:
    config = request.app[SIM_CONFIG]
    body = model_list(
        model=config.model,
        created=int(time.time()),
        max_model_len=config.max_model_len,
        permission_id=f"modelperm-{uuid.uuid4().hex[:_ID_HEX_DIGITS]}",
    )
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _version(request: web.Request) -> web.StreamResponse:
    body = orjson.dumps({"version": SIMULATED_VLLM_VERSION})
    return web.Response(body=body, content_type="application/json")


async def _metrics(request: web.Request) -> web.StreamResponse:
    exposition = request.app[SIM_METRICS].exposition()
    return web.Response(body=exposition, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _error_response(body: dict[str, object], status: int) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def _inference(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    app = request.app
    config, stats, metrics, state = app[SIM_CONFIG], app[SIM_STATS], app[SIM_METRICS], app[_STATE]
    raw = await request.read()
    body: object = None
    decode_error: SimRequestError | None = None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        decode_error = _json_error(raw, exc)
    stats.record(RecordedRequest.capture(request.method, request.path, request.headers, body))
    try:
        if decode_error is not None:
            raise decode_error
        parsed = parse_request(
            kind, body, served_model=config.model, max_model_len=config.max_model_len
        )
    except SimRequestError as exc:
        stats.rejected += 1
        return _error_response(exc.body(), exc.status)

    plan = _plan(request, parsed, config, state)
    fault = state.draw_fault(config.fault)
    if fault != "none":
        stats.faults_injected += 1
    writer = AnswerWriter(request, plan, config, metrics, state.closing)
    held_tokens = parsed.prompt_tokens + len(plan.tokens)
    stats.started += 1
    metrics.running.inc()
    metrics.hold_tokens(held_tokens)
    metrics.prompt_tokens.inc(parsed.prompt_tokens)
    metrics.prefix_queries.inc(parsed.prompt_tokens)
    metrics.prefix_hits.inc(plan.usage.cached_tokens or 0)
    outcome: Literal["completed", "faulted", "cancelled"] = "cancelled"
    try:
        outcome = await _answer(writer, parsed, plan, fault, config)
    except (ClientGone, ConnectionResetError):
        writer.reset()  # a no-op when the client left; drops it when the server closes
    finally:
        # CancelledError (a runner with handler_cancellation) also ends here, cancelled.
        metrics.running.dec()
        metrics.hold_tokens(-held_tokens)
        stats.count_outcome(outcome)
        metrics.finished(outcome, plan.finish_reason, writer.elapsed())
    return writer.response if writer.response is not None else web.Response()


async def _answer(
    writer: AnswerWriter,
    parsed: InferenceRequest,
    plan: AnswerPlan,
    fault: FaultMode,
    config: SimConfig,
) -> Literal["completed", "faulted"]:
    if fault == "error":
        status = config.error_status
        await writer.send(error_body(f"Simulated fault (HTTP {status}).", status=status), status)
        return "faulted"
    if fault == "hang_before_first_byte":
        await writer.pause(None)
    if parsed.stream:
        return await writer.stream(fault)
    if parsed.kind != "embedding":
        return await writer.whole(fault, writer.full_body())
    vectors = [
        embedding_vector(item, model=config.model, variant=config.variant)
        for item in parsed.embedding_inputs
    ]
    encoded: list[list[float] | str] = [
        base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
        if parsed.encoding_format == "base64"
        else v
        for v in vectors
    ]
    body = embedding_response(
        request_id=plan.request_id,
        created=plan.created,
        model=plan.model,
        embeddings=encoded,
        prompt_tokens=parsed.prompt_tokens,
    )
    return await writer.whole(fault, body)


def _json_error(raw: bytes, exc: orjson.JSONDecodeError) -> SimRequestError:
    # vLLM (FastAPI) reports the standard library's wording, so ask it for the reason.
    try:
        json.loads(raw)
    except json.JSONDecodeError as std:
        return invalid_json(std.pos, std.msg)
    except UnicodeDecodeError:
        pass
    return invalid_json(exc.pos, exc.msg)


def _plan(
    request: web.Request, parsed: InferenceRequest, config: SimConfig, state: _SimState
) -> AnswerPlan:
    """Decide the whole answer before the first byte."""
    tokens: list[str] = []
    finish: Literal["stop", "length"] = "stop"
    cached: int | None = None
    if parsed.kind != "embedding":
        # Like vLLM, a max_tokens past the context window is silently shortened.
        cap = config.max_model_len - parsed.prompt_tokens
        if parsed.max_tokens is not None:
            cap = min(cap, parsed.max_tokens)
        nonce = None
        if parsed.sampled:
            state.sample_nonce += 1
            nonce = state.sample_nonce
        digest = answer_digest(
            model=config.model,
            prompt=parsed.prompt_key,
            variant=config.variant,
            seed=parsed.seed,
            nonce=nonce,
        )
        # The answer's words, then the end-of-sequence token, unless max_tokens cuts it.
        tokens = [*answer_tokens(digest, min(cap, config.tokens)), ""][:cap]
        finish = "stop" if len(tokens) == config.tokens + 1 else "length"
        if config.cached_tokens is not None:
            cached = min(config.cached_tokens, parsed.prompt_tokens)
    base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:_ID_HEX_DIGITS]
    return AnswerPlan(
        kind=parsed.kind,
        request_id=_ID_PREFIXES[parsed.kind] + base_id,
        created=int(time.time()),
        model=config.model,
        fingerprint=state.fingerprint,
        tokens=tuple(tokens),
        finish_reason=finish,
        usage=Usage(
            prompt_tokens=parsed.prompt_tokens,
            completion_tokens=len(tokens),
            cached_tokens=cached,
        ),
        include_usage=parsed.include_usage,
        continuous_usage=parsed.continuous_usage,
    )
