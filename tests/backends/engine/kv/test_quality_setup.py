"""Issue 14's own quality setup (``_quality.ISSUE_SETUP``): its texts, and the measurement
through ``measure_setup``, ``kv-quality --long`` and ``bench/kvquant.py --setup issue``, each
on a cut-down setting (the full one takes minutes: ``bench/kvquant.py --setup issue``)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from backends.engine import LlamaModel, kv_quality_command
from backends.engine.kv.codecs._quality import ISSUE_SETUP, measure_quality, measure_setup
from backends.engine.kv.codecs._texts import CALIBRATION_TEXTS, LONG_PROMPTS, PROMPTS
from backends.engine.serving._kv_cli import _LONG_CODECS, _measured

REPO_ROOT = Path(__file__).resolve().parents[4]
SHINGLE_WORDS = 6


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z']+", text.lower())
    return {tuple(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)}


def test_long_prompts_are_long_and_held_out(engine_model: LlamaModel) -> None:
    assert ISSUE_SETUP.prompts == LONG_PROMPTS and len(LONG_PROMPTS) == 3
    for text in LONG_PROMPTS:
        assert len(engine_model.tokenizer.encode(text)) >= ISSUE_SETUP.tokens + 50
    seen = set().union(*(_shingles(t) for t in (*CALIBRATION_TEXTS, *PROMPTS)))
    for text in LONG_PROMPTS:  # no six-word run in common with what calibrates or is scored
        assert not _shingles(text) & seen
    first, second, third = (_shingles(t) for t in LONG_PROMPTS)
    assert not (first & second or first & third or second & third)


def test_measure_setup_keeps_the_unscored_head_when_cut(engine_model: LlamaModel) -> None:
    assert ISSUE_SETUP.tokens - ISSUE_SETUP.queries == 128 and ISSUE_SETUP.semantics == "step"
    configs = (("fp32", 0), ("kivi-2", 0))
    report = measure_setup(engine_model, configs=configs, max_prompts=1, max_tokens=192)
    assert report.prompt_tokens == (192,) and report.queries == 64
    assert report.semantics == "step"
    fp32, kivi = report.results
    assert fp32.kl_nats < 1e-9 and fp32.top1 == 1.0 and fp32.positions == 64
    assert 0.0 < kivi.attention_error < 1.0
    # step: no error carried from one position to the next, so less loss than write's
    write = measure_quality(
        engine_model,
        configs=configs[1:],
        prompts=LONG_PROMPTS[:1],
        max_tokens=192,
        queries=64,
        semantics="write",
    )
    (kivi_write,) = write.results
    assert kivi_write.attention_error == pytest.approx(kivi.attention_error)  # rule 4: the same
    assert kivi.kl_nats < 0.8 * kivi_write.kl_nats


def test_kv_quality_long_measures_the_setups_configs() -> None:
    assert [_measured(name) for name in _LONG_CODECS] == list(ISSUE_SETUP.configs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kv_quality_long_takes_the_setup_and_its_cuts() -> None:
    args = ["--long", "--prompts", "1", "--tokens", "140", "--codec", "e8-2w"]
    result = CliRunner().invoke(
        kv_quality_command, [*args, "--questions", "0", "--json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    setup = document["setup"]
    assert setup["setup"] == "issue" and setup["prompt_tokens"] == [140]
    assert setup["queries"] == 12 and setup["context"] == 140
    assert setup["semantics"] == "step" and setup["encode_tokens"] == 32  # not kv-quality's 16
    (row,) = document["codecs"]
    assert row["codec"] == "e8-2w" and row["window_tokens"] == 128


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_setup_issue_reports_beside_the_issue_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("kvquant", REPO_ROOT / "bench" / "kvquant.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kvquant", bench)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "RESULTS_PATH", tmp_path / "kvquant.json")
    argv = ["--setup", "issue", "--prompts", "1", "--tokens", "136", "--codec", "kivi-2"]
    assert bench.main([*argv, "--codec", "e8-2"]) == 0
    result = json.loads((tmp_path / "kvquant-issue.json").read_text())
    assert result["setup"]["name"] == "issue" and result["setup"]["context"] == 136
    assert [row["codec"] for row in result["codecs"]] == ["kivi-2", "kivi-2 +w128", "e8-2"]
    assert result["setup"]["queries"] == 8 and result["codecs"][0]["positions"] == 8
    assert result["issue_figures"]["kivi-2"] == ["0.46-0.50", "77-81%"]
    assert {check["what"] for check in result["targets"]} >= {"e8-2 top-1 >= 82%"}
    assert "beside the figures issue 14 quotes" in capsys.readouterr().out
