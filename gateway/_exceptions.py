"""The gateway's errors, and the one place foreign errors are translated into them.

    GatewayError                 (status_hint: the HTTP status it becomes)
    ├── RequestError             the client's request cannot be forwarded or done
    │   ├── RequestTooLarge      413
    │   ├── RequestTimeout       408  the body did not arrive whole within body_timeout_s
    │   ├── FaultyFraming        400  an HTTP/1.0 request with Transfer-Encoding
    │   ├── TransferCodingNotImplemented
    │   │                        501  a transfer coding other than chunked (gzip, chunked)
    │   ├── HeadersTooLarge      431  the request's headers exceed max_header_bytes
    │   ├── Unauthorized         401  admin API: missing or wrong bearer token
    │   ├── Forbidden            403  admin API: a browser's cross-site request, or a
    │   │                             Host that is not loopback where no token is set
    │   ├── NotFound             404  admin API: no such candidate or route
    │   ├── Conflict             409  admin API: the action does not fit the state
    │   ├── InvalidBody          422  admin API: the body failed validation
    │   └── MalformedBody        400  admin API: the body's Content-Encoding or chunked
    │                                 framing does not decode
    ├── ChangeNotStored          503  admin API: the store could not take a change (reason:
    │                                 timeout|unavailable|rejected); nothing was applied
    └── UpstreamError            the backend failed us (kind: a bounded metrics label)
        ├── UpstreamUnreachable  502  connect refused / reset before an answer
        ├── UpstreamTimeout      504  connect, first-byte or idle timeout
        └── UpstreamBroken       502  the answer was cut or malformed mid-stream

Every error renders as an OpenAI-style JSON body, so clients' SDKs raise their usual types.
One that ``closes_connection`` is answered with ``Connection: close``: what follows its head
on the connection cannot be trusted to be the next request (408, 400 framing or body, 501).
An upstream error's message names the upstream, never its address, and never quotes what
it sent (those go to the log).
The store's errors (``evaluators.store.StoreError``) become ``ChangeNotStored`` in
``translate_store_errors``, the one place the admin API meets them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import ClassVar, Literal

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import ContentLengthError, TransferEncodingError

from evaluators.store import StoreError, StoreRejected
from gateway._wire import ConnectFailed, ConnectTimeout, MalformedResponse, WireError

__all__ = [
    "ChangeNotStored",
    "ChangeNotStoredReason",
    "Conflict",
    "FaultyFraming",
    "Forbidden",
    "GatewayError",
    "HeadersTooLarge",
    "InvalidBody",
    "MalformedBody",
    "NotFound",
    "RequestError",
    "RequestTimeout",
    "RequestTooLarge",
    "TransferCodingNotImplemented",
    "Unauthorized",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamErrorKind",
    "UpstreamErrorTranslation",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "error_response",
    "translate_store_errors",
    "translate_upstream_errors",
]

log = logging.getLogger("understudy.upstream")

UpstreamErrorKind = Literal[
    "connect", "connect_timeout", "first_byte_timeout", "idle_timeout", "reset", "protocol"
]


class GatewayError(Exception):
    status_hint: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    closes_connection: ClassVar[bool] = False


class RequestError(GatewayError):
    status_hint = 400
    error_type = "invalid_request_error"


class RequestTooLarge(RequestError):
    status_hint = 413


class RequestTimeout(RequestError):
    status_hint = 408
    closes_connection = True  # the rest of the body may never come


class FaultyFraming(RequestError):
    """RFC 9112 6.1: an HTTP/1.0 request with Transfer-Encoding has faulty framing (an
    HTTP/1.0 hop before the gateway reads its body otherwise): never relayed."""

    closes_connection = True


class TransferCodingNotImplemented(RequestError):
    """RFC 9112 6.1: a transfer coding the gateway does not implement (anything but
    ``chunked``) is a 501; its body cannot be decoded, so it is not relayed."""

    status_hint = 501
    closes_connection = True


class HeadersTooLarge(RequestError):
    status_hint = 431


class Unauthorized(RequestError):
    status_hint = 401
    error_type = "authentication_error"


class Forbidden(RequestError):
    """Refused before its body is read: the connection closes rather than read it."""

    status_hint = 403
    error_type = "permission_error"
    closes_connection = True


class NotFound(RequestError):
    status_hint = 404
    error_type = "not_found_error"


class Conflict(RequestError):
    status_hint = 409
    error_type = "conflict_error"


class InvalidBody(RequestError):
    status_hint = 422


class MalformedBody(RequestError):
    closes_connection = True  # where the next request starts is unknown


ChangeNotStoredReason = Literal["timeout", "unavailable", "rejected"]


class ChangeNotStored(GatewayError):
    """An admin change the store did not take: this replica applied none of it."""

    status_hint = 503
    error_type = "store_unavailable"

    def __init__(self, message: str, reason: ChangeNotStoredReason) -> None:
        super().__init__(message)
        self.reason: ChangeNotStoredReason = reason


class UpstreamError(GatewayError):
    status_hint = 502
    error_type = "upstream_error"

    def __init__(self, message: str, kind: UpstreamErrorKind, upstream: str) -> None:
        super().__init__(message)
        self.kind: UpstreamErrorKind = kind
        self.upstream = upstream


class UpstreamUnreachable(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    status_hint = 504
    error_type = "upstream_timeout"


class UpstreamBroken(UpstreamError):
    pass


def error_response(error: GatewayError, request_id: str | None = None, *,
                   response_class: type[web.Response] = web.Response) -> web.Response:
    body = {
        "error": {
            "message": str(error),
            "type": error.error_type,
            "param": None,
            "code": error.status_hint,
        }
    }
    headers = {"X-Request-Id": request_id} if request_id else None
    return response_class(
        status=error.status_hint,
        body=orjson.dumps(body),
        content_type="application/json",
        headers=headers,
    )


@contextmanager
def translate_store_errors(what: str) -> Iterator[None]:
    """Map the store's errors while doing ``what`` (an admin change) onto ChangeNotStored."""
    try:
        yield
    except StoreError as exc:
        if isinstance(exc, StoreRejected):
            raise ChangeNotStored(f"{what}: the store refused it ({exc}); nothing was applied",
                                  "rejected") from exc
        raise ChangeNotStored(f"{what}: the store is unavailable ({exc}); nothing was "
                              "applied, retry when it is back", "unavailable") from exc


