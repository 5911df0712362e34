"""`plan-kv`: a codec per layer for keys and for values under a KV budget, chosen from measured
quality loss (``kv._planner``), and what bounds a decode step on this machine
(``kv._costmodel``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from threadpoolctl import threadpool_limits

from ..kv._costmodel import CostCalibration, StepEstimate, calibrate_costs, estimate_step
from ..kv._plan import ENGINE_CODECS, KVPlan
from ..kv._planner import (
    DEFAULT_PLAN_CODECS,
    PlanCheck,
    RetentionCheck,
    SensitivityTable,
    block_bytes,
    calibration_digest,
    check_plan,
    check_retention,
    heavy_bytes_per_token,
    heavy_row_bytes,
    measure_sensitivity,
    plan_for_budget,
)
from ..kv._store import DEFAULT_BLOCK_SIZE
from ..kv.codecs._calibration_cache import cached_calibration
from ..kv.codecs._codec import ROLES
from ..kv.codecs._registry import CODECS, bits_range
from ..kv.codecs._texts import PROMPTS
from ..model._gguf import read_gguf_config
from ._kv_cli import (
    DEFAULT_CONTEXT,
    _check_queries,
    _gguf,
    _json,
    _load_model,
    _say,
    _text_options,
    _threads,
)

__all__ = ["plan_kv_command"]

DEFAULT_PLAN_PROMPTS = 1
DEFAULT_PLAN_TOKENS = 128
DEFAULT_PLAN_QUERIES = 64
DEFAULT_PLAN_BUDGET_BITS = 4.5
"""Between kivi-2 (3.5 bits at 16-token blocks) and kivi-4 (5.5): where mixing pays."""
DEFAULT_BATCH = 8
_GRID_BATCHES = (1, 8, 64)
_GRID_CONTEXTS = (512, 4096, 32768)


def _check_budget(
    flag: str,
    budget_bytes_per_token: float,
    names: tuple[str, ...],
    kv_heads: int,
    head_dim: int,
    elements: int,
) -> None:
    """Refuse, before minutes of measuring, a budget that no plan meets: under the lightest of
    ``names`` no plan fits, over the heaviest codec of the registry (fp32) no codec spends it.
    Bits per element are the registry's codecs measured on a block of the engine's size and
    this model's KV heads (``elements``: K and V elements per token, all layers)."""
    least = bits_range(names, kv_heads, head_dim, DEFAULT_BLOCK_SIZE)
    most = bits_range(CODECS, kv_heads, head_dim, DEFAULT_BLOCK_SIZE)
    # Compared in bytes as the bits budget was converted (bits * elements / 8), so a budget of
    # exactly a codec's bits is in range; printed in the flag's own unit.
    low, high = least.least_bits * elements / 8, most.most_bits * elements / 8
    if low <= budget_bytes_per_token <= high:
        return
    if flag == "--budget-bytes-per-token":
        unit, given = "bytes per token", budget_bytes_per_token
    else:
        unit, given = "bits per element", 8 * budget_bytes_per_token / elements
        low, high = least.least_bits, most.most_bits
    raise click.UsageError(
        f"{flag}: {given:g} {unit} is outside what the codecs store for this model: from "
        f"{low:g} ({least.lightest}, the lightest of --codecs) to {high:g} ({most.heaviest}, "
        "the heaviest codec)"
    )


