"""What one backend did for one request: the unit every evaluator consumes.

The gateway builds an :class:`Observation` from a :class:`Capture` it filled while it
relayed the answer (timings taken per chunk, bytes kept up to a bound). Parsing the
captured bytes happens here, after the answer has reached the client, never per chunk.

Rules:
1. A value the backend did not report is ``None`` (unknown), never 0. vLLM reports
   ``cached_tokens`` only with ``--enable-prompt-tokens-details``.
2. A capture cut at its byte bound still yields timings and byte counts; fields that
   could only come from the lost bytes are unknown and ``truncated`` says so.
3. ``concurrency`` is the gateway's count of requests in flight at this backend when
   this one was sent, this one included (the load it ran under); None when not counted.
   ``backend_running`` is the backend's own running count (``vllm:num_requests_running``,
   scraped by the gateway at most a few intervals before): it includes load the gateway
   does not see; None where the backend does not export it.
4. TTFT and e2e count from ``sent`` (the moment the gateway sends the request upstream)
   when it is set, so the primary's (whose capture starts when the client's request
   arrives, before its body is read) and a candidate's measure the backend alike; the
   gateway's own Prometheus histograms keep counting from ``started``.
5. Nothing on the wire is trusted: a field of an unexpected type is skipped as if absent, a
   tool call's index is honoured only below ``MAX_TOOL_CALLS``, and a truncated capture keeps
   the last ``CAPTURE_TAIL_BYTES`` bytes (where the usage and finish reason are), whatever
   the reads' sizes. A token count outside ``0..MAX_TOKEN_COUNT``, or more cached tokens
   than prompt tokens, is unknown too: a negative count priced a candidate below zero, and
   one past the store's integer columns cost its record (on SQLite, its whole batch).
6. One answer per observation: the choice of index 0 (``n > 1``, or a legacy completion of
   a list of prompts, has several). A stream interleaves its choices' deltas in an order
   that may differ between two backends giving the same answers; joining them all made
   two equal answers unequal text, and merged the choices' tool calls into one.
7. ``text`` is the answer's content the same way streamed or not: a chat message whose
   content is null (a tool-call-only answer) has the text ``""``, as its stream of no
   content deltas has; a message that only carries a ``refusal`` has the refusal as its
   text. It is None only where no answer text can be known (a truncated capture, a
   failed or non-completion answer such as embeddings).
8. A truncated answer that is not a stream (a long one, or one with ``logprobs``, past
   the capture's bound) keeps its usage: it is read from the tail, where the answer ends
   with it, so its throughput and cost are known as a stream's are. Its finish reason is
   not read there (with several choices the tail's last one is not the first choice's).
9. ``choices`` is how many choices the answer had (distinct indices of a stream's choice
   deltas; the length of an answer's ``choices``), so that an answer with fewer (or more)
   than the request asked for is seen although only choice 0 is compared (rule 6). It is
   None where it cannot be known: a truncated capture (a choice may be in the lost part),
   an answer without ``choices`` (embeddings, an error).
10. ``embeddings`` are an embeddings answer's vectors (``data[i].embedding``, floats or
   vLLM's and OpenAI's base64 of little-endian float32, which the ``openai`` client asks
   for by default), one row per input in ``index`` order, as float32. None where they
   cannot all be known: a truncated capture, another answer, or data that is not one
   finite vector of the same length for each index from 0 up (rule 5).
11. A time that is not a finite number (NaN, an infinity: an Observation built by hand, a
   clock that failed) is unknown, as a time not measured is: ``ttft_s`` and ``e2e_s``
   become None, and ``chunk_gaps_s`` with one such gap becomes ``()`` (no ITL: a mean or
   percentile over it is not a number either). Enforced when an Observation is built, so
   every scorer and every store reads the same value: PostgreSQL stored a NaN latency as
   NaN where SQLite stored NULL, and a latency scorer handed it to ``Score``, which refused
   it and with it the whole exchange's scores.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

__all__ = ["Capture", "Embeddings", "Observation", "Usage", "observe"]

MAX_TOOL_CALLS = 128
"""Most tool calls an answer's observation keeps (a delta's index beyond it is ignored)."""
CAPTURE_TAIL_BYTES = 16 * 1024
"""Bytes a truncated capture keeps from the end of the answer (rule 5)."""
MAX_TOKEN_COUNT = 2**31 - 1
"""The largest token count a usage may report (rule 5): what the store's columns hold."""
CLIENT_DISCONNECTED = "client_disconnected"
"""The error of a primary answer whose client went away before its end (set by the
gateway's relay): the backend did not fail, the answer was cut on the client's side."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = _count_or_none(details.get("cached_tokens") if isinstance(details, dict)
                                else None)
        prompt = _count_or_none(usage.get("prompt_tokens"))
        if cached is not None and prompt is not None and cached > prompt:
            cached = None  # rule 5: not a count to price or to take a hit rate of
        return cls(
            prompt_tokens=prompt,
            completion_tokens=_count_or_none(usage.get("completion_tokens")),
            cached_tokens=cached,
        )


@dataclass(frozen=True, slots=True)
class Embeddings:
    """An embeddings answer's vectors (rule 10): ``count`` rows of ``dims`` float32,
    little-endian, in ``data`` (bytes: compact to hand to the scoring process, and equal
    when the vectors are)."""

    count: int
    dims: int
    data: bytes

    def matrix(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<f4").reshape(self.count, self.dims)

    @classmethod
    def from_json(cls, data: Any) -> Embeddings | None:
        """Rule 10: ``data`` of an embeddings answer, or None where it is not whole."""
        items = _list(data)
        rows: dict[int, np.ndarray] = {}
        for item in items:
            index = _int_or_none(item.get("index")) if isinstance(item, dict) else None
            if index is None or index in rows:
                return None
            row = _vector(item.get("embedding"))
            if row is None:
                return None
            rows[index] = row
        if not rows or sorted(rows) != list(range(len(rows))):
            return None
        dims = {row.size for row in rows.values()}
        if len(dims) != 1 or 0 in dims:
            return None
        matrix = np.stack([rows[i] for i in range(len(rows))])
        if not np.isfinite(matrix).all():
            return None
        return cls(len(rows), dims.pop(), matrix.astype("<f4").tobytes())


def _vector(embedding: Any) -> np.ndarray | None:
    """One ``embedding``: a list of numbers, or base64 of little-endian float32."""
    if isinstance(embedding, str):
        try:
            raw = base64.b64decode(embedding, validate=True)
        except (binascii.Error, ValueError):
            return None
        return np.frombuffer(raw, dtype="<f4") if len(raw) % 4 == 0 else None
    if not isinstance(embedding, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in embedding):
        return None
    try:
        row = np.asarray(embedding, dtype=np.float64)
    except OverflowError:  # an integer past float64
        return None
    if row.size and not np.abs(row).max() <= np.finfo(np.float32).max:
        return None  # past float32, or not finite
    return row.astype(np.float32)


@dataclass(slots=True)
class Capture:
    """Mutable record filled on the hot path; turned into an Observation afterwards.

    Appending is all the relay does per chunk: a clock reading and, while under
    ``max_bytes``, the chunk itself. The tail (last two chunks) is always kept by
    reference so the usage chunk at the end of a long stream is not lost.
    """

    started: float
    max_bytes: int
    max_chunk_times: int
    backend: str = ""
    status: int = 0
    streamed: bool = False
    headers_at: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    total_bytes: int = 0
    truncated: bool = False
    ended: float | None = None
    error: str | None = None
    concurrency: int | None = None
    sent: float | None = None
    backend_running: int | None = None

    def add_chunk(self, now: float, chunk: bytes) -> None:
        # The relay does this method's common case (a chunk that fits, not truncated) in C on
        # the slots (gateway/_relaycore.c rule 4); tests/gateway/test_relaycore.py holds the
        # two equal field by field, so a change here must be made there too.
        if len(self.chunk_times) < self.max_chunk_times:
            self.chunk_times.append(now)
        self.total_bytes += len(chunk)
        if not self.truncated and len(self.body) + len(chunk) <= self.max_bytes:
            self.body += chunk  # the body is the answer's first bytes, never a later piece
        else:
            self.truncated = True
            self.tail += chunk
            if len(self.tail) > CAPTURE_TAIL_BYTES:
                del self.tail[: len(self.tail) - CAPTURE_TAIL_BYTES]


@dataclass(frozen=True, slots=True)
class Observation:
    request_id: str
    backend: str
    route: str
    status: int
    streamed: bool
    started_at: float
    ttft_s: float | None
    chunk_gaps_s: tuple[float, ...]
    e2e_s: float | None
    usage: Usage | None
    finish_reason: str | None
    text: str | None
    tool_calls: tuple[dict[str, Any], ...]
    model: str | None
    bytes: int
    truncated: bool
    error: str | None
    concurrency: int | None = None
    backend_running: int | None = None
    choices: int | None = None
    embeddings: Embeddings | None = None

    def __post_init__(self) -> None:
        # Rule 11. One sum per observation: NaN and infinities carry through it (as does a
        # sum past a float's range, whose mean would be infinite too).
        if self.ttft_s is not None and not math.isfinite(self.ttft_s):
            object.__setattr__(self, "ttft_s", None)
        if self.e2e_s is not None and not math.isfinite(self.e2e_s):
            object.__setattr__(self, "e2e_s", None)
        if not math.isfinite(sum(self.chunk_gaps_s)):
            object.__setattr__(self, "chunk_gaps_s", ())

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300


def observe(capture: Capture, *, request_id: str, backend: str, route: str,
            wall_started: float) -> Observation:
    """Turn a finished capture into an Observation (parses the kept bytes once)."""
    times = capture.chunk_times
    first = times[0] if times else None
    origin = capture.sent if capture.sent is not None else capture.started
    gaps = tuple(b - a for a, b in itertools.pairwise(times))
    parsed = _parse_body(capture)
    return Observation(
        request_id=request_id,
        backend=backend,
        route=route,
        status=capture.status,
        streamed=capture.streamed,
        started_at=wall_started,
        ttft_s=(first - origin) if first is not None else None,
        chunk_gaps_s=gaps,
        e2e_s=(capture.ended - origin) if capture.ended is not None else None,
        usage=parsed.usage,
        finish_reason=parsed.finish_reason,
        text=parsed.text,
        tool_calls=tuple(parsed.tool_calls),
        model=parsed.model,
        bytes=capture.total_bytes,
        truncated=capture.truncated,
        error=capture.error,
        concurrency=capture.concurrency,
        backend_running=capture.backend_running,
        choices=parsed.choices,
        embeddings=parsed.embeddings,
    )


@dataclass(slots=True)
class _Parsed:
    usage: Usage | None = None
    finish_reason: str | None = None
    text: str | None = None
    model: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    choices: int | None = None
    embeddings: Embeddings | None = None


def _parse_body(capture: Capture) -> _Parsed:
    parsed = _Parsed()
    if not capture.body and not capture.tail:
        return parsed
    if capture.streamed:
        _parse_sse(capture, parsed)
    elif capture.truncated:
        parsed.usage = _usage_in_tail(bytes(capture.tail))
    else:
        try:
            doc = orjson.loads(bytes(capture.body))
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict):
            _absorb_completion(doc, parsed)
    return parsed


_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')


def _usage_in_tail(tail: bytes) -> Usage | None:
    """Rule 8: the usage object at the end of a truncated answer that is not a stream.

    The last ``"usage":{`` in the tail is the answer's own (it follows the choices, in
    vLLM's and OpenAI's answers; inside a JSON string its quotes would be escaped)."""
    matches = list(_USAGE_KEY.finditer(tail))
    if not matches:
        return None
    text = tail[matches[-1].end() - 1:].decode("utf-8", errors="replace")
    try:
        usage, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return Usage.from_json(usage)


def _sse_events(data: bytes) -> list[Any]:
    events: list[Any] = []
    for line in data.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            events.append(orjson.loads(payload))
        except orjson.JSONDecodeError:
            continue
    return events


def _parse_sse(capture: Capture, parsed: _Parsed) -> None:
    pieces: list[str] = []
    refusal: list[str] = []
    indices: set[int] | None = None  # rule 9: None until an event carries choices
    for event in _sse_events(bytes(capture.body)):
        if isinstance(event, dict):
            _absorb_chunk(event, parsed, pieces, refusal)
            if isinstance(event.get("choices"), list):
                indices = indices if indices is not None else set()
                indices.update(_choice_indices(event["choices"]))
    if capture.truncated:
        # Only the tail survived: usage and finish reason may be there, the text is partial.
        for event in _sse_events(bytes(capture.tail).partition(b"\n")[2]):
            if isinstance(event, dict):
                _absorb_chunk(event, parsed, [], [])
        parsed.text = None
    else:
        parsed.text = _answer_text("".join(pieces), "".join(refusal))
        parsed.choices = len(indices) if indices is not None else None


def _choice_indices(choices: list[Any]) -> set[int]:
    """The indices of a stream event's choices (a missing index is 0, as in rule 6)."""
    found = set()
    for choice in choices:
        index = _int_or_none(choice.get("index", 0)) if isinstance(choice, dict) else None
        if index is not None:
            found.add(index)
    return found


