"""Property-based fuzzing of the relay's usage-event filter over arbitrary chunk splits.

Properties:
1. A vLLM stream the gateway asked usage for reaches the client as vLLM would have sent it
   without ``include_usage``: the usage event gone, its ``system_fingerprint`` on the
   terminal events, every other byte as it came, whatever the split.
2. Bytes that hold no usage event pass unchanged, whatever the split (nothing is lost,
   reordered or held back after ``flush``).
3. Arbitrary bytes never raise.

Defect found here and fixed: once the usage event was seen the filter passed later chunks
straight through but kept the bytes that followed the usage event in the same read
(``_pending``) until ``flush``, so they reached the client last, out of order (the reproducer
below).
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway._relay import UsageEventFilter
from tests.utils import fuzz_settings

FUZZ = fuzz_settings(200)


def _event(doc: dict[str, Any], eol: bytes = b"\n") -> bytes:
    return b"data: " + orjson.dumps(doc) + eol + eol


def _chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-f",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": choices,
        **extra,
    }


@st.composite
def stream_pairs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(what vLLM sends with include_usage, what it sends without it) for one request, its
    lines ended as vLLM ends them (LF) or as sse-starlette does (CRLF)."""
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    n = draw(st.integers(1, 2))
    pieces = draw(st.lists(st.tuples(st.integers(0, n - 1), st.text(max_size=10)), max_size=10))
    fingerprint = draw(st.none() | st.text(min_size=1, max_size=8))
    reasons = draw(st.lists(st.sampled_from(["stop", "length"]), min_size=n, max_size=n))
    common = [
        _event(
            _chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            ),
            eol,
        )
        for i in range(n)
    ]
    common += [
        _event(
            _chunk(
                [{"index": i, "delta": {"content": p}, "logprobs": None, "finish_reason": None}]
            ),
            eol,
        )
        for i, p in pieces
    ]
    terminal = [
        _chunk(
            [
                {
                    "index": i,
                    "delta": {"content": ""},
                    "logprobs": None,
                    "finish_reason": reasons[i],
                    "stop_reason": None,
                }
            ]
        )
        for i in range(n)
    ]
    stamp = {"system_fingerprint": fingerprint} if fingerprint is not None else {}
    usage = _chunk(
        [],
        usage={
            "prompt_tokens": 3,
            "completion_tokens": len(pieces),
            "total_tokens": 3 + len(pieces),
        },
        **stamp,
    )
    done = b"data: [DONE]" + eol + eol
    upstream = b"".join([*common, *(_event(t, eol) for t in terminal), _event(usage, eol), done])
    client = b"".join([*common, *(_event({**t, **stamp}, eol) for t in terminal), done])
    return upstream, client


def _splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)]) if b > a]


def _filtered(chunks: list[bytes]) -> bytes:
    usage_filter = UsageEventFilter()
    out = [usage_filter.feed(chunk) for chunk in chunks]
    return b"".join(out) + usage_filter.flush()


_cuts = st.lists(st.integers(0, 1 << 16), max_size=60)


@FUZZ
@given(pair=stream_pairs(), cuts=_cuts)
def test_client_sees_the_stream_without_usage_when_cut_up_to_the_usage_event(
    pair: tuple[bytes, bytes],
    cuts: list[int],
) -> None:
    """Every split whose cuts fall before the usage event ends (the defect spares these)."""
    upstream, client = pair
    blank = b"\r\n\r\n" if b"\r\n" in upstream else b"\n\n"
    end = upstream.index(blank, upstream.index(b'"choices":[]')) + len(blank)
    head = _splits(upstream[:end], cuts)
    assert _filtered([*head, upstream[end:]]) == client


@FUZZ
@given(pair=stream_pairs(), cuts=_cuts)
def test_client_sees_the_stream_without_usage_whatever_the_split(
    pair: tuple[bytes, bytes],
    cuts: list[int],
) -> None:
    upstream, client = pair
    assert _filtered(_splits(upstream, cuts)) == client


@FUZZ
@given(pair=stream_pairs(), cuts=_cuts)
def test_byte_by_byte_and_whole_agree(pair: tuple[bytes, bytes], cuts: list[int]) -> None:
    upstream, _client = pair
    whole = _filtered([upstream])
    assert _filtered([upstream[i : i + 1] for i in range(len(upstream))]) == whole
    assert _filtered(_splits(upstream, cuts)) == whole


# Bytes rich in what the filter looks for: event separators and the terminal marker.
_sse_alphabet = st.sampled_from(
    [
        b"\n",
        b"\n\n",
        b"data: ",
        b"{",
        b"}",
        b'"finish_reason":"',
        b'"finish_reason": "',
        b"stop",
        b'"',
        b"[DONE]",
        b"x",
    ]
)
_sse_like = st.lists(_sse_alphabet | st.binary(max_size=6), max_size=40).map(b"".join)


@FUZZ
@given(data=_sse_like | st.binary(max_size=300), cuts=_cuts)
def test_bytes_without_a_usage_event_pass_unchanged(data: bytes, cuts: list[int]) -> None:
    if b'"choices":[]' in data or b'"choices": []' in data:
        return
    assert _filtered(_splits(data, cuts)) == data


@FUZZ
@given(
    data=st.lists(
        _sse_alphabet
        | st.sampled_from([b'"choices":[]', b'"choices": []'])
        | st.binary(max_size=6),
        max_size=40,
    ).map(b"".join),
    cuts=_cuts,
)
def test_arbitrary_bytes_never_raise(data: bytes, cuts: list[int]) -> None:
    out = _filtered(_splits(data, cuts))
    assert isinstance(out, bytes)


def test_reproducer_bytes_after_the_usage_event_stay_in_order() -> None:
    terminal = b'data: {"choices":[{"finish_reason":"stop"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{}}\n\n'
    # Today: terminal + b"ata: [DONE]\n\nd"
    assert _filtered([terminal + usage + b"d", b"ata: [DONE]\n\n"]) == (
        terminal + b"data: [DONE]\n\n"
    )


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_every_cut_around_the_usage_event_loses_and_adds_no_byte(eol: bytes) -> None:
    """One or two cuts anywhere from the terminal event's blank line to the event after the
    usage event. A CRLF blank line cut between its CR and its LF ends its event at the CR
    (the LF still to come begins the next read): the filter once dropped that LF with the
    usage event after it (the client got ``\\r\\n\\r`` before ``data: [DONE]``), or, when the
    usage event's own LF was the one cut off, passed it on (``\\r\\n\\r\\n\\n``)."""
    terminal = b'data: {"choices":[{"finish_reason":"stop"}]}' + eol + eol
    usage = b'data: {"choices":[],"usage":{},"system_fingerprint":"fp"}' + eol + eol
    done = b"data: [DONE]" + eol + eol
    upstream = terminal + usage + done
    client = (b'data: {"choices":[{"finish_reason":"stop"}],"system_fingerprint":"fp"}'
              + eol + eol + done)
    cuts = range(len(terminal) - 3, len(terminal) + len(usage) + 3)
    for a, b in itertools.combinations_with_replacement(cuts, 2):
        chunks = [upstream[:a], upstream[a:b], upstream[b:]]
        assert _filtered([c for c in chunks if c]) == client, (a, b)
