"""Turning an Exchange and its scores into the rows the writer inserts.

This runs inside ``ScoreWriter.submit``, so it is plain CPU work proportional to the
record (its scores and its chunk gaps) and keeps nothing but the rows: the Observations
(and their text, unless configured to be stored) are released as soon as submit returns.

Rules:
1. Identities (request id, session key, backend and metric names) longer than the
   columns hold make the record invalid; descriptive strings (route, model, finish
   reason, error) are cut to their column. A client's header bytes that are not UTF-8
   (lone surrogates in the request id or session key) are kept as backslash escapes:
   no database driver can encode them, and one such row would fail its whole batch.
   The texts a backend or a client chose (answer, prompt, model, finish reason, error)
   keep what no database takes as backslash escapes too: a lone surrogate, and NUL
   (``\\x00``: PostgreSQL refuses it in text; a model's byte-fallback token ``<0x00>``
   detokenizes to it): one such answer would otherwise cost its exchange, scores and all.
   A tool call's name and arguments are such texts too: a lone surrogate in one made the
   JSON encoder of the PostgreSQL insert raise, failing its whole batch.
2. Unknown stays unknown: a missing usage gives NULL token counts, never 0. A score value
   that is not a finite number (NaN, an infinity) makes the record invalid, as the
   scorers' ``Score`` refuses it: PostgreSQL stored NaN where SQLite stored NULL, and one
   such value in a metric made the judge refuse all of that metric's samples. So does a
   start time no ``datetime`` can hold: it raised out of ``submit``, leaving the record
   neither accepted nor counted (the writer's rule 7).
3. ITL is derived from ``chunk_gaps_s``: the mean, and the p99 by nearest rank.
4. ``text_chars`` (what ``queue_text_chars`` bounds) counts every stored text: the
   prompt, and each answer with its tool calls' names and arguments (an agent's answer
   may be nothing but a tool call with a whole file in its arguments).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from evaluators._exchange import Exchange
from evaluators._observation import Observation
from evaluators.store._hash_key import SESSION_KEY_PREFIX, keyed_digest
from evaluators.store._schema import NAME_LENGTH, REQUEST_ID_LENGTH

__all__ = ["InvalidRecord", "Record", "ScoreLike", "build_record", "itl_stats"]

ROUTE_LENGTH = 64
FINISH_REASON_LENGTH = 64
ERROR_CHARS = 2000
"""An Observation's error message is cut to this many characters."""

Row = dict[str, Any]


class ScoreLike(Protocol):
    """What the writer needs of a score: the scorer family's ``Score`` has these fields."""

    @property
    def metric(self) -> str: ...

    @property
    def candidate(self) -> float | None: ...

    @property
    def primary(self) -> float | None: ...


