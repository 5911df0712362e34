"""Typed fields of an OpenAI request body, checked with vLLM's error wording.

Shared by the simulator, the engine and the router: each must refuse what vLLM refuses,
in the same words.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from ._errors import invalid_value, schema_error

__all__ = ["is_token_ids", "optional_bool", "optional_float", "optional_int"]


def is_token_ids(value: object) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, int) and not isinstance(item, bool) for item in value)
    )


def optional_int(body: dict[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise schema_error("int_type", f"body.{name}", "Input should be a valid integer", value)
    if minimum is not None and value < minimum:
        raise invalid_value(
            f"{name} must be at least {minimum}, got {value}.", param=name, value=value
        )
    return value


def optional_float(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        raise schema_error(
            "float_parsing",
            f"body.{name}",
            "Input should be a valid number, unable to parse string as a number",
            value,
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise schema_error("float_type", f"body.{name}", "Input should be a valid number", value)
    number = float(value)
    if not math.isfinite(number):
        raise schema_error(
            "finite_number", f"body.{name}", "Input should be a finite number", value
        )
    return number


def optional_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise schema_error("bool_type", f"body.{name}", "Input should be a valid boolean", value)
