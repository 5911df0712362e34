"""Soak: the gateway under steady mixed traffic and routine operations, watched for growth.

    .venv/bin/python bench/soak.py [--minutes N] [--quick]

Processes (each its own, loopback only, stopped by pid at the end): a simulator as the
primary, one as a healthy candidate, one as a faulty candidate (``--fault`` cycling through
a mid-stream reset at half its requests), the gateway mirroring every request to both (a
SQLite store, the scoring child on, the admin API on with a generated token), and one load
generator (bench/_loadgen.py ``--serve``) in a bounded closed loop.

What happens, for ``--minutes`` (default 10; ``--quick``: 2):
1. Traffic in rounds of ``ROUND_S``: streamed chats with and without the client's own
   ``include_usage``, and non-streamed ones, ``CONCURRENCY`` at a time.
2. Every minute the healthy candidate is promoted (forced, with a reason) through the
   admin API and, half a minute later, rolled back.
3. Once, at a third of the run, the scoring child (the gateway's child process) is killed
   with SIGKILL; /health must show it running again.
4. Every ``SAMPLE_S`` the gateway's RSS, open file descriptors and thread count are read
   from /proc, and its asyncio tasks from its ``understudy_event_loop_tasks`` metric.

Verdict: for each series the Theil-Sen slope over the run after the first ``WARMUP_S``
(scipy.stats.theilslopes, 95% interval); "no growth beyond noise" when the interval holds 0
or the growth it implies over the run is below the series' noise bound (``NOISE``); and
"every request answered": no load generator error, none cut by a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from scipy.stats import theilslopes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import (
    Child,
    LoadGen,
    children_of,
    code_revision,
    free_port,
    run_main,
    snapshot_code,
    spawn,
    start_sim,
    understudy_argv,
    wait_ready,
)
from _report import RESULTS_DIR, loadavg, num, render_table, signed, write_results

ROUND_S = 10.0
CONCURRENCY = 8
SAMPLE_S = 2.0
WARMUP_S = 30.0
PROMOTE_EVERY_S = 60.0
ROLLBACK_AFTER_S = 30.0
# Growth over the run below which a series counts as flat: allocator and page noise.
NOISE = {"rss_mib": 8.0, "fds": 4.0, "threads": 2.0, "tasks": 16.0}
SERIES = tuple(NOISE)
HTTP_TIMEOUT_S = 10.0
ADMIN_TIMEOUT_S = 60.0
"""A promotion judges up to the gates' ``max_judged_exchanges`` in a worker thread: on two
loaded cores that has taken over 10 s. Slower than this is a failed operation."""


def start_soak_sim(stack: ExitStack, workdir: Path, code: Path, name: str, *extra: str) -> Child:
    """A simulator with the soak's timings (20 ms TTFT, 5 ms per token, 32 tokens)."""
    return start_sim(
        stack, workdir, code, ttft_ms=20, itl_ms=5, tokens=32, name=name, extra=extra
    )


def start_gateway(
    stack: ExitStack, workdir: Path, code: Path, primary: str, healthy: str, faulty: str,
    token: str,
) -> tuple[Child, str]:
    port, admin = free_port(), free_port()
    run_dir = workdir / "gateway"
    run_dir.mkdir()
    os.environ["UNDERSTUDY_ADMIN_TOKEN"] = token  # spawn() passes the environment on
    argv = understudy_argv(
        "serve",
        "--primary",
        primary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        "--candidate",
        f"healthy={healthy},rate=1.0,unit=request",
        "--candidate",
        f"faulty={faulty},rate=1.0,unit=request",
    )
    child = spawn(stack, "gateway", argv, run_dir, code, cwd=run_dir,
                  url=f"http://127.0.0.1:{port}")
    wait_ready(child, 60)
    return child, f"http://127.0.0.1:{admin}/admin/v1"


