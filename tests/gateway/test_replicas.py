"""Two gateway processes sharing one PostgreSQL converge on a promotion, and a canary
started on one is carried on by the other when the first goes away."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from tests.fixtures_db import audit_log
from tests.utils import free_ports, run_sim

TOKEN = "replica-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POLL_INTERVAL_S = 1.0
# A replica hears a change by LISTEN at once, by its poll within POLL_INTERVAL_S; two
# gateway processes, the CLI and PostgreSQL on a loaded 2-core CI machine can stretch
# that to seconds. The bound only catches a replica that never converges.
CONVERGED_WITHIN_S = 30.0


@asynccontextmanager
async def _replica(primary: str, candidate: str, db: str,
                   **settings: str) -> AsyncIterator[tuple[str, str]]:
    port, admin = free_ports(2)
    env = {**os.environ, "UNDERSTUDY_ADMIN_TOKEN": TOKEN,
           "UNDERSTUDY_ADMIN__ROUTING_POLL_INTERVAL_S": str(POLL_INTERVAL_S), **settings}
    process = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
        [sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "serve",
         "--primary", primary, "--candidate", f"cand={candidate}", "--port", str(port),
         "--admin-port", str(admin), "--db", db], env=env)
    url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}/admin/v1"
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, "the gateway exited"
                try:  # the admin API starts listening after the relay answers /health
                    async with http.get(url + "/health") as health, http.get(
                            admin_url + "/routing", headers=AUTH) as routing:
                        if health.status == routing.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the gateway did not become healthy"
                await asyncio.sleep(0.2)
        yield url, admin_url
    finally:
        process.terminate()
        process.wait(timeout=40)


async def _routing(http: aiohttp.ClientSession, admin_url: str) -> dict[str, Any]:
    async with http.get(admin_url + "/routing", headers=AUTH) as resp:
        assert resp.status == 200
        return await resp.json()  # type: ignore[no-any-return]


async def _converged(http: aiohttp.ClientSession, admin_url: str, primary: str) -> float:
    """Seconds until the replica at ``admin_url`` routes to ``primary`` (fails after
    ``CONVERGED_WITHIN_S``)."""
    started = time.monotonic()
    while (await _routing(http, admin_url))["primary"]["name"] != primary:
        waited = time.monotonic() - started
        assert waited < CONVERGED_WITHIN_S, f"{admin_url} did not converge on {primary}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_two_replicas_converge_on_a_promotion_and_a_rollback(pg_database: str) -> None:
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=4) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=4, variant="c") as candidate, \
            _replica(primary.url, candidate.url, pg_database) as (url_a, admin_a), \
            _replica(primary.url, candidate.url, pg_database) as (url_b, admin_b), \
            aiohttp.ClientSession() as http:
        assert (await _routing(http, admin_b))["version"] == 1
        # Promote on replica A with the CLI, as an operator would.
        env = {**os.environ, "UNDERSTUDY_ADMIN_TOKEN": TOKEN}
        promoted = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "gateway.cli", "promote", "cand", "--force",
             "--reason", "replica test", "--admin-url", admin_a],
            env=env, capture_output=True, text=True, timeout=60)
        assert promoted.returncode == 0, promoted.stderr
        converged_s = await _converged(http, admin_b, "cand")
        # Replica B now sends new requests to the promoted backend.
        before = candidate.stats.requests_seen
        async with http.post(url_b + "/v1/chat/completions", json={
                "model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 200
        assert candidate.stats.requests_seen == before + 1
        # A rollback on B reaches A the same way.
        rolled = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "gateway.cli", "rollback", "--admin-url", admin_b],
            env=env, capture_output=True, text=True, timeout=60)
        assert rolled.returncode == 0, rolled.stderr
        await _converged(http, admin_a, "primary")
        assert (await _routing(http, admin_a))["version"] == 3
        assert url_a != url_b
    print(f"replica B converged in {converged_s * 1000:.0f} ms")


# Gates loose enough for a few dozen exchanges of an identical candidate to PASS.
LOOSE_GATES = {"UNDERSTUDY_EVALUATION__GATES__MIN_SAMPLES": "8",
               "UNDERSTUDY_EVALUATION__GATES__MAX_MEDIAN_SHIFT_RATIO": "3.0",
               "UNDERSTUDY_EVALUATION__GATES__MAX_STD_RATIO": "10.0",
               "UNDERSTUDY_EVALUATION__GATES__MAX_TTFT_P99_RATIO": "10.0",
               "UNDERSTUDY_EVALUATION__GATES__MAX_E2E_P99_RATIO": "10.0",
               "UNDERSTUDY_EVALUATION__GATES__MARGINAL_BAND": "0.0"}


@pytest.mark.timeout(300)
async def test_a_canary_outlives_the_replica_it_was_started_on(pg_database: str) -> None:
    """Replica A starts a canary and is stopped at its first step, before any traffic was
    scored (so it cannot have judged it PASS); replica B, which serves the same routing,
    judges the step on the traffic it relays and takes the canary on to its next step, in
    its starter's name. (The 100 % step's promotion is the judge's, tested in
    test_promotion and test_canary_driver.)"""
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=4) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=4) as candidate, \
            _replica(primary.url, candidate.url, pg_database, **LOOSE_GATES) as (url_b, admin_b), \
            aiohttp.ClientSession() as http:
        async with _replica(primary.url, candidate.url, pg_database,
                            **LOOSE_GATES) as (_, admin_a):
            async with http.post(admin_a + "/candidates/cand/canary", headers=AUTH,
                                 json={"steps": [50, 100], "interval_s": 1.0,
                                       "actor": "ops"}) as resp:
                assert resp.status == 202, await resp.text()
        # A is gone; B heard of the canary within its poll interval.
        deadline = time.monotonic() + CONVERGED_WITHIN_S
        while (await _routing(http, admin_b))["canary"] is None:
            assert time.monotonic() < deadline, "replica B never served the canary"
            await asyncio.sleep(0.05)
        # Scoring, then a judged step of at least 1 s: ~15 s on an idle machine.
        started = time.monotonic()
        deadline = started + 180
        round_ = 0
        while (canary := (await _routing(http, admin_b))["canary"]) is not None \
                and canary["step"] == 0:
            assert time.monotonic() < deadline, f"the canary was not carried on: {canary}"
            for i in range(4):  # traffic through B: mirrored to the candidate and scored
                async with http.post(url_b + "/v1/chat/completions", json={
                        "model": "sim-model",
                        "messages": [{"role": "user", "content": f"r{round_} {i}"}]}) as resp:
                    assert resp.status == 200
            round_ += 1
        print(f"replica B stepped the canary {time.monotonic() - started:.1f} s after A left")
    actions = [(row.action, row.actor) for row in await audit_log(pg_database)]
    started = actions.index(("canary_start", "ops"))
    assert actions[started:started + 2] == [("canary_start", "ops"), ("canary_step", "ops")], \
        actions
    # B may have judged the 100 % step before it stopped: promoted, or back to 50 % (and
    # up again), all in A's starter's name.
    assert all(actor == "ops" for _, actor in actions[started:]), actions
    assert {a for a, _ in actions[started + 2:]} <= {"promote", "canary_step_back",
                                                     "canary_step"}, actions
