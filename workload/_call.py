"""One request through the official ``openai`` client, timed.

Rules:
1. TTFT is from sending to the first chunk that carries answer text or a tool call (the
   role-only first chunk vLLM sends does not count); e2e is from sending to the stream's end.
2. A token count the server did not report stays None (unknown), never 0.
3. A failed request is an ``Answer`` with ``error`` set (``http_<status>``, ``timeout``,
   ``connection``, ``cancelled``, ``malformed_response`` or the client's exception name);
   nothing is retried (``max_retries=0``), so a failure is counted exactly once.
4. An answer that is not the protocol's (not JSON, not UTF-8, not shaped as a completion:
   a list, a null message, a number for text) is ``malformed_response``, that turn's
   failure like any other server's. The client parses without validating (``json.loads``
   and pydantic's ``construct``), so such an answer surfaces as a ``ValueError``,
   ``TypeError``, ``AttributeError`` or ``LookupError`` while it is read; a run must not
   end on it and lose its summary.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import openai
from openai import AsyncOpenAI, AsyncStream
from openai.types import CompletionUsage

__all__ = [
    "MAX_ANSWER_CHARS", "NO_API_KEY", "Answer", "ReplayRoute", "open_client", "openai_base_url",
    "send",
]

ReplayRoute = Literal["chat_completions", "completions", "embeddings"]
MAX_ANSWER_CHARS: Final = 1 << 20
"""An answer's text kept for the next turn's history, at most (a runaway answer is cut)."""
NO_API_KEY: Final = "EMPTY"
"""What the client sends when no key is given (vLLM's convention for an open server)."""


def openai_base_url(url: str) -> str:
    """``url`` as the client's base URL: a bare server root gets ``/v1``; a URL with a path
    (``https://host/openai/v1``) is taken as given."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


def open_client(base_url: str, api_key: str | None, timeout_s: float) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=openai_base_url(base_url), api_key=api_key or NO_API_KEY,
                       max_retries=0, timeout=timeout_s)


@dataclass(slots=True)
class Answer:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


async def send(client: AsyncOpenAI, route: ReplayRoute, body: dict[str, Any],
               headers: dict[str, str], timeout_s: float) -> Answer:
    """Send ``body`` on ``route``; never raises for the server's or the network's failures
    (rule 3). Cancellation is recorded as ``cancelled`` and re-raised."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    answer = Answer()
    try:
        async with asyncio.timeout(timeout_s):
            await _call(client, route, dict(body), headers, answer, sent)
    except asyncio.CancelledError:
        answer.error = "cancelled"
        answer.e2e_s = loop.time() - sent
        raise
    except TimeoutError:
        answer.error = "timeout"
    except openai.APIStatusError as exc:
        answer.error = f"http_{exc.status_code}"
    except openai.APITimeoutError:
        answer.error = "timeout"
    except openai.APIConnectionError:
        answer.error = "connection"
    except openai.OpenAIError as exc:
        answer.error = type(exc).__name__
    except (ValueError, TypeError, AttributeError, LookupError):  # rule 4
        answer.error = "malformed_response"
    answer.e2e_s = loop.time() - sent
    return answer


async def _call(client: AsyncOpenAI, route: ReplayRoute, body: dict[str, Any],
                headers: dict[str, str], answer: Answer, sent: float) -> None:
    model = body.pop("model", "")
    stream = body.pop("stream", False) is True
    if route == "embeddings":
        result = await client.embeddings.create(model=model, input=body.pop("input", ""),
                                                extra_body=body, extra_headers=headers)
        answer.prompt_tokens = result.usage.prompt_tokens
        return
    if route == "completions":
        completion = await client.completions.create(
            model=model, prompt=body.pop("prompt", ""), stream=stream, extra_body=body,
            extra_headers=headers)
        if isinstance(completion, AsyncStream):
            async with completion:
                async for piece in completion:
                    text = "".join(c.text for c in piece.choices)
                    _on_text(answer, text, sent)
                    _usage(answer, piece.usage)
        else:
            answer.content = "".join(c.text for c in completion.choices)
            _usage(answer, completion.usage)
        return
    chat = await client.chat.completions.create(
        model=model, messages=body.pop("messages", []), stream=stream, extra_body=body,
        extra_headers=headers)
    if not isinstance(chat, AsyncStream):
        if chat.choices:
            message = chat.choices[0].message
            answer.content = _text(message.content)
            answer.tool_calls = [c.model_dump(include={"id", "type", "function"})
                                 for c in message.tool_calls or ()]
        _usage(answer, chat.usage)
        return
    calls: dict[int, dict[str, Any]] = {}
    async with chat:
        async for chunk in chat:
            _usage(answer, chunk.usage)
            for choice in chunk.choices[:1]:
                delta = choice.delta
                if delta.tool_calls and answer.ttft_s is None:
                    answer.ttft_s = asyncio.get_running_loop().time() - sent
                for call in delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {
                        "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    entry["id"] = call.id or entry["id"]
                    if call.function is not None:
                        entry["function"]["name"] += call.function.name or ""
                        entry["function"]["arguments"] += call.function.arguments or ""
                _on_text(answer, _text(delta.content), sent)
    answer.tool_calls = [calls[i] for i in sorted(calls)]


def _text(value: object) -> str:
    """An answer's text; anything but a string or null is a malformed answer (rule 4)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"an answer's text is a {type(value).__name__}")
    return value


def _on_text(answer: Answer, text: str, sent: float) -> None:
    if text and answer.ttft_s is None:
        answer.ttft_s = asyncio.get_running_loop().time() - sent
    if len(answer.content) < MAX_ANSWER_CHARS:
        answer.content = (answer.content + text)[:MAX_ANSWER_CHARS]


def _usage(answer: Answer, usage: CompletionUsage | None) -> None:
    if usage is None:
        return
    answer.prompt_tokens = usage.prompt_tokens
    answer.completion_tokens = usage.completion_tokens
    details = usage.prompt_tokens_details
    if details is not None and details.cached_tokens is not None:
        answer.cached_tokens = details.cached_tokens
