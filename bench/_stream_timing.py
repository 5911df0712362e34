"""One streamed OpenAI request, timed token by token, as a client sees it.

Rules:
1. Tokens are counted by the server, not by chunks: every request asks for
   ``stream_options.include_usage`` and ``continuous_usage_stats``, so each chunk carries
   ``usage.completion_tokens`` so far. A chunk is a token arrival when that count grows (a chat
   stream's role chunk says 0 and is not one); a chunk with choices but no usage is an error,
   since the count would then be a guess.
2. Times are ``time.perf_counter()`` when the line holding the chunk was read; the time to
   first token is the first arrival minus the moment the request was sent.
3. A stream counts only if it ends with ``data: [DONE]`` and sent no error event; anything
   else raises ``StreamError``. Every request has a total timeout (``timeout_s``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["StreamError", "StreamTiming", "sse_chunks", "steady_rate", "timed_stream"]

_DATA = b"data: "
_DONE = b"[DONE]"
MAX_ERROR_BODY = 300
# Token arrivals closer than this came out of one server step (one forward pass): the
# reference engine emits several tokens per step when prompt-lookup drafts are accepted.
SAME_STEP_S = 0.002


class StreamError(RuntimeError):
    """The server answered with an error, or the stream was cut or malformed."""


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """When each token of one streamed answer arrived, and the server's usage figures."""

    sent: float
    arrivals: tuple[tuple[float, int], ...]  # (perf_counter, completion tokens so far)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server did not say (unknown, not 0)

    def __post_init__(self) -> None:
        if not self.arrivals:
            raise StreamError("the stream carried no token")

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0][0] - self.sent

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time from the first arrival to the last."""
        (first_t, first_n), (last_t, last_n) = self.arrivals[0], self.arrivals[-1]
        if last_t <= first_t:
            return None
        return (last_n - first_n) / (last_t - first_t)

    @property
    def tokens_per_step(self) -> float | None:
        """Decode tokens per burst of arrivals: a gap over ``SAME_STEP_S`` starts a burst."""
        bursts = sum(
            1
            for (t0, _), (t1, _) in zip(self.arrivals, self.arrivals[1:], strict=False)
            if t1 - t0 > SAME_STEP_S
        )
        if not bursts:
            return None
        return (self.arrivals[-1][1] - self.arrivals[0][1]) / bursts

    def tokens_by(self, moment: float) -> int:
        """Completion tokens that had arrived at ``moment`` (0 before the first)."""
        count = 0
        for t, n in self.arrivals:
            if t > moment:
                break
            count = n
        return count


def steady_rate(streams: list[StreamTiming]) -> tuple[float, float] | None:
    """(aggregate tokens/s, window seconds) while every stream was decoding at once: from
    the last stream's first token to the first stream's last token. None if the streams
    never all ran together."""
    start = max(s.arrivals[0][0] for s in streams)
    end = min(s.arrivals[-1][0] for s in streams)
    if end <= start:
        return None
    tokens = sum(s.tokens_by(end) - s.tokens_by(start) for s in streams)
    return tokens / (end - start), end - start


def request_body(base: dict[str, Any]) -> bytes:
    """``base`` as a streamed request that reports usage on every chunk (rule 1)."""
    body = {
        **base,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    return json.dumps(body).encode()


async def sse_chunks(
    session: aiohttp.ClientSession, url: str, body: bytes, *, timeout_s: float
) -> AsyncIterator[tuple[float, dict[str, Any] | None]]:
    """POST the JSON ``body`` to ``url`` and yield each SSE chunk with the time its line was read.

    ``data: [DONE]`` is yielded as ``None``, last; a status other than 200 or an error event
    raises ``StreamError``. A stream cut before ``[DONE]`` just ends: the caller says what it
    had by then.
    """
    async with session.post(
        url,
        data=body,
        headers={"Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as resp:
        if resp.status != 200:
            text = (await resp.read())[:MAX_ERROR_BODY]
            raise StreamError(f"status {resp.status}: {text!r}")
        async for line in resp.content:
            now = time.perf_counter()
            if not line.startswith(_DATA):
                continue
            payload = line[len(_DATA) :].strip()
            if payload == _DONE:
                yield now, None
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                raise StreamError(f"error event: {str(chunk['error'])[:MAX_ERROR_BODY]}")
            yield now, chunk


async def timed_stream(
    session: aiohttp.ClientSession, url: str, base: dict[str, Any], *, timeout_s: float
) -> StreamTiming:
    """POST ``base`` (as a stream, see ``request_body``) to ``url`` and time its tokens."""
    arrivals: list[tuple[float, int]] = []
    usage: dict[str, Any] = {}
    done = False
    sent = time.perf_counter()
    async for now, chunk in sse_chunks(session, url, request_body(base), timeout_s=timeout_s):
        if chunk is None:
            done = True
            break
        usage = chunk.get("usage") or usage
        if not chunk.get("choices"):
            continue
        if "completion_tokens" not in usage:
            raise StreamError("a chunk without continuous usage: tokens cannot be counted")
        count = int(usage["completion_tokens"])
        if count > (arrivals[-1][1] if arrivals else 0):
            arrivals.append((now, count))
    if not done:
        raise StreamError(f"stream cut after {len(arrivals)} token arrivals (no [DONE])")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return StreamTiming(
        sent=sent,
        arrivals=tuple(arrivals),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=None if cached is None else int(cached),
    )
