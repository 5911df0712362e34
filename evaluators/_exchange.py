"""An Exchange: one mirrored request, as the primary and one candidate answered it.

The gateway joins the two Observations and hands the pair to an :class:`EvaluationSink`.
A sink's ``submit`` never blocks: it takes the exchange or says no, and the caller
counts the refusal (``reason=sink_full``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Final, Protocol

from evaluators._observation import Observation

__all__ = ["EvaluationSink", "Exchange", "MemorySink", "json_requested", "requested_choices"]

_CHOICE_ROUTES: Final = frozenset({"chat_completions", "completions"})


@dataclass(frozen=True, slots=True)
class Exchange:
    """``turn_depth``: assistant messages before the request's last (chat; None for other
    routes); ``prompt_bytes``: the size of the request body the gateway forwarded;
    ``requested_choices``: how many choices the request asked for
    (:func:`requested_choices`); ``json_requested``: whether it asked for a JSON answer
    (:func:`json_requested`; None when the body could not be read)."""

    request_id: str
    session_key: str
    route: str
    candidate: str
    primary: Observation
    candidate_observation: Observation
    turn_depth: int | None = None
    prompt_bytes: int | None = None
    requested_choices: int | None = None
    json_requested: bool | None = None


def json_requested(route: str, payload: dict[str, Any] | None) -> bool | None:
    """Whether a chat or legacy completion asked for JSON: OpenAI's ``response_format``
    of type ``json_object`` or ``json_schema``, or vLLM's ``guided_json`` or
    ``structured_outputs.json``. None where the body is unknown (not JSON, another
    route)."""
    if payload is None or route not in _CHOICE_ROUTES:
        return None
    response_format = payload.get("response_format")
    if isinstance(response_format, dict) and \
            response_format.get("type") in ("json_object", "json_schema"):
        return True
    structured = payload.get("structured_outputs")
    return payload.get("guided_json") is not None or (
        isinstance(structured, dict) and structured.get("json") is not None)


def requested_choices(route: str, payload: dict[str, Any] | None) -> int | None:
    """How many choices a request's answer should have: ``n`` (1 when absent or null) for
    a chat completion; ``n`` for each prompt of a legacy completion (a string or a list of
    token ids is one prompt, a list of them several). None for other routes and for what
    the backend would refuse (an ``n`` that is not a positive integer, an empty list):
    then there is no count to hold an answer to."""
    if payload is None or route not in _CHOICE_ROUTES:
        return None
    n = payload.get("n")
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    if route == "chat_completions":
        return n
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return n
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return n  # one prompt of token ids
    return n * len(prompt)


class EvaluationSink(Protocol):
    def submit(self, exchange: Exchange) -> bool:
        """Take ``exchange`` without blocking; False if it had to be refused."""
        ...


class MemorySink:
    """A bounded in-memory sink: keeps the newest exchanges, refuses none.

    When full, the oldest exchange is evicted and counted in ``evicted``.
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[Exchange] = deque(maxlen=capacity)
        self.received = 0
        self.evicted = 0

    def submit(self, exchange: Exchange) -> bool:
        if self._items.maxlen is not None and len(self._items) == self._items.maxlen:
            self.evicted += 1
        self._items.append(exchange)
        self.received += 1
        return True

    def __len__(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[Exchange]:
        return list(self._items)
