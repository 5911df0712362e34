"""What a request is inside the engine, and what it reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..kv._blockpool import BlockHash, ExtraKey, PrefixCacheStats
from ..kv._coded_store import DecodedCacheStats
from ..kv._retention import RetainedKV
from ..model._sampling import SamplingParams

__all__ = ["EngineStats", "FinishReason", "Request", "TokenEvent"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token of one request."""

    request_id: str
    token_id: int
    logprob: float
    index: int
    num_prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None = None
    # On the last event of a request that asked to retain its KV: what was kept, if anything.
    retained: RetainedKV | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Gauges and counters for the server's metrics."""

    num_running: int
    num_waiting: int
    kv: PrefixCacheStats
    num_retained_blocks: int = 0
    kv_bytes_per_token: float = 0.0
    decoded_cache: DecodedCacheStats | None = None  # None: fp32, no codec


@dataclass(slots=True, eq=False)
class Request:
    """The engine's state of one request (compared by identity)."""

    request_id: str
    prompt_len: int
    params: SamplingParams
    rng: np.random.Generator
    extra_keys: tuple[ExtraKey, ...]
    tokens: list[int]
    block_hashes: list[BlockHash] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0
    cached_tokens: int | None = None
    drafts: list[int] = field(default_factory=list)
    # Keep the full blocks this long after the request finishes (for another node to pull).
    retain_kv_s: float | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len
