"""Promotion, rollback and canary through the admin API, with the judge and the audit log."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import time
from functools import partial
from typing import Any

import aiohttp
import openai
import pytest
import sqlalchemy as sa
from multidict import CIMultiDict
from pydantic import SecretStr

from evaluators.store import create_engine
from gateway._config import CandidateConfig, UpstreamConfig
from gateway._exceptions import InvalidBody
from gateway._headers import CREDENTIAL_HEADERS
from gateway._metrics import GatewayMetrics
from gateway._routing import Backend, Canary, Routing, Upstreams
from tests.fixtures_db import audit_log
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

# What these tests judge is the switching, on a few exchanges: a rate passes only where its
# interval rules out the limit (0 errors in 8 a side rules out ~40 points, not the default 1).
LOOSE_GATES = {"min_samples": 8, "max_median_shift_ratio": 3.0, "max_std_ratio": 10.0,
               "max_ttft_p99_ratio": 10.0, "max_e2e_p99_ratio": 10.0, "marginal_band": 0.0,
               "max_error_rate_increase": 0.5}


def _evaluation(url: str, **gates: Any) -> dict[str, Any]:
    return {"enabled": True, "store": {"url": url, "flush_interval_s": 0.05},
            "gates": {**LOOSE_GATES, **gates}}


async def _traffic(gw: RunningGateway, n: int, tag: str = "q") -> list[str]:
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    answers = []
    for i in range(n):
        answer = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": f"{tag} {i}"}])
        answers.append(answer.choices[0].message.content or "")
    await client.close()
    return answers


def _json(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else dict(value)


async def _post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body if body is not None else {}) as resp:
        return resp.status, await resp.json()


async def _audit(url: str) -> list[tuple[str, str, Any]]:
    """(action, target, detail with the actor) of every audit row, oldest first."""
    return [(r.action, r.target, {**_json(r.detail), "actor": r.actor})
            for r in await audit_log(url)]


async def test_promotion_refused_on_fail_and_inconclusive_allowed_with_force(
    tmp_path: Any,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'p.db'}"
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=6) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=6, variant="other") as worse, \
            run_gateway(primary.url, candidates=[{"name": "worse", "url": worse.url}],
                        evaluation=_evaluation(url)) as gw, \
            aiohttp.ClientSession() as http:
        promote = gw.admin_url + "/candidates/worse/promote"
        await _traffic(gw, 2)
        await eventually(lambda: gw.written_records >= 2)
        status, body = await _post(http, promote)
        assert status == 409 and "INCONCLUSIVE" in body["error"]["message"]
        await _traffic(gw, 10, "more")
        await eventually(lambda: gw.written_records >= 12)
        status, body = await _post(http, promote)
        assert status == 409 and "FAIL" in body["error"]["message"]
        status, body = await _post(http, promote, {"force": True})
        assert status == 422 and "reason" in body["error"]["message"]
        status, body = await _post(http, promote, {"force": True, "reason": "hotfix",
                                                   "actor": "alice"})
        assert status == 200 and body["routing"]["primary"]["name"] == "worse"
        assert body["verdict"] == "FAIL"
        assert "worse" not in gw.state.mirror.candidates  # no longer mirrored to itself
        served = await _traffic(gw, 1, "after")
        assert worse.stats.requests[-1].body["messages"][0]["content"] == "after 0"  # type: ignore[index]
        assert served
    actions = [(a, t) for a, t, _ in await _audit(url)]
    assert actions == [("promote_refused", "worse"), ("promote_refused", "worse"),
                       ("promote", "worse")]
    detail = (await _audit(url))[-1][2]
    assert detail["force"] is True and detail["reason"] == "hotfix"
    assert detail["actor"] == "alice"
    assert detail["verdict"] == "FAIL"


async def test_promotion_on_pass_then_rollback(tmp_path: Any) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'p.db'}"
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=6) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=6) as same, \
            run_gateway(primary.url, candidates=[{"name": "same", "url": same.url}],
                        evaluation=_evaluation(url)) as gw, \
            aiohttp.ClientSession() as http:
        status, body = await _post(http, gw.admin_url + "/rollback")
        assert status == 409 and "no previous primary" in body["error"]["message"]
        await _traffic(gw, 12)
        await eventually(lambda: gw.written_records >= 12)
        status, body = await _post(http, gw.admin_url + "/candidates/same/promote")
        assert status == 200, body
        assert body["verdict"] == "PASS"
        assert body["routing"]["primary"]["name"] == "same"
        assert body["routing"]["previous"]["name"] == "primary"
        before = same.stats.requests_seen
        await _traffic(gw, 3, "new")
        assert same.stats.requests_seen == before + 3
        status, body = await _post(http, gw.admin_url + "/rollback", {"reason": "drill"})
        assert status == 200 and body["routing"]["primary"]["name"] == "primary"
        async with http.get(gw.admin_url + "/routing") as resp:
            routing = await resp.json()
        assert routing["version"] == 3 and routing["previous"]["name"] == "same"
        before = primary.stats.requests_seen
        await _traffic(gw, 2, "back")
        assert primary.stats.requests_seen == before + 2
    assert [a for a, _, _ in await _audit(url)] == ["promote", "rollback"]


async def test_promote_and_rollback_under_load_loses_nothing() -> None:
    """Every request completes, wholly on one backend, while the primary flips."""
    async with run_sim(ttft_ms=2, itl_ms=2, tokens=10) as a, \
            run_sim(ttft_ms=2, itl_ms=2, tokens=10, variant="b") as b, \
            run_gateway(a.url, candidates=[{"name": "b", "url": b.url,
                                            "sample_rate": 0.0}]) as gw, \
            aiohttp.ClientSession() as http:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        direct = {name: openai.AsyncOpenAI(base_url=sim.base_url, api_key="x")
                  for name, sim in (("primary", a), ("b", b))}
        prompts = [f"load {i}" for i in range(60)]
        expected = {name: {p: await _stream_text(c, p) for p in prompts}
                    for name, c in direct.items()}
        stop = asyncio.Event()
        results: list[tuple[str, str]] = []

        async def load(worker: int) -> None:
            i = worker
            while not stop.is_set() and i < len(prompts) * 4:
                prompt = prompts[i % len(prompts)]
                results.append((prompt, await _stream_text(client, prompt)))
                i += 8

        async def flip() -> None:
            for _ in range(5):
                await asyncio.sleep(0.05)
                status, body = await _post(http, gw.admin_url + "/candidates/b/promote",
                                           {"force": True, "reason": "load test"})
                assert status == 200, body
                await asyncio.sleep(0.05)
                status, body = await _post(http, gw.admin_url + "/rollback")
                assert status == 200, body
                # Rollback leaves b out of the mirror; add it back for the next round.
                status, _ = await _post(http, gw.admin_url + "/candidates",
                                        {"name": "b", "url": b.url, "sample_rate": 0.0})
                assert status == 201
            stop.set()

        await asyncio.wait_for(asyncio.gather(flip(), *(load(w) for w in range(8))), 60)
        await client.close()
        for c in direct.values():
            await c.close()
    assert len(results) >= 40
    served_by = [next(n for n in ("primary", "b") if expected[n][p] == text)
                 for p, text in results]  # StopIteration here means a mixed answer
    assert {"primary", "b"} <= set(served_by)
    assert gw.metric("understudy_requests_total", route="chat_completions", status="200") >= len(
        results)


async def _stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": prompt}], stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_canary_steps_up_and_promotes_or_rolls_back(tmp_path: Any) -> None:
    """Each step is judged on the scores since it began: traffic keeps flowing meanwhile
    (the sessions the canary does not serve are mirrored to it and scored)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'c.db'}"
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=6) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=6) as good, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=6, variant="bad") as bad, \
            run_gateway(primary.url, candidates=[{"name": "good", "url": good.url},
                                                 {"name": "bad", "url": bad.url}],
                        evaluation=_evaluation(url)) as gw, \
            aiohttp.ClientSession() as http:

        async def steady() -> None:
            for round_ in range(1000):
                await _traffic(gw, 4, tag=f"r{round_}")

        background = asyncio.create_task(steady())
        try:
            await eventually(lambda: gw.written_records >= 24)
            status, body = await _post(http, gw.admin_url + "/candidates/bad/canary",
                                       {"steps": [10, 100], "interval_s": 1.0})
            assert status == 202 and body["routing"]["canary"]["percent"] == 10
            status, body = await _post(http, gw.admin_url + "/candidates/good/canary",
                                       {"steps": [50, 100], "interval_s": 1.0})
            assert status == 409  # one canary at a time
            await eventually(lambda: gw.state.routing.canary is None, within_s=20)
            assert gw.state.routing.primary.name == "primary"  # the bad canary rolled back

            status, body = await _post(http, gw.admin_url + "/candidates/good/canary",
                                       {"steps": [50, 100], "interval_s": 1.0})
            assert status == 202
            await eventually(lambda: gw.state.routing.primary.name == "good", within_s=30)
            # The gauge follows the routing once the promoted candidate's mirroring has
            # drained (replays of the ongoing traffic may still be in flight).
            await eventually(lambda: gw.metric("understudy_canary_percent") == 0, within_s=10)
        finally:
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await background
    actions = [a for a, _, _ in await _audit(url)]
    assert actions[:3] == ["canary_start", "canary_rollback", "canary_start"], actions
    # To 100 % and promoted, or (a verdict short of PASS at 100 %, on replays scored after
    # the step up) back to 50 % to measure more, and up again.
    middle = actions[3:-1]
    assert actions[-1] == "promote" and middle == ["canary_step"] + [
        "canary_step_back", "canary_step"] * ((len(middle) - 1) // 2), actions
    steps = [d for a, _, d in await _audit(url) if a in ("canary_step", "promote")]
    assert all(d["verdict"] == "PASS" for d in steps)  # only a PASS takes 100 % (rule 3a)
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            windows = (await connection.execute(sa.text(
                "SELECT window_start FROM verdicts WHERE window_start IS NOT NULL"))).all()
    finally:
        await engine.dispose()
    assert len(windows) >= 3  # every canary judgement had its step's window


async def test_canary_validation() -> None:
    async with run_sim() as primary, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": primary.url}]) as gw, \
            aiohttp.ClientSession() as http:
        bad: list[dict[str, object]] = [{"steps": [50, 10, 100]}, {"steps": [5, 50]},
                                        {"steps": [0, 100]}, {"interval_s": 0}, {"steps": []}]
        for body in bad:
            status, _ = await _post(http, gw.admin_url + "/candidates/c/canary", body)
            assert status == 422, body
        async with http.delete(gw.admin_url + "/canary", json={}) as resp:
            assert resp.status == 409


async def test_a_restart_keeps_a_promotion_unless_the_configured_primary_changed(
    tmp_path: Any,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'r.db'}"
    async with run_sim() as primary, run_sim(variant="c") as cand, run_sim() as other:
        candidates = [{"name": "cand", "url": cand.url}]
        async with run_gateway(primary.url, candidates=candidates,
                               evaluation=_evaluation(url)) as gw, \
                aiohttp.ClientSession() as http:
            status, _ = await _post(http, gw.admin_url + "/candidates/cand/promote",
                                    {"force": True, "reason": "restart test"})
            assert status == 200
        async with run_gateway(primary.url, candidates=candidates,
                               evaluation=_evaluation(url)) as gw:
            assert gw.state.routing.primary.name == "cand"  # the promotion survived
            assert gw.state.routing.version == 2
        async with run_gateway(other.url, evaluation=_evaluation(url)) as gw:
            assert gw.state.routing.primary.url == other.url  # a new configured primary wins
            assert gw.state.routing.version == 3 and gw.state.routing.previous is None


def test_the_full_step_is_judged_on_the_scores_since_the_last_mirrored_step() -> None:
    """At 100 % nothing is mirrored: judging that step on its own window would hold forever."""
    canary = Canary(Backend("good", "http://127.0.0.1:9"), (10.0, 50.0, 100.0), 0, 1.0, 100.0)
    assert canary.judged_since == 100.0
    half = canary.next_step(200.0)
    assert half.judged_since == 200.0
    full = half.next_step(300.0)
    assert full.percent == 100.0 and full.judged_since == 200.0
    assert Canary.from_dict(full.to_dict()) == full
    assert Canary(canary.backend, (100.0,), 0, 1.0, 5.0).judged_since is None  # whole window


def test_each_judgement_of_a_step_is_one_more_look_at_its_window() -> None:
    """Rule 3c: the looks at a step's growing window are counted from where its scores
    begin, one an interval, the same on every replica; a new step begins a new window, and
    the 100 % step goes on counting the looks at the last mirrored step's."""
    canary = Canary(Backend("good", "http://127.0.0.1:9"), (10.0, 50.0, 100.0), 0, 30.0, 100.0)
    assert [canary.look(100.0 + 30.0 * k) for k in (1, 2, 3, 10)] == [1, 2, 3, 10]
    assert canary.look(100.0) == canary.look(110.0) == 1  # never before the first
    assert canary.look(100.0 + 30.0 * 4 + 9.0) == 4  # a judgement late by less than half
    half = canary.next_step(400.0)
    assert half.look(430.0) == 1
    full = half.next_step(490.0)
    assert full.look(520.0) == 4  # judged on the scores since 400: its fourth look
    assert Canary(canary.backend, (100.0,), 0, 30.0, 5.0).look(65.0) == 2  # its own start


async def _routing_change(http: aiohttp.ClientSession, gw: RunningGateway, path: str,
                          body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(gw.admin_url + path, json=body) as resp:
        return resp.status, await resp.json()


async def test_concurrent_rollbacks_of_one_routing_roll_back_once() -> None:
    """Two operators rolling back at once (or a client retrying a rollback whose answer it
    lost) each got 200, and the second undid the first: the bad primary served again. A
    change that names the routing version it was decided on is a 409 once that version is
    gone, so exactly one applies."""
    async with run_sim() as primary, run_sim() as c, run_sim() as d, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": c.url},
                                                 {"name": "d", "url": d.url}]) as gw, \
            aiohttp.ClientSession() as http:
        status, _ = await _routing_change(http, gw, "/candidates/c/promote",
                                          {"force": True, "reason": "r"})
        assert status == 200 and gw.state.routing.primary.name == "c"
        version = gw.state.routing.version
        answers = await asyncio.gather(*(
            _routing_change(http, gw, "/rollback", {"routing_version": version})
            for _ in range(3)))
        assert sorted(status for status, _ in answers) == [200, 409, 409], answers
        assert gw.state.routing.primary.name == "primary"
        assert gw.state.routing.version == version + 1
        refused = next(body for status, body in answers if status == 409)
        assert f"version {version + 1}" in refused["error"]["message"]
        # Two promotions decided on the same routing: the second would demote the first.
        version = gw.state.routing.version
        answers = await asyncio.gather(*(
            _routing_change(http, gw, f"/candidates/{name}/promote",
                            {"force": True, "reason": "r", "routing_version": version})
            for name in ("d", "c")))
        assert sorted(status for status, _ in answers) == [200, 409], answers
        assert gw.state.routing.previous is not None
        assert gw.state.routing.previous.name == "primary"
        # Without a version, as before: each applies to the routing it finds.
        status, _ = await _routing_change(http, gw, "/rollback", {})
        assert status == 200 and gw.state.routing.primary.name == "primary"


