"""Typed fields of an OpenAI request body, checked with vLLM's error wording.

Shared by the simulator, the engine and the router: each must refuse what vLLM refuses,
in the same words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from ._errors import invalid_value, sampling_params_error, schema_error

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_CHOICES",
    "MAX_TEMPERATURE",
    "SamplingFields",
    "StopFields",
    "choice_count",
    "is_token_ids",
    "optional_bool",
    "optional_float",
    "optional_int",
    "request_seed",
    "sampling_fields",
    "stop_fields",
]


def is_token_ids(value: object) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, int) and not isinstance(item, bool) for item in value)
    )


# vLLM's pydantic bounds on ``seed`` (and its other 64-bit fields): a signed 64-bit integer.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def optional_int(
    body: dict[str, Any], name: str, *, ge: int | None = None, le: int | None = None
) -> int | None:
    """An integer field read as pydantic's lax ``int`` reads it for vLLM: any size (a JSON
    integer past 64 bits included; ``decode_body`` keeps it exact), a float with no fractional
    part within 64 bits as that integer; refused out of the field's bounds ``ge``/``le`` (a
    ``Field(ge=..., le=...)``) with pydantic's wording."""
    value = body.get(name)
    if value is None:
        return None
    loc = f"body.{name}"
    if isinstance(value, float):
        value = _int_from_float(loc, value)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise schema_error("int_type", loc, "Input should be a valid integer", value)
    if ge is not None and value < ge:
        raise schema_error(
            "greater_than_equal",
            loc,
            f"Input should be greater than or equal to {ge}",
            value,
            ctx={"ge": ge},
        )
    if le is not None and value > le:
        raise schema_error(
            "less_than_equal",
            loc,
            f"Input should be less than or equal to {le}",
            value,
            ctx={"le": le},
        )
    return value


def _int_from_float(loc: str, value: float) -> int:
    # pydantic-core takes a float for an int only when it is finite, whole and fits 64 bits.
    if not math.isfinite(value):
        raise schema_error("finite_number", loc, "Input should be a finite number", value)
    if not value.is_integer():
        raise schema_error(
            "int_from_float",
            loc,
            "Input should be a valid integer, got a number with a fractional part",
            value,
        )
    if not INT64_MIN <= value < -INT64_MIN:
        raise schema_error(
            "int_parsing_size",
            loc,
            "Unable to parse input string as an integer, exceeded maximum size",
            value,
        )
    return int(value)


def request_seed(body: dict[str, Any]) -> int | None:
    """``seed``, bounded to a signed 64-bit integer as vLLM's request models bound it."""
    return optional_int(body, "seed", ge=INT64_MIN, le=INT64_MAX)


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
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range is no number to pydantic either
        raise schema_error(
            "float_type", f"body.{name}", "Input should be a valid number", value
        ) from None
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


# vLLM's SamplingParams bounds: temperature in [0, 2], n at most VLLM_MAX_N_SEQUENCES's default.
MAX_TEMPERATURE = 2.0
MAX_CHOICES = 16384


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """A body's ``temperature``, ``top_p`` and ``top_k`` as given (None: unset)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None


def sampling_fields(body: dict[str, Any]) -> SamplingFields:
    """``temperature``, ``top_p`` and ``top_k``, refused out of range as vLLM's
    ``SamplingParams`` refuses them (top_k -1 and 0 both disable it)."""
    temperature = optional_float(body, "temperature")
    if temperature is not None and temperature < 0:
        raise invalid_value(
            f"temperature must be non-negative, got {temperature}.",
            param="temperature",
            value=temperature,
        )
    if temperature is not None and temperature > MAX_TEMPERATURE:
        raise invalid_value(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}.",
            param="temperature",
            value=temperature,
        )
    top_p = optional_float(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise invalid_value(f"top_p must be in (0, 1], got {top_p}.", param="top_p", value=top_p)
    top_k = optional_int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise sampling_params_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    return SamplingFields(temperature=temperature, top_p=top_p, top_k=top_k)


def choice_count(body: dict[str, Any]) -> int | None:
    """``n``, the choices asked for, refused below 1 as vLLM's ``SamplingParams`` refuses it."""
    n = optional_int(body, "n")
    if n is not None and n < 1:
        raise sampling_params_error(f"n must be at least 1, got {n}.")
    if n is not None and n > MAX_CHOICES:
        raise sampling_params_error(
            f"n must be at most {MAX_CHOICES}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    return n


@dataclass(frozen=True, slots=True)
class StopFields:
    """A body's stop conditions as given: ``stop`` strings (empty ones dropped, as they stop
    nothing), ``stop_token_ids`` and ``ignore_eos``."""

    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


def stop_fields(body: dict[str, Any]) -> StopFields:
    """``stop`` (a string or a list of them), ``stop_token_ids`` (a list of integers) and
    ``ignore_eos``, refused with FastAPI's schema errors when of another type; each server
    bounds and range-checks what it uses."""
    stop = body.get("stop")
    items = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise schema_error("string_type", "body.stop", "Input should be a valid string", stop)
    ids = body.get("stop_token_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise schema_error(
            "int_type", "body.stop_token_ids", "Input should be a valid integer", ids
        )
    return StopFields(
        stop=tuple(s for s in items if s),
        stop_token_ids=() if ids is None else tuple(ids),
        ignore_eos=optional_bool(body, "ignore_eos") or False,
    )
