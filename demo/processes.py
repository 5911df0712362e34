"""Child processes on loopback: what the demo and the benchmarks (``bench/_procs.py``) start.

Rules:
1. Every child logs stdout and stderr to a file of its own, reads nothing (stdin closed),
   and is stopped by its own pid: SIGTERM, then SIGKILL past a grace (``STOP_GRACE_S``);
   several are stopped together (``stop_all``: all signalled first, then one grace for all).
2. A child is ready when its ``/health`` answers 200; waiting for several polls all of
   them, and a child that exits first fails the wait with the tail of its log.
3. understudy's own servers run as ``python -m gateway.cli`` (``understudy_argv``), which
   puts the child's working directory first on ``sys.path``: a benchmark starts them in a
   snapshot of the code, so edits made during a run do not reach them.
4. Whoever starts children stops them when it is stopped: inside ``interrupted_by_signals``
   SIGINT, SIGTERM (``timeout``, a supervisor) and SIGHUP (a closed terminal) raise
   ``Interrupted``, a KeyboardInterrupt, where the program is, so its ``finally`` blocks and
   exit stacks stop the children as on Ctrl-C; later signals are ignored until the block is
   left, so that unwinding runs whole (it is bounded: ``stop_all``'s grace). Without it
   SIGTERM and SIGHUP ended the program at once and left every child running.
5. A child is put where its stopper finds it (a list ``stop_all`` is given, a ``finally``
   that stops it) inside ``signals_deferred``, its ``spawn`` included: a stop signal that
   arrives meanwhile raises ``Interrupted`` when the block is left, with the child in
   place. Raised between the fork and that (inside ``Popen``, or as ``spawn`` returned), it
   left a running child that no one stopped.
6. A program that starts children runs inside ``ended_by_signals``: a stop signal it
   received is its exit status (128 + the signal's number), whatever exception carries it
   up, or none. ``Interrupted`` is raised where the program is, and C code there may wrap
   it: in CI a SIGTERM landed in the openai client's lazy import, where pydantic-core made
   it a SchemaError, and the demo exited 1 with a traceback instead of 143. Unwinding
   through the wrapper still ran every ``finally``, so the children were stopped.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NoReturn

__all__ = [
    "STOP_SIGNALS",
    "THREAD_ENV",
    "Interrupted",
    "Process",
    "ended_by_signals",
    "free_port",
    "interrupted_by_signals",
    "signals_deferred",
    "spawn",
    "stop_all",
    "understudy_argv",
    "wait_healthy",
]

THREAD_ENV: Final = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                     "MKL_NUM_THREADS": "1"}
"""One BLAS and one OpenMP thread: engines sharing a few cores collapse when numpy's BLAS
threads spin-wait on each other."""
STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a program that started children (rule 4)."""
STOP_GRACE_S: Final = 10.0
HEALTH_POLL_S: Final = 0.25
LOG_TAIL_LINES: Final = 30


class Interrupted(KeyboardInterrupt):
    """What a stop signal raises (rule 4). A KeyboardInterrupt, so that all that unwinds on
    Ctrl-C (asyncio re-raises it out of a task) unwinds on it; a class of its own because
    CPython 3.11 remembers a bare KeyboardInterrupt that ends a string ``exec`` (``dataclass``
    runs one, in an import a lazy module starts mid-request) as unhandled even once caught,
    and under ``python -m`` turns the exit status the program then gives into a death by
    SIGINT (the flag is set for that exact type only)."""


