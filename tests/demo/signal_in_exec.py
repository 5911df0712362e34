"""``python -m tests.demo.signal_in_exec``: a SIGTERM that lands inside a string ``exec``, as
one did inside ``dataclass`` during a lazy import of the demo's HTTP client; exits 128 + the
signal's number, as ``understudy demo`` does once its processes are stopped."""

from __future__ import annotations

import signal
import sys

from demo.processes import interrupted_by_signals

received: list[signal.Signals] = []
try:
    with interrupted_by_signals(received.append):
        exec("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nfor _ in range(10**8): pass")
except KeyboardInterrupt:
    sys.exit(128 + received[0].value)
