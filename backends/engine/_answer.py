"""Writing one engine answer in vLLM's wire format, streamed or whole.

Rules
-----
1. A streamed answer sends its headers at once (as vLLM's StreamingResponse does); the chat
   role chunk goes out with the first token, when prefill is done -- so a client's time to
   first chunk is the engine's time to first token.  Then one chunk per generated token, its
   text the detokenizer's piece: possibly "" (half a UTF-8 character, text held back because
   it may start a stop string, or a special token such as ``<|im_end|>``, which vLLM counts
   in ``completion_tokens`` too).  The last token's chunk carries ``finish_reason`` (and
   ``stop_reason``: the stop string or stop token id); then the usage chunk (``choices: []``)
   when ``stream_options.include_usage``; then ``data: [DONE]``.  Bodies are built by
   ``backends.sim._protocol``, which reproduces vLLM 0.32 field for field.
2. Waiting for tokens polls the connection at most ``DISCONNECT_POLL_S`` apart: a client that
   left raises ``ClientGone`` within that bound (aiohttp does not cancel a handler whose client
   left unless asked to), and the caller aborts the request in the engine.
3. An engine error before the headers is an error response with its status; after the headers
   of a stream it is an error event followed by ``[DONE]``, as vLLM ends a failed stream.
4. On a decode node (``kv_source`` given), what the request retained for the next turn is
   described in ``kv_transfer_params``: on the whole body (vLLM's field), or on the stream's
   finishing chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import hdrs, web

from backends.sim._errors import error_body
from backends.sim._protocol import (
    RequestKind,
    Usage,
    chat_chunk,
    completion_chunk,
    full_response,
    usage_chunk,
)

from ._detokenizer import IncrementalDetokenizer, TextPiece
from ._engine_loop import EngineServerError, RequestHandle
from ._openai import GenerationRequest
from ._request import TokenEvent
from ._retention import RetainedKV
from ._tokenizer import ChatTokenizer

__all__ = [
    "DISCONNECT_POLL_S",
    "AnswerWriter",
    "ClientGone",
    "ResponseIdentity",
    "json_response",
]

DISCONNECT_POLL_S = 0.05
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection."""


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    """The fields every body of one answer repeats."""

    kind: RequestKind
    response_id: str
    created: int
    model: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class _Token:
    event: TokenEvent
    piece: TextPiece
    finish_reason: str | None
    stop_reason: str | int | None


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON_CONTENT_TYPE)


