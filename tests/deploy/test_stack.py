"""The compose stack's services, run without containers and scraped by a real Prometheus.

The commands are the compose file's own (``docker-compose config``), with addresses rewritten
to loopback ports: PostgreSQL (the machine's, a fresh database), the migrate job, the primary
engine and the kivi-4 candidate engine (the real model), the gateway with the stack's config
(deploy/understudy.toml, narrowed to the backends started here), ``understudy load``, and
Prometheus from the Debian package with the stack's scrape config narrowed the same way. The
test asks Prometheus's HTTP API for the gateway's series and the engines'.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.utils import free_ports

from ._stack import PROMETHEUS_CONFIG, ROOT, TEST_ADMIN_TOKEN, option, require_tool, services

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

UNDERSTUDY = str(Path(sys.executable).with_name("understudy"))
STARTED = ("primary", "kivi4")  # the backends run here (each loads the model: ~10 s idle)
HEALTH_TIMEOUT_S = 300.0
LOAD_TIMEOUT_S = 300.0
QUERY_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0


def local_command(name: str, port: int, **replace: str) -> list[str]:
    """The compose service's command, listening on ``127.0.0.1:port``."""
    args = [str(a) for a in services()[name]["command"]]
    replace = {"--host": "127.0.0.1", "--port": str(port), **replace}
    for flag, value in replace.items():
        if flag in args:
            args[args.index(flag) + 1] = value
    return args


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{url} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            get(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"{url} not healthy within {HEALTH_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")


