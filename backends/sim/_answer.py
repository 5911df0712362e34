"""Pacing one answer and injecting faults (the bytes are ``backends.openai_wire``'s).

Rules:
1. Streamed answers send their headers at once (as vLLM's StreamingResponse does), then
   the first token after `ttft_ms` and each further token `itl_ms` later. A non-streamed
   answer is written whole after ``ttft + itl * (tokens - 1)``, when the last token
   would have been decoded.
2. Every wait polls the connection (at most `DISCONNECT_POLL_MAX_S` apart) and the
   app's closing flag, so an abandoned request stops within that bound instead of
   sleeping on; the poll is needed because aiohttp by default does not cancel a handler
   whose client left. Leaving raises `ClientGone`.
3. Mid-stream faults fire after `fault_after_chunks` token chunks (the chat role chunk
   is not counted) and before the rest; if the answer is shorter, they fire after its
   last token chunk, before the usage chunk and `[DONE]`. A non-streamed answer with a
   mid-stream fault sends its headers and the first half of its JSON body first.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import web

from backends.openai_wire import (
    JSON_CONTENT_TYPE,
    AnswerWriter,
    ClientGone,
    RequestKind,
    ResponseIdentity,
    StreamOptions,
    Usage,
    client_left,
)
from backends.sim._config import FaultMode, SimConfig
from backends.sim._metrics import SimMetrics

__all__ = ["DISCONNECT_POLL_MAX_S", "AnswerPlan", "Outcome", "PacedAnswer"]

DISCONNECT_POLL_MIN_S = 0.005
DISCONNECT_POLL_MAX_S = 0.1
MID_STREAM_FAULTS: frozenset[FaultMode] = frozenset(
    {"hang_mid_stream", "reset_mid_stream", "malformed_chunks"}
)
_MALFORMED_EVENTS = b"data: {not json\n\nthis line has no data field\n\n"

Outcome = Literal["completed", "faulted"]


@dataclass(frozen=True, slots=True)
class AnswerPlan:
    """One answer, decided before the first byte. A natural stop ends `tokens` with the
    end-of-sequence token "" (counted in completion_tokens, as vLLM counts it)."""

    identity: ResponseIdentity
    tokens: tuple[str, ...]
    finish_reason: Literal["stop", "length"]
    usage: Usage
    stream_options: StreamOptions

    @property
    def kind(self) -> RequestKind:
        return self.identity.kind


class PacedAnswer:
    """Writes one planned answer for one request at its pace, applying at most one fault."""

    def __init__(
        self,
        request: web.Request,
        plan: AnswerPlan,
        config: SimConfig,
        metrics: SimMetrics,
        closing: asyncio.Event,
        *,
        load: Callable[[], int] = lambda: 1,
        prefill_s: float = 0.0,
    ) -> None:
        self._request = request
        self._load = load
        self._prefill_s = prefill_s
        self._plan = plan
        self._config = config
        self._metrics = metrics
        self._closing = closing
        self._writer = AnswerWriter(
            request,
            plan.identity,
            prompt_tokens=plan.usage.prompt_tokens,
            stream_options=plan.stream_options,
        )
        self._loop = asyncio.get_running_loop()
        self._arrived_at = self._loop.time()
        self._last_token_at = self._arrived_at

    async def pause(self, seconds: float | None) -> None:
        """Sleep `seconds` (None: until the client leaves); raise `ClientGone` early."""
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        interval = DISCONNECT_POLL_MIN_S
        while True:
            if client_left(self._request) or self._closing.is_set():
                raise ClientGone
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            step = interval if remaining is None else min(interval, remaining)
            await asyncio.sleep(step)
            interval = min(interval * 2, DISCONNECT_POLL_MAX_S)

    def reset(self) -> None:
        """Abort the TCP connection with an RST, so the client sees a reset, not an end."""
        transport = self._request.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()

    @property
    def response(self) -> web.StreamResponse | None:
        """The response, once its headers are sent."""
        return self._writer.response

    async def stream(self, fault: FaultMode) -> Outcome:
        plan, config, writer = self._plan, self._config, self._writer
        await writer.open_stream()
        await self.pause(self._ttft_s())
        if plan.kind == "chat":
            await writer.event(writer.chunk(None))
        fault_at = config.fault_after_chunks if fault in MID_STREAM_FAULTS else None
        last = len(plan.tokens) - 1
        for index, token in enumerate(plan.tokens):
            if index > 0:
                await self.pause(self._itl_s())
            if index == fault_at and await self._mid_stream_fault(fault):
                return "faulted"
            finish = plan.finish_reason if index == last else None
            await writer.event(
                writer.chunk(token, completion_tokens=index + 1, finish_reason=finish)
            )
            self._observe_token(index, measured=True)
        if fault_at is not None and fault_at > last and await self._mid_stream_fault(fault):
            return "faulted"
        await writer.end_stream(plan.usage)
        return "faulted" if fault == "malformed_chunks" else "completed"

    async def whole(self, fault: FaultMode, body: dict[str, Any]) -> Outcome:
        """Answer with one JSON body (non-streamed completions and embeddings)."""
        decode_s = self._itl_s() * max(0, len(self._plan.tokens) - 1)
        await self.pause(self._ttft_s() + decode_s)
        for index in range(len(self._plan.tokens)):
            self._observe_token(index, measured=False)
        if fault not in MID_STREAM_FAULTS:
            await self.send(body, 200)
            return "completed"
        payload = orjson.dumps(body)
        stream = await self._writer.open_stream(JSON_CONTENT_TYPE)
        await stream.write(payload[: len(payload) // 2])
        if fault == "hang_mid_stream":
            await self.pause(None)
        elif fault == "reset_mid_stream":
            self.reset()
        else:
            await stream.write_eof()
        return "faulted"

    async def send(self, body: dict[str, Any], status: int) -> None:
        """Write one whole JSON response now."""
        await self._writer.send(body, status)

    def full_body(self) -> dict[str, Any]:
        plan = self._plan
        return self._writer.full_body(
            text="".join(plan.tokens), finish_reason=plan.finish_reason, usage=plan.usage
        )

    async def _mid_stream_fault(self, fault: FaultMode) -> bool:
        """Apply a mid-stream fault; True when the answer ends here."""
        if fault == "hang_mid_stream":
            await self.pause(None)
            return True  # pause(None) only ends by raising ClientGone
        if fault == "reset_mid_stream":
            self.reset()
            return True
        await self._writer.write(_MALFORMED_EVENTS)
        return False

    def _observe_token(self, index: int, *, measured: bool) -> None:
        """Record a token's latency: as measured when streamed, as planned when whole."""
        now = self._loop.time()
        if index == 0:
            planned = self._config.ttft_ms / 1000
            self._metrics.ttft.observe(now - self._arrived_at if measured else planned)
        else:
            planned = self._config.itl_ms / 1000
            self._metrics.itl.observe(now - self._last_token_at if measured else planned)
        self._last_token_at = now
        self._metrics.generation_tokens.inc()

    def _ttft_s(self) -> float:
        """The load model's TTFT: base, plus per other request in flight, plus prefill."""
        config = self._config
        others = max(0, self._load() - 1)
        return (config.ttft_ms + config.ttft_per_inflight_ms * others) / 1000 + self._prefill_s

    def _itl_s(self) -> float:
        config = self._config
        return (config.itl_ms + config.itl_per_inflight_ms * max(0, self._load() - 1)) / 1000

    def elapsed(self) -> float:
        return self._loop.time() - self._arrived_at
