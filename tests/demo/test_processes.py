"""``demo.processes`` rule 5: a stop signal that lands while a child is started never leaves
that child running."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from demo import _deployments
from demo._deployments import DeploymentSpec, deployments
from demo.processes import (
    Interrupted,
    Process,
    interrupted_by_signals,
    signals_deferred,
    spawn,
)


def test_a_signal_inside_signals_deferred_is_raised_when_the_block_is_left() -> None:
    received: list[signal.Signals] = []
    steps: list[str] = []
    with pytest.raises(Interrupted), interrupted_by_signals(received.append):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            steps.append("inside, after the signal")
        steps.append("after the block")
    assert steps == ["inside, after the signal"]
    assert received == [signal.SIGHUP]


def test_a_stop_signal_as_an_engine_is_spawned_stops_that_engine_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole run's demo, sent SIGTERM once its seven engines ran, left the last one
    running: the signal raised Interrupted after that engine's fork, before it was on its
    deployment's list, so nothing stopped it. Here the signal lands as spawn returns."""
    spawned: list[Process] = []

    def spawn_then_signalled(workdir: Path, name: str, args: Sequence[str]) -> Process:
        process = spawn(name, [sys.executable, "-c", "import time; time.sleep(120)"], workdir)
        spawned.append(process)
        os.kill(os.getpid(), signal.SIGTERM)  # a stop, as the fork is done
        return process

    monkeypatch.setattr(_deployments, "_spawn", spawn_then_signalled)
    received: list[signal.Signals] = []
    try:
        with pytest.raises(Interrupted), interrupted_by_signals(received.append), \
                deployments(tmp_path, [DeploymentSpec("d", "unified")]):
            pytest.fail("the deployment started despite the stop")
    finally:
        left = [process for process in spawned if process.alive()]
        for process in left:
            process.proc.kill()
            process.proc.wait()
    assert received == [signal.SIGTERM]
    assert len(spawned) == 1 and left == [], "the engine was left running"
