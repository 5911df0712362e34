"""Property-based fuzzing of the admin API from its own OpenAPI document: never a 5xx."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gateway._admin import admin_openapi
from tests.utils import free_ports

if TYPE_CHECKING:  # the alias exists for type checkers only
    from schemathesis.specs.openapi.schemas import OpenApiCase

TOKEN = "fuzz-admin-token-0123"
schema = schemathesis.openapi.from_dict(admin_openapi())


def _wait_healthy(url: str, process: subprocess.Popen[bytes],
                  headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{url} exited"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                        timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"{url} did not become healthy")


@pytest.fixture(scope="module")
def admin_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real gateway (evaluation on, SQLite) in front of a simulator, in subprocesses."""
    sim_port, port, admin = free_ports(3)
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    env = {**os.environ, "UNDERSTUDY_ADMIN_TOKEN": TOKEN}
    cli = [sys.executable, "-m", "gateway.cli", "--log-level", "ERROR"]
    processes = [
        subprocess.Popen([*cli, "sim", "--port", str(sim_port), "--ttft-ms", "0",
                          "--itl-ms", "0"], env=env),
        subprocess.Popen([*cli, "serve", "--primary", f"http://127.0.0.1:{sim_port}",
                          "--candidate", f"c=http://127.0.0.1:{sim_port}",
                          "--port", str(port), "--admin-port", str(admin),
                          "--db", f"sqlite+aiosqlite:///{db}"], env=env),
    ]
    try:
        _wait_healthy(f"http://127.0.0.1:{sim_port}/health", processes[0])
        _wait_healthy(f"http://127.0.0.1:{port}/health", processes[1])
        # The admin API starts listening after the relay answers /health.
        root = f"http://127.0.0.1:{admin}/admin/v1"
        _wait_healthy(root + "/candidates", processes[1], {"Authorization": f"Bearer {TOKEN}"})
        yield root
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=40)


@schema.parametrize()
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
def test_admin_api_never_answers_5xx(case: OpenApiCase, admin_root: str) -> None:
    response = case.call(base_url=admin_root, headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/json"), (
        case.method, case.formatted_path, response.status_code, response.text[:200])
