"""The hot path: forward one request to the primary and stream its answer back.

Rules (DESIGN.md invariant 1):
1. Every chunk the primary sends is written to the client as it arrives; the relay never
   waits for a candidate, the store or an evaluator before or while answering.
2. Per chunk the relay does only: read a clock, append to the bounded :class:`Capture`,
   note the time for the idle watchdog, and write. The one exception is a stream on which
   the gateway itself asked for usage (``include_usage``) that the client did not ask
   for: there whole SSE events are passed on and the extra usage event is dropped. An event
   is held whole only up to ``MAX_EVENT_BYTES``: one longer passes on unheld, as it comes,
   and is counted (``understudy_usage_filter_oversized_events``). It cannot be the usage
   event (vLLM's is a few hundred bytes, as its per-token events are), and holding it would
   let a backend that never ends an event grow the gateway's memory without bound.
3. The request body is read once, bounded by ``max_body_bytes``, and parsed as JSON at
   most once (only for the routes whose fields matter). A body that is not JSON is
   forwarded untouched: the backend judges it. A body that does not arrive whole within
   ``body_timeout_s`` of the head is a 408 and the connection is closed (a stalled body
   would hold the connection, its admission slot and a task for ever); a body that came
   with its head, as a small request's does, costs no timer.
   A backend with a ``model`` (a candidate live as the canary or promoted, ``_routing``
   rule 2) gets the body with that model named: built from the parsed payload, or for a
   coded body decoded, rewritten and coded again (``_body_coding`` rule 3).
4. Once the response has begun, an upstream failure can no longer become a 502/504: the
   client connection is aborted so the client sees a cut answer, never a clean end.
5. The relay does not know which server read the request: it talks to a
   :class:`RelayClient`, the front's (``_front.py``, every ``/v1/`` request on a
   connection it kept) or aiohttp's (:class:`AiohttpClient`, on a connection handed over).
6. Only ``/v1/`` is forwarded, so a path with a ``.`` or ``..`` segment (percent-encoded,
   or behind an encoded slash or a backslash, too) is refused with a 400, never forwarded:
   ``/v1/models/../../reset_prefix_cache`` would reach the backend's other endpoints
   through anything between them that resolves dot segments (nginx, for one). No OpenAI
   route has such a segment. What goes upstream is the target's origin form (RFC 9112
   §3.2), its path and query as sent: an absolute-form target's scheme and authority are
   the client's (the primary, or a proxy before it, would route on them) and a fragment is
   never part of a request.
7. A request's framing is ``Content-Length`` or ``Transfer-Encoding: chunked`` alone (RFC
   9112 §6.1, as nginx): any other transfer coding (``gzip, chunked``, which the parser
   decodes as chunked) is a 501, and an HTTP/1.0 request with ``Transfer-Encoding`` a 400;
   both close the connection and are never relayed: the body left coded, or framed one way
   here and another by an HTTP/1.0 hop before the gateway.
8. The answer's head carries the client's request id as the client's bytes (``_headers``:
   ``wire_text``), on either server: the front writes its head as Latin-1, and so do the
   responses here (:class:`RelayedResponse`, :class:`RelayedError`), since aiohttp's own
   writer encodes each character as UTF-8 and drops a surrogate escape: a byte of the id
   that is not UTF-8 would come back changed, or not at all. A head all ASCII (nearly
   every one) is the same bytes either way and is left to aiohttp's own writer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import unquote

import orjson
from aiohttp import StreamReader, web
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from evaluators import Capture, observe
from gateway._body_coding import with_fields
from gateway._exceptions import (
    FaultyFraming,
    GatewayError,
    HeadersTooLarge,
    RequestError,
    RequestTimeout,
    RequestTooLarge,
    TransferCodingNotImplemented,
    UpstreamError,
    error_response,
)
from gateway._headers import (
    REQUEST_ID_HEADER,
    downstream_headers,
    forwarded_headers,
    wire_text,
)
from gateway._metrics import Route, route_of
from gateway._relaycore import ClientSink, SseFilter
from gateway._sampler import exchange_request_id, session_key
from gateway._state import GatewayState
from gateway._upstream import Upstream

__all__ = ["MAX_EVENT_BYTES", "MAX_HELD_BYTES", "AiohttpClient", "ClientStream", "RelayClient",
           "RelayStream", "RelayedResponse", "RequestPlan", "UsageEventFilter", "origin_form",
           "plan_request", "read_body", "relay"]

log = logging.getLogger("understudy.gateway")

MAX_HELD_BYTES = 64 * 1024
"""The most of an answer that is not a stream held back to leave with its head."""
MAX_EVENT_BYTES = 64 * 1024
"""The most of an unfinished SSE event the usage filter holds (rule 2). vLLM's usage event
is a few hundred bytes, a per-token event with 20 top logprobs a few KB."""

_JSON_ROUTES: frozenset[Route] = frozenset({"chat_completions", "completions", "embeddings"})
_STREAMING_ROUTES: frozenset[Route] = frozenset({"chat_completions", "completions"})


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the gateway learned from the request, once, and the body it will send."""

    route: Route
    body: bytes
    payload: dict[str, Any] | None
    stream: bool
    injected_usage: bool

    def naming(self, model: str, coding: str | None) -> RequestPlan:
        """This plan for a backend that serves ``model`` (rule 3): its body names it."""
        if not self.body:
            return self
        if self.payload is None:  # not read as JSON: coded, or not an object
            return replace(self, body=with_fields(self.body, {"model": model}, coding))
        payload = {**self.payload, "model": model}
        upstream = _with_usage(payload) if self.injected_usage else payload
        return replace(self, body=bytes(memoryview(orjson.dumps(upstream))))