def _check_writable(flag: str, path: Path) -> None:
    """Refuse, before minutes of measuring, a path a file cannot be written whole to (``_plan``
    rule 7: a temporary file in its directory, renamed over it): not a file name, a directory
    that does not exist or cannot be written, or something there that is not a regular file (a
    rename would replace a device or a pipe, not write into it).  A failure left to the end
    (a full disk, the directory removed meanwhile) is still one line."""
    if path.name in ("", ".", "..", "-"):
        raise click.UsageError(
            f"{flag}: {str(path)!r} is not a file name (the plan is written to a file, not to "
            "stdout; --json prints the report)"
        )
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        raise click.UsageError(f"{flag}: {path} is not a regular file")
    folder = target.parent
    if not folder.is_dir():
        raise click.UsageError(f"{flag}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise click.UsageError(f"{flag}: cannot write in {folder}")


def _estimates(
    costs: CostCalibration,
    table: SensitivityTable,
    plan: KVPlan,
    batch: int,
    context: int,
) -> list[StepEstimate]:
    out = []
    for name in dict.fromkeys(("fp32", *table.codecs)):
        size = costs.num_layers * sum(
            block_bytes(name, role, costs.kv_heads, costs.head_dim, table.block_size)
            for role in ROLES
        )
        out.append(estimate_step(costs, name, size / table.block_size, batch, context))
    out.append(estimate_step(costs, plan, table.bytes_per_token(plan), batch, context))
    return out


def _estimate_dict(estimate: StepEstimate) -> dict[str, Any]:
    return {
        "codec": estimate.codec,
        "batch": estimate.batch,
        "context": estimate.context,
        "kv_bytes_per_token": estimate.kv_bytes_per_token,
        "compute_ms": 1e3 * estimate.compute_s,
        "dequant_ms": 1e3 * estimate.dequant_s,
        "weights_ms": 1e3 * estimate.weights_s,
        "kv_ms": 1e3 * estimate.kv_s,
        "bound": estimate.bound,
        "tokens_per_s": estimate.tokens_per_s,
    }


def _check_dict(check: PlanCheck) -> dict[str, Any]:
    return {
        "budget_bytes_per_token": check.budget_bytes_per_token,
        "plan": check.plan.name,
        "predicted_kl": check.predicted_kl,
        **check.against_best_uniform(),
        "uniform_fitting": {
            q.codec: {
                "kl": q.kl_nats,
                "top1": q.top1,
                "bytes_per_token": check.uniform_bytes_per_token[q.codec],
            }
            for q in check.measured[1:]
        },
        "chosen": check.chosen.name,
        "prompt_tokens": list(check.prompt_tokens),
    }


def _retention_dict(split: RetentionCheck) -> dict[str, Any]:
    return {
        "context_tokens": split.context_tokens,
        "splits": [
            {
                "window_tokens": plan.window_tokens,
                "heavy_tokens": plan.heavy_tokens,
                "plan": plan.describe(),
                "bytes_per_token": size,
                "kl": quality.kl_nats,
                "top1": quality.top1,
                "attention_error": quality.attention_error,
            }
            for plan, size, quality in zip(
                split.plans, split.bytes_per_token, split.measured, strict=True
            )
        ],
        "chosen_window_tokens": split.chosen.window_tokens,
        "chosen_heavy_tokens": split.chosen.heavy_tokens,
    }


@click.command("plan-kv")
@click.option(
    "--budget-bits", type=click.FloatRange(min=0, min_open=True), default=None,
    help=f"KV budget in mean bits per element over layers, K and V, within what the codecs "
    f"store: from the lightest of --codecs to fp32 [default: {DEFAULT_PLAN_BUDGET_BITS}].",
)  # fmt: skip
@click.option(
    "--budget-bytes-per-token", type=click.FloatRange(min=0, min_open=True), default=None,
    help="KV budget in bytes per token, all layers, K and V (understudy_kv_bytes_per_token).",
)  # fmt: skip
@click.option(
    "--codecs", default=",".join(DEFAULT_PLAN_CODECS), show_default=True,
    help="Codecs a layer's K or V may use, comma-separated.",
)  # fmt: skip
@click.option("--batch", type=click.IntRange(1), default=DEFAULT_BATCH, show_default=True,
              help="Cost model: sequences per decode step.")  # fmt: skip
@click.option("--context", type=click.IntRange(1), default=DEFAULT_CONTEXT, show_default=True,
              help="Cost model: tokens of context per sequence.")  # fmt: skip
@_text_options(
    prompts=DEFAULT_PLAN_PROMPTS,
    tokens=DEFAULT_PLAN_TOKENS,
    queries=DEFAULT_PLAN_QUERIES,
    prompts_help="Prompts the sensitivity is measured on.",
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("kv-plan.json"),
    show_default=True, help="Where the plan is written (for engine --kv-plan).",
)  # fmt: skip
@click.option(
    "--cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Sensitivity table cache [default: OUT with .sensitivity.json].",
)  # fmt: skip
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Measure the plan's KL against the uniform codecs that fit the budget, on "
              "held-out prompts, and keep the better.")  # fmt: skip
