"""Errors as vLLM (0.32, FastAPI) words them, checked against a real server.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status in `code`. Two families, as in vLLM:

- schema errors (not JSON, a missing field, a wrong type), raised by FastAPI's request
  validation: type ``"Bad Request"``, param ``"body.<field>"``, and a message that lists
  pydantic's error dict;
- value errors raised by vLLM itself: type ``"BadRequestError"`` (or ``"NotFoundError"``
  for an unknown model), param the field, message ending ``(parameter=..., value=...)``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "RequestError",
    "body_not_parsed",
    "error_body",
    "error_type_for_status",
    "invalid_json",
    "invalid_value",
    "sampling_params_error",
    "schema_error",
    "unknown_model",
]

_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}
_SCHEMA_ERROR_TYPE = "Bad Request"


def error_type_for_status(status: int) -> str:
    """The `type` vLLM (and the OpenAI client's exception names) use for a status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "InternalServerError" if status >= 500 else "BadRequestError"


def error_body(
    message: str, *, status: int, param: str | None = None, err_type: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": err_type or error_type_for_status(status),
            "param": param,
            "code": status,
        }
    }


class RequestError(Exception):
    """A request a server refuses as vLLM would, carrying the HTTP status it becomes."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(
            self.message, status=self.status, param=self.param, err_type=self.err_type
        )


# vLLM's validation handler echoes an error's input in at most this many characters.
MAX_ERROR_INPUT_CHARS = 200


def _describe_input(value: object) -> str:
    """The input as vLLM's validation handler echoes it: containers summarised, any other
    value as its ``str`` (a number too: ``'1.5'``), cut at ``MAX_ERROR_INPUT_CHARS``."""
    if isinstance(value, dict | list):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an integer past the interpreter's digit limit
        return f"<{type(value).__name__}>"
    if len(text) > MAX_ERROR_INPUT_CHARS:
        return text[:MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def schema_error(
    kind: str, loc: str, msg: str, value: object, ctx: dict[str, object] | None = None
) -> RequestError:
    """A FastAPI request-validation error for one location (``body`` or ``body.<x>``)."""
    detail: dict[str, object] = {"type": kind, "loc": loc, "msg": msg}
    detail["input"] = _describe_input(value)
    if ctx is not None:
        detail["ctx"] = ctx
    return RequestError(
        f"1 validation error:\n  {detail!r}", param=loc, err_type=_SCHEMA_ERROR_TYPE
    )


def invalid_json(position: int, reason: str) -> RequestError:
    return schema_error(
        "json_invalid",
        f"body.{position}",
        "JSON decode error",
        {},
        ctx={"error": reason},
    )


def body_not_parsed() -> RequestError:
    """A body the JSON parser raised on with something else than a syntax error (nesting too
    deep, an integer too long): FastAPI's ``HTTPException(400, "There was an error parsing
    the body")``, which vLLM's handler words with the status's phrase as its type."""
    return RequestError(
        "There was an error parsing the body", status=400, err_type=_SCHEMA_ERROR_TYPE
    )


def invalid_value(message: str, *, param: str, value: object = None) -> RequestError:
    suffix = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
    return RequestError(f"{message} ({suffix})", param=param)


def sampling_params_error(message: str) -> RequestError:
    """A value vLLM's ``SamplingParams`` refuses with a bare ``ValueError`` (``n``, ``top_k``):
    its message as it is, no param, unlike ``invalid_value``'s."""
    return RequestError(message)


def unknown_model(model: object, served: str) -> RequestError:
    return RequestError(
        f"The model `{model}` does not exist. Valid aliases: {served}.",
        param="model",
        status=404,
    )