def _answer_text(content: str, refusal: str | None) -> str:
    """Rule 7: the content, or the refusal when there is no content."""
    return content if content or not refusal else refusal


def _first_choice(choice: Any) -> bool:
    """Rule 6: whether ``choice`` is the answer's first (index 0; a missing index is 0)."""
    return isinstance(choice, dict) and _int_or_none(choice.get("index", 0)) == 0


def _absorb_chunk(event: dict[str, Any], parsed: _Parsed, pieces: list[str],
                  refusal: list[str]) -> None:
    if parsed.model is None and isinstance(event.get("model"), str):
        parsed.model = event["model"]
    usage = Usage.from_json(event.get("usage"))
    if usage is not None:
        parsed.usage = usage
    for choice in _list(event.get("choices")):
        if not _first_choice(choice):
            continue
        if choice.get("finish_reason"):
            parsed.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if isinstance(delta.get("content"), str):
                pieces.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                refusal.append(delta["refusal"])
            for call in _list(delta.get("tool_calls")):
                _merge_tool_call_delta(parsed.tool_calls, call)
        elif isinstance(choice.get("text"), str):
            pieces.append(choice["text"])


def _merge_tool_call_delta(calls: list[dict[str, Any]], delta: Any) -> None:
    """Rule 5: the wire's index and types are checked, never trusted."""
    if not isinstance(delta, dict):
        return
    index = _int_or_none(delta.get("index", len(calls)))
    if index is None or not 0 <= index < MAX_TOOL_CALLS:
        return
    while len(calls) <= index:
        calls.append({"name": "", "arguments": ""})
    name, arguments = _function_parts(delta.get("function"))
    calls[index]["name"] += name
    calls[index]["arguments"] += arguments


