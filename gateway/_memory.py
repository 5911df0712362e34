"""How the gateway gives memory back to the system (glibc's allocator; elsewhere, nothing).

A judgement (``Scorekeeper.judge``, in a worker thread) allocates tens of MiB of numpy
buffers for a moment: the soak saw the gateway's RSS jump by ~70 MiB during one and fall
back after. Two of glibc's defaults would keep part of that for good:

1. Its mmap threshold rises to the largest buffer freed so far, after which large buffers
   are carved from the heap and stay there. ``return_large_buffers`` (at ``serve``) fixes
   it at ``MMAP_THRESHOLD_BYTES``: the soak's RSS grew 24.7 MiB/min before, 2.8 after.
2. The small pieces a worker thread frees stay in that thread's arena, whose pages are
   returned only from its top. ``trim_heaps`` (after each judgement, in its thread) hands
   every arena's free pages back (``malloc_trim``): a soak of 10 minutes with a promotion
   and a rollback each minute grew 12 MiB without it, within its 8 MiB noise bound with it.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Final

__all__ = ["MMAP_THRESHOLD_BYTES", "return_large_buffers", "trim_heaps"]

M_MMAP_THRESHOLD: Final = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES: Final = 128 * 1024
"""Buffers at least this large are mapped on their own and unmapped when freed."""


def return_large_buffers() -> None:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD_BYTES`` (rule 1)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def trim_heaps() -> None:
    """Give every arena's free pages back to the system (rule 2): a few ms; call it after
    a burst of allocations, never on the relay's path."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
