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
   when ``stream_options.include_usage``; then ``data: [DONE]``.  The bytes are written by
   ``backends.openai_wire``'s ``AnswerWriter``, which reproduces vLLM 0.32 field for field.
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

from aiohttp import web

from backends.openai_wire import (
    AnswerWriter,
    ClientGone,
    ResponseIdentity,
    Usage,
    client_left,
    json_response,
)

from ..kv._retention import RetainedKV
from ..model._tokenizer import ChatTokenizer
from ._detokenizer import IncrementalDetokenizer, TextPiece
from ._engine_loop import EngineServerError, RequestHandle
from ._openai import GenerationRequest
from ._request import TokenEvent

__all__ = ["DISCONNECT_POLL_S", "EngineAnswer"]

DISCONNECT_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class _Token:
    event: TokenEvent
    piece: TextPiece
    finish_reason: str | None
    stop_reason: str | int | None


class EngineAnswer:
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
        self._writer = AnswerWriter(
            request,
            identity,
            prompt_tokens=len(generation.prompt_ids),
            stream_options=generation.stream_options,
        )
        self._kv_source = kv_source
        self._kv_params: dict[str, Any] | None = None
        self._handle = handle
        self._generation = generation
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, generation.stop)
        self._prompt_tokens = len(generation.prompt_ids)
        self._cached_tokens = 0
        self._completion_tokens = 0
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the answer (the engine did not finish the request)."""
        return self._stopped

    @property
    def response(self) -> web.StreamResponse | None:
        """The response, once its headers are sent."""
        return self._writer.response

    async def whole(self) -> web.StreamResponse:
        finish: str | None = None
        stop_reason: str | int | None = None
        try:
            async with aclosing(self._tokens()) as tokens:
                async for token in tokens:
                    finish, stop_reason = token.finish_reason, token.stop_reason
        except EngineServerError as exc:
            return json_response(exc.body(), exc.status)
        body = self._writer.full_body(
            text=self._detokenizer.text, finish_reason=finish or "length", usage=self._usage()
        )
        body["choices"][0]["stop_reason"] = stop_reason
        body["kv_transfer_params"] = self._kv_params
        return json_response(body)

    async def stream(self) -> web.StreamResponse:
        writer = self._writer
        response = await writer.open_stream()
        try:
            async with aclosing(self._tokens()) as tokens:
                async for token in tokens:
                    if self._completion_tokens == 1 and writer.identity.kind == "chat":
                        await writer.event(writer.chunk(None))
                    await writer.event(self._chunk(token))
        except EngineServerError as exc:
            await writer.fail_stream(exc.body())
            return response
        await writer.end_stream(self._usage())
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
                    self._stopped = True
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
        if client_left(self._request):
            raise ClientGone

    def _usage(self) -> Usage:
        return Usage(
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
            cached_tokens=self._cached_tokens,
        )

    def _chunk(self, token: _Token) -> dict[str, Any]:
        """The chunk of ``token``; the finishing one carries what a decode node retained."""
        chunk = self._writer.chunk(
            token.piece.text,
            completion_tokens=self._completion_tokens,
            finish_reason=token.finish_reason,
            stop_reason=token.stop_reason,
        )
        if token.finish_reason is not None and self._kv_params is not None:
            chunk["kv_transfer_params"] = self._kv_params
        return chunk
