"""vLLM's OpenAI wire format: request validation and response bodies.

Rules (what a client of vLLM sees, matched field for field where the simulator has the
information):
1. Errors are ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status in
   `code` (vLLM's `ErrorResponse(error=ErrorInfo(...))`); invalid JSON or a missing
   field is 400 `BadRequestError`, an unknown model 404 `NotFoundError`.
2. Stream chunks are dumped like vLLM's `model_dump_json(exclude_unset=True)`: no
   `usage` key on token chunks; the last token chunk carries `finish_reason`; with
   `stream_options.include_usage` (which defaults to true once `stream_options` is
   given) a final chunk has ``choices: []`` and the usage without null fields.
3. Non-streamed bodies are dumped like `model_dump()`: optional fields are present as
   null, `usage.prompt_tokens_details` included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "RequestKind",
    "SimRequestError",
    "Usage",
    "chat_chunk",
    "completion_chunk",
    "embedding_response",
    "error_body",
    "error_type_for_status",
    "full_response",
    "model_list",
    "usage_body",
    "usage_chunk",
]

RequestKind = Literal["chat", "completion", "embedding"]

# vLLM's CompletionRequest.max_tokens default (the OpenAI legacy API's default too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


def error_type_for_status(status: int) -> str:
    """The `type` vLLM (and the OpenAI client's exception names) use for a status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "InternalServerError" if status >= 500 else "BadRequestError"


class SimRequestError(Exception):
    """A request the simulator refuses, carrying the HTTP status it becomes."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        return error_body(self.message, status=self.status, param=self.param)


def error_body(message: str, *, status: int, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type_for_status(status),
            "param": param,
            "code": status,
        }
    }


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.completion_tokens < 0:
            raise ValueError("token counts are never negative")


def usage_body(usage: Usage, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    elif not stream:
        body["prompt_tokens_details"] = None
    return body


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(
    *, request_id: str, created: int, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
    }


def usage_chunk(
    *, kind: RequestKind, request_id: str, created: int, model: str, usage: Usage
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage, stream=True),
    }


def full_response(
    *,
    kind: RequestKind,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: Usage,
) -> dict[str, Any]:
    choice: dict[str, Any]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    return {
        "id": request_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body(usage, stream=False),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def embedding_response(
    *,
    request_id: str,
    created: int,
    model: str,
    embeddings: list[list[float] | str],
    prompt_tokens: int,
) -> dict[str, Any]:
    """Embeddings as vLLM returns them; each item is floats or base64 little-endian f32."""
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"index": index, "object": "embedding", "embedding": embedding}
            for index, embedding in enumerate(embeddings)
        ],
        "usage": usage_body(
            Usage(prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=None),
            stream=False,
        ),
    }


def model_list(
    *, model: str, created: int, max_model_len: int, permission_id: str
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
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
                ],
            }
        ],
    }
