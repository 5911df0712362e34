"""OpenAI request bodies read into engine requests, refused with the errors vLLM gives.

Rules
-----
1. Type errors answer as FastAPI's request validation does (type ``"Bad Request"``,
   param ``body.<field>``); value errors as vLLM's own checks do (``BadRequestError``, the
   message ending ``(parameter=..., value=...)``); an unknown model is a 404.  Every refusal is
   a ``RequestError`` carrying its status: bad input never becomes a 500.
2. A chat is rendered with the model's own chat template (from the GGUF) and tokenized; a
   completion prompt is a string or a list of token ids (or a batch of exactly one of those).
   ``chat_template_kwargs`` are the template's extra variables, as on vLLM: those the template
   reads are rendered (``{"enable_thinking": false}`` for a template that reads it), the
   others change nothing, as vLLM drops them; the request's own ``add_generation_prompt`` and
   ``continue_final_message`` win over theirs, and a ``chat_template`` among them is refused
   as the field is (rule 4).
3. ``max_tokens`` (``max_completion_tokens`` first for chat) above ``max_model_len`` is
   refused; otherwise it is cut to the room the prompt leaves, as vLLM does; unset, chat
   may use all that room and a completion gets vLLM's default of 16.
4. Options the engine does not implement (log-probabilities, penalties, n > 1, a chat template
   or a continued final message, special tokens' text, ...) are refused when set to anything
   but their neutral value, rather than silently ignored.
5. ``cache_salt`` (vLLM's, a non-empty string) keys the request's prefix-cache blocks: requests
   share cached blocks only under the same salt (or none), so one tenant cannot read another's
   prompts from its time to first token.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

from backends.openai_wire import (
    RequestError,
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
    optional_bool,
    request_object,
    request_seed,
    requested_max_tokens,
    sampling_fields,
    schema_error,
    stop_fields,
    stream_options,
)

from ..model._sampling import SamplingParams
from ..model._tokenizer import ChatTokenizer

__all__ = [
    "ENGINE_VERSION",
    "MAX_STOP_STRINGS",
    "GenerationRequest",
    "parse_generation_request",
]


def _understudy_version() -> str:
    try:
        return importlib.metadata.version("understudy")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


# What the engine's servers and its router answer at ``GET /version``: understudy's release.
ENGINE_VERSION = _understudy_version()

# Stop strings are searched after every token, so their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# vLLM treats a temperature below this as greedy decoding.
_GREEDY_TEMPERATURE = 1e-5
_DEFAULT_TEMPERATURE = 1.0
_SEED_MODULUS = 1 << 64
# Fields accepted only at their neutral values.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "prompt_logprobs": (None, 0),
    "suffix": (None, ""),
    # vLLM's sampling and output extras, which would change the answer.
    "min_tokens": (None, 0),
    "min_p": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "prompt_embeds": (None,),
    # vLLM's output extras: special tokens' text, the answer's token ids.
    "skip_special_tokens": (None, True),
    "return_token_ids": (None, False),
}
# Chat fields that change how vLLM renders the prompt (a completion has no template: vLLM takes
# and ignores them there).
_CHAT_NEUTRAL: dict[str, tuple[object, ...]] = {
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
}
# Template variables the request's own fields set, whatever its chat_template_kwargs say: vLLM
# merges those fields over the kwargs, and they are never null there (rule 2).
_OWN_TEMPLATE_VARIABLES = frozenset({"add_generation_prompt", "continue_final_message"})


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What the engine and the answer writer need from one request body."""

    kind: RequestKind
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop: tuple[str, ...]
    stream_options: StreamOptions
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a generation request needs a prompt")


