"""Security defaults (issue 12 items 6-10), over real sockets against a running gateway."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.utils import eventually, run_gateway, run_sim

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
SECRET_HEADERS = {
    "Authorization": "Bearer client-secret",
    "X-Auth-Token": "tok-1",
    "X-Goog-Api-Key": "goog-1",
    "OpenAI-Organization": "org-1",
    "X-Acme-Auth": "acme-1",
    "Cookie": "session=abc",
    "X-Forwarded-For": "10.1.2.3",
}


async def _post(url: str, headers: dict[str, str], body: Any = None) -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", json=body or CHAT, headers=headers) as response:
        await response.read()
        return response


async def test_candidates_receive_only_allowed_headers() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as plain, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as trusted, \
            run_gateway(primary.url, candidates=[
                {"name": "plain", "url": plain.url, "forward_headers": ["X-Tenant"]},
                {"name": "trusted", "url": trusted.url, "forward_credentials": True}],
                mirror={"forward_headers": ["X-Trace"]}) as gw:
        headers = {**SECRET_HEADERS, "X-Session-Id": "s-1", "X-Tenant": "t-1",
                   "X-Trace": "tr-1", "Accept": "application/json"}
        response = await _post(gw.url, headers)
        assert response.status == 200
        await eventually(lambda: len(gw.sink) == 2)
        # The primary is the service the client called: it gets the request as sent.
        assert primary.stats.requests[-1].headers["X-Auth-Token"] == "tok-1"
        got = plain.stats.requests[-1].headers
        for name in SECRET_HEADERS:
            assert name not in got, name
        assert got["X-Session-Id"] == "s-1"
        assert got["X-Tenant"] == "t-1" and got["X-Trace"] == "tr-1"
        assert got["Content-Type"] == "application/json" and got["Accept"] == "application/json"
        assert got["X-Request-Id"]
        trusted_got = trusted.stats.requests[-1].headers
        assert trusted_got["Authorization"] == "Bearer client-secret"
        assert "X-Tenant" not in trusted_got  # plain's extra is plain's alone
        for name in ("X-Auth-Token", "X-Goog-Api-Key", "OpenAI-Organization", "X-Acme-Auth"):
            assert name not in trusted_got, name
