"""Security defaults (issue 12 items 6-10), over real sockets against a running gateway."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from typing import Any

import aiohttp
import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from tests.utils import answering_once, eventually, free_port, run_gateway, run_sim

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
        # Trusted with the client's credentials: every header that carries one.
        assert trusted_got["X-Goog-Api-Key"] == "goog-1"
        assert trusted_got["OpenAI-Organization"] == "org-1"
        assert "X-Tenant" not in trusted_got  # plain's extra is plain's alone
        # A custom auth header is no credential until [mirror].credential_headers names
        # it: like any other unnamed header it never reaches a replay.
        assert "X-Acme-Auth" not in trusted_got


async def test_a_live_candidate_gets_no_client_credential_without_forward_credentials(
) -> None:
    """The canary and a promoted candidate were sent every client header but
    Authorization, Cookie, x-api-key and api-key: X-Goog-Api-Key, X-Auth-Token and
    OpenAI-Organization reached a candidate not trusted with credentials. Now none of the
    credential headers does, nor one named in [mirror].credential_headers; the client's
    other headers still do (it answers the client as the primary would)."""
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as plain, \
            run_sim(ttft_ms=0, itl_ms=0, tokens=2) as trusted, \
            run_gateway(primary.url, candidates=[
                {"name": "plain", "url": plain.url, "sample_rate": 0.0},
                {"name": "trusted", "url": trusted.url, "sample_rate": 0.0,
                 "forward_credentials": True}],
                mirror={"credential_headers": ["X-Acme-Auth"]}) as gw, \
            aiohttp.ClientSession() as http:
        headers = {**SECRET_HEADERS, "X-Session-Id": "s-1", "X-Tenant": "t-1"}
        for name, sim in (("plain", plain), ("trusted", trusted)):
            async with http.post(f"{gw.admin_url}/candidates/{name}/canary",
                                 json={"steps": [100], "interval_s": 600}) as resp:
                assert resp.status == 202, await resp.text()
            assert (await _post(gw.url, headers)).status == 200
            got = sim.stats.requests[-1].headers
            assert got["X-Tenant"] == "t-1" and got["X-Forwarded-For"]  # served live
            if name == "plain":
                for secret in ("Authorization", "Cookie", "X-Auth-Token", "X-Goog-Api-Key",
                               "OpenAI-Organization", "X-Acme-Auth"):
                    assert secret not in got, secret
            else:
                for secret in ("Authorization", "X-Goog-Api-Key", "X-Acme-Auth"):
                    assert got[secret] == SECRET_HEADERS[secret], secret
            async with http.delete(f"{gw.admin_url}/canary") as resp:
                assert resp.status == 200, await resp.text()


async def test_a_primary_with_its_own_key_gets_none_of_the_client_credentials() -> None:
    """A primary with an api_key got the client's X-Goog-Api-Key, X-Auth-Token and
    OpenAI-Organization beside the gateway's own key."""
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_gateway(primary.url, primary={"api_key": "gateway-key"}) as gw:
        assert (await _post(gw.url, SECRET_HEADERS)).status == 200
        got = primary.stats.requests[-1].headers
        assert got["Authorization"] == "Bearer gateway-key"
        for secret in ("Cookie", "X-Auth-Token", "X-Goog-Api-Key", "OpenAI-Organization"):
            assert secret not in got, secret
        assert got["X-Acme-Auth"] == "acme-1"  # not named a credential here


# -- item 6: slowloris and connection bounds ----------------------------------------------

async def _trickler(port: int, seconds: float) -> float | None:
    """Send one header byte a second; the time the gateway closed the connection."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"[: int(seconds)]:
            writer.write(bytes([byte]))
            try:
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                    return loop.time() - started
            except TimeoutError:
                continue
            except ConnectionError:
                return loop.time() - started
        return None
    finally:
        writer.close()


async def test_slowloris_connections_are_closed_while_requests_are_served() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_gateway(primary.url, server={"header_timeout_s": 2.0}) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        trickle = [asyncio.create_task(_trickler(port, 8)) for _ in range(50)]
        # All 50 admitted before the requests (on a loaded machine some may be closed
        # already, past header_timeout_s).
        await eventually(lambda: gw.metric("understudy_connections_open") + gw.metric(
            "understudy_connections_closed_total", reason="header_timeout") == 50)
        async with aiohttp.ClientSession() as session:
            for _ in range(5):  # served throughout
                async with session.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
                await asyncio.sleep(0.3)
        closed_after = await asyncio.gather(*trickle)
        assert all(t is not None and t < 4.0 for t in closed_after), closed_after
        assert gw.metric("understudy_connections_closed_total", reason="header_timeout") == 50
        await eventually(lambda: gw.metric("understudy_connections_open") == 0)


async def test_connection_limits_answer_503_json_and_count() -> None:
    async with run_sim(ttft_ms=0, itl_ms=0, tokens=2) as primary, \
            run_gateway(primary.url, server={"max_connections_per_ip": 3}) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert json.loads(body)["error"]["type"] == "server_busy"
        assert gw.metric("understudy_connections_closed_total",
                         reason="max_connections_per_ip") == 1
        for _, w in held:
            w.close()
        await eventually(lambda: gw.metric("understudy_connections_open") == 0)
        assert (await _post(gw.url, {})).status == 200


async def test_idle_keepalive_connections_are_closed_and_counted() -> None:
    async with run_sim() as primary, \
            run_gateway(primary.url, server={"keepalive_timeout_s": 0.5}) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"}")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert gw.metric("understudy_connections_closed_total", reason="keepalive_timeout") == 1


# -- item 10: header bounds answer OpenAI-style JSON -----------------------------------------

async def test_many_headers_totalling_over_the_bound_answer_431_json() -> None:
    async with run_sim() as primary, run_gateway(primary.url) as gw:
        headers = {f"X-Pad-{i}": "v" * 1000 for i in range(40)}
        async with aiohttp.ClientSession() as session, \
                session.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert r.status == 431
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        assert primary.stats.requests_seen == 0
        assert gw.metric("understudy_requests_rejected_total", reason="headers_too_large") == 1


async def test_aiohttp_own_header_errors_are_openai_json() -> None:
    async with run_sim() as primary, run_gateway(primary.url) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        for headers in ({"X-Big": "v" * 20_000}, {f"X-Pad-{i}": "v" * 1000 for i in range(100)}):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode())
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.split(b" ", 2)[1] == b"431", head
            assert b"application/json" in head
            assert json.loads(body)["error"]["code"] == 431
        assert gw.metric("understudy_connections_closed_total", reason="headers_too_large") == 2


async def test_502_names_the_upstream_not_its_address_nor_its_bytes() -> None:
    port = free_port()  # nothing listens there
    async with run_gateway(f"http://127.0.0.1:{port}") as gw:
        response = await _post(gw.url, {})
        assert response.status == 502
        async with aiohttp.ClientSession() as session, \
                session.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
            body = await r.json()
        assert body["error"]["type"] == "upstream_error"
        assert "127.0.0.1" not in body["error"]["message"] and str(port) not in str(body)

    garbage = b"HTTP/1.1 200 OK\r\nX-Secret-Inside: 10.0.0.7\x00\x01\r\n\r\n"
    async with answering_once(garbage) as url, run_gateway(url) as gw:
        async with aiohttp.ClientSession() as session, \
                session.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 502
            text = await r.text()
        assert "10.0.0.7" not in text and "Secret" not in text


# -- item 9: SSRF and secrets in URLs ----------------------------------------------------

async def test_admin_refuses_metadata_service_and_own_destinations(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with run_sim() as primary, run_sim() as cand, \
            run_gateway(primary.url, admin={"allowed_candidate_hosts": ["127.0.0.1:6379"]}) as gw, \
            aiohttp.ClientSession() as session:
        gw_port = gw.url.rsplit(":", 1)[1]
        admin_port = gw.admin_url.split(":")[2].split("/")[0]
        refused = [
            "http://169.254.169.254/latest", "http://[fe80::1]:8000", "http://100.100.100.200",
            "http://metadata.google.internal", "http://[::ffff:169.254.169.254]:80",
            "http://127.0.0.1:5432", "http://localhost:3306", "http://10.0.0.5:5672",
            f"http://127.0.0.1:{gw_port}", f"http://localhost:{admin_port}",
            "http://0.0.0.0:8000",
        ]
        for i, url in enumerate(refused):
            async with session.post(gw.admin_url + "/candidates",
                                    json={"name": f"c{i}", "url": url}) as r:
                assert r.status == 422, url
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        assert gw.state.mirror.candidates == {}
        # A loopback sim on an ordinary port, and an allowed service port, are fine; the
        # password is masked in the answer, the list and the log.
        secret_url = cand.url.replace("http://", "http://user:hunter2@")
        for name, url in (("sim", secret_url), ("allowed", "http://127.0.0.1:6379")):
            async with session.post(gw.admin_url + "/candidates",
                                    json={"name": name, "url": url}) as r:
                assert r.status == 201, await r.text()
                assert "hunter2" not in await r.text()
        async with session.get(gw.admin_url + "/candidates") as r:
            listed = await r.text()
        assert "hunter2" not in listed and "user:***@" in listed
    assert "hunter2" not in caplog.text


async def test_routing_answers_never_hold_a_password() -> None:
    """GET /routing and each routing change's answer showed the primary's and the rollback
    target's URLs whole, password and all (the candidates' answers masked them)."""
    async with run_sim() as primary, run_sim() as cand:
        primary_url = primary.url.replace("http://", "http://user:hunter2@")
        secret_url = cand.url.replace("http://", "http://user:hunter2@")
        async with run_gateway(primary_url, candidates=[{"name": "c", "url": secret_url}]) \
                as gw, aiohttp.ClientSession() as session:
            answers = []
            async with session.get(gw.admin_url + "/routing") as r:
                answers.append(await r.text())
            async with session.post(gw.admin_url + "/candidates/c/promote",
                                    json={"force": True, "reason": "test"}) as r:
                assert r.status == 200, await r.text()
                answers.append(await r.text())
            async with session.get(gw.admin_url + "/routing") as r:
                answers.append(await r.text())
            assert gw.state.routing.primary.url == secret_url  # routed with the real URL
    for answer in answers:
        assert "hunter2" not in answer and "user:***@" in answer, answer


def test_backends_rows_never_hold_a_password() -> None:
    async def main() -> list[str | None]:
        from sqlalchemy import select

        from evaluators.store import StoreConfig, create_engine, upgrade
        from evaluators.store._queries import register_backend
        from evaluators.store._schema import BackendRow
        with tempfile.TemporaryDirectory() as tmp:
            config = StoreConfig(url=f"sqlite+aiosqlite:///{tmp}/s.db")
            await upgrade(config.url)
            engine = create_engine(config)
            try:
                async with engine.begin() as conn, AsyncSession(bind=conn) as session:
                    await register_backend(session, "c", role="candidate",
                                           url="http://u:hunter2@10.0.0.1:8000")
                    await session.commit()
                async with engine.connect() as conn:
                    return list((await conn.execute(select(BackendRow.url))).scalars())
            finally:
                await engine.dispose()

    assert asyncio.run(main()) == ["http://u:***@10.0.0.1:8000"]


# -- the admin API against a browser on another site -------------------------------------

async def test_a_tokenless_admin_api_refuses_cross_site_and_rebound_browser_requests() -> None:
    """Without a token (loopback only) any web page the operator opened could change the
    gateway: a form or a no-cors fetch POSTing text/plain added a candidate at the page's
    own address with the clients' credentials forwarded (every mirrored prompt and API key
    sent to it), paused or promoted one; a DNS-rebound name reached it as its own origin."""
    async with run_sim() as sim, run_gateway(sim.url) as gw, \
            aiohttp.ClientSession() as session:
        admin_port = gw.admin_url.split(":")[2].split("/")[0]
        body = json.dumps({"name": "exfil", "url": sim.url, "forward_credentials": True})
        text = {"Content-Type": "text/plain"}
        refused: list[dict[str, str]] = [
            {**text, "Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"},
            {**text, "Origin": "https://evil.example"},  # a browser without Sec-Fetch-*
            {**text, "Origin": "null"},  # a sandboxed frame, a data: URL
            {**text, "Sec-Fetch-Site": "same-site"},  # another port of the same host
            # DNS rebinding: evil.example resolves to 127.0.0.1, its page is same-origin.
            {**text, "Host": f"evil.example:{admin_port}",
             "Origin": f"http://evil.example:{admin_port}", "Sec-Fetch-Site": "same-origin"},
        ]
        for headers in refused:
            async with session.post(gw.admin_url + "/candidates", data=body,
                                    headers=headers) as r:
                assert r.status == 403, (headers, r.status, await r.text())
                assert (await r.json())["error"]["type"] == "permission_error"
            async with session.get(gw.admin_url + "/candidates", headers=headers) as r:
                assert r.status == 403, headers
        assert gw.state.mirror.candidates == {}
        # The CLI, curl and the scorecard page itself are served as before.
        admitted: list[dict[str, str]] = [
            {}, {"Host": f"localhost:{admin_port}"}, {"Host": f"[::1]:{admin_port}"},
            {"Origin": f"http://127.0.0.1:{admin_port}", "Sec-Fetch-Site": "same-origin"},
            {"Sec-Fetch-Site": "none"},
        ]
        for i, headers in enumerate(admitted):
            async with session.post(gw.admin_url + "/candidates", headers=headers,
                                    json={"name": f"c{i}", "url": sim.url}) as r:
                assert r.status == 201, (headers, await r.text())
        root = gw.admin_url.removesuffix("/admin/v1")
        async with session.get(root + "/admin/ui", headers={"Sec-Fetch-Site": "cross-site"}) as r:
            assert r.status == 200  # a link to the page from elsewhere opens it


async def test_admin_answers_are_not_cached_sniffed_or_framed() -> None:
    """The page's files carried no-store, nosniff and frame-ancestors; the API's answers,
    the operator's data read with the token, carried none of them."""
    token = "headers-admin-token"
    async with run_sim() as sim, run_gateway(sim.url, admin={"token": token}) as gw, \
            aiohttp.ClientSession() as session:
        for headers in ({"Authorization": f"Bearer {token}"}, {}):
            for path in ("/candidates", "/routing", "/openapi.json", "/nothing"):
                async with session.get(gw.admin_url + path, headers=headers) as r:
                    await r.read()
                    assert r.headers.get("Cache-Control") == "no-store", (path, r.headers)
                    assert r.headers.get("X-Content-Type-Options") == "nosniff", path
                    assert "frame-ancestors 'none'" in r.headers.get(
                        "Content-Security-Policy", ""), path
                    assert token not in str(r.headers)
