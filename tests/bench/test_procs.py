"""``bench/_procs.py`` rule 3: a child is on its starter's exit stack from the moment it runs,
so a start that fails (not ready in time) or is stopped by a signal leaves nothing running.

Each start function spawns, through its own path, a child that never answers (a sleeping
Python) in place of its server. Before, a stop signal that landed as the child was spawned
(``Interrupted`` raised as ``spawn`` returned) lost it: the start function never returned it,
so its caller never registered its stop, and it ran on. The load generators and workers the
benchmarks start with a bare ``Popen`` had the same gap, and ``run_loadgens`` stopped none of
its load generators when interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from demo import processes
from demo.processes import Interrupted, Process, interrupted_by_signals

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # as bench scripts do
import _procs

pytestmark = pytest.mark.timeout(60)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
NOWHERE = "http://127.0.0.1:9"  # never asked: the children here only sleep
READY_TIMEOUT_S = 0.5

Start = Callable[[ExitStack, Path], object]
STARTS: dict[str, Start] = {
    "sim": lambda stack, d: _procs.start_sim(stack, d, d, ttft_ms=1, itl_ms=1, tokens=1),
    "gateway": lambda stack, d: _procs.start_gateway(stack, d, d, NOWHERE),
    "bare relay": lambda stack, d: _procs.start_bare_relay(stack, d, NOWHERE),
    "nginx": lambda stack, d: _procs.start_nginx(stack, d, "nginx", NOWHERE),
    "engine": lambda stack, d: _procs.start_engine(stack, d, d),
}


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Any:
    """What ``_procs.spawn`` starts: a sleeper in place of the server, kept here to check;
    any left running is killed after the test."""
    children: list[Process] = []

    def sleeper(name: str, argv: list[str], log_dir: Path, **options: Any) -> Process:
        children.append(processes.spawn(name, SLEEPER, log_dir, **options))
        return children[-1]

    monkeypatch.setattr(_procs, "start_process", sleeper)
    yield children
    for child in children:
        if child.alive():
            child.proc.kill()
            child.proc.wait()


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_a_child_never_ready_is_stopped(
    start: Start, spawned: list[Process], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_procs, "READY_TIMEOUT_S", READY_TIMEOUT_S)
    monkeypatch.setattr(_procs, "ENGINE_READY_TIMEOUT_S", READY_TIMEOUT_S)
    with pytest.raises(RuntimeError), ExitStack() as stack:
        start(stack, tmp_path)
    assert len(spawned) == 1
    assert not spawned[0].alive(), "the child that never answered was left running"


def test_a_failed_start_stops_the_children_started_before_it(
    spawned: list[Process], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/soak.py listed its three simulators for stopping once all three ran: the third
    not ready in time left the first two running. On one stack, all are stopped."""
    waits: list[str] = []

    def first_ready(children: list[Process], timeout_s: float, **options: Any) -> None:
        waits.append(children[0].name)
        if len(waits) > 1:
            raise RuntimeError(f"not ready within {timeout_s:.0f} s")

    monkeypatch.setattr(_procs, "wait_healthy", first_ready)
    with pytest.raises(RuntimeError), ExitStack() as stack:
        _procs.start_bare_relay(stack, tmp_path, NOWHERE)
        assert spawned[0].alive()
        _procs.start_gateway(stack, tmp_path, tmp_path, NOWHERE)
    assert waits == ["aiohttp", "gateway"]
    assert [child.alive() for child in spawned] == [False, False]


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_a_stop_signal_as_a_child_is_spawned_stops_it(
    start: Start, spawned: list[Process], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def then_signalled(name: str, argv: list[str], log_dir: Path, **options: Any) -> Process:
        spawned.append(processes.spawn(name, SLEEPER, log_dir, **options))
        os.kill(os.getpid(), signal.SIGTERM)  # a stop, as the fork is done
        return spawned[-1]

    monkeypatch.setattr(_procs, "start_process", then_signalled)
    received: list[signal.Signals] = []
    with pytest.raises(Interrupted), interrupted_by_signals(received.append), \
            ExitStack() as stack:
        start(stack, tmp_path)
        pytest.fail("the start went on despite the stop")
    assert received == [signal.SIGTERM]
    assert len(spawned) == 1
    assert not spawned[0].alive(), "the child spawned as the signal came was left running"


def _popen(stack: ExitStack, tmp_path: Path) -> None:
    _procs.popen(stack, SLEEPER, stdout=subprocess.PIPE)


def _loadgen(stack: ExitStack, tmp_path: Path) -> None:
    _procs.LoadGen(stack, tmp_path)


def _loadgens(stack: ExitStack, tmp_path: Path) -> None:
    _procs.run_loadgens(_procs.LOADGEN_SCRIPT, [{"deadline_s": 1.0}])


BARE_STARTS: dict[str, Start] = {"popen": _popen, "LoadGen": _loadgen,
                                 "run_loadgens": _loadgens}


@pytest.mark.parametrize("start", BARE_STARTS.values(), ids=BARE_STARTS.keys())
def test_a_stop_signal_as_a_bare_child_is_started_stops_it(
    start: Start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[Any]] = []
    real_popen = subprocess.Popen

    def then_signalled(argv: list[str], **options: Any) -> subprocess.Popen[Any]:
        started.append(real_popen(SLEEPER, **options))
        os.kill(os.getpid(), signal.SIGTERM)  # a stop, as the fork is done
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", then_signalled)
    try:
        with pytest.raises(Interrupted), interrupted_by_signals(lambda _: None), \
                ExitStack() as stack:
            start(stack, tmp_path)
            pytest.fail("the start went on despite the stop")
    finally:
        left = [proc for proc in started if proc.poll() is None]
        for proc in left:
            proc.kill()
            proc.wait()
    assert len(started) == 1
    assert left == [], "the child started as the signal came was left running"


def _wrapped_up(stack: ExitStack) -> int:
    """A SIGTERM inside C code that wraps what is raised there, as pydantic-core wrapped
    ``Interrupted`` in a SchemaError in the openai client's lazy import."""
    try:
        signal.raise_signal(signal.SIGTERM)
    except Interrupted as exc:
        raise ValueError("Error building `literal` serializer") from exc
    return 0


def _wrapped_and_caught(stack: ExitStack) -> int:
    """The same, the wrapper caught by the benchmark (bench/multiturn.py takes a ValueError
    from a turn as that turn's error) and a failure status returned."""
    try:
        _wrapped_up(stack)
    except ValueError:
        return 1
    return 0


WRAPPED: dict[str, Callable[[ExitStack], int]] = {"raised": _wrapped_up,
                                                  "caught": _wrapped_and_caught}


@pytest.mark.parametrize("stopped", WRAPPED.values(), ids=WRAPPED.keys())
def test_a_stop_signal_that_surfaces_wrapped_still_stops_with_its_status(
    stopped: Callable[[ExitStack], int], capsys: pytest.CaptureFixture[str]
) -> None:
    """``run_main`` caught only KeyboardInterrupt: a stop signal that came up as another
    exception ended the benchmark with 1 and a traceback, not 143 (the demo's CI failure,
    4a72094). Whatever carries it up, a received stop signal is the exit status, and the
    benchmark's children are stopped."""
    started: list[subprocess.Popen[Any]] = []

    def main() -> int:
        with ExitStack() as stack:
            started.append(_procs.popen(stack, SLEEPER))
            return stopped(stack)

    try:
        with pytest.raises(SystemExit) as exited:
            sys.exit(_procs.run_main(main))  # as every benchmark ends
    finally:
        left = [proc for proc in started if proc.poll() is None]
        for proc in left:
            proc.kill()
            proc.wait()
    assert exited.value.code == 128 + signal.SIGTERM.value
    assert "Stopped by SIGTERM" in capsys.readouterr().err
    assert len(started) == 1
    assert left == [], "the benchmark's child was left running"