async def test_a_candidate_live_names_the_model_it_serves() -> None:
    """A candidate whose ``model`` rewrite was judged on its mirrored requests got live
    requests (as the canary, then promoted) with the client's model name, which it does not
    serve: every one a 404. Its live requests name its model too, gzip-coded ones as well."""
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2, model="cand-model") as cand, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": cand.url,
                                                  "model": "cand-model"}]) as gw, \
            aiohttp.ClientSession() as http:

        async def statuses(tag: str, n: int, gzipped: bool = False) -> list[int]:
            out = []
            for i in range(n):
                body = json.dumps({"model": "sim-model", "stream": i % 2 == 0,
                                   "messages": [{"role": "user", "content": "hi"}]}).encode()
                headers = {"X-Session-Id": f"{tag}{i}", "Content-Type": "application/json"}
                if gzipped:
                    body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
                async with http.post(gw.base_url + "/chat/completions", data=body,
                                     headers=headers) as resp:
                    await resp.read()
                    out.append(resp.status)
            return out

        status, body = await _post(http, gw.admin_url + "/candidates/c/canary",
                                   {"steps": [50, 100], "interval_s": 600})
        assert status == 202
        assert set(await statuses("s", 30)) == {200}
        assert body["routing"]["canary"]["backend"]["model"] == "cand-model"
        assert set(await statuses("z", 10, gzipped=True)) == {200}
        live = [r for r in cand.stats.requests if "X-Forwarded-For" in r.headers]
        assert live and all(isinstance(r.body, dict) and r.body["model"] == "cand-model"
                            for r in live)
        status, body = await _post(http, gw.admin_url + "/candidates/c/promote",
                                   {"force": True, "reason": "drill"})
        assert status == 200 and body["routing"]["primary"]["model"] == "cand-model"
        assert set(await statuses("p", 6)) == {200}
        status, body = await _post(http, gw.admin_url + "/rollback", {"reason": "drill"})
        assert status == 200 and body["routing"]["previous"]["model"] == "cand-model"
        before = primary.stats.requests_seen
        assert set(await statuses("r", 4)) == {200}
        assert primary.stats.requests_seen == before + 4


