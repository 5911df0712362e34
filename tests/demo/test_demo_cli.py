"""``understudy demo``'s flags and work folder: what is refused is refused before anything
starts (seven engines, minutes of both cores), in one line, not with a traceback."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

import demo._run
from demo import DemoSpec
from demo.processes import Interrupted
from gateway.cli import main


def _never_started(spec: DemoSpec) -> None:
    raise AssertionError(f"the demo started with {spec}")


@pytest.mark.parametrize("flag", ["--minutes", "--rate"])
@pytest.mark.parametrize("value", ["nan", "-nan", "NaN"])
def test_a_number_that_is_not_one_is_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, flag: str, value: str) -> None:
    # NaN compares false with both of click's bounds: it passed the range check, started
    # the engines and failed minutes later in the workload's spec, with a traceback.
    monkeypatch.setattr(demo._run, "run_demo", _never_started)
    result = CliRunner().invoke(main, ["demo", flag, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output
    assert "not a number" in result.output


def test_a_work_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    # Made before any engine starts; a NotADirectoryError (or PermissionError) escaped as a
    # traceback.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(main, ["demo", "--workdir", str(blocker / "demo")])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert f"Error: cannot use the work folder {blocker / 'demo'}" in result.output


def _stopped_inside_wrapping_code(spec: DemoSpec) -> None:
    try:
        signal.raise_signal(signal.SIGTERM)
    except Interrupted as exc:  # as pydantic-core wraps an exception raised inside it
        raise ValueError("Error building `literal` serializer") from exc


def test_a_stop_signal_that_surfaces_wrapped_still_stops_with_its_status(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM landing in the openai client's lazy import surfaced as pydantic-core's
    SchemaError: the demo exited 1 with a traceback, not 143 (a CI run of
    test_demo_signals). Whatever carries it up, a received stop signal is the exit status."""
    monkeypatch.setattr(demo._run, "run_demo", _stopped_inside_wrapping_code)
    result = CliRunner().invoke(main, ["demo", "--sessions", "1"])
    assert result.exit_code == 128 + signal.SIGTERM.value, result.output
    assert "Stopped by SIGTERM" in result.output
