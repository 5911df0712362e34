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
    "PrefixCacheMode",
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
PrefixCacheMode = Literal["off", "prefix"]

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
# The load model: each request in flight besides this one adds this much to the TTFT
# (read when the request starts) and to every inter-token gap (read at each token).
DEFAULT_TTFT_PER_INFLIGHT_MS = 0.0
DEFAULT_ITL_PER_INFLIGHT_MS = 0.0
# Prefill: each prompt token not served from the prefix cache adds this to the TTFT.
DEFAULT_PREFILL_MS_PER_TOKEN = 0.0
# The simulated prefix cache holds at most this many message prefixes (LRU).
DEFAULT_PREFIX_CACHE_ENTRIES = 10_000
# vLLM's default context length for the small models we mirror; reported by /v1/models.
DEFAULT_MAX_MODEL_LEN = 8192


class SimConfig(BaseModel):
    """How the simulator answers: timing, answer length, reported cache hits, faults.

    The load model: a request's TTFT is ``ttft_ms + ttft_per_inflight_ms * (k - 1) +
    prefill_ms_per_token * uncached prompt tokens``, k the requests in flight (this one
    included) when it starts; each later token comes ``itl_ms + itl_per_inflight_ms *
    (k - 1)`` after the previous, k read at that token. ``cache="prefix"`` models vLLM's
    prefix cache on chat requests: the cached tokens are those of the longest message
    prefix this server saw before (its last ``prefix_cache_entries`` prefixes), so a
    server that saw only some turns of a conversation reports fewer; it replaces the
    fixed ``cached_tokens``.

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
    ttft_per_inflight_ms: float = Field(default=DEFAULT_TTFT_PER_INFLIGHT_MS, ge=0.0)
    itl_per_inflight_ms: float = Field(default=DEFAULT_ITL_PER_INFLIGHT_MS, ge=0.0)
    prefill_ms_per_token: float = Field(default=DEFAULT_PREFILL_MS_PER_TOKEN, ge=0.0)
    cache: PrefixCacheMode = "off"
    prefix_cache_entries: int = Field(default=DEFAULT_PREFIX_CACHE_ENTRIES, ge=1)
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