@click.option("--retention/--no-retention", default=False, show_default=True,
              help="Also split the budget between the layers' codecs, a recent window kept "
              "raw (0/32/64/128 tokens, priced at the held-out prompt's length) and heavy "
              "hitters (0/1/2 float16 rows per block and KV head), measure every split there "
              "and write the best.")  # fmt: skip
@click.option("--retention-tokens", type=click.IntRange(2), default=None,
              help="The held-out prompt cut to this many tokens for --retention, the context the "
              "window is priced at [default: --tokens].")  # fmt: skip
@_threads
@_json
@_gguf
def plan_kv_command(
    budget_bits: float | None,
    budget_bytes_per_token: float | None,
    codecs: str,
    batch: int,
    context: int,
    prompts: int,
    tokens: int,
    queries: int,
    out: Path,
    cache: Path | None,
    verify: bool,
    retention: bool,
    retention_tokens: int | None,
    threads: int,
    as_json: bool,
    gguf_path: Path | None,
) -> None:
    """Choose a KV codec per layer for keys and for values under a memory budget, from measured
    quality loss, and say what bounds a decode step on this machine."""
    if budget_bits is not None and budget_bytes_per_token is not None:
        raise click.UsageError("give --budget-bits or --budget-bytes-per-token, not both")
    # FloatRange lets nan and inf through; either would be found out only after minutes of
    # measuring, as a plan that fits nothing or a budget that means nothing.
    for flag, value in (
        ("--budget-bits", budget_bits),
        ("--budget-bytes-per-token", budget_bytes_per_token),
    ):
        if value is not None and not math.isfinite(value):
            raise click.UsageError(f"{flag} must be a finite number above 0, got {value}")
    if queries >= tokens:
        raise click.UsageError("--queries must be below --tokens")
    # A codec named twice would be measured twice (minutes) for one column of the table.
    names = tuple(dict.fromkeys(name.strip() for name in codecs.split(",") if name.strip()))
    unknown = [name for name in names if name not in ENGINE_CODECS]
    if unknown or not names:
        raise click.UsageError(f"--codecs: served codecs are {', '.join(ENGINE_CODECS)}")
    if (verify or retention) and prompts >= len(PROMPTS):
        raise click.UsageError(
            f"--prompts: {prompts} leaves no held-out prompt to check the plan on (at most "
            f"{len(PROMPTS) - 1} with --verify or --retention; or --no-verify)"
        )
    if retention and retention_tokens is not None and retention_tokens <= queries:
        raise click.UsageError("--retention-tokens must be above --queries")
    _check_writable("--out", out)
    cache = cache or out.with_name(out.stem + ".sensitivity.json")
    _check_writable("--cache", cache)
    try:  # the metadata alone (seconds): the budget is checked before the model loads
        cfg = read_gguf_config(gguf_path)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load the model: {exc}") from exc
    elements = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    flag = "--budget-bytes-per-token" if budget_bytes_per_token is not None else "--budget-bits"
    if budget_bytes_per_token is None:
        bits = DEFAULT_PLAN_BUDGET_BITS if budget_bits is None else budget_bits
        budget_bytes_per_token = bits * elements / 8
    _check_budget(flag, budget_bytes_per_token, names, cfg.num_kv_heads, cfg.head_dim, elements)
    model = _load_model(gguf_path)
    held_out = PROMPTS[prompts:]
    _check_queries(model, PROMPTS[:prompts], tokens, queries)
    if verify:
        _check_queries(model, held_out[:1], tokens, queries, first=prompts)
    if retention:
        _check_queries(
            model,
            held_out[:1],
            retention_tokens or tokens,
            queries,
            tokens_flag="--tokens" if retention_tokens is None else "--retention-tokens",
            first=prompts,
        )
    say = _say(as_json)
    with threadpool_limits(threads, "blas"):
        calibration = cached_calibration(model)
        costs = calibrate_costs(model, names)
        settings = {
            "model": model.fingerprint.hex(),
            "calibration": calibration_digest(calibration),
            "codecs": list(names),
            "prompt_tokens": [len(model.tokenizer.encode(t)[:tokens]) for t in PROMPTS[:prompts]],
            "queries": queries,
            "block_size": DEFAULT_BLOCK_SIZE,
        }
        table = SensitivityTable.cached(cache, settings)
        if table is None:
            table = measure_sensitivity(
                model,
                codecs=names,
                block_size=DEFAULT_BLOCK_SIZE,
                max_prompts=prompts,
                max_tokens=tokens,
                queries=queries,
                calibration=calibration,
                progress=say,
            )
            try:
                table.save(cache)
            except OSError as exc:  # the plan can still be written; another budget re-measures
                click.echo(f"Warning: --cache: cannot write {cache}: {exc}", err=True)
        else:
            say(f"sensitivity from {cache}")
        plan = plan_for_budget(table, budget_bytes_per_token)
        if plan is None:
            lightest = min(
                table.bytes_per_token(KVPlan.uniform(n, table.num_layers)) for n in names
            )
            raise click.ClickException(
                f"no plan fits {budget_bytes_per_token:.0f} bytes per token (the lightest "
                f"codec needs {lightest:.0f})"
            )
        check = None
        if verify:
            check = check_plan(
                model,
                table,
                plan,
                budget_bytes_per_token,
                prompts=held_out[:1],
                max_tokens=tokens,
                queries=queries,
                calibration=calibration,
                progress=say,
            )
        split = None
        if retention:
            split = check_retention(
                model,
                table,
                budget_bytes_per_token,
                prompt=held_out[0],
                max_tokens=retention_tokens or tokens,
                queries=queries,
                calibration=calibration,
                progress=say,
            )
    chosen = plan if check is None else check.chosen
    if split is not None:
        chosen = split.chosen
    meta: dict[str, Any] = {
        "budget_bytes_per_token": budget_bytes_per_token,
        "bytes_per_token": table.bytes_per_token(chosen)
        + heavy_bytes_per_token(
            chosen.heavy_tokens,
            table.block_size,
            heavy_row_bytes(
                model.config.num_layers, model.config.num_kv_heads, model.config.head_dim
            ),
        ),
        "predicted_kl": table.predicted_loss(chosen),
        "sensitivity": settings,
    }
    if check is not None:
        meta["check"] = _check_dict(check)
    if split is not None:
        meta["retention"] = _retention_dict(split)
    written = KVPlan(
        chosen.layers,
        meta,
        window_tokens=chosen.window_tokens,
        heavy_tokens=chosen.heavy_tokens,
    )
    try:
        written.dump(out)
    except OSError as exc:
        raise click.ClickException(f"--out: cannot write the plan to {out}: {exc}") from exc
    estimates = _estimates(costs, table, chosen, batch, context)
    fp32_bytes = next(e.kv_bytes_per_token for e in estimates if e.codec == "fp32")
    grid = [
        _estimate_dict(estimate_step(costs, codec, size, b, n))
        for codec, size in (("fp32", fp32_bytes), (chosen, table.bytes_per_token(chosen)))
        for b in _GRID_BATCHES
        for n in _GRID_CONTEXTS
    ]
    document = {
        "plan_file": str(out),
        "plan": written.to_dict(),
        "cost_model": {
            "calibration": {
                "weight_bytes": costs.weight_bytes,
                "weight_gb_per_s": costs.weight_bytes_per_s / 1e9,
                "gflops": costs.flops_per_s / 1e9,
                "kv_gb_per_s": costs.kv_bytes_per_s / 1e9,
                "dequant_ns_per_token_layer": {
                    k: 1e9 * v for k, v in costs.dequant_s_per_token_layer.items()
                },
            },
            "estimates": [_estimate_dict(e) for e in estimates],
            "plan_grid": grid,
        },
        "sensitivity": {
            "codecs": list(table.codecs),
            "kl_per_layer_role": table.loss.tolist(),
            "seconds": table.seconds,
            "cache": str(cache),
        },
    }
    if as_json:
        click.echo(json.dumps(document, indent=1))
        return
    _print_plan(document, table, written, check)


