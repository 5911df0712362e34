"""vLLM's OpenAI response bodies, field for field (checked against vLLM 0.32.0's server).

Rules:
1. Stream chunks are dumped like vLLM's ``model_dump_json(exclude_unset=True)``: token
   chunks carry no `usage` key unless ``stream_options.continuous_usage_stats``; the
   chunk of the last generated token carries `finish_reason` (a natural stop ends with the
   end-of-sequence token, whose text is ""); without include_usage that last chunk also
   carries `system_fingerprint`, otherwise the usage chunk (``choices: []``) does.
2. Non-streamed bodies are dumped like ``model_dump()``: optional fields present as null.
3. `prompt_tokens_details` exists only when the server reports cached tokens (vLLM's
   --enable-prompt-tokens-details); unknown is absent or null, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "SIMULATED_VLLM_VERSION",
    "RequestKind",
    "ResponseIdentity",
    "Usage",
    "embedding_response",
    "full_response",
    "model_list",
    "token_chunk",
    "usage_body",
    "usage_chunk",
]

RequestKind = Literal["chat", "completion", "embedding"]
# The vLLM release whose wire format this module reproduces (reported by /version).
SIMULATED_VLLM_VERSION = "0.32.0"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.completion_tokens < 0:
            raise ValueError("token counts are never negative")


def usage_body(usage: Usage, *, kind: RequestKind, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    cached = usage.cached_tokens
    if stream:
        if cached is not None:
            details: dict[str, Any] = {"cached_tokens": cached}
            if kind == "chat":
                details["created_cache_tokens"] = 0
            body["prompt_tokens_details"] = details
        return body
    body["prompt_tokens_details"] = (
        None
        if cached is None
        else {
            "cached_tokens": cached,
            "created_cache_tokens": 0 if kind == "chat" else None,
            "multimodal_tokens": None,
        }
    )
    body["completion_tokens_details"] = None
    return body


def _running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The per-chunk usage of ``continuous_usage_stats``."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "completion_tokens_details": None,
    }


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    """The fields every body of one answer repeats."""

    kind: RequestKind
    response_id: str
    created: int
    model: str
    fingerprint: str


def _head(identity: ResponseIdentity, *, stream: bool) -> dict[str, Any]:
    """The keys every body of an answer opens with."""
    if identity.kind != "chat":
        object_name = "text_completion"
    else:
        object_name = "chat.completion.chunk" if stream else "chat.completion"
    return {
        "id": identity.response_id,
        "object": object_name,
        "created": identity.created,
        "model": identity.model,
    }


def token_chunk(
    identity: ResponseIdentity,
    *,
    text: str | None,
    finish_reason: str | None,
    running_usage: tuple[int, int] | None = None,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The chunk of one token whose text is ``text`` (rule 1); for a chat, ``text=None`` is
    the role chunk that precedes the tokens and carries the (null) prompt fields."""
    choice: dict[str, Any]
    first = identity.kind == "chat" and text is None
    if identity.kind == "chat":
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""} if first else {"content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = None
        if not first:
            choice["token_ids"] = None
    else:
        choice = {
            "index": 0,
            "text": text or "",
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    chunk = {**_head(identity, stream=True), "choices": [choice]}
    if running_usage is not None:
        chunk["usage"] = _running_usage(*running_usage)
    if first:
        chunk["prompt_token_ids"] = None
        chunk["prompt_text"] = None
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def usage_chunk(identity: ResponseIdentity, usage: Usage) -> dict[str, Any]:
    return {
        **_head(identity, stream=True),
        "choices": [],
        "usage": usage_body(usage, kind=identity.kind, stream=True),
        "system_fingerprint": identity.fingerprint,
    }


def full_response(
    identity: ResponseIdentity, *, text: str, finish_reason: str, usage: Usage
) -> dict[str, Any]:
    choice: dict[str, Any]
    if identity.kind == "chat":
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
    body = {
        **_head(identity, stream=False),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": identity.fingerprint,
        "usage": usage_body(usage, kind=identity.kind, stream=False),
    }
    if identity.kind == "chat":
        body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def embedding_response(
    *,
    request_id: str,
    created: int,
    model: str,
    embeddings: list[list[float] | str],
    prompt_tokens: int,
) -> dict[str, Any]:
    """Embeddings as vLLM returns them; each item is floats or base64 little-endian f32."""
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=None)
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"index": index, "object": "embedding", "embedding": embedding}
            for index, embedding in enumerate(embeddings)
        ],
        "usage": usage_body(usage, kind="embedding", stream=False),
    }


def model_list(
    *, model: str, created: int, max_model_len: int, permission_id: str
) -> dict[str, Any]:
    permission = {
        "id": permission_id,
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}