async def test_a_candidate_live_is_sent_its_own_api_key(caplog: Any) -> None:
    """The canary and a promoted candidate were sent the primary's api_key: the live pool of
    every backend was built from the primary's settings. Each live backend gets its own key
    now (looked up locally, never stored in the routing), the primary its own again after a
    rollback; no key shows in the routing view, /metrics or the logs."""
    caplog.set_level(logging.DEBUG)
    secrets = ("primary-secret", "cand-own-key")
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": cand.url,
                                                  "api_key": "cand-own-key"}],
                        primary={"api_key": "primary-secret"}) as gw, \
            aiohttp.ClientSession() as http:
        status, _ = await _post(http, gw.admin_url + "/candidates/c/canary",
                                {"steps": [50, 100], "interval_s": 600})
        assert status == 202
        seen = len(primary.stats.requests)
        assert await _live_keys(http, gw, cand, "s", 30) == {"Bearer cand-own-key"}  # was
        # {"Bearer primary-secret"}; the other half of the sessions stayed on the primary:
        assert {r.headers.get("Authorization", "") for r in list(primary.stats.requests)[seen:]
                if "X-Forwarded-For" in r.headers} == {"Bearer primary-secret"}
        status, body = await _post(http, gw.admin_url + "/candidates/c/promote",
                                   {"force": True, "reason": "drill"})
        assert status == 200
        assert await _live_keys(http, gw, cand, "p", 4) == {"Bearer cand-own-key"}
        status, body = await _post(http, gw.admin_url + "/rollback", {"reason": "drill"})
        assert status == 200
        assert await _live_keys(http, gw, primary, "r", 4) == {"Bearer primary-secret"}
        async with http.get(gw.admin_url + "/routing") as resp:
            view = await resp.text()
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
        stored = json.dumps(gw.state.routing.to_dict())
    for text in (view, metrics, stored, caplog.text, json.dumps(body)):
        assert not any(secret in text for secret in secrets)