def _print_plan(
    document: dict[str, Any], table: SensitivityTable, plan: KVPlan, check: PlanCheck | None
) -> None:
    console = Console(width=160)
    cal = document["cost_model"]["calibration"]
    console.print(
        f"cost model, measured here: weights {cal['weight_bytes'] / 2**20:.0f} MiB read at "
        f"{cal['weight_gb_per_s']:.1f} GB/s, matmul {cal['gflops']:.1f} GFLOP/s, K/V read by "
        f"attention at {cal['kv_gb_per_s']:.2f} GB/s"
    )
    steps = Table(title="a decode step (ms): what binds it")
    for column in ("codec", "batch", "context", "KV B/token", "compute", "dequant", "weights",
                   "KV reads", "bound", "tok/s"):  # fmt: skip
        steps.add_column(column, justify="left" if column in ("codec", "bound") else "right")
    for row in document["cost_model"]["estimates"] + document["cost_model"]["plan_grid"]:
        steps.add_row(
            row["codec"],
            str(row["batch"]),
            str(row["context"]),
            f"{row['kv_bytes_per_token']:.0f}",
            f"{row['compute_ms']:.1f}",
            f"{row['dequant_ms']:.1f}",
            f"{row['weights_ms']:.1f}",
            f"{row['kv_ms']:.1f}",
            row["bound"],
            f"{row['tokens_per_s']:.1f}",
        )
    console.print(steps)
    layers = Table(title=f"plan {plan.describe()}")
    for column in ("layer", "K", "KL if only K", "V", "KL if only V"):
        layers.add_column(column, justify="right")
    index = {name: i for i, name in enumerate(table.codecs)}
    for layer, names in enumerate(plan.layers):
        layers.add_row(
            str(layer),
            names.key,
            f"{table.loss[layer, 0, index[names.key]]:.5f}",
            names.value,
            f"{table.loss[layer, 1, index[names.value]]:.5f}",
        )
    console.print(layers)
    meta = plan.meta
    console.print(
        f"budget {meta['budget_bytes_per_token']:.0f} B/token; plan {meta['bytes_per_token']:.0f} "
        f"B/token, predicted KL {meta['predicted_kl']:.5f}"
    )
    if check is not None:
        summary = _check_dict(check)
        for codec, q in summary["uniform_fitting"].items():
            console.print(
                f"  uniform {codec}: {q['bytes_per_token']:.0f} B/token, KL {q['kl']:.5f}, "
                f"top-1 {100 * q['top1']:.1f}%",
                markup=False,
            )
        console.print(
            f"  plan: KL {summary['plan_kl']:.5f}, top-1 {100 * summary['plan_top1']:.1f}% "
            f"(held-out prompt of {summary['prompt_tokens']} tokens); best uniform that fits: "
            f"{summary['best_uniform']} KL {summary['best_uniform_kl'] or float('nan'):.5f}; "
            f"written: {summary['chosen']}",
            markup=False,
        )
    retention = plan.meta.get("retention")
    if retention is not None:
        for row in retention["splits"]:
            console.print(
                f"  window {row['window_tokens']:>3}, heavy {row['heavy_tokens']} + {row['plan']}: "
                f"{row['bytes_per_token']:.0f} "
                f"B/token at {retention['context_tokens']} tokens, KL {row['kl']:.5f}, top-1 "
                f"{100 * row['top1']:.1f}%",
                markup=False,
            )
    console.print(f"plan written to {document['plan_file']}")
