"""Property-based fuzzing of Observation parsing: the SSE parser and usage extraction.

Properties:
1. A valid vLLM stream, captured whole, yields the same text, usage, finish reason, model
   and tool calls whatever the chunk split the relay read it in.
2. ``observe`` never raises and never builds more than the bytes it kept justify, for
   arbitrary bytes and for well-formed SSE carrying arbitrary JSON (it documents no error).
3. Usage: a missing ``cached_tokens`` is unknown (None), never 0; bools are not counts.

Defects found here and fixed (``_observation`` rule 5): ``_merge_tool_call_delta`` trusted the
wire's ``index`` (memory proportional to the index; TypeError for a non-int index or non-dict
``function``), and a truncated capture kept only the last two *chunks*, so a usage event split
over three reads was lost.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evaluators import Capture, Observation, Usage, observe
from evaluators._observation import MAX_TOKEN_COUNT
from tests.utils import fuzz_settings

FUZZ = fuzz_settings(150)

_ID = "chatcmpl-fuzz"
_MODEL = "sim-model"


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": _ID,
        "object": "chat.completion.chunk",
        "created": 1,
        "model": _MODEL,
        "choices": choices,
        **extra,
    }


_texts = st.lists(st.text(max_size=12), min_size=0, max_size=12)
_usages = st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**6)},
    optional={"cached_tokens": st.integers(0, 10**6)},
)


@st.composite
def vllm_streams(draw: st.DrawFn) -> tuple[bytes, list[str], dict[str, int] | None, str]:
    """A chat stream as vLLM writes it: role event, content events, terminal event, the
    usage event (``choices: []``) when include_usage is on, then ``[DONE]``."""
    pieces = draw(_texts)
    usage = draw(st.none() | _usages)
    reason = draw(st.sampled_from(["stop", "length"]))
    out = [
        _event(
            _chunk(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        )
    ]
    out += [
        _event(
            _chunk([{"index": 0, "delta": {"content": p}, "logprobs": None, "finish_reason": None}])
        )
        for p in pieces
    ]
    out.append(
        _event(
            _chunk(
                [
                    {
                        "index": 0,
                        "delta": {"content": ""},
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": None,
                    }
                ]
            )
        )
    )
    if usage is not None:
        wire: dict[str, Any] = {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        }
        if "cached_tokens" in usage:
            wire["prompt_tokens_details"] = {"cached_tokens": usage["cached_tokens"]}
        out.append(_event(_chunk([], usage=wire, system_fingerprint="fp-1")))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out), pieces, usage, reason


def _splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


def _observe(
    chunks: list[bytes], *, max_bytes: int = 1 << 20, streamed: bool = True
) -> Observation:
    capture = Capture(started=0.0, max_bytes=max_bytes, max_chunk_times=64)
    capture.status, capture.streamed = 200, streamed
    for i, chunk in enumerate(chunks):
        capture.add_chunk(float(i + 1), chunk)
    capture.ended = float(len(chunks) + 1)
    return observe(capture, request_id="r", backend="b", route="chat_completions", wall_started=0.0)


def _expected_usage(usage: dict[str, int] | None) -> Usage | None:
    if usage is None:
        return None
    cached = usage.get("cached_tokens")
    if cached is not None and cached > usage["prompt_tokens"]:
        cached = None  # more cached than prompted is no count (_observation rule 5)
    return Usage(usage["prompt_tokens"], usage["completion_tokens"], cached)


@FUZZ
@given(stream=vllm_streams(), cuts=st.lists(st.integers(0, 1 << 16), max_size=40))
def test_any_split_of_a_valid_stream_gives_the_same_observation(
    stream: tuple[bytes, list[str], dict[str, int] | None, str],
    cuts: list[int],
) -> None:
    data, pieces, usage, reason = stream
    whole = _observe([data])
    split = _observe(_splits(data, cuts))
    assert whole.text == split.text == "".join(pieces)
    assert whole.usage == split.usage == _expected_usage(usage)
    assert whole.finish_reason == split.finish_reason == reason
    assert whole.model == split.model == _MODEL
    assert whole.tool_calls == split.tool_calls == ()
    assert split.bytes == len(data) and not split.truncated


@FUZZ
@given(
    stream=vllm_streams(),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=40),
    max_bytes=st.integers(0, 400),
)
def test_a_truncated_capture_never_invents_values(
    stream: tuple[bytes, list[str], dict[str, int] | None, str],
    cuts: list[int],
    max_bytes: int,
) -> None:
    """Cut at its byte bound, a capture yields no text and only values the stream held."""
    data, _pieces, usage, reason = stream
    observation = _observe(_splits(data, cuts), max_bytes=max_bytes)
    assert observation.bytes == len(data)
    if observation.truncated:
        assert observation.text is None
    assert observation.usage in (None, _expected_usage(usage))
    assert observation.finish_reason in (None, reason)


@FUZZ
@given(
    chunks=st.lists(st.binary(max_size=200), max_size=20),
    streamed=st.booleans(),
    max_bytes=st.sampled_from([0, 64, 1 << 20]),
)
def test_arbitrary_bytes_never_raise(chunks: list[bytes], streamed: bool, max_bytes: int) -> None:
    observation = _observe(chunks, max_bytes=max_bytes, streamed=streamed)
    assert observation.bytes == sum(map(len, chunks))
    if observation.text is not None:
        assert len(observation.text) <= sum(map(len, chunks))


# Arbitrary JSON where the parser expects structure (small ints: see the index defect).
_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-1000, 1000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return value | _json


_tool_call = st.fixed_dictionaries(
    {},
    optional={
        "index": _maybe(st.integers(0, 3)),
        "function": _maybe(
            st.fixed_dictionaries(
                {}, optional={"name": _maybe(st.text(max_size=4)), "arguments": _maybe(st.text())}
            )
        ),
    },
)
_delta = st.fixed_dictionaries(
    {}, optional={"content": _json, "tool_calls": _maybe(st.lists(_tool_call, max_size=3))}
)
_choice = st.fixed_dictionaries(
    {}, optional={"delta": _maybe(_delta), "text": _json, "finish_reason": _json, "message": _json}
)
_event_doc = st.fixed_dictionaries(
    {},
    optional={
        "model": _json,
        "usage": _json,
        "choices": _maybe(st.lists(_maybe(_choice), max_size=3)),
    },
)


@FUZZ
@given(docs=st.lists(_event_doc | _json, max_size=6), streamed=st.booleans())
def test_wellformed_sse_with_arbitrary_json_never_raises(docs: list[Any], streamed: bool) -> None:
    body = b"".join(_event(d) if streamed else orjson.dumps(d) for d in docs)
    _observe([body], streamed=streamed)


@pytest.mark.parametrize(
    "event",
    [
        {"choices": 5},
        {"choices": [{"delta": {"tool_calls": [{"index": "0"}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": 1}}]}}]},
    ],
)
def test_reproducers_of_wire_type_trust(event: dict[str, Any]) -> None:
    """Minimal reproducers of the defect above: a field of the wrong type is skipped."""
    observation = _observe([_event(event)])
    assert all(call == {"name": "", "arguments": ""} for call in observation.tool_calls)


def test_a_huge_tool_call_index_is_bounded() -> None:
    event = {"choices": [{"delta": {"tool_calls": [{"index": 200_000}]}}]}
    observation = _observe([_event(event)])
    assert len(observation.tool_calls) <= 128  # index 10**9 would take ~100 GB


def test_truncated_capture_keeps_a_usage_event_split_over_three_reads() -> None:
    usage = _event(_chunk([], usage={"prompt_tokens": 7, "completion_tokens": 3}))
    head = b"".join(_event(_chunk([{"delta": {"content": "x" * 50}}])) for _ in range(4))
    thirds = [usage[:30], usage[30:60], usage[60:]]
    observation = _observe([head, *thirds, b"data: [DONE]\n\n"], max_bytes=100)
    assert observation.truncated
    assert observation.usage == Usage(7, 3, None)


@FUZZ
@given(
    usage=st.fixed_dictionaries(
        {},
        optional={
            "prompt_tokens": _maybe(st.integers(0, 10**9)),
            "completion_tokens": _maybe(st.integers(0, 10**9)),
            "prompt_tokens_details": _maybe(
                st.fixed_dictionaries({}, optional={"cached_tokens": _maybe(st.integers(0, 10**9))})
            ),
        },
    )
)
def test_usage_extraction(usage: dict[str, Any]) -> None:
    parsed = Usage.from_json(usage)
    assert parsed is not None

    def count(value: Any) -> int | None:
        return value if type(value) is int and 0 <= value <= MAX_TOKEN_COUNT else None

    details = usage.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens") if isinstance(details, dict) else None)
    prompt = count(usage.get("prompt_tokens"))
    assert parsed.prompt_tokens == prompt
    assert parsed.completion_tokens == count(usage.get("completion_tokens"))
    if cached is not None and prompt is not None and cached > prompt:
        cached = None  # more cached than prompted: no count (_observation rule 5)
    assert parsed.cached_tokens == cached  # missing or not a count: unknown, not 0


@pytest.mark.parametrize(("usage", "expected"), [
    ({"prompt_tokens": -5, "completion_tokens": -3}, Usage(None, None, None)),
    ({"prompt_tokens": 12, "completion_tokens": 10**30}, Usage(12, None, None)),
    ({"prompt_tokens": MAX_TOKEN_COUNT + 1, "completion_tokens": MAX_TOKEN_COUNT},
     Usage(None, MAX_TOKEN_COUNT, None)),
    ({"prompt_tokens": 12, "completion_tokens": 4,
      "prompt_tokens_details": {"cached_tokens": 99}}, Usage(12, 4, None)),
    ({"prompt_tokens": 12, "completion_tokens": 4,
      "prompt_tokens_details": {"cached_tokens": 12}}, Usage(12, 4, 12)),
    ({"completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": -1}},
     Usage(None, 4, None)),
])  # fmt: skip
def test_impossible_token_counts_are_unknown(usage: dict[str, Any], expected: Usage) -> None:
    """_observation rule 5: a count no backend could mean is not priced, rated or stored."""
    assert Usage.from_json(usage) == expected


@FUZZ
@given(value=_json)
def test_usage_of_a_non_object_is_unknown(value: Any) -> None:
    if not isinstance(value, dict):
        assert Usage.from_json(value) is None


def test_missing_cached_tokens_is_unknown_not_zero() -> None:
    usage = Usage.from_json({"prompt_tokens": 5, "completion_tokens": 2})
    assert usage == Usage(5, 2, None)
    assert Usage.from_json({"prompt_tokens": 5, "prompt_tokens_details": {}}) == Usage(
        5, None, None
    )
    assert Usage.from_json({"prompt_tokens": True}) == Usage(None, None, None)
