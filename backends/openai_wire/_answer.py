"""Writing one answer in vLLM's wire format: a JSON body, or a stream of server-sent events.

Rules
-----
1. A stream is ``data: {json}\\n\\n`` events: for a chat, the role chunk first; then one chunk
   per generated token, the last carrying ``finish_reason`` (and ``system_fingerprint`` unless
   a usage chunk follows); then, when ``stream_options.include_usage``, the usage chunk with
   ``choices: []``; then ``data: [DONE]``.  Bodies are built by ``_bodies``.
2. With ``continuous_usage_stats`` every token chunk carries the usage so far.
3. An error after the headers of a stream is an error event followed by ``[DONE]``, as vLLM
   ends a failed stream.
4. Every server names its answers as vLLM does: a prefix for the kind and 16 hex digits, or
   the client's ``X-Request-Id``, its bytes read as Latin-1 as vLLM's server (Starlette)
   reads a header (aiohttp gives bytes beyond ASCII as surrogate escapes, which no JSON
   encoder takes: such an id was a 500).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from aiohttp import hdrs, web

from ._bodies import (
    RequestKind,
    ResponseIdentity,
    Usage,
    full_response,
    token_chunk,
    usage_chunk,
)
from ._requests import StreamOptions

__all__ = [
    "DONE_EVENT",
    "JSON_CONTENT_TYPE",
    "SSE_CONTENT_TYPE",
    "AnswerWriter",
    "ClientGone",
    "client_left",
    "json_response",
    "response_id",
    "sse_event",
]

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
DONE_EVENT = b"data: [DONE]\n\n"
# vLLM's request ids: a prefix and 16 hex digits (or the client's X-Request-Id).
ID_HEX_DIGITS = 16
_ID_PREFIXES: dict[RequestKind, str] = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "embedding": "embd-",
}


class ClientGone(Exception):
    """The client closed the connection, or the server is shutting down."""


def client_left(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON_CONTENT_TYPE)


def sse_event(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def response_id(kind: RequestKind, request: web.Request) -> str:
    """The id of the answer to ``request`` (rule 4)."""
    given = request.headers.get("X-Request-Id")
    if given:
        return _ID_PREFIXES[kind] + given.encode("utf-8", "surrogateescape").decode("latin-1")
    return _ID_PREFIXES[kind] + uuid.uuid4().hex[:ID_HEX_DIGITS]


class AnswerWriter:
    """The bytes of one answer to one request; what they say is the caller's."""

    def __init__(
        self,
        request: web.Request,
        identity: ResponseIdentity,
        *,
        prompt_tokens: int,
        stream_options: StreamOptions,
    ) -> None:
        self._request = request
        self.identity = identity
        self._prompt_tokens = prompt_tokens
        self._stream_options = stream_options
        self.response: web.StreamResponse | None = None  # once the headers are sent

    async def open_stream(self, content_type: str = SSE_CONTENT_TYPE) -> web.StreamResponse:
        """Send the headers of an event stream (or of a body written in parts)."""
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: content_type})
        self.response = response
        await response.prepare(self._request)
        return response

    async def event(self, body: dict[str, Any]) -> None:
        await self.write(sse_event(body))

    async def write(self, raw: bytes) -> None:
        assert self.response is not None, "open the stream first"
        await self.response.write(raw)

    def chunk(
        self,
        text: str | None,
        *,
        completion_tokens: int = 0,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> dict[str, Any]:
        """The chunk of a token whose text is ``text`` and that makes ``completion_tokens``
        generated so far; ``text=None`` is the chat role chunk that precedes the tokens."""
        identity, options = self.identity, self._stream_options
        running = (self._prompt_tokens, completion_tokens) if options.continuous_usage else None
        fingerprint = (
            identity.fingerprint
            if finish_reason is not None and not options.include_usage
            else None
        )
        chunk = token_chunk(
            identity,
            text=text,
            finish_reason=finish_reason,
            running_usage=running,
            fingerprint=fingerprint,
        )
        if stop_reason is not None:
            chunk["choices"][0]["stop_reason"] = stop_reason
        return chunk

    async def end_stream(self, usage: Usage) -> None:
        """The usage chunk (when asked for), ``[DONE]``, and the end of the response."""
        if self._stream_options.include_usage:
            await self.event(usage_chunk(self.identity, usage))
        await self._close()

    async def fail_stream(self, error: dict[str, Any]) -> None:
        """End the stream with an error event (rule 3)."""
        await self.event(error)
        await self._close()

    async def _close(self) -> None:
        await self.write(DONE_EVENT)
        assert self.response is not None
        await self.response.write_eof()

    def full_body(self, *, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The whole (non-streamed) body of the answer."""
        return full_response(self.identity, text=text, finish_reason=finish_reason, usage=usage)

    async def send(self, body: dict[str, Any], status: int) -> None:
        """Write one whole JSON response now."""
        response = json_response(body, status)
        self.response = response
        await response.prepare(self._request)
        await response.write_eof()
