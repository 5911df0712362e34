"""The checks every server makes on an OpenAI request body, refused as vLLM refuses them.

Each server (the simulator, the engine, the router) reads the fields its answer depends on
itself; the checks here are the ones vLLM makes before any of that, in the order it makes
them, so that a bad request gets the same status and body from every server.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

from ._bodies import RequestKind
from ._errors import (
    RequestError,
    body_not_parsed,
    invalid_json,
    invalid_value,
    schema_error,
    unknown_model,
)
from ._fields import is_token_ids, optional_bool, optional_int

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "StreamOptions",
    "chat_messages",
    "check_message_content",
    "check_message_role",
    "check_room",
    "completion_prompt",
    "decode_body",
    "encode_body",
    "request_object",
    "requested_max_tokens",
    "stream_options",
]


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """``stream`` and what ``stream_options`` asks of the stream (by default, nothing: the
    answer is written whole). As vLLM reads them, ``continuous_usage`` comes only with
    ``include_usage``, and that only in a stream."""

    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False

    def __post_init__(self) -> None:
        if self.continuous_usage and not self.include_usage:
            raise ValueError("continuous usage comes only with include_usage")
        if self.include_usage and not self.stream:
            raise ValueError("include_usage asks something of a stream")


# orjson reads 1,024 levels of nesting but writes only 254, and the servers write a client's
# body again (the router forwards it, the simulator hashes its messages), so a body nested
# deeper is refused at the door as one too deep for FastAPI's parser is (vLLM's parser takes
# ~990 levels; no OpenAI body needs more than a handful).
MAX_BODY_NESTING = 254


# orjson reads an integer past 64 bits as a float (2**64 as 1.8446744073709552e+19), where
# vLLM's parser keeps it exact; any integer with this many digits may be one.
_LONG_INTEGER = re.compile(rb"[0-9]{19}")


def decode_body(raw: bytes) -> Any:
    """The JSON body, or the error FastAPI gives for invalid JSON (a 400 in every case: a
    body nested deeper than ``MAX_BODY_NESTING`` or with an integer too long for the standard
    library's parser is FastAPI's "error parsing the body", not a 500). Integers are exact,
    as vLLM reads them, however long: a body with a long one is read again by the standard
    library's parser.

    vLLM hands the body's bytes to the standard library's parser, which reads the encoding
    from them (``json.detect_encoding``): a UTF-8 byte order mark, UTF-16 and UTF-32 are read
    there and refused by orjson, so such a body is decoded first; bytes that are not text in
    their encoding (invalid UTF-8) are FastAPI's "error parsing the body", not a JSON error."""
    encoding = json.detect_encoding(raw)
    if encoding != "utf-8":
        try:
            raw = raw.decode(encoding).encode()
        except UnicodeError:
            raise body_not_parsed() from None
    try:
        body = orjson.loads(raw)
        if _LONG_INTEGER.search(raw) is not None:
            body = json.loads(raw)
    except orjson.JSONDecodeError as exc:
        # vLLM (FastAPI) reports the standard library's wording, so ask it for the reason.
        try:
            json.loads(raw)
        except json.JSONDecodeError as std:
            raise invalid_json(std.pos, std.msg) from exc
        except (RecursionError, ValueError):  # UnicodeDecodeError is a ValueError
            raise body_not_parsed() from None
        raise invalid_json(exc.pos, exc.msg) from exc
    except (ValueError, RecursionError):  # orjson read it; the standard library cannot
        raise body_not_parsed() from None
    # Counting brackets is cheap and bounds the depth, so only a body with many is written.
    # A body that is no object is refused as vLLM refuses it (``request_object``), and is
    # never hashed nor forwarded: its depth does not matter.
    if isinstance(body, dict) and raw.count(b"[") + raw.count(b"{") > MAX_BODY_NESTING:
        try:
            encode_body(body)
        except (orjson.JSONEncodeError, RecursionError):
            raise body_not_parsed() from None
    return body


def encode_body(body: object, *, sort_keys: bool = False) -> bytes:
    """A decoded body (or part of one) as JSON again, to forward or hash it: orjson's, or, for
    one holding an integer past 64 bits (which vLLM takes where it bounds nothing), the
    standard library's."""
    try:
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except orjson.JSONEncodeError as exc:
        if "64-bit" not in str(exc):
            raise
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, sort_keys=sort_keys).encode()


def request_object(body: object, *, served_model: str) -> dict[str, Any]:
    """The body as a JSON object naming the served model (or none)."""
    if not isinstance(body, dict):
        raise schema_error(
            "model_attributes_type",
            "body",
            "Input should be a valid dictionary or object to extract fields from",
            body,
        )
    model = body.get("model")
    if model is not None and model != served_model:
        raise unknown_model(model, served_model)
    return body