class RelayStream(Protocol):
    """The client's writer of one answer (a ``ClientSink``): the upstream's ``ClientWriter``."""

    def write(self, piece: bytes) -> bool: ...

    @property
    def gone(self) -> bool: ...

    async def drain(self) -> None: ...


class RelayClient(Protocol):
    """The client's half of one relayed request, whichever server read it (rule 5)."""

    @property
    def method(self) -> str: ...
    @property
    def version(self) -> tuple[int, int]: ...
    @property
    def path(self) -> str: ...
    @property
    def raw_path(self) -> str: ...
    @property
    def headers(self) -> CIMultiDictProxy[str]: ...
    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def content(self) -> StreamReader: ...
    @property
    def client_ip(self) -> str | None: ...
    @property
    def scheme(self) -> str: ...

    def refuse(self, error: GatewayError, request_id: str | None) -> None:
        """Answer ``error`` (OpenAI-style JSON); nothing of an answer was sent yet."""

    async def begin(self, status: int, reason: str, headers: CIMultiDict[str], *,
                    live_soon: bool) -> RelayStream:
        """The answer's head (held until the first write or the end, see ``ClientStream``)
        and the writer of its body."""

    async def end(self, stream: RelayStream) -> None:
        """The answer's end: what ``stream`` still holds, then the end of the body."""

    def cut(self) -> None:
        """Abort the connection: the answer had begun (rule 4)."""


async def read_body(request: RelayClient | web.Request, limit: int, timeout_s: float) -> bytes:
    """Rule 3: the whole body, at most ``limit`` bytes, within ``timeout_s``."""
    length = request.content_length
    if length is not None and length > limit:
        raise RequestTooLarge(f"request body of {length} bytes exceeds "
                              f"the limit of {limit} bytes")
    content = request.content
    if content.is_eof():  # all of it came with the head (a small request): one join, no loop
        whole = content.read_nowait()
        if len(whole) > limit:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
        return whole
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await content.readany():
                body += chunk
                if len(body) > limit:
                    raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive whole within {timeout_s:g} s "
                             f"({len(body)} bytes came)") from None
    return bytes(body)


