"""Deterministic sampling: which requests each candidate sees.

Rules (DESIGN.md invariant 5):
1. The decision is a pure function of (namespace, salt, sampling key, rate): a keyed
   BLAKE2b hash mapped to [0, 1) and compared with the rate. Python's ``hash`` is salted
   per process and is never used.
2. With ``unit = "session"`` the key is the session: the configured header (default
   ``X-Session-Id``), else the body's ``user`` field, else a hash of the conversation's
   opening (model, system prompt, first user message), which every later turn repeats.
   So every turn of a sampled conversation is mirrored, on every replica.
3. With ``unit = "request"`` the key is the request id.
4. Samplers never share a hash: a candidate's mirror sample (:func:`mirror_sampled`) is
   salted with its name under the BLAKE2b personalization :data:`MIRROR_NAMESPACE`; the
   canary's routing (``"canary"``) and the recorder (``"record"``) use their fixed salts
   without one. A candidate named ``canary`` or ``record`` salted like them would have
   sampled exactly the canary's sessions (none of which reach the mirror: 0 mirrored of
   a 10 % canary's other 90 %) or the recorder's; under its own namespace its sample is
   independent of theirs. The namespace is a personalization, not a prefix of the salt,
   so a 64-character name keeps all of its bytes in the key.
5. A session key is at most :data:`MAX_SESSION_KEY_CHARS` characters: a longer one (a
   header up to ``max_header_field_bytes``, a ``user`` field up to ``max_body_bytes``, both
   the client's) becomes its kind and a BLAKE2b digest of its value, the same on every
   replica. It is held per mirrored request, per join and per exchange awaiting evaluation
   (10,000 of those, counted, not charged to the budget), and the store refuses one over
   200 characters; a key within the bound is kept as it was (a longer one samples unlike
   it did before this rule: across a rolling upgrade such a canary session may switch
   backend once). The length is the store's: a header's byte that is not UTF-8 (a lone
   surrogate) counts as its 6-character backslash escape (100 such bytes were 602
   characters there, and the exchange was dropped as invalid). A request-id key (``r:``)
   is the request id as the relay keeps it (rule 6).
6. The request id the mirror keys on (the join of a primary's answer with its candidates',
   the duplicate-id check, a request-unit sample, an ``r:`` session key, both Observations
   and the stored exchange) is at most :data:`MAX_REQUEST_ID_CHARS` characters, counted as
   in rule 5: a client's longer ``X-Request-Id`` becomes ``#`` and a BLAKE2b digest
   of it (:func:`exchange_request_id`), the same on every replica and for both sides of a
   join, so the answers still pair and a reused id is still a duplicate. The store refused
   an id over 200 characters, which dropped the exchange as invalid. The id relayed (to the
   primary, to candidates, back to the client) is the client's, as sent.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["MAX_REQUEST_ID_CHARS", "MAX_SESSION_KEY_CHARS", "MIRROR_NAMESPACE",
           "exchange_request_id", "mirror_sampled", "sampled", "session_key"]

_SCALE = float(1 << 64)
# A text-completion conversation grows by appending to its prompt: its head is stable.
OPENING_PROMPT_CHARS = 512
MIRROR_NAMESPACE: Final = b"mirror"
"""Rule 4: the BLAKE2b personalization (at most 16 bytes) of candidates' mirror samples."""
MAX_SESSION_KEY_CHARS: Final = 128
"""Rule 5: the longest session key kept as it came."""
MAX_REQUEST_ID_CHARS: Final = 128
"""Rule 6: the longest request id an exchange is keyed on as it came."""


def sampled(salt: str, key: str, rate: float, *, namespace: bytes = b"") -> bool:
    """Whether ``key`` falls in the ``rate`` sample of the sampler ``salt`` (rule 1).

    ``namespace`` empty: the fixed samplers' own hash (the canary's routing, the recorder),
    unchanged, so a rolling upgrade moves no live session between backends."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    # A header's bytes that are not UTF-8 reach ``key`` as lone surrogates (aiohttp's
    # surrogateescape): hashed as they are, never an UnicodeEncodeError on the request.
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=salt.encode()[:64], person=namespace).digest()
    return int.from_bytes(digest, "big") / _SCALE < rate


def mirror_sampled(candidate: str, key: str, rate: float) -> bool:
    """Whether candidate ``candidate`` mirrors ``key`` at ``rate`` (rule 4: its own
    namespace, so no name shares the canary's or the recorder's sample)."""
    return sampled(candidate, key, rate, namespace=MIRROR_NAMESPACE)


def session_key(headers: CIMultiDict[str] | CIMultiDictProxy[str], payload: dict[str, Any] | None,
                header: str, request_id: str) -> str:
    explicit = headers.get(header)
    if explicit:
        return _bounded("h", explicit)
    if payload is None:
        return f"r:{request_id}"
    user = payload.get("user")
    if isinstance(user, str) and user:
        return _bounded("u", user)
    return "c:" + _opening_hash(payload)


def _bounded(kind: str, value: str) -> str:
    """Rule 5: ``kind:value``, or ``kind#<digest>`` past the bound."""
    if _stored_chars(value, MAX_SESSION_KEY_CHARS) + len(kind) + 1 <= MAX_SESSION_KEY_CHARS:
        return f"{kind}:{value}"
    # Lone surrogates (a header's bytes that are not UTF-8) hashed as they are, as ``sampled``.
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=32)
    return f"{kind}#{digest.hexdigest()}"


def exchange_request_id(request_id: str) -> str:
    """Rule 6: the id ``request_id``'s exchange is joined and stored under: itself, or
    ``#<digest>`` where the store would hold more than :data:`MAX_REQUEST_ID_CHARS`."""
    if _stored_chars(request_id, MAX_REQUEST_ID_CHARS) <= MAX_REQUEST_ID_CHARS:
        return request_id
    # Lone surrogates (a header's bytes that are not UTF-8) hashed as they are, as ``sampled``.
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=32)
    return f"#{digest.hexdigest()}"


def _stored_chars(value: str, bound: int) -> int:
    """The length of ``value`` as the store keeps it, where that matters below ``bound``:
    a lone surrogate (a header's byte that is not UTF-8) as its backslash escape."""
    if len(value) > bound or value.isascii():  # the common cases: no escape to measure
        return len(value)
    return len(value.encode("utf-8", "backslashreplace").decode())


def _opening_hash(payload: dict[str, Any]) -> str:
    messages = payload.get("messages")
    opening: list[Any] = [payload.get("model")]
    if isinstance(messages, list):
        system = next((m.get("content") for m in messages
                       if isinstance(m, dict) and m.get("role") in ("system", "developer")), None)
        first_user = next((m.get("content") for m in messages
                           if isinstance(m, dict) and m.get("role") == "user"), None)
        opening += [system, first_user]
    else:
        prompt = payload.get("prompt", payload.get("input"))
        opening.append(prompt[:OPENING_PROMPT_CHARS] if isinstance(prompt, str) else prompt)
    return hashlib.blake2b(orjson.dumps(opening, option=orjson.OPT_SORT_KEYS),
                           digest_size=12).hexdigest()
