"""A benchmark stopped by a signal stops every process it started (``bench/_procs.py`` rule 2).

``bench/proxy.py --quick`` (the simulator, the gateway, the bare relay, nginx and the load
generators) gets SIGTERM once it runs three children: before, a SIGTERM (``timeout``, a CI
job's end) ended the benchmark at once and left them running, where they then skewed the next
benchmark on the machine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.utils import kill_left_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO_ROOT = Path(__file__).resolve().parents[2]
CHILDREN = 3
SPAWN_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0


def test_sigterm_stops_a_benchmark_and_every_process_it_started() -> None:
    argv = [sys.executable, str(REPO_ROOT / "bench" / "proxy.py"), "--quick"]
    with subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True) as proc:
        bench = psutil.Process(proc.pid)
        started: list[psutil.Process] = []
        try:
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            while len(started := bench.children(recursive=True)) < CHILDREN:
                assert proc.poll() is None, "the benchmark exited before its children ran"
                assert time.monotonic() < deadline, "the benchmark started no children"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=EXIT_TIMEOUT_S)
        finally:
            running = kill_left_running(proc, started)
    assert running == [], "left running after SIGTERM"
    assert proc.returncode == 128 + signal.SIGTERM.value, err
    assert "Stopped by SIGTERM" in err, err
