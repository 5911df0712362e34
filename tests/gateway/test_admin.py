"""The admin API: auth, validation, and candidates changed at runtime without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pydantic import ValidationError

from gateway._admin import check_admin_binding
from gateway._config import MIN_ADMIN_TOKEN_LENGTH, AdminConfig, load_config
from tests.utils import eventually, run_gateway, run_sim

TOKEN = "s3cr3t-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def _call(http: aiohttp.ClientSession, method: str, url: str,
                **kwargs: Any) -> tuple[int, Any]:
    async with http.request(method, url, **kwargs) as resp:
        assert resp.content_type == "application/json"
        return resp.status, await resp.json()


async def test_auth_missing_or_wrong_token_is_401_and_token_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with run_sim() as sim, run_gateway(sim.url, admin={"token": TOKEN}) as gw, \
            aiohttp.ClientSession() as http:
        url = gw.admin_url + "/candidates"
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            status, body = await _call(http, "GET", url, headers=headers)
            assert status == 401 and body["error"]["type"] == "authentication_error"
        status, body = await _call(http, "GET", url, headers=AUTH)
        assert status == 200 and body == {"candidates": []}
        status, _ = await _call(http, "POST", url, headers=AUTH,
                                json={"name": "c", "url": sim.url})
        assert status == 201
    assert TOKEN not in caplog.text


def test_no_token_refuses_non_loopback() -> None:
    check_admin_binding(AdminConfig(host="127.0.0.1"))
    check_admin_binding(AdminConfig(host="0.0.0.0", token=TOKEN))
    with pytest.raises(ValueError, match="needs a token"):
        check_admin_binding(AdminConfig(host="0.0.0.0"))


@pytest.mark.parametrize("blank", ["", " ", "\t\n  "])
def test_an_empty_or_blank_token_is_no_token(blank: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert AdminConfig(token=blank).token is None
    with pytest.raises(ValueError, match="needs a token"):
        check_admin_binding(AdminConfig(host="0.0.0.0", token=blank))
    # The same through the environment, as `UNDERSTUDY_ADMIN__TOKEN= understudy serve`.
    monkeypatch.setenv("UNDERSTUDY_ADMIN__HOST", "0.0.0.0")
    monkeypatch.setenv("UNDERSTUDY_ADMIN__TOKEN", blank)
    monkeypatch.setenv("UNDERSTUDY_ADMIN_TOKEN", blank)
    config = load_config(None)
    assert config.admin.token is None
    with pytest.raises(ValueError, match="needs a token"):
        check_admin_binding(config.admin)


def test_a_short_token_is_refused_without_echoing_it() -> None:
    short = "x" * (MIN_ADMIN_TOKEN_LENGTH - 1)
    with pytest.raises(ValidationError, match=f"at least {MIN_ADMIN_TOKEN_LENGTH}") as caught:
        AdminConfig(token=short)
    assert short not in str(caught.value)
    padded = f"  {'y' * MIN_ADMIN_TOKEN_LENGTH}\n"  # e.g. read from a file with its newline
    token = AdminConfig(token=padded).token
    assert token is not None and token.get_secret_value() == padded.strip()


@pytest.mark.parametrize(("token", "refusal"), [
    ("", "needs a token"),
    ("   ", "needs a token"),
    ("short-token", f"at least {MIN_ADMIN_TOKEN_LENGTH} characters"),
])
def test_serve_refuses_a_weak_token_on_every_interface(token: str, refusal: str) -> None:
    env = {**os.environ, "UNDERSTUDY_ADMIN__HOST": "0.0.0.0", "UNDERSTUDY_ADMIN__TOKEN": token,
           "UNDERSTUDY_EVALUATION__ENABLED": "false"}
    env.pop("UNDERSTUDY_ADMIN_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--primary", "http://127.0.0.1:9",
         "--port", "0", "--admin-port", "0"],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert refusal in done.stderr and "Traceback" not in done.stderr
    assert not token.strip() or token not in done.stderr


async def test_an_empty_bearer_value_never_authenticates() -> None:
    async with run_sim() as sim, run_gateway(sim.url, admin={"token": TOKEN}) as gw, \
            aiohttp.ClientSession() as http:
        for value in ("Bearer ", "Bearer    ", "Bearer", "bearer \t", " ", ""):
            status, body = await _call(http, "GET", gw.admin_url + "/candidates",
                                       headers={"Authorization": value})
            assert status == 401 and body["error"]["type"] == "authentication_error", value


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/candidates", b"{not json", 422),
    ("POST", "/candidates", {"name": "x"}, 422),                        # url missing
    ("POST", "/candidates", {"name": "bad name!", "url": "http://a"}, 422),
    ("POST", "/candidates", {"name": "x", "url": "ftp://a"}, 422),
    ("POST", "/candidates", {"name": "x", "url": "http://a", "sample_rate": 2}, 422),
    ("POST", "/candidates", {"name": "x", "url": "http://a", "bogus": 1}, 422),
    ("PATCH", "/candidates/c", {"sample_rate": -0.1}, 422),
    ("PATCH", "/candidates/c", {"max_concurrency": 0}, 422),
    ("PATCH", "/candidates/c", {"url": "http://elsewhere"}, 422),
    ("PATCH", "/candidates/nope", {"sample_rate": 0.5}, 404),
    ("GET", "/candidates/nope", None, 404),
    ("DELETE", "/candidates/nope", None, 404),
    ("POST", "/candidates/nope/pause", None, 404),
    ("GET", "/nothing-here", None, 404),
    ("PUT", "/candidates", None, 405),
    ("POST", "/candidates", {"name": "c", "url": "http://127.0.0.1:9"}, 409),  # exists
])
async def test_validation_errors_are_clear_4xx(method: str, path: str, body: Any,
                                               status: int) -> None:
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}]) as gw, \
            aiohttp.ClientSession() as http:
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        got, answer = await _call(http, method, gw.admin_url + path, **kwargs)
        assert got == status, answer
        assert answer["error"]["code"] == status and answer["error"]["message"]


async def test_candidates_change_at_runtime() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as cand, \
            run_gateway(primary.url) as gw, aiohttp.ClientSession() as http:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")

        async def traffic(n: int, tag: str) -> None:
            for i in range(n):
                await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                     user=f"{tag}-{i}")

        status, view = await _call(http, "POST", gw.admin_url + "/candidates",
                                   json={"name": "c", "url": cand.url, "max_concurrency": 2})
        assert status == 201 and view["max_concurrency"] == 2
        await traffic(4, "a")
        await eventually(lambda: cand.stats.requests_seen == 4)

        _, view = await _call(http, "POST", gw.admin_url + "/candidates/c/pause")
        assert view["paused"] is True
        await traffic(3, "b")
        assert gw.metric("understudy_mirror_dropped_total", candidate="c", reason="paused") == 3
        await _call(http, "POST", gw.admin_url + "/candidates/c/resume")

        _, view = await _call(http, "PATCH", gw.admin_url + "/candidates/c",
                              json={"sample_rate": 0.0, "max_concurrency": 1})
        assert view["sample_rate"] == 0.0 and view["max_concurrency"] == 1
        await eventually(lambda: len(gw.state.mirror.candidates["c"].workers) == 1)
        await traffic(3, "c")
        assert gw.metric("understudy_mirror_dropped_total", candidate="c",
                         reason="not_sampled") == 3

        _, listing = await _call(http, "GET", gw.admin_url + "/candidates")
        assert [c["name"] for c in listing["candidates"]] == ["c"]
        status, _ = await _call(http, "DELETE", gw.admin_url + "/candidates/c")
        assert status == 200
        assert "c" not in gw.state.mirror.candidates
        await traffic(2, "d")
        assert cand.stats.requests_seen == 4
        await eventually(lambda: gw.state.mirror.budget.used == 0)
        await client.close()


async def test_removed_stalled_candidate_returns_its_budget_bytes() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(fault="hang_before_first_byte") as cand, \
            run_gateway(primary.url, candidates=[{"name": "slow", "url": cand.url,
                                                  "max_concurrency": 1}],
                        mirror={"drain_timeout_s": 0.1}) as gw, \
            aiohttp.ClientSession() as http:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        for i in range(5):
            await client.chat.completions.create(model="sim-model", messages=CHAT, user=f"{i}")
        await client.close()
        assert gw.state.mirror.budget.used > 0
        await _call(http, "DELETE", gw.admin_url + "/candidates/slow")
        assert gw.state.mirror.budget.used == 0
        # Counted as dropped (the sample-bias check's tally, bound for the store); its
        # Prometheus series went with it (_metrics rule 2).
        assert sum(c.count for c in gw.state.mirror.traffic.drain()
                   if (c.candidate, c.outcome) == ("slow", "removed")) == 5
        assert gw.metric("understudy_mirror_dropped_total", candidate="slow",
                         reason="removed") == 0


async def test_openapi_document_describes_every_route() -> None:
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        status, doc = await _call(http, "GET", gw.admin_url + "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/candidates", "/candidates/{name}", "/candidates/{name}/pause"} <= set(doc["paths"])
    assert "CandidateConfig" in doc["components"]["schemas"]


async def test_two_changes_of_one_candidate_at_once_each_keep_the_others_field(
        tmp_path: Any) -> None:
    """Each PATCH built the candidate's new settings before it waited for the store (its
    audit entry) and the other change: the later one put back the field the earlier one had
    changed, and both answered 200."""
    store = f"sqlite+aiosqlite:///{tmp_path / 's.db'}"
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}],
                        evaluation={"enabled": True, "store": {"url": store}}) as gw, \
            aiohttp.ClientSession() as http:
        url = gw.admin_url + "/candidates/c"
        answers = await asyncio.gather(
            _call(http, "PATCH", url, json={"sample_rate": 0.25}),
            _call(http, "PATCH", url, json={"max_concurrency": 2}),
            _call(http, "PATCH", url, json={"buffer_items": 7}))
        assert [status for status, _ in answers] == [200, 200, 200]
        _, view = await _call(http, "GET", url)
        assert (view["sample_rate"], view["max_concurrency"], view["buffer_items"]) == \
            (0.25, 2, 7)
