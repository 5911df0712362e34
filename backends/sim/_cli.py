"""`sim`: run one simulated vLLM server until SIGINT or SIGTERM."""

from __future__ import annotations

import click
from pydantic import ValidationError

from backends.openai_wire import config_error, serve_until_signalled
from backends.sim._config import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_ERROR_STATUS,
    DEFAULT_FAULT_AFTER_CHUNKS,
    DEFAULT_HOST,
    DEFAULT_ITL_MS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MODEL,
    DEFAULT_PORT,
    DEFAULT_TTFT_MS,
    FAULT_MODES,
    FaultMode,
    PrefixCacheMode,
    SimConfig,
)
from backends.sim._server import running_sim

__all__ = ["sim_command"]


@click.command("sim")
@click.option("--host", default=DEFAULT_HOST, show_default=True)
@click.option(
    "--port", default=DEFAULT_PORT, show_default=True, type=int, help="0 picks a free port."
)
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Served model name.")
@click.option("--ttft-ms", default=DEFAULT_TTFT_MS, show_default=True, type=float)
@click.option("--itl-ms", default=DEFAULT_ITL_MS, show_default=True, type=float)
@click.option(
    "--ttft-per-inflight-ms", default=0.0, show_default=True, type=float,
    help="Load model: TTFT added per other request in flight.",
)  # fmt: skip
@click.option(
    "--itl-per-inflight-ms", default=0.0, show_default=True, type=float,
    help="Load model: inter-token time added per other request in flight.",
)  # fmt: skip
@click.option(
    "--prefill-ms-per-token", default=0.0, show_default=True, type=float,
    help="TTFT added per prompt token not served from the prefix cache.",
)  # fmt: skip
@click.option(
    "--cache", type=click.Choice(["off", "prefix"]), default="off", show_default=True,
    help="prefix: cached_tokens from the longest chat-message prefix seen before.",
)  # fmt: skip
@click.option(
    "--tokens", default=DEFAULT_ANSWER_TOKENS, show_default=True, type=int,
    help="Answer length before max_tokens caps it.",
)  # fmt: skip
@click.option(
    "--cached-tokens", default=None, type=int,
    help="Report usage.prompt_tokens_details.cached_tokens (omitted when unset).",
)  # fmt: skip
@click.option("--variant", default="", help="Mixed into the text so two sims answer differently.")
@click.option("--max-model-len", default=DEFAULT_MAX_MODEL_LEN, show_default=True, type=int)
@click.option("--fault", type=click.Choice(FAULT_MODES), default="none", show_default=True)
@click.option(
    "--fault-rate", default=1.0, show_default=True, type=float,
    help="Fraction of requests that get the fault, spread evenly by a request counter.",
)  # fmt: skip
@click.option("--error-status", default=DEFAULT_ERROR_STATUS, show_default=True, type=int)
@click.option(
    "--fault-after-chunks", default=DEFAULT_FAULT_AFTER_CHUNKS, show_default=True, type=int,
    help="Token chunks sent before a mid-stream fault.",
)  # fmt: skip
def sim_command(
    host: str,
    port: int,
    model: str,
    ttft_ms: float,
    itl_ms: float,
    ttft_per_inflight_ms: float,
    itl_per_inflight_ms: float,
    prefill_ms_per_token: float,
    cache: PrefixCacheMode,
    tokens: int,
    cached_tokens: int | None,
    variant: str,
    max_model_len: int,
    fault: FaultMode,
    fault_rate: float,
    error_status: int,
    fault_after_chunks: int,
) -> None:
    """Serve a vLLM OpenAI-protocol simulator (for tests and benchmarks)."""
    try:
        config = SimConfig(
            host=host,
            port=port,
            model=model,
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
            ttft_per_inflight_ms=ttft_per_inflight_ms,
            itl_per_inflight_ms=itl_per_inflight_ms,
            prefill_ms_per_token=prefill_ms_per_token,
            cache=cache,
            tokens=tokens,
            cached_tokens=cached_tokens,
            variant=variant,
            max_model_len=max_model_len,
            fault=fault,
            fault_rate=fault_rate,
            error_status=error_status,
            fault_after_chunks=fault_after_chunks,
        )
    except ValidationError as exc:
        raise config_error(exc) from exc
    serve_until_signalled(
        lambda: running_sim(config),
        lambda sim: f"sim: serving {config.model!r} on {sim.root_url}",
    )
