"""Which build of ``_e8core.c`` the E8 codec runs (issue 14).

setup.py builds the file twice on x86-64: ``_e8core`` for x86-64-v2 (numpy's own baseline:
every machine numpy runs on), its lattice rounding in 2 lanes of SSE registers, and
``_e8core_avx2`` for x86-64-v3, in 4 lanes of AVX2 registers (and the key transform in 8-float
vectors): ~15-25 % less time a block on the same machine.  ``e8core`` is the second where the
CPU runs it (``_e8core.RUNS_AVX2``, asked of the CPU by the C), else the first.  Both give the
same codes bit for bit (``_e8core.c`` rule 1: no operation mixes lanes, fuses or reassociates),
so a node with one build and a node with the other exchange blocks as equals; the tests hold
the two builds to the same codes, flags, scales and rows (``BUILDS``: every build this machine
can run, baseline first).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from . import _e8core as _baseline

__all__ = ["BUILDS", "e8core"]


def _builds() -> tuple[ModuleType, ...]:
    if not _baseline.RUNS_AVX2:
        return (_baseline,)
    from . import _e8core_avx2  # built on every x86-64 (setup.py), where RUNS_AVX2 can hold

    return (_baseline, _e8core_avx2)


BUILDS = _builds()
"""Every build of ``_e8core.c`` this machine runs, the baseline first."""

if TYPE_CHECKING:  # one interface, ``_e8core.pyi``, for both builds
    from . import _e8core as e8core
else:
    e8core = BUILDS[-1]