class InvalidRecord(ValueError):
    """The exchange or a score cannot be stored as given (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class Record:
    """One submitted exchange, as rows; foreign keys are filled in when it is written."""

    exchange: Row
    primary_backend: str
    primary: Row
    candidate_backend: str
    candidate: Row
    candidate_name: str
    scores: tuple[tuple[str, float | None, float | None], ...]
    created_at: datetime
    queued_at: float
    rows: int
    text_chars: int


def build_record(exchange: Exchange, scores: Sequence[ScoreLike], *, prompt: bytes | str | None,
                 store_prompts: bool, store_answers: bool, queued_at: float,
                 hash_key: bytes, store_session_keys: bool = False) -> Record:
    """Rows for ``exchange`` and ``scores``; raises InvalidRecord if they cannot be stored.

    The session key and the prompt's hash are keyed hashes (``_hash_key.py``) unless
    ``store_session_keys``; the prompt's text is kept only with ``store_prompts``.
    """
    request_id = _identity("request_id", exchange.request_id, REQUEST_ID_LENGTH)
    session_key = _identity("session_key", exchange.session_key, NAME_LENGTH)
    if not store_session_keys:
        session_key = SESSION_KEY_PREFIX + keyed_digest(hash_key, session_key.encode())
    _identity("candidate", exchange.candidate, NAME_LENGTH)
    primary, candidate = exchange.primary, exchange.candidate_observation
    _identity("primary backend", primary.backend, NAME_LENGTH)
    _identity("candidate backend", candidate.backend, NAME_LENGTH)
    score_rows = tuple(_score(score) for score in scores)
    prompt_text: str | None = None
    prompt_hash: str | None = None
    if prompt is not None:
        raw = prompt.encode() if isinstance(prompt, str) else prompt
        prompt_hash = keyed_digest(hash_key, raw)
        if store_prompts:
            prompt_text = _storable(prompt if isinstance(prompt, str)
                                    else raw.decode(errors="replace"))
    primary_row = observation_row(primary, store_answers=store_answers)
    candidate_row = observation_row(candidate, store_answers=store_answers)
    text_chars = len(prompt_text or "") + _answer_chars(primary_row) + _answer_chars(
        candidate_row)
    return Record(
        exchange={
            "request_id": request_id,
            "session_key": session_key,
            "route": exchange.route[:ROUTE_LENGTH],
            "model": _cut(_storable(primary.model or candidate.model), NAME_LENGTH),
            "started_at": _utc(primary.started_at),
            "prompt_hash": prompt_hash,
            "prompt": prompt_text,
            "prompt_bytes": exchange.prompt_bytes,
            "turn_depth": exchange.turn_depth,
        },
        primary_backend=primary.backend,
        primary=primary_row,
        candidate_backend=candidate.backend,
        candidate=candidate_row,
        candidate_name=exchange.candidate,
        scores=score_rows,
        created_at=datetime.now(UTC),
        queued_at=queued_at,
        rows=3 + len(score_rows),
        text_chars=text_chars,
    )


def observation_row(observation: Observation, *, store_answers: bool) -> Row:
    """Every measured field of ``observation``; answer text only when ``store_answers``."""
    usage = observation.usage
    itl_mean, itl_p99 = itl_stats(observation.chunk_gaps_s)
    return {
        "started_at": _utc(observation.started_at),
        "status": observation.status,
        "streamed": observation.streamed,
        "ttft_s": observation.ttft_s,
        "e2e_s": observation.e2e_s,
        "itl_mean_s": itl_mean,
        "itl_p99_s": itl_p99,
        "chunks": len(observation.chunk_gaps_s) + 1 if observation.ttft_s is not None else 0,
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "completion_tokens": usage.completion_tokens if usage is not None else None,
        "cached_tokens": usage.cached_tokens if usage is not None else None,
        "finish_reason": _cut(_storable(observation.finish_reason), FINISH_REASON_LENGTH),
        "model": _cut(_storable(observation.model), NAME_LENGTH),
        "bytes": observation.bytes,
        "truncated": observation.truncated,
        "error": _cut(_storable(observation.error), ERROR_CHARS),
        "answer": _storable(observation.text) if store_answers else None,
        "tool_calls": _tool_calls(observation.tool_calls) if store_answers else None,
        "concurrency": observation.concurrency,
        "backend_running": observation.backend_running,
    }


def itl_stats(gaps: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and nearest-rank p99 of the inter-chunk gaps; (None, None) without gaps."""
    n = len(gaps)
    if n == 0:
        return None, None
    # Nearest rank: the ceil(0.99 n)-th smallest is the (n - ceil(0.99 n) + 1)-th largest.
    from_top = n - math.ceil(0.99 * n) + 1
    return sum(gaps) / n, heapq.nlargest(from_top, gaps)[-1]


def _tool_calls(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Rule 1: each call's name and arguments storable (the parser makes both strings)."""
    if not calls:
        return None
    return [{key: _storable(value) if isinstance(value, str) else value
             for key, value in call.items()} for call in calls]


def _answer_chars(row: Row) -> int:
    """Rule 4: the answer's text and its tool calls' strings."""
    chars = len(row["answer"] or "")
    for call in row["tool_calls"] or ():
        chars += sum(len(value) for value in call.values() if isinstance(value, str))
    return chars


def _score(score: ScoreLike) -> tuple[str, float | None, float | None]:
    metric = score.metric
    if type(metric) is not str or not 0 < len(metric) <= NAME_LENGTH:
        raise InvalidRecord(f"score metric must be a string of 1 to {NAME_LENGTH} characters,"
                            f" got {metric!r:.80}")
    return metric, _value(metric, score.candidate), _value(metric, score.primary)


def _value(metric: str, value: float | None) -> float | None:
    if value is None:
        return value
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRecord(
                f"score {metric!r}: value must be a number or None, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an int past a float's range
            raise InvalidRecord(f"score {metric!r}: {value} is past a float's range") from None
    if not math.isfinite(value):  # rule 2
        raise InvalidRecord(f"score {metric!r}: {value!r} is not a finite number")
    return value


def _identity(what: str, value: str, limit: int) -> str:
    if not value.isascii():  # rule 1: lone surrogates become backslash escapes
        value = value.encode("utf-8", "backslashreplace").decode()
    if len(value) > limit:
        raise InvalidRecord(f"{what} longer than {limit} characters")
    return value


def _storable(value: str | None) -> str | None:
    """Rule 1: ``value`` with NUL and lone surrogates as backslash escapes."""
    if value is None:
        return None
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            value = value.encode("utf-8", "backslashreplace").decode()
    return value


def _cut(value: str | None, limit: int) -> str | None:
    return value[:limit] if value is not None else None


def _utc(timestamp: float) -> datetime:
    try:
        return datetime.fromtimestamp(timestamp, UTC)
    except (OverflowError, ValueError, OSError) as exc:  # rule 2: past year 9999, NaN
        raise InvalidRecord(f"start time {timestamp!r} is not a storable time: {exc}") from None
