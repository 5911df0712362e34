"""The demo's backends: reference-engine processes on loopback, started together.

Rules:
1. Every engine is ``python -m gateway.cli engine`` on 127.0.0.1 at a port the OS picked
   free, with one BLAS and one OpenMP thread (``THREAD_ENV``): seven engines share two
   cores, and numpy's BLAS threads spin-waiting on each other collapse throughput.
2. All start at once; each must answer ``/health`` within ``ENGINE_READY_TIMEOUT_S``, and
   one that exits first fails the start with the tail of its log.
3. Every process is stopped by its own pid: SIGTERM, then SIGKILL past ``STOP_GRACE_S``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

__all__ = [
    "ENGINE_READY_TIMEOUT_S",
    "Deployment",
    "DeploymentSpec",
    "Engine",
    "deployments",
    "free_port",
]

THREAD_ENV: Final = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                     "MKL_NUM_THREADS": "1"}
ENGINE_READY_TIMEOUT_S: Final = 300.0
"""Loading dequantizes the GGUF and probes the BLAS kernels: ~20 s alone, more when
seven engines load at once on two cores."""
STOP_GRACE_S: Final = 10.0
HEALTH_POLL_S: Final = 0.25
LOG_TAIL_LINES: Final = 30


def free_port() -> int:
    """A loopback port the OS picked free."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """One system under test: a unified engine, or prefill + decode nodes behind a router."""

    name: str
    kind: Literal["unified", "disaggregated"]
    engine_args: tuple[str, ...] = ()
    description: str = ""


@dataclass
class Engine:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_GRACE_S)


@dataclass
class Deployment:
    spec: DeploymentSpec
    url: str = ""
    engines: list[Engine] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def metrics_urls(self) -> list[str]:
        """Every engine's ``/metrics`` (a router's included)."""
        return [e.url + "/metrics" for e in self.engines]


def _spawn(workdir: Path, name: str, args: Sequence[str]) -> Engine:
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "engine",
            "--host", "127.0.0.1", "--port", str(port), *args]
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env={**os.environ, **THREAD_ENV}, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Engine(name, f"http://127.0.0.1:{port}", process, log)


def _start(workdir: Path, spec: DeploymentSpec) -> Deployment:
    deployment = Deployment(spec)
    if spec.kind == "unified":
        engine = _spawn(workdir, spec.name, ["--role", "unified", *spec.engine_args])
        deployment.engines.append(engine)
        deployment.url = engine.url
        return deployment
    prefill = _spawn(workdir, f"{spec.name}-prefill", ["--role", "prefill", *spec.engine_args])
    decode = _spawn(workdir, f"{spec.name}-decode", ["--role", "decode", *spec.engine_args])
    router = _spawn(workdir, f"{spec.name}-router",
                    ["--role", "router", "--policy", "kv-aware",
                     "--prefill", prefill.url, "--decode", decode.url])
    deployment.engines += [prefill, decode, router]
    deployment.url = router.url
    return deployment


def _wait_ready(engines: Sequence[Engine]) -> None:
    """Rule 2."""
    deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
    waiting = list(engines)
    while waiting and time.monotonic() < deadline:
        for engine in list(waiting):
            if engine.process.poll() is not None:
                raise RuntimeError(f"engine {engine.name} exited "
                                   f"({engine.process.returncode}) while starting:\n"
                                   f"{engine.log_tail()}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(engine.url + "/health", timeout=1.0) as answer:
                if answer.status == 200:
                    waiting.remove(engine)
        time.sleep(HEALTH_POLL_S)
    if waiting:
        raise RuntimeError(f"not ready within {ENGINE_READY_TIMEOUT_S:.0f} s: "
                           + ", ".join(e.name for e in waiting))


@contextlib.contextmanager
def deployments(workdir: Path, specs: Sequence[DeploymentSpec]) -> Iterator[list[Deployment]]:
    """Start every deployment of ``specs`` at once, wait until all are ready (rules 1-2);
    stop them all when the context exits (rule 3)."""
    started: list[Deployment] = []
    try:
        for spec in specs:
            started.append(_start(workdir, spec))
        _wait_ready([e for d in started for e in d.engines])
        yield started
    finally:
        for deployment in reversed(started):
            for engine in reversed(deployment.engines):
                engine.stop()
