"""A request body sent with a ``Content-Encoding``: a bounded decoded copy for the mirror.

The relay forwards a body as it came, coded or not (the backend judges it). But what the
mirror reads from the body (the session key, the turn depth, the choices asked for, what
``[record]`` writes) is JSON: read from ``gzip`` bytes it was nothing, so a compressed
conversation's turns were sampled one by one, never recorded, and a candidate's ``model``
rewrite was skipped (the candidate got the primary's model name).

Rules:
1. Only ``gzip`` (``x-gzip``) and ``deflate`` (zlib-wrapped, or raw as some clients send
   it), one coding, are decoded: the standard library's, in one bounded call. Another
   coding, or several, is left as sent and counted ``unsupported``.
2. The copy is at most :data:`MAX_DECODED_BODY_BYTES`, the size of the plain body the
   gateway reads by default: a body that decodes to more (a compression bomb, or a large
   prompt) is not decoded past the bound and is counted ``too_large``; one that does not
   decode (cut, corrupt, trailing bytes) is counted ``corrupt``. Either way the request is
   forwarded and mirrored as sent, read as the gateway reads a body that is not JSON.
3. The decoded copy is only read and recorded; what is forwarded (to the primary and to a
   candidate) keeps the client's coding: a candidate's rewrite (of its mirrored requests,
   and of its live ones as the canary or once promoted) is coded again the same way
   (:func:`encode`, :func:`with_fields`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

__all__ = ["MAX_DECODED_BODY_BYTES", "Decoded", "UndecodedReason", "decode", "encode",
           "with_fields"]

MAX_DECODED_BODY_BYTES: Final = 8 * 1024 * 1024
"""Rule 2: the most a decoded copy holds (the gateway's default ``max_body_bytes``)."""

UndecodedReason = Literal["unsupported", "too_large", "corrupt"]

_GZIP_WBITS: Final = 16 + zlib.MAX_WBITS
_ZLIB_WBITS: Final = zlib.MAX_WBITS
_RAW_DEFLATE_WBITS: Final = -zlib.MAX_WBITS
_WBITS: Final = {"gzip": (_GZIP_WBITS,), "x-gzip": (_GZIP_WBITS,),
                 "deflate": (_ZLIB_WBITS, _RAW_DEFLATE_WBITS)}


@dataclass(frozen=True, slots=True)
class Decoded:
    """The decoded copy (``body``), or why there is none (``reason``)."""

    body: bytes | None
    reason: UndecodedReason | None = None


def decode(coding: str, body: bytes, limit: int = MAX_DECODED_BODY_BYTES) -> Decoded:
    """Rules 1 and 2: ``body`` decoded from its ``Content-Encoding`` ``coding``."""
    attempts = _WBITS.get(coding.strip(" \t").lower())
    if attempts is None:
        return Decoded(None, "unsupported")
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error:
            continue  # deflate: zlib-wrapped failed, try raw
        if len(out) > limit or inflater.unconsumed_tail:
            return Decoded(None, "too_large")
        if inflater.eof and not inflater.unused_data:
            return Decoded(out)
    return Decoded(None, "corrupt")


def encode(coding: str, body: bytes) -> bytes:
    """Rule 3: ``body`` coded as ``coding`` (one that :func:`decode` takes)."""
    wbits = _WBITS[coding.strip(" \t").lower()][0]
    deflater = zlib.compressobj(wbits=wbits)
    return deflater.compress(body) + deflater.flush()


def with_fields(body: bytes, fields: Mapping[str, Any], coding: str | None = None) -> bytes:
    """Rule 3: the JSON object ``body`` with ``fields`` set, coded again as ``coding``; the
    body as sent when it is no JSON object, or cannot be decoded (counted when it was
    read)."""
    plain = body
    if coding is not None:
        decoded = decode(coding, body).body
        if decoded is None:
            return body
        plain = decoded
    try:
        payload = orjson.loads(plain)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(payload, dict):
        return body
    out = orjson.dumps({**payload, **fields})
    # orjson's output can own far more memory than its length; the budget charges the
    # length (as ``_relay.plan_request``): an exact copy keeps the charge true.
    return encode(coding, out) if coding is not None else bytes(memoryview(out))
