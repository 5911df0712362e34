"""Validation of inference request bodies, refused with the errors vLLM gives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from backends.openai_wire import (
    RequestKind,
    StreamOptions,
    chat_messages,
    chat_template_kwargs,
    check_message_content,
    check_message_role,
    check_room,
    choice_count,
    completion_prompt,
    invalid_value,
    is_token_ids,
    request_object,
    request_seed,
    requested_max_tokens,
    sampling_fields,
    schema_error,
    stop_fields,
    stream_options,
)
from backends.sim._text import count_words

__all__ = [
    "MESSAGE_OVERHEAD_TOKENS",
    "InferenceRequest",
    "chat_prompt_tokens",
    "parse_request",
]

# Tokens a chat template adds around each message (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 4

EncodingFormat = Literal["float", "base64"]


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """The parts of a request body the simulator's answer depends on."""

    kind: RequestKind
    stream_options: StreamOptions
    max_tokens: int | None
    prompt_tokens: int
    # What the answer text is a function of: the messages, the prompt, or the inputs.
    prompt_key: object
    seed: int | None
    # temperature > 0 given without a seed: the answer may differ from call to call.
    sampled: bool
    embedding_inputs: tuple[object, ...] = ()
    encoding_format: EncodingFormat = "float"

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens is never negative")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens is at least 1")


def parse_request(
    kind: RequestKind, body: object, *, served_model: str, max_model_len: int
) -> InferenceRequest:
    """Check a decoded JSON body; raise ``RequestError`` where vLLM answers 4xx."""
    body = request_object(body, served_model=served_model)
    if kind == "embedding":
        return _parse_embedding(body)
    options = stream_options(body)
    n = choice_count(body)
    if n not in (None, 1):
        raise invalid_value("The simulator answers with one choice.", param="n", value=n)
    seed = request_seed(body)
    max_tokens, max_tokens_param = requested_max_tokens(kind, body)
    if kind == "chat":
        prompt_key: object = _chat_messages(body)
        prompt_tokens = chat_prompt_tokens(body["messages"])
        # No template to render them (the prompt is counted in words), so the variables change
        # nothing here; a body vLLM refuses for their type is still refused.
        chat_template_kwargs(body)
    else:
        prompt_key, prompt_tokens = _completion_prompt(body)
    check_room(
        max_tokens=max_tokens,
        param=max_tokens_param,
        prompt_tokens=prompt_tokens,
        max_model_len=max_model_len,
    )
    temperature = sampling_fields(body).temperature
    stop_fields(body)  # the simulator's answer stops at its length; the fields must still parse
    return InferenceRequest(
        kind=kind,
        stream_options=options,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        prompt_key=prompt_key,
        seed=seed,
        sampled=temperature is not None and temperature > 0 and seed is None,
    )


def _parse_embedding(body: dict[str, Any]) -> InferenceRequest:
    raw = body.get("input")
    inputs: list[object]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(item, str) for item in raw):
        inputs = list(raw)
    elif isinstance(raw, list) and raw and all(is_token_ids(item) for item in raw):
        inputs = [list(item) for item in raw]
    elif is_token_ids(raw):
        inputs = [raw]
    elif raw is None:
        raise schema_error("missing", "body.input", "Field required", body)
    else:
        raise schema_error(
            "string_type", "body.input", "Input should be a valid string or list", raw
        )
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise schema_error(
            "literal_error",
            "body.encoding_format",
            "Input should be 'float' or 'base64'",
            encoding,
        )
    tokens = sum(
        count_words([item]) if isinstance(item, str) else len(_as_list(item)) for item in inputs
    )
    return InferenceRequest(
        kind="embedding",
        stream_options=StreamOptions(),
        max_tokens=None,
        prompt_tokens=tokens,
        prompt_key=inputs,
        seed=None,
        sampled=False,
        embedding_inputs=tuple(inputs),
        encoding_format="base64" if encoding == "base64" else "float",
    )


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = chat_messages(body)
    for index, message in enumerate(messages):
        check_message_content(index, check_message_role(index, message))
    return messages


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The prompt tokens of ``messages`` as the simulator counts them."""
    texts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return count_words(texts) + MESSAGE_OVERHEAD_TOKENS * len(messages)


def _completion_prompt(body: dict[str, Any]) -> tuple[object, int]:
    prompt = completion_prompt(body)
    if isinstance(prompt, str):
        return prompt, count_words([prompt])
    if is_token_ids(prompt):
        return prompt, len(_as_list(prompt))
    raise invalid_value(
        "The simulator answers one prompt (a string or a list of token ids) per request.",
        param="prompt",
    )


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []
