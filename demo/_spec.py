"""How big ``understudy demo`` is: apart from ``demo._run`` so that the command's options
(whose defaults are these) are read without importing the gateway, the store and the
workload (``understudy demo --help``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DemoSpec"]


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """How big the demo is: ``sessions`` x ``turns`` is its size (27 exchanges per
    candidate, ``min_samples`` 20 of them needed for a verdict); ``minutes`` only bounds
    the workload on a machine too busy to finish it (no session starts after it)."""

    sessions: int = 9
    turns: int = 3
    minutes: float = 10.0
    rate: float = 0.5
    think_s: float = 1.0
    concurrency: int = 4
    max_tokens: int = 16
    min_samples: int = 20
    primary_vllm: bool = False
    promote: bool = True
    workdir: Path | None = None