class AnswerWriter:
    """Turns one request's token events into its HTTP response."""

    def __init__(
        self,
        request: web.Request,
        handle: RequestHandle,
        generation: GenerationRequest,
        identity: ResponseIdentity,
        tokenizer: ChatTokenizer,
        kv_source: Callable[[RetainedKV], dict[str, Any]] | None = None,
    ) -> None:
        self._request = request
        self._kv_source = kv_source
        self._kv_params: dict[str, Any] | None = None
        self._handle = handle
        self._generation = generation
        self._identity = identity
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, generation.stop)
        self._prompt_tokens = len(generation.prompt_ids)
        self._cached_tokens = 0
        self._completion_tokens = 0
        self.response: web.StreamResponse | None = None  # once the headers are sent

    async def whole(self) -> web.StreamResponse:
        finish: str | None = None
        stop_reason: str | int | None = None
        try:
            async with aclosing(self._tokens()) as tokens:
                async for token in tokens:
                    finish, stop_reason = token.finish_reason, token.stop_reason
        except EngineServerError as exc:
            return json_response(
                error_body(str(exc), status=exc.status, err_type=exc.err_type), exc.status
            )
        ident = self._identity
        body = full_response(
            kind=ident.kind,
            request_id=ident.response_id,
            created=ident.created,
            model=ident.model,
            text=self._detokenizer.text,
            finish_reason=finish or "length",
            usage=self._usage(),
            fingerprint=ident.fingerprint,
        )
        body["choices"][0]["stop_reason"] = stop_reason
        body["kv_transfer_params"] = self._kv_params
        return json_response(body)

    async def stream(self) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: SSE_CONTENT_TYPE})
        self.response = response
        await response.prepare(self._request)
        ident, generation = self._identity, self._generation
        try:
            async with aclosing(self._tokens()) as tokens:
                async for token in tokens:
                    if self._completion_tokens == 1 and ident.kind == "chat":
                        await _send(response, self._chunk(None, ""))
                    await _send(response, self._chunk(token, token.piece.text))
        except EngineServerError as exc:
            await _send(response, error_body(str(exc), status=exc.status, err_type=exc.err_type))
            await response.write(_DONE)
            await response.write_eof()
            return response
        if generation.include_usage:
            await _send(
                response,
                usage_chunk(
                    kind=ident.kind,
                    request_id=ident.response_id,
                    created=ident.created,
                    model=ident.model,
                    usage=self._usage(),
                    fingerprint=ident.fingerprint,
                ),
            )
        await response.write(_DONE)
        await response.write_eof()
        return response

    # -- internals --------------------------------------------------------------------------

    async def _tokens(self) -> AsyncGenerator[_Token, None]:
        """The answer's tokens with their text, up to and including the one that ends it."""
        params = self._generation.params
        eos_ids = self._tokenizer.stop_token_ids
        while True:
            for event in await self._next_batch():
                if self._completion_tokens == 0:
                    self._cached_tokens = event.cached_tokens
                if event.retained is not None and self._kv_source is not None:
                    self._kv_params = self._kv_source(event.retained)
                self._completion_tokens += 1
                piece = self._detokenizer.push(event.token_id, last=event.finished)
                finish: str | None = event.finish_reason
                stop_reason: str | int | None = None
                if piece.stop is not None:
                    finish, stop_reason = "stop", piece.stop
                elif (
                    finish == "stop"
                    and event.token_id in params.stop_token_ids
                    and (params.ignore_eos or event.token_id not in eos_ids)
                ):
                    stop_reason = event.token_id
                yield _Token(event, piece, finish, stop_reason)
                if finish is not None:
                    return

    async def _next_batch(self) -> list[TokenEvent]:
        queue = self._handle.queue
        while True:
            self._check_client()
            if queue.empty():
                try:
                    async with asyncio.timeout(DISCONNECT_POLL_S):
                        item = await queue.get()
                except TimeoutError:
                    continue
            else:
                item = queue.get_nowait()
            if isinstance(item, EngineServerError):
                raise item
            return item

    def _check_client(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            raise ClientGone

    def _usage(self) -> Usage:
        return Usage(
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
            cached_tokens=self._cached_tokens,
        )

    def _chunk(self, token: _Token | None, text: str) -> dict[str, Any]:
        """The chunk of ``token``; None is the chat role chunk that precedes the tokens."""
        ident, generation = self._identity, self._generation
        finish = None if token is None else token.finish_reason
        done = self._completion_tokens if token is not None else 0
        running = (self._prompt_tokens, done) if generation.continuous_usage else None
        fingerprint = (
            ident.fingerprint if finish is not None and not generation.include_usage else None
        )
        if ident.kind == "chat":
            chunk = chat_chunk(
                request_id=ident.response_id,
                created=ident.created,
                model=ident.model,
                delta={"role": "assistant", "content": ""} if token is None else {"content": text},
                finish_reason=finish,
                first=token is None,
                running_usage=running,
                fingerprint=fingerprint,
            )
        else:
            chunk = completion_chunk(
                request_id=ident.response_id,
                created=ident.created,
                model=ident.model,
                text=text,
                finish_reason=finish,
                running_usage=running,
                fingerprint=fingerprint,
            )
        if token is not None and token.stop_reason is not None:
            chunk["choices"][0]["stop_reason"] = token.stop_reason
        if finish is not None and self._kv_params is not None:
            chunk["kv_transfer_params"] = self._kv_params
        return chunk


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(body) + b"\n\n")