def stream_options(body: dict[str, Any]) -> StreamOptions:
    """``stream`` and ``stream_options``, checked against vLLM 0.32: usage is sent only when
    include_usage is true, and continuous_usage_stats adds it to every chunk only then."""
    stream = optional_bool(body, "stream") or False
    options = body.get("stream_options")
    if options is None:
        return StreamOptions(stream=stream)
    if not isinstance(options, dict):
        raise schema_error(
            "model_type",
            "body.stream_options",
            "Input should be a valid dictionary or instance of StreamOptions",
            options,
        )
    if options and not stream:  # vLLM lets an empty object pass
        raise invalid_value(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    include = _stream_option(options, "include_usage")
    continuous = include and _stream_option(options, "continuous_usage_stats")
    return StreamOptions(stream=stream, include_usage=include, continuous_usage=continuous)


def _stream_option(options: dict[str, Any], name: str) -> bool:
    """A flag of ``stream_options``: a boolean or null (unset), as ``stream`` is read; any
    other value was taken for its truth ("no" meant yes)."""
    value = options.get(name)
    if value is None or isinstance(value, bool):
        return value is True
    raise schema_error(
        "bool_type", f"body.stream_options.{name}", "Input should be a valid boolean", value
    )


# vLLM's CompletionRequest.max_tokens default (the legacy OpenAI API's default too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def requested_max_tokens(kind: RequestKind, body: dict[str, Any]) -> tuple[int | None, str]:
    """The answer's length limit the body asks for and the field that asked (for errors): a
    chat's ``max_completion_tokens`` (else ``max_tokens``; None: all the room its prompt
    leaves), a completion's ``max_tokens`` (vLLM's default when unset); refused below 1 as
    vLLM refuses it."""
    if kind == "chat":
        value, param = optional_int(body, "max_completion_tokens"), "max_completion_tokens"
        if value is None:
            value, param = optional_int(body, "max_tokens"), "max_tokens"
    else:
        value, param = optional_int(body, "max_tokens"), "max_tokens"
        if "max_tokens" not in body:
            value = COMPLETIONS_DEFAULT_MAX_TOKENS
    if value is not None and value < 1:
        raise invalid_value(
            f"max_tokens must be at least 1, got {value}.", param=param, value=value
        )
    return value, param


def check_room(
    *, max_tokens: int | None, param: str, prompt_tokens: int, max_model_len: int
) -> None:
    """Refuse a ``max_tokens`` (named ``param``) or a prompt that the context cannot hold."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise invalid_value(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param=param,
            value=max_tokens,
        )
    if prompt_tokens >= max_model_len:
        raise invalid_value(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_tokens} input tokens. Please reduce the length of the "
            "input messages.",
            param="input_tokens",
            value=prompt_tokens,
        )


def chat_messages(body: dict[str, Any]) -> list[Any]:
    """A chat body's ``messages``: present, a list, not empty (each checked by the caller)."""
    if "messages" not in body:
        raise schema_error("missing", "body.messages", "Field required", body)
    messages = body["messages"]
    if not isinstance(messages, list):
        raise schema_error("list_type", "body.messages", "Input should be a valid list", messages)
    if not messages:
        raise RequestError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    return messages


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body's ``chat_template_kwargs`` (vLLM's extra variables for the chat template):
    an object, ``{}`` when unset or null; anything else refused as FastAPI refuses it. What
    the variables do is each server's: a template renders them, the simulator has none."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise schema_error(
            "dict_type", "body.chat_template_kwargs", "Input should be a valid dictionary", kwargs
        )
    return kwargs


def check_message_role(index: int, message: object) -> dict[str, Any]:
    """Message ``index`` as an object with a string ``role``."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise schema_error("missing", f"body.messages.{index}.role", "Field required", message)
    return message


def check_message_content(index: int, message: dict[str, Any]) -> str | list[Any] | None:
    """Message ``index``'s ``content``: text, a list of content parts (each server reads the
    parts it supports) or null; anything else is refused as FastAPI refuses it."""
    content = message.get("content")
    if content is None or isinstance(content, str | list):
        return content
    raise schema_error(
        "string_type", f"body.messages.{index}.content", "Input should be a valid string", content
    )


def completion_prompt(body: dict[str, Any]) -> object:
    """A completion's ``prompt``, not empty, a batch of one taken out of its list (and then
    not empty either: ``[""]`` and ``[[]]`` are no prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not is_token_ids(prompt):
        prompt = prompt[0]  # a batch of one
    if prompt is None or prompt == "" or prompt == []:
        raise invalid_value(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    return prompt