async def test_a_backend_without_local_settings_gets_no_key() -> None:
    """A routing adopted from another replica may name a candidate this one does not have:
    it is sent no key and none of the client's credentials, never the primary's key."""
    upstreams = Upstreams(UpstreamConfig(url="http://127.0.0.1:8",
                                         api_key=SecretStr("primary-secret")),
                          (CandidateConfig(name="c", url="http://127.0.0.1:9",
                                           api_key=SecretStr("cand-own-key")),),
                          credentials=CREDENTIAL_HEADERS)
    client = CIMultiDict({"Authorization": "Bearer client-key", "Accept": "*/*"})
    try:
        own = upstreams.get(Backend("c", "http://127.0.0.1:9", "m")).credentials(client)
        assert own["Authorization"] == "Bearer cand-own-key"
        elsewhere = upstreams.get(Backend("c", "http://127.0.0.1:10"))  # same name, other URL
        unknown = upstreams.get(Backend("d", "http://127.0.0.1:11"))
        for upstream in (elsewhere, unknown):
            sent = upstream.credentials(client)
            assert "Authorization" not in sent and sent["Accept"] == "*/*"
        primary = upstreams.get(Backend("primary", "http://127.0.0.1:8"))
        assert primary.credentials(client)["Authorization"] == "Bearer primary-secret"
        # A candidate changed at runtime: its open pool takes the new settings at once.
        upstreams.know(CandidateConfig(name="c", url="http://127.0.0.1:9",
                                       api_key=SecretStr("rotated")))
        own = upstreams.get(Backend("c", "http://127.0.0.1:9", "m")).credentials(client)
        assert own["Authorization"] == "Bearer rotated"
    finally:
        await upstreams.close()