@contextmanager
def running(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own group, stopped when the block ends: SIGTERM to the process (it
    stops its own children, as under a container runtime), then SIGKILL to the group."""
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(STOP_GRACE_S)


def gateway_config(ports: dict[str, int], store_url: str, path: Path) -> Path:
    """deploy/understudy.toml with the started backends on loopback and the test's store."""
    config = tomllib.loads((ROOT / "deploy" / "understudy.toml").read_text())
    hosts = {name: f"http://127.0.0.1:{ports[name]}" for name in STARTED}
    assert config["primary"]["url"] == "http://primary:8200"
    config["primary"]["url"] = hosts["primary"]
    config["candidates"] = [
        {**c, "url": hosts[c["url"].split("//")[1].split(":")[0]]}
        for c in config["candidates"] if c["url"].split("//")[1].split(":")[0] in hosts
    ]
    assert [c["name"] for c in config["candidates"]] == ["kivi4"]
    config["server"].update(host="127.0.0.1", port=ports["gateway"])
    config["admin"].update(host="127.0.0.1", port=ports["admin"])
    config["evaluation"]["store"]["url"] = store_url
    path.write_text(_toml(config))
    return path


def _toml(data: dict[str, Any], prefix: str = "") -> str:
    """Enough TOML for the gateway's config: tables, arrays of tables, scalars, lists."""
    lines: list[str] = []
    tables: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in tables:
        name = f"{prefix}{key}"
        for table in value if isinstance(value, list) else [value]:
            header = f"[[{name}]]" if isinstance(value, list) else f"[{name}]"
            lines.append(f"\n{header}\n{_toml(table, name + '.')}")
    return "\n".join(lines)


def prometheus_config(ports: dict[str, int], path: Path) -> dict[str, str]:
    """deploy/prometheus/prometheus.yml narrowed to the started services, on loopback;
    returns each kept target's address by service."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    kept: dict[str, str] = {}
    jobs = []
    for job in config["scrape_configs"]:
        statics = []
        for static in job["static_configs"]:
            targets = []
            for target in static["targets"]:
                host = target.rsplit(":", 1)[0]
                if host in ports:
                    kept[host] = f"127.0.0.1:{ports[host]}"
                    targets.append(kept[host])
            if targets:
                statics.append({**static, "targets": targets})
        if statics:
            jobs.append({**job, "static_configs": statics})
    config["scrape_configs"] = jobs
    path.write_text(yaml.safe_dump(config))
    return kept


def query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    answer = json.loads(get(url))
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


Series = list[dict[str, Any]]


def eventually_series(prometheus: str, promql: str,
                      complete: Callable[[Series], bool] = bool) -> Series:
    """``promql``'s result once ``complete`` holds for it (by default: once it has a
    series). Prometheus spreads its first scrapes over the interval and a scrape may land
    before the last request is counted, so a result is complete only when every series
    the caller waits for is there with its value."""
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    while True:
        result = query(prometheus, promql)
        if complete(result) or time.monotonic() > deadline:
            return result
        time.sleep(1)


def labels(result: Series, name: str) -> set[str]:
    return {r["metric"].get(name, "") for r in result}


def test_the_stack_runs_without_containers_and_prometheus_scrapes_it(
    pg_database: str, tmp_path: Path,
) -> None:
    prometheus_bin = require_tool("prometheus")
    started = time.monotonic()
    names = (*STARTED, "gateway", "admin", "prometheus")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    config = gateway_config(ports, pg_database, tmp_path / "understudy.toml")
    os.environ["UNDERSTUDY_ADMIN_TOKEN"] = TEST_ADMIN_TOKEN
    try:
        with ExitStack() as stack:
            # The migrate job first, as depends_on orders it.
            migrate = local_command("migrate", 0, **{"--config": str(config)})
            done = subprocess.run([UNDERSTUDY, *migrate], capture_output=True, text=True,
                                  cwd=ROOT, timeout=120, check=False)
            assert done.returncode == 0, done.stdout + done.stderr

            engines = {name: stack.enter_context(running(
                [UNDERSTUDY, *local_command(name, ports[name])], tmp_path / f"{name}.log"))
                for name in STARTED}
            assert option(local_command("kivi4", 0), "--kv-codec") == "kivi-4"
            for name, process in engines.items():
                wait_healthy(f"http://127.0.0.1:{ports[name]}/health", process,
                             tmp_path / f"{name}.log")

            gateway_args = local_command("gateway", ports["gateway"], **{"--config": str(config)})
            gateway = stack.enter_context(running([UNDERSTUDY, *gateway_args],
                                                  tmp_path / "gateway.log"))
            wait_healthy(f"http://127.0.0.1:{ports['gateway']}/health", gateway,
                         tmp_path / "gateway.log")

            targets = prometheus_config({**ports}, tmp_path / "prometheus.yml")
            assert set(targets) == {"gateway", *STARTED}
            prometheus = f"http://127.0.0.1:{ports['prometheus']}"
            scraper = stack.enter_context(running([
                prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
            ], tmp_path / "prometheus.log"))
            wait_healthy(f"{prometheus}/-/ready", scraper, tmp_path / "prometheus.log")

            # The load service's command, against this gateway and sized for a test.
            load = local_command("load", 0, **{
                "--url": f"http://127.0.0.1:{ports['gateway']}/v1", "--sessions": "2",
                "--rate": "2", "--duration-s": "60"})
            done = subprocess.run(
                [UNDERSTUDY, *load, "--turns", "2", "--max-tokens", "8", "--think-s", "0.2"],
                capture_output=True, text=True, cwd=ROOT, timeout=LOAD_TIMEOUT_S, check=False)
            assert done.returncode == 0, (done.stdout + done.stderr + "\ngateway log:\n"
                                          + (tmp_path / "gateway.log").read_text()[-4000:])

            every_target = set(targets.values())
            up = eventually_series(prometheus, "up == 1",
                                   lambda r: labels(r, "instance") == every_target)
            assert labels(up, "instance") == every_target, up
            requests = eventually_series(
                prometheus, 'sum by (job) (understudy_requests_total{route="chat_completions"})',
                lambda r: bool(r) and float(r[0]["value"][1]) >= 4)
            assert requests and requests[0]["metric"]["job"] == "gateway"
            assert float(requests[0]["value"][1]) >= 4  # 2 sessions x 2 turns
            for promql in (
                'understudy_primary_ttft_seconds_bucket{job="gateway"}',
                'understudy_mirror_queued_total{candidate="kivi4"} > 0',
                "understudy_memory_budget_limit_bytes > 0",
                'vllm:time_to_first_token_seconds_count{backend="primary"} > 0',
                'vllm:kv_cache_usage_perc{backend="kivi4"}',
            ):
                assert eventually_series(prometheus, promql), promql
            per_token = {r["metric"]["backend"]: float(r["value"][1]) for r in
                         eventually_series(prometheus, "understudy_kv_bytes_per_token",
                                           lambda r: {"kivi4", "primary"} <= labels(
                                               r, "backend"))}
            assert per_token["kivi4"] < per_token["primary"] / 4, per_token
    finally:
        os.environ.pop("UNDERSTUDY_ADMIN_TOKEN", None)
    print(f"stack without containers: {time.monotonic() - started:.0f} s")
