"""Configuration of one simulated vLLM server.

Building a `SimConfig` has no side effects: it only validates numbers. `build_app` turns
it into a server.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_PORT",
    "FAULT_MODES",
    "FaultMode",
    "SimConfig",
]

FaultMode = Literal[
    "none",
    "error",
    "hang_before_first_byte",
    "hang_mid_stream",
    "reset_mid_stream",
    "malformed_chunks",
]
FAULT_MODES: tuple[FaultMode, ...] = get_args(FaultMode)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8100
DEFAULT_MODEL = "sim-model"
DEFAULT_TTFT_MS = 20.0
DEFAULT_ITL_MS = 5.0
DEFAULT_ANSWER_TOKENS = 32
DEFAULT_ERROR_STATUS = 500
DEFAULT_FAULT_AFTER_CHUNKS = 4
# A simulated answer longer than this is a configuration mistake, not a benchmark.
MAX_ANSWER_TOKENS = 1_000_000
# vLLM's default context length for the small models we mirror; reported by /v1/models.
DEFAULT_MAX_MODEL_LEN = 8192


class SimConfig(BaseModel):
    """How the simulator answers: timing, answer length, reported cache hits, faults.

    Fault selection (`fault_rate`) is deterministic by a per-app counter over inference
    requests that passed validation: the k-th such request (k = 1, 2, ...) gets the fault
    iff ``floor(k * fault_rate) > floor((k - 1) * fault_rate)``. So exactly
    ``floor(n * fault_rate)`` of the first n requests fault, spread evenly; 1.0 faults
    every request and 0.0 none.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    model: str = Field(default=DEFAULT_MODEL, min_length=1)
    ttft_ms: float = Field(default=DEFAULT_TTFT_MS, ge=0.0)
    itl_ms: float = Field(default=DEFAULT_ITL_MS, ge=0.0)
    # Words in a full answer. A natural stop then generates the end-of-sequence token
    # (text "", counted in completion_tokens as vLLM counts it): max_tokens >= tokens + 1
    # ends with finish_reason "stop", a smaller one cuts the words with "length".
    tokens: int = Field(default=DEFAULT_ANSWER_TOKENS, ge=1, le=MAX_ANSWER_TOKENS)
    # None: the usage carries no `prompt_tokens_details` (vLLM without
    # --enable-prompt-tokens-details); a number: reported as cached_tokens, capped by
    # the request's prompt_tokens.
    cached_tokens: int | None = Field(default=None, ge=0)
    variant: str = ""
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=1)
    fault: FaultMode = "none"
    fault_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    error_status: int = Field(default=DEFAULT_ERROR_STATUS, ge=400, le=599)
    fault_after_chunks: int = Field(default=DEFAULT_FAULT_AFTER_CHUNKS, ge=0)