def http_json(
    url: str, *, method: str = "GET", body: dict[str, Any] | None = None, token: str | None = None,
    timeout_s: float = HTTP_TIMEOUT_S,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def loop_tasks(gateway_url: str) -> float:
    """The gateway's ``understudy_event_loop_tasks``: requests in flight move it, leaks lift it."""
    with urllib.request.urlopen(gateway_url + "/metrics", timeout=HTTP_TIMEOUT_S) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("understudy_event_loop_tasks "):
                return float(line.split()[1])
    raise LookupError("the gateway's /metrics has no understudy_event_loop_tasks")


def proc_sample(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": float(int(fields["Threads"])),
        "fds": float(len(os.listdir(f"/proc/{pid}/fd"))),
    }


def scoring_children(gateway_pid: int) -> list[int]:
    """The gateway's child processes that are not multiprocessing's resource tracker."""
    found = []
    for pid in children_of(gateway_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            found.append(pid)
    return found


class Operator(threading.Thread):
    """Samples the gateway and runs the promotions, rollbacks and the one kill (rules 2-4)."""

    def __init__(
        self, gateway: Child, admin: str, token: str, duration_s: float, healthy_url: str
    ) -> None:
        super().__init__(daemon=True)
        self.healthy_url = healthy_url
        self.gateway, self.admin, self.token, self.duration_s = gateway, admin, token, duration_s
        self.samples: list[dict[str, float]] = []
        self.events: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.stop_event = threading.Event()

    def note(self, t: float, what: str, ok: bool, detail: Any) -> None:
        self.events.append({"t_s": round(t, 1), "what": what, "ok": ok, "detail": detail})
        if not ok:
            self.failures.append(f"{what} at {t:.0f}s: {detail}")

    def admin_call(
        self, t: float, what: str, path: str, body: dict[str, Any], expect: int = 200
    ) -> bool:
        began = time.monotonic()
        try:
            status, answer = http_json(self.admin + path, method="POST", body=body,
                                       token=self.token, timeout_s=ADMIN_TIMEOUT_S)
        except OSError as exc:  # refused, reset, or no answer within ADMIN_TIMEOUT_S
            status, answer = 0, repr(exc)
        elapsed = round(time.monotonic() - began, 2)
        self.note(t, what, status == expect, {"status": status, "answer": answer,
                                               "elapsed_s": elapsed})
        return status == expect

    def kill_scoring(self, t: float) -> None:
        victims = scoring_children(self.gateway.pid)
        if not victims:
            self.note(t, "kill scoring child", False, "no child process found")
            return
        os.kill(victims[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            _status, health = http_json(self.gateway.url + "/health")
            scoring = (health or {}).get("scoring", {}) if isinstance(health, dict) else {}
            now = scoring_children(self.gateway.pid)
            if scoring.get("state") == "running" and now and victims[0] not in now:
                self.note(
                    t,
                    "kill scoring child",
                    True,
                    {"killed": victims[0], "new": now[0], "scoring": scoring},
                )
                return
        self.note(t, "kill scoring child", False, {"killed": victims[0], "health": health})

    def run(self) -> None:
        try:
            self._operate()
        except Exception as exc:  # a dead operator must fail the soak, not end it quietly
            self.failures.append(f"the operations thread died: {exc!r}")

    def _operate(self) -> None:
        start = time.monotonic()
        next_sample = start
        next_promote = start + PROMOTE_EVERY_S / 3
        next_rollback: float | None = None
        kill_at: float | None = start + self.duration_s / 3
        while not self.stop_event.is_set():
            now = time.monotonic()
            t = now - start
            if now >= next_sample:
                try:
                    sample = {"t_s": t, **proc_sample(self.gateway.pid)}
                except OSError as exc:
                    self.failures.append(f"gateway gone at {t:.0f}s: {exc}")
                    return
                try:
                    sample["tasks"] = loop_tasks(self.gateway.url)
                except OSError as exc:  # a scrape that timed out is a failure, not the end
                    self.note(t, "read /metrics", False, repr(exc))
                self.samples.append(sample)
                next_sample += SAMPLE_S
            if now >= next_promote and t < self.duration_s - ROLLBACK_AFTER_S:
                promoted = self.admin_call(
                    t,
                    "promote healthy",
                    "/candidates/healthy/promote",
                    {"force": True, "reason": "soak", "actor": "soak"},
                )
                next_promote += PROMOTE_EVERY_S
                next_rollback = now + ROLLBACK_AFTER_S if promoted else None
            if next_rollback is not None and now >= next_rollback:
                next_rollback = None
                if self.admin_call(t, "rollback", "/rollback", {"reason": "soak", "actor": "soak"}):
                    # A promoted candidate leaves the candidate list: add it back for the next.
                    self.admin_call(
                        t,
                        "re-add healthy",
                        "/candidates",
                        {
                            "name": "healthy",
                            "url": self.healthy_url,
                            "sample_rate": 1.0,
                            "sampling_unit": "request",
                        },
                        201,
                    )
            if kill_at is not None and now >= kill_at:
                kill_at = None
                self.kill_scoring(t)
            self.stop_event.wait(0.2)


def slope_verdict(samples: list[dict[str, float]], key: str, span_s: float) -> dict[str, Any]:
    points = [s for s in samples if s["t_s"] >= WARMUP_S and key in s]
    if len(points) < 5:
        return {"series": key, "n": len(points), "verdict": "too few samples"}
    x = [p["t_s"] for p in points]
    y = [p[key] for p in points]
    slope, _intercept, low, high = theilslopes(y, x, alpha=0.95)
    per_min = slope * 60
    growth = slope * span_s
    flat = low <= 0 <= high or growth < NOISE[key]
    return {
        "series": key,
        "n": len(points),
        "first": y[0],
        "last": y[-1],
        "max": max(y),
        "slope_per_min": per_min,
        "ci_per_min": [low * 60, high * 60],
        "growth_over_run": growth,
        "noise_bound": NOISE[key],
        "verdict": "flat" if flat else "GROWS",
    }


def spec(url: str, mode: str, client_usage: bool, duration_s: float) -> dict[str, Any]:
    return {
        "url": url,
        "model": "sim-model",
        "max_tokens": 32,
        "mode": mode,
        "client_usage": client_usage,
        "concurrency": CONCURRENCY,
        "requests_per_worker": 100_000,
        "duration_s": duration_s,
        "deadline_s": duration_s + 30,
        "request_timeout_s": 30,
        "stagger_s": 0.2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="2 minutes")
    args = parser.parse_args()
    duration_s = 120.0 if args.quick else args.minutes * 60
    token = secrets.token_urlsafe(24)
    revision = code_revision()
    with tempfile.TemporaryDirectory(prefix="understudy-soak-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        code = snapshot_code(workdir)
        primary = start_soak_sim(stack, workdir, code, "primary")
        healthy = start_soak_sim(stack, workdir, code, "healthy", "--variant", "h")
        faulty = start_soak_sim(
            stack,
            workdir,
            code,
            "faulty",
            "--fault",
            "reset_mid_stream",
            "--fault-rate",
            "0.5",
            "--fault-after-chunks",
            "4",
        )
        gateway, admin = start_gateway(
            stack, workdir, code, primary.url, healthy.url, faulty.url, token
        )
        loadgen = LoadGen(stack, workdir)
        operator = Operator(gateway, admin, token, duration_s, healthy.url)
        operator.start()
        modes = [("stream", False), ("stream", True), ("small", False)]
        rounds: list[dict[str, Any]] = []
        started = time.monotonic()
        while (left := duration_s - (time.monotonic() - started)) > 1:
            mode, usage = modes[len(rounds) % len(modes)]
            result = loadgen.run(
                spec(gateway.url, mode, usage, min(ROUND_S, left)), timeout_s=ROUND_S + 120
            )
            rounds.append(
                {
                    "mode": mode,
                    "client_usage": usage,
                    "ok": result["ok"],
                    "errors": result["errors"],
                    "cut": result["cut_by_deadline"],
                    "error_samples": result["error_samples"],
                }
            )
        operator.stop_event.set()
        operator.join(30)
        elapsed = time.monotonic() - started
        _s, health = http_json(gateway.url + "/health")
        gateway_alive = gateway.alive()
    report(rounds, operator, health, gateway_alive, elapsed, revision)


def report(
    rounds: list[dict[str, Any]],
    operator: Operator,
    health: Any,
    gateway_alive: bool,
    elapsed: float,
    revision: str,
) -> None:
    ok = sum(r["ok"] for r in rounds)
    errors = sum(r["errors"] for r in rounds)
    cut = sum(r["cut"] for r in rounds)
    samples = [s for r in rounds for s in r["error_samples"]][:5]
    span = elapsed - WARMUP_S
    slopes = [slope_verdict(operator.samples, key, span) for key in SERIES]
    answered = errors == 0 and cut == 0 and gateway_alive
    flat = all(s["verdict"] == "flat" for s in slopes)
    promotions = sum(e["what"] == "promote healthy" and e["ok"] for e in operator.events)
    rollbacks = sum(e["what"] == "rollback" and e["ok"] for e in operator.events)
    kills = [e for e in operator.events if e["what"] == "kill scoring child"]
    print(f"soak: {elapsed:.0f} s, code {revision}, load average {loadavg()}")
    print(
        f"requests: {ok} answered, {errors} errors, {cut} cut by a deadline "
        f"over {len(rounds)} rounds{f'; samples: {samples}' if samples else ''}"
    )
    print(
        f"operations: {promotions} promotions, {rollbacks} rollbacks, scoring child killed "
        f"{len(kills)}x ({'restarted' if kills and kills[0]['ok'] else 'NOT restarted'})"
    )
    timed = [e["detail"]["elapsed_s"] for e in operator.events
             if isinstance(e["detail"], dict) and "elapsed_s" in e["detail"]]
    if timed:
        print(f"admin calls: {len(timed)}, slowest {max(timed):.1f} s")
    for failure in operator.failures:
        print(f"  failed: {failure}")
    rows = [
        [
            s["series"],
            str(s["n"]),
            num(s.get("first")),
            num(s.get("last")),
            num(s.get("max")),
            signed(s.get("slope_per_min"), 3),
            "[" + ", ".join(signed(v, 3) for v in s.get("ci_per_min", [])) + "]",
            signed(s.get("growth_over_run")),
            num(s.get("noise_bound")),
            s["verdict"],
        ]
        for s in slopes
    ]
    print(
        render_table(
            f"gateway growth after {WARMUP_S:.0f} s warm-up (Theil-Sen, 95%)",
            [
                "series",
                "n",
                "first",
                "last",
                "max",
                "slope/min",
                "95% CI /min",
                "growth",
                "noise",
                "verdict",
            ],
            rows,
        )
    )
    print(f"health at the end: {json.dumps(health)}")
    verdict = answered and flat and not operator.failures
    print(
        f"verdict: every request answered: {'yes' if answered else 'NO'}; "
        f"no growth beyond noise: {'yes' if flat else 'NO'}; "
        f"operations: {'all ok' if not operator.failures else 'FAILURES'} -> "
        f"{'PASS' if verdict else 'FAIL'}"
    )
    print(
        write_results(
            RESULTS_DIR / "soak.json",
            {
                "revision": revision,
                "elapsed_s": elapsed,
                "rounds": rounds,
                "slopes": slopes,
                "samples": operator.samples,
                "events": operator.events,
                "failures": operator.failures,
                "health": health,
                "pass": verdict,
            },
        )
    )


if __name__ == "__main__":
    sys.exit(run_main(main))
