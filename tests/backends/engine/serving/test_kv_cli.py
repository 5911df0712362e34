"""`plan-kv` and `kv-quality` end to end on the real model, with small bounds; the plan they
write is the one the engine serves (``--kv-plan``).

The planner's target (issue 14): its plan's measured whole-model KL beats the best uniform codec
that fits the same memory.  Here the budget (4 bits per element) admits e8-2 but not kivi-4, so
the plan mixes them; it is measured on a held-out prompt against e8-2 at the same budget.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from backends.engine import (
    Engine,
    KVPlan,
    LlamaModel,
    SamplingParams,
    kv_quality_command,
    plan_kv_command,
)
from backends.engine.kv.codecs._texts import QUESTIONS
from backends.engine.serving._answer_agreement import _KV_LIMIT_BYTES, MAX_ANSWER_TOKENS
from backends.engine.serving._server_config import UnifiedServerConfig

SMALL = ["--tokens", "48", "--queries", "16", "--prompts", "1", "--threads", "1", "--json"]


def _invoke(command: Any, args: list[str]) -> dict[str, Any]:
    result = CliRunner().invoke(command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    document: dict[str, Any] = json.loads(result.stdout)
    return document


@pytest.mark.timeout(900)
def test_plan_kv_beats_the_best_uniform_codec_and_the_engine_serves_its_plan(
    engine_model: LlamaModel, tmp_path: Path
) -> None:
    out = tmp_path / "plan.json"
    args = ["--codecs", "kivi-4,e8-2,kivi-4", "--budget-bits", "4", "--out", str(out), *SMALL]
    document = _invoke(plan_kv_command, args)
    assert document["sensitivity"]["codecs"] == ["kivi-4", "e8-2"]  # kivi-4 measured once
    plan = KVPlan.load(out)
    check = plan.meta["check"]
    budget = plan.meta["budget_bytes_per_token"]
    assert budget == 4 * 30 * 2 * 3 * 64 / 8
    assert check["best_uniform"] == "e8-2"  # kivi-4 does not fit 4 bits
    assert check["plan_bytes_per_token"] <= budget
    assert check["plan_kl"] < check["best_uniform_kl"]
    assert plan.uniform_codec is None and {"kivi-4", "e8-2"} == {*plan.keys, *plan.values}
    print(
        f"plan {check['plan_bytes_per_token']:.0f} B/token KL {check['plan_kl']:.5f} "
        f"(predicted {check['predicted_kl']:.5f}); e8-2 {check['best_uniform_kl']:.5f}"
    )
    bounds = {row["codec"]: row["bound"] for row in document["cost_model"]["estimates"]}
    assert set(bounds) == {"fp32", "kivi-4", "e8-2", plan.name}
    assert set(bounds.values()) <= {"compute", "weights", "kv"}
    # The sensitivity is cached: another budget re-plans without measuring again.
    cache = Path(document["sensitivity"]["cache"])
    assert cache.exists()
    other = ["--budget-bits", "5", "--out", str(tmp_path / "plan5.json"), "--cache", str(cache)]
    again = _invoke(plan_kv_command, ["--codecs", "kivi-4,e8-2", *other, *SMALL, "--no-verify"])
    assert again["sensitivity"]["seconds"] == document["sensitivity"]["seconds"]
    # The engine serves the plan at the bytes the planner counted.
    config = UnifiedServerConfig(kv_plan=out)
    assert config.kv_plan == out
    engine = Engine(engine_model, 64 << 20, kv_codec=plan)  # room for the raw blocks and cache
    assert engine.stats().kv_bytes_per_token == plan.meta["bytes_per_token"]
    assert engine.kv_codec == plan.name

    quality = _invoke(
        kv_quality_command,
        ["--codec", "fp32", "--codec", "fp8", "--plan", str(out), "--questions", "2",
         "--answer-tokens", "4", *SMALL],
    )  # fmt: skip
    rows = {row["codec"]: row for row in quality["codecs"]}
    assert set(rows) == {"fp32", "fp8", plan.name}
    assert rows["fp32"]["kl_nats"] == pytest.approx(0.0, abs=1e-9)
    assert rows["fp32"]["answers_identical"] == 1.0
    for name in ("fp8", plan.name):
        row = rows[name]
        assert len(row["attention_error_per_layer"]) == 30
        assert 0 <= row["answers_identical"] <= 1 and 0 <= row["answers_token_agreement"] <= 1
        assert row["top1"] > 0.5
    assert rows["fp8"]["kl_nats"] < rows[plan.name]["kl_nats"]
    assert rows[plan.name]["bits_per_element"] < 4.5


@pytest.mark.timeout(900)
def test_plan_kv_splits_one_budget_between_a_window_and_the_layers(
    engine_model: LlamaModel, tmp_path: Path
) -> None:
    """At 48 tokens and 12 bits every window leaves room for a plan: a window's complete blocks
    hold float16 rows in place of codes (``_paged_codec`` rule 9), so a 32-token one is cheaper
    than none there, and a 64- or 128-token one holds all three blocks as rows -- two float16
    blocks more than a plain codec, 15,360 of the budget's 17,280 bytes a token -- and any plan
    fits beside them; 0, 1 and 2 heavy hitters per block fit beside each.  Every split is measured,
    the lower KL is written with its window and heavy hitters, and the engine (its bytes per
    token those the planner priced) and kv-quality take that plan."""
    out = tmp_path / "plan.json"
    args = ["--codecs", "kivi-4,e8-2", "--budget-bits", "12", "--out", str(out), *SMALL]
    _invoke(plan_kv_command, [*args, "--retention", "--no-verify"])
    plan = KVPlan.load(out)
    retention = plan.meta["retention"]
    splits = {(row["heavy_tokens"], row["window_tokens"]): row for row in retention["splits"]}
    assert set(splits) == {(h, w) for h in (0, 1, 2) for w in (0, 32, 64, 128)}
    assert retention["context_tokens"] == 48
    budget = plan.meta["budget_bytes_per_token"]
    assert all(row["bytes_per_token"] <= budget for row in splits.values())
    best = min(splits, key=lambda pair: splits[pair]["kl"])
    assert plan.heavy_tokens == retention["chosen_heavy_tokens"] == best[0]
    assert plan.window_tokens == retention["chosen_window_tokens"] == best[1]
    print({pair: round(row["kl"], 5) for pair, row in splits.items()})
    engine = Engine(engine_model, 64 << 20, kv_codec=plan, max_num_seqs=2)
    assert engine.pool.codec is not None
    assert engine.pool.codec.window_blocks == max(1, best[1] // 16)
    assert engine.stats().kv_bytes_per_token == pytest.approx(plan.meta["bytes_per_token"])
    prompt = engine_model.tokenizer.encode("The harbour master counts the ships. " * 4)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert len(engine.generate(prompt, params)) == 20
    quality = _invoke(kv_quality_command, ["--plan", str(out), "--questions", "0", *SMALL])
    (row,) = quality["codecs"]  # measured on the planner's own prompt, not the held-out one
    assert row["window_tokens"] == best[1] and row["registry_name"] == plan.name


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    both = runner.invoke(plan_kv_command, ["--budget-bits", "3", "--budget-bytes-per-token", "9"])
    assert both.exit_code == 2 and "not both" in both.output
    unknown = runner.invoke(plan_kv_command, ["--codecs", "e8-2w"])
    assert unknown.exit_code == 2 and "served codecs" in unknown.output
    queries = runner.invoke(kv_quality_command, ["--tokens", "16", "--queries", "16"])
    assert queries.exit_code == 2
    broken = tmp_path / "plan.json"
    broken.write_text('{"layers": [{"k": "int3", "v": "fp8"}]}')
    bad_plan = runner.invoke(kv_quality_command, ["--plan", str(broken)])
    assert bad_plan.exit_code == 2 and "int3" in bad_plan.output


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["--budget-bits", "1000"], "--budget-bits: 1000 bits per element is outside"),
        (["--budget-bits", "1"], "--budget-bits: 1 bits per element is outside"),
        (["--budget-bytes-per-token", "1e9"], "--budget-bytes-per-token: 1e+09 bytes per token"),
        (["--codecs", "fp16,fp32"], "--budget-bits: 4.5 bits per element is outside"),
    ],
    ids=["above-fp32", "below-e8-2", "bytes-above-fp32", "default-below-fp16"],
)
def test_a_budget_no_codec_can_meet_is_refused_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, args: list[str], refusal: str
) -> None:
    """No codec stores more than fp32's 32 bits per element, and below the lightest codec
    allowed no plan fits: either was found out after minutes of measuring."""

    def no_load(*_: object, **__: object) -> LlamaModel:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LlamaModel, "load", no_load)
    result = CliRunner().invoke(plan_kv_command, args)
    assert result.exit_code == 2, result.output
    assert refusal in result.output
    lightest = "fp16" if "fp16,fp32" in args else "e8-2"
    assert f"({lightest}, the lightest of --codecs)" in result.output
    assert "(fp32, the heaviest codec)" in result.output


@pytest.mark.usefixtures("no_model_load")
def test_answers_longer_than_the_reference_engine_holds_are_refused_before_loading() -> None:
    """--answer-tokens past what the fp32 reference engine's pool holds was a traceback from
    the engine ('request needs 315 KV blocks, the pool has 90') after the whole measurement."""
    too_long = str(MAX_ANSWER_TOKENS + 1)
    result = CliRunner().invoke(kv_quality_command, ["--answer-tokens", too_long])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"'--answer-tokens': {MAX_ANSWER_TOKENS + 1} is not in the range" in result.stderr


def test_the_longest_answer_asked_for_fits_the_reference_engine(engine_model: LlamaModel) -> None:
    """Every question with MAX_ANSWER_TOKENS is taken by the engines greedy_answers builds (the
    engine refuses a request its pool cannot hold when it is added, before any step)."""
    engine = Engine(engine_model, _KV_LIMIT_BYTES, max_num_seqs=len(QUESTIONS))
    params = SamplingParams(max_tokens=MAX_ANSWER_TOKENS, temperature=0.0)
    for index, question in enumerate(QUESTIONS):
        ids = engine_model.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        engine.add_request(str(index), ids, params)
    assert engine.has_unfinished_requests()


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize("command", [plan_kv_command, kv_quality_command], ids=lambda c: c.name)
@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_below_one_are_refused_before_the_model_loads(
    tmp_path: Path, command: click.Command, threads: str
) -> None:
    """--threads 0 and below were taken: the model loaded and minutes of measuring ran on
    whatever BLAS made of the count."""
    out = ["--out", str(tmp_path / "plan.json")] if command is plan_kv_command else []
    result = CliRunner().invoke(command, ["--threads", threads, *out])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert line == f"Error: Invalid value for '--threads': {threads} is not in the range x>=1."


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["--out", "-"], "--out: '-' is not a file name"),
        (["--out", ""], "--out: '.' is not a file name"),
        (["--out", "MISSING/plan.json"], "--out: MISSING is not a directory"),
        (["--out", "/dev/null"], "--out: /dev/null is not a regular file"),
        (["--cache", "MISSING/table.json"], "--cache: MISSING is not a directory"),
        (["--prompts", "3"], "--prompts: 3 leaves no held-out prompt"),
        (["--prompts", "3", "--no-verify", "--retention"], "--prompts: 3 leaves no held-out"),
        (
            ["--retention", "--retention-tokens", "16", "--queries", "16"],
            "--retention-tokens must be above --queries",
        ),
    ],
    ids=[
        "stdout", "empty", "no-dir", "device", "cache-no-dir", "no-held-out",
        "no-held-out-retention", "retention-tokens",
    ],
)  # fmt: skip
def test_plan_kv_refuses_what_it_would_find_out_only_after_measuring(
    tmp_path: Path, args: list[str], refusal: str
) -> None:
    """Each of these was found out minutes later: a traceback when the cache or the plan was
    written (a missing directory, '' as '.'), a file named '-', a rename over /dev/null, a
    retention split that scores more positions than its prompt holds, or -- silently -- a plan
    'checked on a held-out prompt' that was one of the prompts it was fitted on."""
    missing = str(tmp_path / "missing")
    args = [arg.replace("MISSING", missing) for arg in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "plan.json")]
    result = CliRunner().invoke(plan_kv_command, [*args, *out])
    assert result.exit_code == 2, result.output
    assert refusal.replace("MISSING", missing) in result.output
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize(
    ("command", "args", "refusal"),
    [
        (plan_kv_command, ["--tokens", "100000", "--queries", "1000"], "prompt 0 (cut to --tokens"),
        (  # the held-out prompt (417 tokens) is shorter than the one measured (453)
            plan_kv_command,
            ["--tokens", "440", "--queries", "420"],
            "--queries: 420 is not below the 417 tokens of prompt 1 (cut to --tokens 440)",
        ),
        (
            plan_kv_command,
            [
                *("--tokens", "440", "--queries", "420", "--no-verify"),
                *("--retention", "--retention-tokens", "430"),
            ],
            "--queries: 420 is not below the 417 tokens of prompt 1 (cut to --retention-tokens",
        ),
        (kv_quality_command, ["--tokens", "100000", "--queries", "1000"], "of prompt 0 (cut to"),
        (kv_quality_command, ["--long", "--tokens", "100"], "--tokens: 100 leaves no position"),
    ],
    ids=["plan-kv", "plan-kv-held-out", "plan-kv-retention", "kv-quality", "kv-quality-long"],
)
def test_queries_beyond_a_prompt_are_refused_before_measuring(
    engine_model: LlamaModel,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: Any,
    args: list[str],
    refusal: str,
) -> None:
    """``--queries`` below ``--tokens`` is not enough: a prompt shorter than ``--tokens`` has
    fewer positions than that to score.  The measurement raised ValueError (a traceback)."""
    monkeypatch.setattr(LlamaModel, "load", lambda *_, **__: engine_model)
    out = ["--out", str(tmp_path / "plan.json")] if command is plan_kv_command else []
    codecs = ["--codecs", "e8-2"] if out else ["--codec", "fp8"]
    result = CliRunner().invoke(command, [*args, *out, *codecs])
    assert result.exit_code == 2, result.output
    assert refusal in result.output, result.output
    assert not (tmp_path / "plan.json").exists()


def test_kv_quality_measures_a_codec_named_twice_once(
    engine_model: LlamaModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A codec repeated, or a uniform plan beside its codec, is one row (it was measured and
    reported once per mention, under one name)."""
    monkeypatch.setattr(LlamaModel, "load", lambda *_, **__: engine_model)
    plan = tmp_path / "fp8.json"
    KVPlan.uniform("fp8", 30).dump(plan)
    args = ["--codec", "fp8", "--codec", "fp8", "--plan", str(plan), "--questions", "0", *SMALL]
    document = _invoke(kv_quality_command, args)
    assert [row["codec"] for row in document["codecs"]] == ["fp8"]


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize(
    ("plan", "refusal"),
    [
        ({"layers": [{"k": "fp8", "v": "fp8"}] * 29}, "a KV plan of 29 layers for a 30-layer"),
        (
            {"layers": [{"k": "fp8", "v": "fp8"}] * 30, "heavy_tokens": 16},
            "heavy_tokens 16 is not below the engine's 16-token block",
        ),
        (
            {"layers": [{"k": "fp8", "v": "fp8"}] * 30, "window_tokens": 17},
            "window_tokens 17 is not a multiple of the engine's 16-token block",
        ),
    ],
    ids=["layers", "heavy", "window"],
)
def test_kv_quality_refuses_a_plan_the_engine_could_not_serve(
    tmp_path: Path, plan: dict[str, Any], refusal: str
) -> None:
    """The first two were a traceback from the measurement; the window was measured as if an
    engine could serve it."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    result = CliRunner().invoke(kv_quality_command, ["--plan", str(path), "--questions", "0"])
    assert result.exit_code == 2, result.output
    assert f"Error: --plan: {path}: {refusal}" in result.output