def _function_parts(function: Any) -> tuple[str, str]:
    """A tool call's ``function`` name and arguments; "" for what is missing or not a string."""
    if not isinstance(function, dict):
        return "", ""
    name, arguments = function.get("name"), function.get("arguments")
    return (
        name if isinstance(name, str) else "",
        arguments if isinstance(arguments, str) else "",
    )


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _absorb_completion(doc: dict[str, Any], parsed: _Parsed) -> None:
    parsed.model = doc.get("model") if isinstance(doc.get("model"), str) else None
    parsed.usage = Usage.from_json(doc.get("usage"))
    if isinstance(doc.get("choices"), list):
        parsed.choices = sum(1 for c in doc["choices"] if isinstance(c, dict))
    if doc.get("object") == "list" and "data" in doc:
        parsed.embeddings = Embeddings.from_json(doc["data"])
    choices = _list(doc.get("choices"))
    choice = next((c for c in choices if _first_choice(c)), None)
    if not isinstance(choice, dict):
        return
    reason = choice.get("finish_reason")
    parsed.finish_reason = str(reason) if reason else None
    message = choice.get("message")
    if isinstance(message, dict):
        content, refusal = message.get("content"), message.get("refusal")
        if content is None or isinstance(content, str):  # another type: unknown (rule 5)
            parsed.text = _answer_text(content or "",
                                       refusal if isinstance(refusal, str) else None)
        for call in _list(message.get("tool_calls"))[:MAX_TOOL_CALLS]:
            name, arguments = _function_parts(call.get("function") if isinstance(call, dict)
                                              else None)
            parsed.tool_calls.append({"name": name, "arguments": arguments})
    elif isinstance(choice.get("text"), str):
        parsed.text = choice["text"]


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count_or_none(value: Any) -> int | None:
    """A token count as rule 5 trusts it: an int in ``0..MAX_TOKEN_COUNT``, else None."""
    count = _int_or_none(value)
    return count if count is not None and 0 <= count <= MAX_TOKEN_COUNT else None