def plan_request(route: Route, method: str, body: bytes) -> RequestPlan:
    payload: dict[str, Any] | None = None
    if method == "POST" and route in _JSON_ROUTES and body:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        payload = parsed if isinstance(parsed, dict) else None
    if payload is None or route not in _STREAMING_ROUTES or payload.get("stream") is not True:
        return RequestPlan(route, body, payload, stream=False, injected_usage=False)
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return RequestPlan(route, body, payload, stream=True, injected_usage=False)
    if options is not None and not isinstance(options, dict):
        # Malformed stream_options: forward untouched, the backend answers the 400.
        return RequestPlan(route, body, payload, stream=True, injected_usage=False)
    upstream_payload = _with_usage(payload)
    # orjson's output can own far more memory than its length (1 MiB for a 64 KiB body);
    # an exact copy keeps what the request holds, and what the MemoryBudget charges, true.
    body = bytes(memoryview(orjson.dumps(upstream_payload)))
    return RequestPlan(route, body, payload, stream=True, injected_usage=True)


def _with_usage(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` asking for the usage chunk (its ``stream_options`` a dict or absent)."""
    options = payload.get("stream_options")
    return {**payload, "stream_options": {**(options or {}), "include_usage": True}}


class UsageEventFilter(SseFilter):
    """Hides the usage-only SSE event (``"choices":[]``) from a client that did not ask.

    vLLM stamps ``system_fingerprint`` on the terminal chunks (those with a finish reason)
    when ``include_usage`` is off, and on the usage chunk instead when it is on. So
    terminal chunks are held back until the next event that is not one: the usage chunk
    (vLLM sends it right after the last of them) gives them its fingerprint and is dropped;
    any other event (with ``n > 1``, a choice still streaming after another finished)
    passes them on as they came, before it. No event waits past the next one, and the
    order is the upstream's. Only complete events (ending in a blank line) are passed on,
    each with its own line ends: a blank line is two line ends in a row, each CRLF, LF or CR
    (the SSE grammar; vLLM writes ``\n\n``, sse-starlette ``\r\n\r\n``). An event that
    outgrows ``max_event_bytes`` before its blank line (rule 2) is passed on unheld instead:
    the events held before it first, as they came, then its bytes as they come; holding
    resumes with the next event. ``oversized`` counts such events (a terminal one among them
    is not given the usage event's fingerprint). Only the usage event and its blank line are
    dropped, to the byte, however the reads fall (``_around_usage``).

    ``feed`` is the C base's (``gateway/_relaycore.c``, per chunk, its rule 5): it keeps the
    bytes after the last blank line in ``_pending`` (at most ``max_event_bytes``), passes
    whole events with neither marker as they are (or everything, once ``_done``), and hands
    the others to ``_marked``, here.
    """

    __slots__ = ()

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        super().__init__(max_event_bytes)

    _USAGE = (b'"choices":[]', b'"choices": []')
    _TERMINAL = (b'"finish_reason":"', b'"finish_reason": "')

    def _marked(self, complete: bytes) -> bytes:
        """Whole events (``complete`` ends in a blank line) of which one may be marked, or
        with terminal events held before them."""
        out: list[bytes] = []
        events = _events(complete)
        for k, event in enumerate(events, 1):
            if self._done:  # what follows the usage event passes, as the C base passes it
                out.append(event)
            elif any(m in event for m in self._USAGE):
                out += [_stamp(held, _fingerprint(event)) for held in self._held]
                self._held = []
                self._done = True
                around, owes_lf = _around_usage(event)
                out.append(around)
                self._skip_lf = owes_lf and k == len(events)
            elif any(m in event for m in self._TERMINAL):
                self._held.append(event)
            else:
                out += self._held
                self._held = []
                out.append(event)
        return b"".join(out)

    def flush(self) -> bytes:
        rest = b"".join(self._held) + self._pending
        self._held, self._pending = [], b""
        return rest


# A blank line: two line ends in a row, each CRLF, LF or CR (a CR then LF is one).
_BLANK_LINE = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r(?!\n))")


def _events(complete: bytes) -> list[bytes]:
    """The events of ``complete`` (the C base cut it after a blank line), each with the
    blank line that ends it; more blank lines at the end stay with the last event."""
    events, start = [], 0
    for blank in _BLANK_LINE.finditer(complete):
        events.append(complete[start:blank.end()])
        start = blank.end()
    if start < len(complete):
        events[-1] += complete[start:]
    return events


def _around_usage(event: bytes) -> tuple[bytes, bool]:
    """What of the usage event passes on, and whether an LF still to come is its.

    Only the event and its blank line are dropped: a line end before it is the previous
    event's (a CRLF whose read ended at the CR leaves its LF here), and line ends after its
    blank line pass as they came. A blank line that ends the event (and so the read) at a CR
    owes the LF that may follow: ``_relaycore.c`` rule 6 drops it when it comes."""
    start = len(event) - len(event.lstrip(b"\r\n"))
    blank = _BLANK_LINE.search(event, start)
    end = blank.end() if blank else len(event)
    return event[:start] + event[end:], end == len(event) and event.endswith(b"\r")


def _fingerprint(event: bytes) -> bytes | None:
    try:
        doc = orjson.loads(event.partition(b"data:")[2])
    except orjson.JSONDecodeError:
        return None
    value = doc.get("system_fingerprint") if isinstance(doc, dict) else None
    return orjson.dumps(value) if isinstance(value, str) else None


def _stamp(event: bytes, fingerprint: bytes | None) -> bytes:
    """``event`` with ``"system_fingerprint"`` appended as its last field, as vLLM does."""
    end = event.rfind(b"}")
    if fingerprint is None or end < 0 or b'"system_fingerprint"' in event:
        return event
    return event[:end] + b',"system_fingerprint":' + fingerprint + event[end:]


async def relay(client: RelayClient, state: GatewayState) -> None:
    """Handle one proxied request end to end; never raises for upstream failures."""
    loop = asyncio.get_running_loop()
    started, wall_started = loop.time(), time.time()
    # 128 random bits as 32 hex digits, like uuid4().hex, without building a UUID.
    request_id = client.headers.get(REQUEST_ID_HEADER) or os.urandom(16).hex()
    # What the mirror joins and the store keeps (_sampler rule 6); relayed: request_id.
    exchange_id = exchange_request_id(request_id)
    route = route_of(client.path)
    metrics = state.metrics
    limit = state.config.server.max_header_bytes
    if sum(len(k) + len(v) + 4 for k, v in client.raw_headers) > limit:
        metrics.rejected.labels("headers_too_large").inc()
        metrics.route(route).answered(431).inc()
        client.refuse(HeadersTooLarge(
            f"request headers exceed the limit of {limit} bytes in all"), None)
        return
    if (refusal := _framing_refusal(client)) is not None:
        metrics.rejected.labels(refusal[0]).inc()
        metrics.route(route).answered(refusal[1].status_hint).inc()
        client.refuse(refusal[1], None)
        return
    if _has_dot_segment(client.raw_path):
        metrics.rejected.labels("dot_segment").inc()
        metrics.route(route).answered(400).inc()
        client.refuse(RequestError(
            "the path has a '.' or '..' segment; the gateway forwards only /v1/ paths"), None)
        return
    routing = state.routing  # one snapshot: the whole request goes where it says
    capture = Capture(started=started, max_bytes=state.config.capture.max_bytes,
                      max_chunk_times=state.config.capture.max_chunk_times)
    metrics.relaying += 1
    mirrored = False  # whether a candidate's answer waits for this one (_mirror rule 2)
    try:
        server = state.config.server
        body = await read_body(client, server.max_body_bytes, server.body_timeout_s)
        plan = plan_request(route, client.method, body)
        headers = forwarded_headers(client.headers, request_id=request_id,
                                    client_ip=client.client_ip, scheme=client.scheme)
        backend = routing.primary
        if state.mirror.active or routing.canary is not None:
            session = session_key(headers, plan.payload, state.config.mirror.session_header,
                                  exchange_id)
            if routing.canary is not None and routing.chooses_canary(session):
                # Served live by the canary: not a primary answer to compare against.
                backend = routing.canary.backend
                state.mirror.skip("canary")
            elif state.mirror.active:
                mirrored = state.mirror.offer(route, client.method, client.raw_path,
                                              headers, plan.body, plan.payload, exchange_id,
                                              session)
        if backend.model is not None:  # a candidate live: the model it serves (rule 3)
            plan = plan.naming(backend.model, headers.get("Content-Encoding"))
        upstream = state.upstreams.get(backend)
        await _forward(client, state, upstream, plan, headers, capture, request_id)
    except (RequestTooLarge, RequestTimeout) as exc:
        too_large = isinstance(exc, RequestTooLarge)
        metrics.rejected.labels("body_too_large" if too_large else "body_timeout").inc()
        capture.status = exc.status_hint
        client.refuse(exc, request_id)
    except UpstreamError as exc:  # before the answer began: it becomes a 502/504
        metrics.upstream_errors.labels(exc.upstream, exc.kind).inc()
        capture.status, capture.error = exc.status_hint, exc.kind
        client.refuse(exc, request_id)
    except asyncio.CancelledError:  # the client went away; the upstream call is closed
        capture.error = "client_disconnected"
        raise
    finally:
        metrics.relaying -= 1
        capture.ended = loop.time()
        _record(state, capture, exchange_id, route, wall_started, mirrored)


def _framing_refusal(client: RelayClient) -> tuple[str, GatewayError] | None:
    """Rule 7: the reason and error refusing a request framed by a transfer coding other
    than ``chunked`` alone, or an HTTP/1.0 request framed by one; ``None`` for the rest."""
    codings = client.headers.get("Transfer-Encoding")
    if codings is None:  # the common case: one lookup
        return None
    if client.version < (1, 1):
        return "faulty_framing", FaultyFraming(
            "an HTTP/1.0 request cannot have a Transfer-Encoding header")
    # The parser let through one header whose last coding is chunked, and only once.
    if codings.strip(" \t").lower() == "chunked":
        return None
    return "transfer_coding", TransferCodingNotImplemented(
        "a Transfer-Encoding other than chunked is not implemented")


def origin_form(target: str, url: URL) -> str:
    """Rule 6: the path and query of a request ``target`` as sent (``url``, its parsed form,
    for an absolute-form one), without a fragment."""
    if target.startswith("/"):
        return target.partition("#")[0] if "#" in target else target
    return url.raw_path_qs


def _has_dot_segment(raw_path: str) -> bool:
    """Rule 6: whether the path, percent-decoded, has a ``.`` or ``..`` segment (a
    backslash counted as a slash)."""
    path = raw_path.partition("?")[0]
    if "." not in path and "%" not in path:  # the common case, without decoding
        return False
    segments = unquote(path).replace("\\", "/").split("/")
    return "." in segments or ".." in segments


async def _forward(client: RelayClient, state: GatewayState, upstream: Upstream,
                   plan: RequestPlan, headers: CIMultiDict[str], capture: Capture,
                   request_id: str) -> None:
    capture.backend = upstream.name
    in_flight = state.in_flight
    in_flight[upstream.name] += 1
    capture.concurrency = in_flight[upstream.name]
    load = state.backend_load
    capture.backend_running = None if load is None else load.running(upstream.name)
    capture.sent = asyncio.get_running_loop().time()
    try:
        await _relay_answer(client, state, upstream, plan, headers, capture, request_id)
    finally:
        in_flight[upstream.name] -= 1
        if not in_flight[upstream.name]:
            del in_flight[upstream.name]


async def _relay_answer(client: RelayClient, state: GatewayState, upstream: Upstream,
                        plan: RequestPlan, headers: CIMultiDict[str], capture: Capture,
                        request_id: str) -> None:
    async with upstream.call(client.method, client.raw_path, upstream.credentials(headers),
                             plan.body, capture) as up:
        usage_filter = UsageEventFilter() if plan.injected_usage and capture.streamed else None
        stream = await client.begin(
            up.status, up.reason,
            downstream_headers(up.headers, request_id=request_id,
                               body_rewritten=usage_filter is not None),
            live_soon=capture.streamed)
        try:
            await upstream.read(up, capture, stream, usage_filter)
        except UpstreamError as exc:
            state.metrics.upstream_errors.labels(upstream.name, exc.kind).inc()
            capture.error = exc.kind
            # Rare and otherwise seen only as a count: say which request was cut, and why.
            log.warning("request %s cut mid-answer: %s (%s)", request_id, exc, exc.kind)
            client.cut()  # the answer had begun: cut it, never end it cleanly
            return
        finally:
            if usage_filter is not None and usage_filter.oversized:
                state.metrics.usage_filter_oversized.inc(usage_filter.oversized)
        # A whole answer that came before the client stream went live (a small one) goes
        # out with the head and the end in one write.
        await client.end(stream)


class AiohttpClient:
    """A :class:`RelayClient` on aiohttp's server: a ``/v1/`` request on a connection the
    front handed to aiohttp (``_front.py`` rule 1). ``response`` is the handler's answer."""

    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    @property
    def method(self) -> str:
        return self._request.method

    @property
    def version(self) -> tuple[int, int]:
        return self._request.version

    @property
    def path(self) -> str:
        return self._request.path

    @property
    def raw_path(self) -> str:
        return origin_form(self._request.raw_path, self._request.rel_url)

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self._request.headers

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self._request.raw_headers

    @property
    def content_length(self) -> int | None:
        return self._request.content_length

    @property
    def content(self) -> StreamReader:
        return self._request.content

    @property
    def client_ip(self) -> str | None:
        transport = self._request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return str(peer[0]) if peer else None

    @property
    def scheme(self) -> str:
        return self._request.scheme

    def refuse(self, error: GatewayError, request_id: str | None) -> None:
        self.response = error_response(
            error, None if request_id is None else wire_text(request_id),
            response_class=RelayedError)  # rule 8
        # aiohttp reads and drops an unread body, then keeps the connection: for one
        # never to come (a 413 before 100 Continue) the client's next request would be
        # read as that body. Closed after the answer, as the front does (_front.py rule 6).
        if error.closes_connection or not self._request.content.is_eof():
            self.response.force_close()

    async def begin(self, status: int, reason: str, headers: CIMultiDict[str], *,
                    live_soon: bool) -> ClientStream:
        self.response = response = RelayedResponse(status=status, reason=reason,
                                                   headers=headers)
        await response.prepare(self._request)  # the head is buffered, not yet sent
        return ClientStream(self._request, live_soon=live_soon)

    async def end(self, stream: RelayStream) -> None:
        assert self.response is not None and isinstance(stream, ClientStream)
        await self.response.write_eof(stream.held())

    def cut(self) -> None:
        if self._request.transport is not None:
            self._request.transport.abort()


class RelayedResponse(web.StreamResponse):
    """A ``StreamResponse`` whose head waits for the first write instead of leaving alone
    at ``prepare`` (aiohttp's ``Response`` does the same): a small answer goes out with its
    head and its end in one write, one system call instead of two. Its head is written as
    Latin-1 (rule 8)."""

    _send_headers_immediately = False

    async def _write_headers(self) -> None:
        if _ascii_head(self):  # aiohttp's own writer, as fast, gives the same bytes
            await super()._write_headers()
        else:
            _latin1_head(self)


class RelayedError(web.Response):
    """A refusal on a connection aiohttp serves, its head written as Latin-1 (rule 8)."""

    async def _write_headers(self) -> None:
        if _ascii_head(self):
            await super()._write_headers()
        else:
            _latin1_head(self)


_HEAD_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _ascii_head(response: web.StreamResponse) -> bool:
    """Rule 8: a head all ASCII is the same bytes in UTF-8 and Latin-1, so aiohttp's own
    writer (its C serializer) writes it; only a head past ASCII is built here, in Python."""
    return all(name.isascii() and value.isascii() for name, value in response.headers.items())


def _latin1_head(response: web.StreamResponse) -> None:
    """Rule 8: what aiohttp's ``_write_headers`` does (the head buffered in its writer,
    sent with the first write), one Latin-1 byte a character instead of UTF-8; a value with
    a control character is refused, as aiohttp's writer refuses it (aiohttp 3.14's
    internals, pinned in pyproject.toml)."""
    request, writer = response._req, response._payload_writer
    assert request is not None and isinstance(writer, StreamWriter)
    version = request.version
    lines = [f"HTTP/{version[0]}.{version[1]} {response.status} {response.reason}",
             *map(": ".join, response.headers.items())]
    if any(_HEAD_FORBIDDEN.search(line) is not None for line in lines):
        raise ValueError("a header holds a control character")
    head = "\r\n".join([*lines, "", ""])
    writer._headers_buf = head.encode("latin-1", "replace")
    writer._headers_written = False


class ClientStream(ClientSink):
    """The client's side of the relay: body pieces written straight to its transport.

    A stream goes live (its head sent, each piece written on, framed, as it comes) on the
    loop's next iteration: what came with the head is held until then. An answer that is
    not a stream is held until its end or ``MAX_HELD_BYTES``, so that a small one leaves
    in one write with its head and its end (``held``). aiohttp's response writer still
    sends the head and the end. ``write`` is the C base's (``gateway/_relaycore.c``): a
    piece held, or framed as a chunk (when the answer is chunked) and written; ``True``
    when the client's protocol is past its high-water mark or its transport closing.
    """

    __slots__ = ("_writer",)

    def __init__(self, request: web.Request, *, live_soon: bool) -> None:
        writer = request.writer
        assert isinstance(writer, StreamWriter) and request.transport is not None
        super().__init__(request.transport, writer.protocol, writer.chunked, MAX_HELD_BYTES)
        self._writer = writer
        if live_soon:
            asyncio.get_running_loop().call_soon(self.go_live)

    @property
    def gone(self) -> bool:
        return self._transport.is_closing()

    async def drain(self) -> None:
        await self._writer.drain()

    def go_live(self) -> None:
        held, self._held = self._held, None
        if held is None or self._transport.is_closing():
            return
        self._writer.send_headers()
        if held:
            self.write(b"".join(held))

    def held(self) -> bytes:
        """The pieces not yet written (the whole answer if it never went live)."""
        held, self._held = self._held, None
        return b"".join(held) if held else b""


def _record(state: GatewayState, capture: Capture, request_id: str, route: Route,
            wall_started: float, mirrored: bool) -> None:
    series = state.metrics.route(route)
    series.answered(capture.status or 499).inc()
    if capture.chunk_times:
        series.ttft.observe(capture.chunk_times[0] - capture.started)
    if capture.ended is not None and capture.error is None:
        series.e2e.observe(capture.ended - capture.started)
    # Parsing the captured answer costs per event: it is done only when a candidate waits
    # for it; the record of recent answers parses lazily, when someone reads it.
    state.observations.accept(capture, request_id, route, wall_started)
    if mirrored:
        state.mirror.primary_done(observe(capture, request_id=request_id,
                                          backend=capture.backend, route=route,
                                          wall_started=wall_started))
