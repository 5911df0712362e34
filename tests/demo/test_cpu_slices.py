"""Each deployment on its own CPU slice: the quota is the kernel's and it bites; without a
writable cgroup controller the demo says the CPU is shared."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from demo import _cpu_slices
from demo._cpu_slices import ENGINE_CPU_SHARE, cpu_slices, usable_cores

BUSY = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def _controller_or_fail() -> None:
    # Loudly, not a skip: without slices the demo's latency verdicts are the machine's
    # (README, the demo), so a machine that runs this suite must give the demo its slices.
    if _cpu_slices._controller() is None:
        pytest.fail("no writable cgroup cpu controller here: the demo would share the CPU "
                    "and its latency verdicts would be the machine's (run as root, or "
                    "delegate a cgroup v2 subtree with the cpu controller)")


def test_a_busy_process_is_held_to_its_slice_and_released() -> None:
    _controller_or_fail()
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        names = ["a", "b", "c", "d", "e"]
        with cpu_slices({"a": [busy.pid], **{n: [] for n in names[1:]}}) as slices:
            assert slices.cores_each == pytest.approx(ENGINE_CPU_SHARE * usable_cores() / 5)
            assert "core per deployment" in slices.how
            group = next(g for g in slices.groups if g.name.endswith("-a"))
            assert str(busy.pid) in (group / "cgroup.procs").read_text().split()
            time.sleep(1.0)  # a busy loop beyond its quota is throttled by the kernel
            stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
            assert int(stat["nr_throttled"]) > 0, stat
            groups = list(slices.groups)
        assert not any(g.exists() for g in groups)  # removed, the process moved back
        assert busy.poll() is None
    finally:
        busy.kill()
        busy.wait()


def test_without_a_writable_controller_the_cpu_is_shared(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_slices, "CGROUP_V2_ROOT", tmp_path / "v2")
    monkeypatch.setattr(_cpu_slices, "CGROUP_V1_CPU", tmp_path / "v1")
    with cpu_slices({"primary": [1]}) as slices:
        assert slices.cores_each is None and slices.groups == []
        assert slices.how.startswith("shared CPU")


def test_the_empty_groups_of_a_killed_demo_are_removed_by_the_next() -> None:
    _controller_or_fail()
    found = _cpu_slices._controller()
    assert found is not None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = found[0] / f"{_cpu_slices.GROUP_PREFIX}-{gone.pid}-primary"
    stale.mkdir()
    try:
        with cpu_slices({}):
            assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()
