"""The docker-compose stack as data: the resolved compose file, its understudy services and
what each listens on. Shared by the static checks and the run without containers.

The compose file is read as ``docker-compose config`` resolves it (anchors merged, variables
interpolated, every profile included): what a Docker engine would run, not what the YAML
looks like. Debian's docker-compose (1.29) does this without an engine;
``scripts/setup-deploy.sh`` installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "understudy.json"
COMPOSE_SPEC = Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")
UNDERSTUDY_IMAGE = "understudy:local"
# A token for interpolation only: the compose file refuses to resolve without one.
TEST_ADMIN_TOKEN = "compose-test-token-0123456789"
SETUP_HINT = "run scripts/setup-deploy.sh (apt-get install -y docker-compose prometheus)"


def require_tool(name: str) -> str:
    """The path of ``name``; fails the test, loudly, with the install hint when it is absent."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: {SETUP_HINT}", pytrace=False)
    return path


def compose_env() -> dict[str, str]:
    return {**os.environ, "UNDERSTUDY_ADMIN_TOKEN": TEST_ADMIN_TOKEN}


@cache
def resolved_compose() -> dict[str, Any]:
    """``docker-compose --profile gpu config``, parsed."""
    tool = require_tool("docker-compose")
    done = subprocess.run(
        [tool, "-f", str(COMPOSE_FILE), "--profile", "gpu", "config"],
        capture_output=True, text=True, env=compose_env(), cwd=ROOT, timeout=60, check=False,
    )
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def raw_compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return data


def compose_schema() -> dict[str, Any]:
    if not COMPOSE_SPEC.is_file():
        pytest.fail(f"the compose spec schema is missing ({COMPOSE_SPEC}): {SETUP_HINT}",
                    pytrace=False)
    schema: dict[str, Any] = json.loads(COMPOSE_SPEC.read_text())
    return schema


def services() -> dict[str, dict[str, Any]]:
    return dict(resolved_compose()["services"])


def is_understudy(service: dict[str, Any]) -> bool:
    """Runs the project's image (built from the Dockerfile, entry point ``understudy``)."""
    return bool(service.get("image") == UNDERSTUDY_IMAGE)


def option(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` in ``args``."""
    if name in args:
        return args[args.index(name) + 1]
    return None


@dataclass(frozen=True, slots=True)
class Listener:
    """Where a service serves HTTP (and so /health and /metrics)."""

    service: str
    host: str  # what it binds
    port: int


def gateway_toml(args: list[str]) -> dict[str, Any]:
    config = option(args, "--config")
    assert config is not None, f"the gateway command names no --config: {args}"
    data: dict[str, Any] = tomllib.loads((ROOT / config).read_text())
    return data


def listener(name: str, service: dict[str, Any]) -> Listener | None:
    """The HTTP listener a service's command sets up, or None (a one-shot job, a client)."""
    args = [str(a) for a in service.get("command") or []]
    if is_understudy(service):
        if args[:1] == ["engine"] or args[:1] == ["sim"]:
            return Listener(name, option(args, "--host") or "127.0.0.1",
                            int(option(args, "--port") or 0))
        if args[:1] == ["serve"]:
            server = gateway_toml(args).get("server", {})
            return Listener(name, server.get("host", "127.0.0.1"), int(server.get("port", 8080)))
        return None
    host = option(args, "--host") or "127.0.0.1"
    if args and args[0] == "vllm-router":
        return Listener(name, host, int(option(args, "--port") or 0))
    if service.get("entrypoint") == ["vllm", "serve"]:
        return Listener(name, host, int(option(args, "--port") or 8000))
    return None


def metrics_port(name: str, service: dict[str, Any]) -> int | None:
    """The port Prometheus scrapes a service on, or None when it exports no metrics."""
    args = [str(a) for a in service.get("command") or []]
    if args and args[0] == "vllm-router":
        return int(option(args, "--prometheus-port") or 29000)
    found = listener(name, service)
    return None if found is None else found.port
