"""Each deployment under test on its own fixed slice of the machine's CPU.

Why: in production every backend has its own accelerator; here five deployments share two
cores. Shared, a candidate that answers sooner (bidir-kv reuses its KV, so its prefill is
short) decodes while the recompute baselines are still prefilling and pays for their CPU,
and the baselines decode after the candidates are done, alone: the candidate's inter-token
latency and output rate come out worse than the baseline's for a reason that is the
machine's, not the candidate's (measured: bidir-kv decodes as fast as the baseline when
each runs alone, and at 0.47-0.63x its rate beside it). A fixed quota per deployment makes
each one's speed independent of what the others are doing, as separate hardware would.

Rules:
1. Every deployment gets the same CPU quota: ``ENGINE_CPU_SHARE`` of the usable cores,
   divided by the number of deployments, in its own cgroup (every engine process of a
   disaggregated deployment in the same one). The rest is left to the gateway (scoring)
   and the load generator.
2. The quota is applied once the engines are ready (loading is not throttled), over a
   short period (``QUOTA_PERIOD_US``) so a decode step is not held up a whole period.
3. cgroup v2 (``cpu.max``) where its cpu controller is enabled for child groups, else
   cgroup v1's cpu controller (``cpu.cfs_quota_us``). Where neither can be written (not
   root, no delegation) the deployments share the CPU and ``CpuSlices.how`` says so: the
   scorecard prints it beside the latencies.
4. The groups are removed when the context exits: a process still in one is moved back
   to the parent group first. Empty groups left by a demo that was killed are removed
   when the next one starts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = ["ENGINE_CPU_SHARE", "CpuSlices", "cpu_slices", "usable_cores"]

ENGINE_CPU_SHARE: Final = 0.8
"""Rule 1: the part of the cores the deployments under test share between them."""
QUOTA_PERIOD_US: Final = 20_000
"""Rule 2: the quota's period; a decode step takes ~70 ms of one core."""
CGROUP_V2_ROOT: Final = Path("/sys/fs/cgroup")
CGROUP_V1_CPU: Final = Path("/sys/fs/cgroup/cpu")
GROUP_PREFIX: Final = "understudy-demo"


@dataclass
class CpuSlices:
    """What rule 3 found: the cores each deployment got, or why the CPU is shared."""

    cores_each: float | None = None
    how: str = "shared CPU"
    groups: list[Path] = field(default_factory=list)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def _controller() -> tuple[Path, bool] | None:
    """Rule 3: the folder to create groups in and whether it is cgroup v2."""
    enabled = CGROUP_V2_ROOT / "cgroup.subtree_control"  # children get cpu.max
    with contextlib.suppress(OSError):
        if "cpu" in enabled.read_text().split() and os.access(CGROUP_V2_ROOT, os.W_OK):
            return CGROUP_V2_ROOT, True
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists() and os.access(CGROUP_V1_CPU, os.W_OK):
        return CGROUP_V1_CPU, False
    return None


def _limit(group: Path, v2: bool, cores: float) -> None:
    quota = max(1000, round(cores * QUOTA_PERIOD_US))
    if v2:
        (group / "cpu.max").write_text(f"{quota} {QUOTA_PERIOD_US}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(QUOTA_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))


@contextlib.contextmanager
def cpu_slices(pids_by_deployment: Mapping[str, Sequence[int]]) -> Iterator[CpuSlices]:
    """Rules 1-4 for the given deployments' engine processes."""
    slices = CpuSlices()
    found = _controller()
    if found is None:
        slices.how = "shared CPU (no writable cgroup cpu controller)"
    else:
        parent, v2 = found
        _remove_stale(parent)
        cores = ENGINE_CPU_SHARE * usable_cores() / max(len(pids_by_deployment), 1)
        try:
            for name, pids in pids_by_deployment.items():
                group = parent / f"{GROUP_PREFIX}-{os.getpid()}-{name}"
                group.mkdir()
                slices.groups.append(group)
                _limit(group, v2, cores)
                for pid in pids:
                    (group / "cgroup.procs").write_text(str(pid))
            slices.cores_each = cores
            slices.how = (f"{cores:.2f} core per deployment (cgroup "
                          f"{'v2 cpu.max' if v2 else 'v1 cpu quota'})")
        except OSError as exc:
            _release(slices.groups, parent)
            slices.groups.clear()
            slices.how = f"shared CPU (cgroup: {exc})"
    try:
        yield slices
    finally:
        if found is not None:
            _release(slices.groups, found[0])


def _release(groups: Sequence[Path], parent: Path) -> None:
    """Rule 4: processes still in a group go back to the parent, then it is removed."""
    for group in groups:
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (parent / "cgroup.procs").write_text(pid)
            group.rmdir()


def _remove_stale(parent: Path) -> None:
    """Rule 4: the empty groups of demos whose process is gone."""
    for group in parent.glob(f"{GROUP_PREFIX}-*"):
        owner = group.name.removeprefix(f"{GROUP_PREFIX}-").split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            with contextlib.suppress(OSError):
                group.rmdir()  # refused while a process is still in it