def translate_upstream_errors(upstream: str,
                              phase: Literal["connect", "stream"]) -> UpstreamErrorTranslation:
    """``with`` it: map wire (``_wire.py``), aiohttp and asyncio failures talking to
    ``upstream`` onto the tree above.

    ``phase`` says whether the answer had begun: a timeout before the headers is a
    first-byte timeout, after them an idle timeout.
    """
    return UpstreamErrorTranslation(upstream, phase)


class UpstreamErrorTranslation:
    """``translate_upstream_errors``'s context manager: a class, not ``@contextmanager``,
    whose generator and frames cost ~3 µs per entry on the relay's path (two per request)."""

    __slots__ = ("_phase", "_upstream")

    def __init__(self, upstream: str, phase: Literal["connect", "stream"]) -> None:
        self._upstream = upstream
        self._phase = phase

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: type[BaseException] | None, exc: BaseException | None,
                 _tb: TracebackType | None) -> None:
        if exc is not None and (error := _translated(exc, self._upstream, self._phase)):
            raise error from exc


def _translated(exc: BaseException, upstream: str,
                phase: Literal["connect", "stream"]) -> UpstreamError | None:
    """The ``UpstreamError`` that ``exc`` becomes; ``None`` if it is none of the upstream's
    failures (it then propagates as it is)."""
    if isinstance(exc, TimeoutError):
        if isinstance(exc, ConnectTimeout | aiohttp.ConnectionTimeoutError):
            kind: UpstreamErrorKind = "connect_timeout"
        else:
            kind = "first_byte_timeout" if phase == "connect" else "idle_timeout"
        return UpstreamTimeout(f"upstream {upstream} timed out ({kind})", kind, upstream)
    if isinstance(exc, ConnectFailed | aiohttp.ClientConnectorError):
        # The client hears the upstream's name, never its address or the OS's words.
        # Debug: a candidate that is down would log once per mirrored request; the
        # metrics count these (understudy_upstream_errors, understudy_mirror_failed).
        log.debug("upstream %s is unreachable: %s", upstream, exc)
        return UpstreamUnreachable(f"upstream {upstream} is unreachable", "connect", upstream)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
                  | ConnectionResetError):
        kind = "connect" if phase == "connect" else "reset"
        return UpstreamBroken(f"upstream {upstream} closed the connection", kind, upstream)
    if isinstance(exc, aiohttp.ClientPayloadError):
        # A body that stopped short of its declared framing is a connection cut mid-answer.
        cut = isinstance(exc.__cause__, ContentLengthError | TransferEncodingError)
        return UpstreamBroken(f"upstream {upstream} sent a broken body",
                              "reset" if cut else "protocol", upstream)
    if isinstance(exc, MalformedResponse | WireError):
        log.debug("upstream %s sent an invalid response: %s", upstream, exc)
        return UpstreamBroken(f"upstream {upstream} sent an invalid response", "protocol",
                              upstream)
    if isinstance(exc, aiohttp.ClientResponseError):
        # exc.message may quote the upstream's raw bytes: logged (cut), never sent on.
        log.debug("upstream %s sent an invalid response: %.200r", upstream, exc.message)
        return UpstreamBroken(f"upstream {upstream} sent an invalid response", "protocol",
                              upstream)
    return None