async def _live_keys(http: aiohttp.ClientSession, gw: RunningGateway, sim: Any,
                     tag: str, n: int) -> set[str]:
    """The Authorization headers ``sim`` got on ``n`` live chats (sessions ``tag``0...),
    the client sending its own key."""
    seen = len(sim.stats.requests)
    for i in range(n):
        async with http.post(gw.base_url + "/chat/completions", json={
                "model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
                headers={"X-Session-Id": f"{tag}{i}",
                         "Authorization": "Bearer client-key"}) as resp:
            await resp.read()
            assert resp.status == 200
    # Live requests carry X-Forwarded-For; mirrored replays do not.
    return {r.headers.get("Authorization", "") for r in list(sim.stats.requests)[seen:]
            if "X-Forwarded-For" in r.headers}


async def test_a_candidate_removed_as_a_routing_made_it_the_canary_keeps_its_key(
        monkeypatch: Any) -> None:
    """The removal's "still live" check looked at the primary and the rollback target only:
    a routing adopted during the removal's drain that made the candidate the canary left
    its settings forgotten, and the canary's pool was opened keyless."""
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand, \
            run_gateway(primary.url, candidates=[{"name": "x", "url": cand.url,
                                                  "api_key": "cand-own-key"}]) as gw, \
            aiohttp.ClientSession() as http:
        mirror, sync = gw.state.mirror, gw.state.sync
        drain = mirror.remove_candidate

        async def drained_while_another_replica_started_a_canary(name: str) -> None:
            await drain(name)
            canary = Canary(Backend("x", cand.url), (100.0,), 0, 600.0, time.time())
            await sync.commit(partial(Routing.with_canary, canary=canary))

        monkeypatch.setattr(mirror, "remove_candidate",
                            drained_while_another_replica_started_a_canary)
        async with http.delete(gw.admin_url + "/candidates/x") as resp:
            assert resp.status == 200, await resp.text()
        assert gw.state.routing.canary is not None
        assert await _live_keys(http, gw, cand, "s", 4) == {"Bearer cand-own-key"}  # was {""}


async def test_a_candidate_url_change_is_refused_before_it_is_stored(tmp_path: Any) -> None:
    """A changed URL reached the live pools' settings only after the audit entry was
    stored, and there the mirror refused it (ValueError: a 500, an audit entry for a change
    never applied); had it gone through, the key would have stayed at the old address. It
    is refused first now, nothing stored, the key where it was."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'p.db'}"
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as old, \
            run_gateway(primary.url, candidates=[{"name": "x", "url": old.url,
                                                  "api_key": "cand-own-key"}],
                        evaluation=_evaluation(url)) as gw, \
            aiohttp.ClientSession() as http:
        config = gw.state.mirror.candidates["x"].config
        moved = "http://127.0.0.1:1"
        with pytest.raises(InvalidBody, match="cannot change"):
            await gw.state.promoter.update_candidate("x", {"url": moved})
        assert gw.state.mirror.candidates["x"].config == config
        await gw.state.sync.commit(lambda r: r.promoted(Backend("x", old.url)))
        assert await _live_keys(http, gw, old, "o", 3) == {"Bearer cand-own-key"}
    assert await _audit(url) == []  # no candidate_update entry


async def test_audit_entries_of_promote_and_rollback_mask_a_url_password(
        tmp_path: Any) -> None:
    """Promote and rollback audit entries copied the routing whole, a password inside a
    backend's URL included; the copy masks it (the stored routing keeps it to connect)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'p.db'}"
    password = "url-secret-5d1e"
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand:
        cand_url = cand.url.replace("http://", f"http://user:{password}@", 1)
        async with run_gateway(primary.url, candidates=[{"name": "c", "url": cand_url}],
                               evaluation=_evaluation(url)) as gw, \
                aiohttp.ClientSession() as http:
            status, body = await _post(http, gw.admin_url + "/candidates/c/promote",
                                       {"force": True, "reason": "drill"})
            assert status == 200, body
            status, body = await _post(http, gw.admin_url + "/rollback", {"reason": "drill"})
            assert status == 200, body
            assert gw.state.routing.previous == Backend("c", cand_url)
    entries = {action: detail for action, _, detail in await _audit(url)}
    for action in ("promote", "rollback"):
        text = json.dumps(entries[action])
        assert password not in text and "user:***@" in text, text


async def test_a_pool_opened_without_local_settings_is_counted() -> None:
    """A live backend this replica has no settings for (a candidate added at runtime and
    promoted elsewhere, or here before a restart) was visible only as one warning."""
    metrics = GatewayMetrics()
    upstreams = Upstreams(UpstreamConfig(url="http://127.0.0.1:8"),
                          (CandidateConfig(name="c", url="http://127.0.0.1:9"),), metrics,
                          credentials=CREDENTIAL_HEADERS)
    try:
        upstreams.get(Backend("c", "http://127.0.0.1:9"))
        upstreams.get(Backend("primary", "http://127.0.0.1:8"))
        upstreams.get(Backend("d", "http://127.0.0.1:11"))
        upstreams.get(Backend("d", "http://127.0.0.1:11"))  # its pool, opened once
    finally:
        await upstreams.close()
    text = metrics.exposition().decode()
    assert 'understudy_live_backend_without_settings_total{backend="d"} 1.0' in text
    assert 'backend="c"' not in text and 'backend="primary"' not in text
