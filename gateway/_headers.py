"""Header handling for a forwarding proxy (RFC 9110 §7.6.1).

Hop-by-hop headers, and any header named in ``Connection``, describe one connection and
are never forwarded in either direction. ``Content-Length`` is recomputed by the
transport whenever the relay may change the body.

The primary receives the client's request as sent (it is the service the client called).
A candidate's mirrored requests carry only an allow-list (DESIGN.md, security defaults):
the content type and encoding (the body goes on as it came, compressed or not),
``Accept``, the request id, the session header and the configured extras
(``[mirror].forward_headers``, a candidate's ``forward_headers``); the client's
credentials only when the candidate has ``forward_credentials``. A header nobody named
never reaches a candidate's replays.

The client's credentials are every header an LLM API or its gateway authenticates or
bills by (:data:`CREDENTIAL_HEADERS`: OpenAI's, Anthropic's, Azure's, Google's, a bearer
token, a cookie) and the names in ``[mirror].credential_headers`` (a deployment's own
auth header). A backend that takes live traffic (the canary, a promoted candidate) gets
the client's other headers as the primary does, and these only with
``forward_credentials``; a backend with its own ``api_key`` gets that key instead of all
of them, the primary included.

The request id goes to every upstream and back to the client as the client's bytes: a
field's octets past ASCII are opaque (RFC 9110 §5.5), and nginx and vLLM (Starlette's
Latin-1 headers) give them back unchanged. aiohttp's parser reads a field as UTF-8, each
other byte a surrogate escape; an upstream's answer head is read as Latin-1 (``_wire``),
one character a byte, and written so. ``wire_text`` turns the one into the other, so an
id that is not UTF-8 comes back as sent, not as ``?`` per byte.
"""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "CANDIDATE_HEADERS",
    "CREDENTIAL_HEADERS",
    "REQUEST_ID_HEADER",
    "allowed_only",
    "candidate_allow_list",
    "credential_headers",
    "downstream_headers",
    "forwarded_headers",
    "wire_text",
    "with_credentials",
]

REQUEST_ID_HEADER = "X-Request-Id"

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
        "Proxy-Connection", "TE", "Trailer", "Transfer-Encoding", "Upgrade",
    )
)
# Set by the client library for the new connection, never copied. ``Expect`` is met by
# the gateway itself (it reads the whole body before relaying, answering 100 or 413), so
# the primary is never asked for a ``100 Continue`` nobody waits for (nginx drops it too).
_REQUEST_RECOMPUTED = frozenset({"host", "content-length", "expect"})
_RESPONSE_RECOMPUTED = frozenset({"content-length"})

CREDENTIAL_HEADERS = frozenset({
    "authorization", "cookie", "x-auth-token",
    "openai-organization", "openai-project",  # OpenAI: which account the key bills
    "x-api-key",  # Anthropic, and many API gateways
    "api-key", "ocp-apim-subscription-key",  # Azure OpenAI, Azure API Management
    "x-goog-api-key",  # Google
})
"""The headers a client's credentials travel in, besides ``[mirror].credential_headers``."""
CANDIDATE_HEADERS = frozenset({"content-type", "content-encoding", "accept",
                               REQUEST_ID_HEADER.lower()})
"""What every candidate receives of a client's headers, besides the session header."""


def credential_headers(extras: Iterable[str] = ()) -> frozenset[str]:
    """The headers (lower-case) that carry a client's credentials, ``extras`` named too."""
    return CREDENTIAL_HEADERS | {h.lower() for h in extras}


def candidate_allow_list(session_header: str, extras: Iterable[str], *,
                         credentials: frozenset[str] | None) -> frozenset[str]:
    """The headers (lower-case) a candidate may receive of a client's request: the
    ``credentials`` too where it is trusted with them (``None``: not)."""
    allowed = CANDIDATE_HEADERS | {session_header.lower()} | {h.lower() for h in extras}
    return allowed if credentials is None else allowed | credentials


def allowed_only(headers: CIMultiDict[str], allowed: frozenset[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() in allowed)


def _connection_tokens(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    return frozenset(
        token.strip().lower()
        for value in headers.getall("Connection", ())
        for token in value.split(",")
        if token.strip()
    )


_REQUEST_DROPPED = HOP_BY_HOP | _REQUEST_RECOMPUTED
_RESPONSE_DROPPED = HOP_BY_HOP | _RESPONSE_RECOMPUTED


def _copy(headers: CIMultiDictProxy[str], dropped: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without ``dropped`` (lower-case names) and those ``Connection`` names."""
    if "Connection" in headers:
        dropped = dropped | _connection_tokens(headers)
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in dropped])


def forwarded_headers(
    incoming: CIMultiDictProxy[str], *, request_id: str, client_ip: str | None, scheme: str
) -> CIMultiDict[str]:
    """The client's headers as any upstream receives them, before credential policy."""
    out = _copy(incoming, _REQUEST_DROPPED)
    prior = incoming.get("X-Forwarded-For")
    if client_ip:
        out["X-Forwarded-For"] = f"{prior}, {client_ip}" if prior else client_ip
    out["X-Forwarded-Proto"] = incoming.get("X-Forwarded-Proto", scheme)
    out[REQUEST_ID_HEADER] = request_id
    return out


def with_credentials(
    headers: CIMultiDict[str], *, forward_client_credentials: bool, api_key: str | None,
    credentials: frozenset[str],
) -> CIMultiDict[str]:
    """Apply one upstream's credential policy: its own key, the client's ``credentials``
    headers, or none."""
    if forward_client_credentials and api_key is None:
        return headers
    out = CIMultiDict(headers)
    for name in credentials:
        out.popall(name, None)
    if api_key is not None:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def downstream_headers(
    upstream: CIMultiDictProxy[str], *, request_id: str, body_rewritten: bool
) -> CIMultiDict[str]:
    """An upstream's answer headers (Latin-1 text, ``_wire``) as the client receives them,
    with the client's request id in the same form."""
    out = _copy(upstream, _RESPONSE_DROPPED if body_rewritten else HOP_BY_HOP)
    out[REQUEST_ID_HEADER] = wire_text(request_id)
    return out


def wire_text(value: str) -> str:
    """A field as aiohttp's parser read it (UTF-8, each other byte a surrogate escape) as
    the text of an answer's head, one Latin-1 character a byte: the bytes it came as."""
    if value.isascii():
        return value
    return value.encode("utf-8", "surrogateescape").decode("latin-1")
