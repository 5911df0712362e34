"""The simulator's aiohttp application: routes, per-request bookkeeping, fault draws.

All state lives on the `web.Application` under typed keys (`SIM_STATS` is public), so
several simulators run side by side in one process without sharing anything.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

from aiohttp import web

from backends.openai_wire import (
    SIMULATED_VLLM_VERSION,
    ClientGone,
    RequestError,
    RequestKind,
    ResponseIdentity,
    ServedModel,
    Usage,
    decode_body,
    embedding_response,
    encode_body,
    error_body,
    install_openai_app,
    json_response,
    metrics_response,
    response_id,
)
from backends.sim._answer import AnswerPlan, PacedAnswer
from backends.sim._config import FaultMode, SimConfig
from backends.sim._metrics import SimMetrics
from backends.sim._requests import InferenceRequest, chat_prompt_tokens, parse_request
from backends.sim._stats import RecordedRequest, SimStats
from backends.sim._text import answer_digest, answer_tokens, embedding_vector

__all__ = ["MAX_REQUEST_BODY_BYTES", "SIM_CONFIG", "SIM_METRICS", "SIM_STATS", "build_app"]

MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
# Fault rates are compared as exact fractions, so 0.1 faults exactly 1 request in 10.
_MAX_RATE_DENOMINATOR = 1_000_000


@dataclass(slots=True)
class _SimState:
    closing: asyncio.Event
    fault_rate: Fraction
    fingerprint: str
    fault_draws: int = 0
    sample_nonce: int = 0
    in_flight: int = 0  # inference requests being answered now (the load model)
    # The prefix cache (``cache="prefix"``): digests of message prefixes seen, with their
    # token counts, least recently used first; at most ``prefix_cache_entries``.
    prefixes: OrderedDict[bytes, int] = field(default_factory=OrderedDict)

    def cached_prefix_tokens(self, messages: list[dict[str, object]], capacity: int) -> int:
        """Tokens of the longest message prefix seen before; then remember every prefix."""
        cached = 0
        digest = hashlib.blake2b(digest_size=16)
        for k, message in enumerate(messages, start=1):
            digest.update(encode_body(message, sort_keys=True))
            key = digest.copy().digest()
            if key in self.prefixes:
                self.prefixes.move_to_end(key)
                if k < len(messages):  # the whole prompt is not a prefix of itself
                    cached = self.prefixes[key]
            else:
                self.prefixes[key] = chat_prompt_tokens(messages[:k])
                while len(self.prefixes) > capacity:
                    self.prefixes.popitem(last=False)
        return cached

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
    install_openai_app(
        app, ServedModel(config.model, config.max_model_len), version=SIMULATED_VLLM_VERSION
    )
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


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


async def _metrics(request: web.Request) -> web.StreamResponse:
    return metrics_response(request.app[SIM_METRICS].registry)


async def _inference(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    app = request.app
    config, stats, metrics, state = app[SIM_CONFIG], app[SIM_STATS], app[SIM_METRICS], app[_STATE]
    raw = await request.read()
    body: object = None
    decode_error: RequestError | None = None
    try:
        body = decode_body(raw)
    except RequestError as exc:
        decode_error = exc
    stats.record(RecordedRequest.capture(request.method, request.path, request.headers, body))
    try:
        if decode_error is not None:
            raise decode_error
        parsed = parse_request(
            kind, body, served_model=config.model, max_model_len=config.max_model_len
        )
    except RequestError as exc:
        stats.rejected += 1
        return json_response(exc.body(), exc.status)

    plan = _plan(request, parsed, config, state)
    fault = state.draw_fault(config.fault)
    if fault != "none":
        stats.faults_injected += 1
    state.in_flight += 1
    uncached = parsed.prompt_tokens - (plan.usage.cached_tokens or 0)
    writer = PacedAnswer(request, plan, config, metrics, state.closing,
                         load=lambda: state.in_flight,
                         prefill_s=config.prefill_ms_per_token / 1000 * max(0, uncached))
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
        state.in_flight -= 1
        metrics.running.dec()
        metrics.hold_tokens(-held_tokens)
        stats.count_outcome(outcome)
        metrics.finished(outcome, plan.finish_reason, writer.elapsed())
    return writer.response if writer.response is not None else web.Response()


async def _answer(
    writer: PacedAnswer,
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
    if parsed.stream_options.stream:
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
        request_id=plan.identity.response_id,
        created=plan.identity.created,
        model=plan.identity.model,
        embeddings=encoded,
        prompt_tokens=parsed.prompt_tokens,
    )
    return await writer.whole(fault, body)


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
        if config.cache == "prefix" and parsed.kind == "chat" and isinstance(
            parsed.prompt_key, list
        ):
            cached = min(
                state.cached_prefix_tokens(parsed.prompt_key, config.prefix_cache_entries),
                parsed.prompt_tokens,
            )
        elif config.cached_tokens is not None:
            cached = min(config.cached_tokens, parsed.prompt_tokens)
    return AnswerPlan(
        identity=ResponseIdentity(
            kind=parsed.kind,
            response_id=response_id(parsed.kind, request),
            created=int(time.time()),
            model=config.model,
            fingerprint=state.fingerprint,
        ),
        tokens=tuple(tokens),
        finish_reason=finish,
        usage=Usage(
            prompt_tokens=parsed.prompt_tokens,
            completion_tokens=len(tokens),
            cached_tokens=cached,
        ),
        stream_options=parsed.stream_options,
    )