def free_port() -> int:
    """A loopback port the OS picked free."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def understudy_argv(command: str, *args: str) -> list[str]:
    """``understudy COMMAND ARGS`` as a child runs it (rule 3), logging warnings and up."""
    return [sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", command, *args]


@dataclass
class Process:
    """One started child: its name, its Popen, where it logs, the URL it serves (if any),
    and the pids of workers it forked whose CPU counts as its own (nginx's, say)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    extra_pids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_pids(self) -> list[int]:
        return [self.pid, *self.extra_pids]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Rule 1."""
        stop_all([self], grace_s)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stop_all(processes: Sequence[Process], grace_s: float = STOP_GRACE_S) -> None:
    """Rule 1 for several at once: SIGTERM to every one still running, then one grace for
    all of them, then SIGKILL to those left (each waited for)."""
    running = [p for p in processes if p.proc.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            process.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            process.proc.kill()
            process.proc.wait(grace_s)


def spawn(name: str, argv: Sequence[str], log_dir: Path, *, cwd: Path | None = None,
          env: Mapping[str, str] | None = None, url: str = "") -> Process:
    """Start ``argv`` in ``cwd`` (None: this process's) with ``env`` (None: this process's),
    logging to ``log_dir/NAME.log`` (rule 1)."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Process(name, proc, log, url)


def wait_healthy(processes: Sequence[Process], timeout_s: float, *,
                 poll_s: float = HEALTH_POLL_S) -> None:
    """Wait until every one of ``processes`` answers ``URL/health`` (rule 2)."""
    if nameless := [p.name for p in processes if not p.url]:
        raise ValueError(f"no URL to ask for health: {', '.join(nameless)}")
    deadline = time.monotonic() + timeout_s
    waiting = list(processes)
    while waiting and time.monotonic() < deadline:
        for process in list(waiting):
            if not process.alive():
                raise RuntimeError(f"{process.name} exited ({process.proc.returncode}) "
                                   f"while starting:\n{process.log_tail()}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(process.url + "/health", timeout=1.0) as answer:
                if answer.status == 200:
                    waiting.remove(process)
        if waiting:
            time.sleep(poll_s)
    if waiting:
        raise RuntimeError(f"not ready within {timeout_s:.0f} s: "
                           + ", ".join(p.name for p in waiting))


@contextlib.contextmanager
def interrupted_by_signals(note: Callable[[signal.Signals], None]) -> Iterator[None]:
    """Rule 4: the first of ``STOP_SIGNALS`` raises ``Interrupted`` where the program is
    (``note`` is told which); the rest are ignored until the block is left. Off the main
    thread (a test's runner) signals are not ours to take: nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        note(signal.Signals(signum))
        raise Interrupted

    with _stop_signals_to(interrupt):
        yield


@contextlib.contextmanager
def ended_by_signals(program: str) -> Iterator[None]:
    """Rule 6: the block runs inside ``interrupted_by_signals``; if a stop signal was received
    it ends with ``SystemExit(128 + its number)``, after one line on stderr that says so
    (``program``: who started the processes, "the demo"), whether the block raised (any
    exception: the signal's ``Interrupted`` or what wrapped it) or returned. A
    ``KeyboardInterrupt`` without a signal received (Ctrl-C off the main thread) is a SIGINT.
    Anything else the block raises goes up unchanged."""
    received: list[signal.Signals] = []
    try:
        with interrupted_by_signals(received.append):
            yield
    except BaseException as exc:
        if not received and not isinstance(exc, KeyboardInterrupt):
            raise
        _exit_stopped_by(received[0] if received else signal.SIGINT, program)
    if received:
        _exit_stopped_by(received[0], program)


def _exit_stopped_by(stop: signal.Signals, program: str) -> NoReturn:
    print(f"Stopped by {stop.name}: every process {program} started is stopped.",
          file=sys.stderr)
    raise SystemExit(128 + stop.value) from None


@contextlib.contextmanager
def _stop_signals_to(handler: Callable[[int, object], None],
                     ) -> Iterator[dict[signal.Signals, Any]]:
    """Every stop signal handled by ``handler`` inside the block, the handlers before it
    (which the block is given) put back when it is left."""
    previous = {each: signal.signal(each, handler) for each in STOP_SIGNALS}
    try:
        yield previous
    finally:
        for each, before in previous.items():
            signal.signal(each, before)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Rule 5: a stop signal received inside the block is handled when the block is left,
    by the handler there was before it (``interrupted_by_signals``': ``Interrupted``),
    the first one received only. Off the main thread, nothing is deferred."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def defer(signum: int, frame: object) -> None:
        received.append(signum)

    try:
        with _stop_signals_to(defer) as previous:
            yield
    finally:
        if received:
            handler = previous[signal.Signals(received[0])]
            if callable(handler):
                handler(received[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(received[0])
