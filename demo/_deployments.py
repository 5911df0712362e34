"""The demo's backends: reference-engine processes on loopback, started together.

Rules:
1. Every engine is ``understudy engine`` on 127.0.0.1 at a port the OS picked free, with
   one BLAS and one OpenMP thread (``THREAD_ENV``): seven engines share two cores, and
   numpy's BLAS threads spin-waiting on each other collapse throughput.
2. All start at once; each must answer ``/health`` within ``ENGINE_READY_TIMEOUT_S``, and
   one that exits first fails the start with the tail of its log (``wait_healthy``).
3. Every process is stopped by its own pid: SIGTERM to all, then SIGKILL past one grace.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from demo.processes import (
    THREAD_ENV,
    Process,
    free_port,
    signals_deferred,
    spawn,
    stop_all,
    understudy_argv,
    wait_healthy,
)

__all__ = [
    "ENGINE_READY_TIMEOUT_S",
    "Deployment",
    "DeploymentSpec",
    "deployments",
]

ENGINE_READY_TIMEOUT_S: Final = 300.0
"""Loading dequantizes the GGUF and probes the BLAS kernels: ~20 s alone, more when
seven engines load at once on two cores."""


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """One system under test: a unified engine, or prefill + decode nodes behind a router."""

    name: str
    kind: Literal["unified", "disaggregated"]
    engine_args: tuple[str, ...] = ()
    description: str = ""


@dataclass
class Deployment:
    spec: DeploymentSpec
    url: str = ""
    engines: list[Process] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def metrics_urls(self) -> list[str]:
        """Every engine's ``/metrics`` (a router's included)."""
        return [e.url + "/metrics" for e in self.engines]


def _spawn(workdir: Path, name: str, args: Sequence[str]) -> Process:
    port = free_port()
    argv = understudy_argv("engine", "--host", "127.0.0.1", "--port", str(port), *args)
    return spawn(name, argv, workdir, env={**os.environ, **THREAD_ENV},
                 url=f"http://127.0.0.1:{port}")


def _start(workdir: Path, deployment: Deployment) -> None:
    """Spawn ``deployment``'s engines, each on its list as soon as it runs (rule 3: an
    interrupted start leaves none unstopped)."""
    spec = deployment.spec

    def engine(name: str, args: Sequence[str]) -> Process:
        with signals_deferred():  # on its list before a stop signal unwinds (processes rule 5)
            process = _spawn(workdir, name, args)
            deployment.engines.append(process)
        return process

    if spec.kind == "unified":
        deployment.url = engine(spec.name, ["--role", "unified", *spec.engine_args]).url
        return
    prefill = engine(f"{spec.name}-prefill", ["--role", "prefill", *spec.engine_args])
    decode = engine(f"{spec.name}-decode", ["--role", "decode", *spec.engine_args])
    deployment.url = engine(f"{spec.name}-router",
                            ["--role", "router", "--policy", "kv-aware",
                             "--prefill", prefill.url, "--decode", decode.url]).url


@contextlib.contextmanager
def deployments(workdir: Path, specs: Sequence[DeploymentSpec]) -> Iterator[list[Deployment]]:
    """Start every deployment of ``specs`` at once, wait until all are ready (rules 1-2);
    stop them all when the context exits (rule 3)."""
    started: list[Deployment] = []
    try:
        for spec in specs:
            started.append(Deployment(spec))
            _start(workdir, started[-1])
        wait_healthy([e for d in started for e in d.engines], ENGINE_READY_TIMEOUT_S)
        yield started
    finally:
        stop_all([e for d in reversed(started) for e in reversed(d.engines)])