def parse_generation_request(
    kind: RequestKind,
    body: object,
    *,
    tokenizer: ChatTokenizer,
    served_model: str,
    max_model_len: int,
) -> GenerationRequest:
    """Check a decoded body and tokenize its prompt; raise ``RequestError`` where vLLM
    answers 4xx."""
    if kind == "embedding":
        raise RequestError("The engine serves no embedding model.", param="model", status=404)
    body = request_object(body, served_model=served_model)
    options = stream_options(body)
    n = choice_count(body)
    if n not in (None, 1):
        raise invalid_value("The engine answers with one choice.", param="n", value=n)
    unsupported = _NEUTRAL | _CHAT_NEUTRAL if kind == "chat" else _NEUTRAL
    for name, neutral in unsupported.items():
        if body.get(name) not in neutral:
            raise invalid_value(
                f"`{name}` is not supported by this engine.", param=name, value=body[name]
            )
    if kind == "chat":
        prompt = _chat_prompt(body, tokenizer)
    else:
        prompt = _completion_prompt(body, tokenizer)
    max_tokens, name = requested_max_tokens(kind, body)
    check_room(
        max_tokens=max_tokens, param=name, prompt_tokens=len(prompt), max_model_len=max_model_len
    )
    room = max_model_len - len(prompt)
    sampling, stops = sampling_fields(body), stop_fields(body)
    params = SamplingParams(
        max_tokens=room if max_tokens is None else min(max_tokens, room),
        temperature=_temperature(sampling.temperature),
        top_p=1.0 if sampling.top_p is None else sampling.top_p,
        top_k=0 if sampling.top_k is None or sampling.top_k < 0 else sampling.top_k,
        seed=_seed(body),
        stop_token_ids=_stop_token_ids(stops.stop_token_ids, tokenizer.vocab_size),
        ignore_eos=stops.ignore_eos,
    )
    return GenerationRequest(
        kind=kind,
        prompt_ids=tuple(prompt),
        params=params,
        stop=_stop_strings(stops.stop),
        stream_options=options,
        cache_salt=_cache_salt(body),
    )


def _cache_salt(body: dict[str, Any]) -> str | None:
    """Rule 5, refused with vLLM's words."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise invalid_value("Parameter 'cache_salt' must be a non-empty string if provided.",
                            param="cache_salt", value=salt)
    return salt


# -- prompts ---------------------------------------------------------------------------------


def _chat_prompt(body: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    messages = chat_messages(body)
    flat = [_chat_message(index, message) for index, message in enumerate(messages)]
    add_generation_prompt = optional_bool(body, "add_generation_prompt")
    variables = _template_variables(body, tokenizer)
    try:
        return tokenizer.apply_chat_template(
            flat, add_generation_prompt=add_generation_prompt is not False, **variables
        )
    except Exception as exc:
        # As vLLM: the render's failure is the request's (its messages, its variables: on them
        # a template's range() or arithmetic raises OverflowError or ZeroDivisionError, beside
        # jinja2's and type errors).
        raise invalid_value(f"The chat template failed: {exc}", param="messages") from exc


def _template_variables(body: dict[str, Any], tokenizer: ChatTokenizer) -> dict[str, Any]:
    """Rule 2: the request's ``chat_template_kwargs`` that the template reads."""
    kwargs = chat_template_kwargs(body)
    if kwargs.get("chat_template") is not None:  # rule 4, as the ``chat_template`` field
        raise invalid_value(
            "`chat_template_kwargs.chat_template` is not supported by this engine.",
            param="chat_template_kwargs",
            value=kwargs["chat_template"],
        )
    return {
        name: value
        for name, value in kwargs.items()
        if name in tokenizer.template_variables and name not in _OWN_TEMPLATE_VARIABLES
    }


def _chat_message(index: int, message: object) -> dict[str, str]:
    """One message with its content as plain text (text parts joined by newlines, as vLLM)."""
    message = check_message_role(index, message)
    content = check_message_content(index, message)
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid_value(
                    "Only text content parts are supported by this engine.",
                    param=f"messages.{index}.content",
                )
            if not isinstance(part.get("text"), str):
                raise schema_error(
                    "string_type",
                    f"body.messages.{index}.content.text",
                    "Input should be a valid string",
                    part.get("text"),
                )
            parts.append(part["text"])
        text = "\n".join(parts)
    return {"role": message["role"], "content": text}


def _completion_prompt(body: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    prompt = completion_prompt(body)
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if is_token_ids(prompt):
        vocab = tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise invalid_value(
                f"Token id {bad[0]} is out of vocabulary (size {vocab}).",
                param="prompt",
                value=bad[0],
            )
        return list(prompt)
    raise invalid_value(
        "The engine answers one prompt (a string or a list of token ids) per request.",
        param="prompt",
    )


# -- options ---------------------------------------------------------------------------------


def _temperature(value: float | None) -> float:
    if value is None:
        return _DEFAULT_TEMPERATURE
    return 0.0 if value < _GREEDY_TEMPERATURE else value


def _seed(body: dict[str, Any]) -> int | None:
    # vLLM takes any signed 64-bit seed; numpy's generator wants it unsigned.
    value = request_seed(body)
    return None if value is None else value % _SEED_MODULUS


def _stop_strings(stop: tuple[str, ...]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise invalid_value(
            f"At most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} "
            "characters are supported.",
            param="stop",
        )
    return stop


def _stop_token_ids(ids: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    if any(not 0 <= t < vocab_size for t in ids):
        raise invalid_value(f"stop_token_ids must be in [0, {vocab_size}).", param="stop_token_ids")
    return ids
