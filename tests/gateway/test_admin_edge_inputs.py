"""Edge inputs at the gateway's HTTP surfaces, each answered with the right 4xx in OpenAI's
error shape (or served), never a 500, and never at the cost of data already accepted."""

from __future__ import annotations

import asyncio
import gzip
import logging
from typing import Any

import aiohttp
import orjson
import pytest
from pydantic import ValidationError

from gateway._admin import MAX_ADMIN_BODY_BYTES, MIN_CANARY_INTERVAL_S, admin_openapi
from gateway._config import MAX_CANDIDATES, load_config
from tests.utils import eventually, run_gateway, run_sim

TOKEN = "edge-admin-token-0123"
CHAT = orjson.dumps({"model": "sim-model", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "hi"}]})


async def _call(http: aiohttp.ClientSession, method: str, url: str,
                **kwargs: Any) -> tuple[int, Any]:
    async with http.request(method, url, **kwargs) as resp:
        assert resp.content_type == "application/json", (method, url, await resp.text())
        return resp.status, await resp.json()


def _is_error(body: Any, status: int) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str) and error.get("code") == status)


async def _raw_chat(url: str, extra_headers: bytes) -> bytes:
    """POST a chat with header bytes no HTTP client library would send; the status line."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n" + extra_headers
                     + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(CHAT) + CHAT)
        async with asyncio.timeout(10):
            answer = await reader.read()
    finally:
        writer.close()
    return answer.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("url", ["http://", "http:///v1", "http://[::1",
                                 "http://127.0.0.1:99999", "http://u:pw-s3cret@127.0.0.1:x"])
async def test_a_candidate_url_without_a_valid_host_or_port_is_422(url: str) -> None:
    """These were 500s (yarl's ValueError past the handler), and "http://" was stored as a
    change before building the candidate failed."""
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        status, body = await _call(http, "POST", gw.admin_url + "/candidates",
                                   json={"name": "c", "url": url})
        assert status == 422 and _is_error(body, 422), body
        assert "url" in body["error"]["message"] and "s3cret" not in body["error"]["message"]
        assert (await _call(http, "GET", gw.admin_url + "/candidates")) == (
            200, {"candidates": []})
        async with http.post(gw.base_url + "/chat/completions", data=CHAT,
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200


def test_a_configured_url_without_a_host_is_a_config_error_that_hides_it() -> None:
    with pytest.raises(ValidationError, match="not a valid URL") as caught:
        load_config(None, {"primary": {"url": "http://user:pw-s3cret@[::1"}})
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/candidates", b'{"name": "x", "url": "%s", "sample_rate": "0.5"}'),
    ("POST", "/candidates", b'{"name": "x", "url": "%s", "sample_rate": true}'),
    ("POST", "/candidates", b'{"name": "x", "url": "%s", "request_timeout_s": Infinity}'),
    ("POST", "/candidates", b'{"name": "x", "url": "%s", "connect_timeout_s": 1e400}'),
    ("PATCH", "/candidates/c", b'{"forward_credentials": "yes"}'),
    ("PATCH", "/candidates/c", b'{"forward_credentials": 1}'),
    ("PATCH", "/candidates/c", b'{"max_concurrency": "8"}'),
    ("PATCH", "/candidates/c", b'{"request_timeout_s": Infinity}'),
    ("POST", "/candidates/c/canary", b'{"interval_s": true}'),
    ("POST", "/candidates/c/canary", b'{"steps": [true, 100]}'),
    ("POST", "/candidates/c/canary", b'{"steps": [NaN, 100]}'),
    ("POST", "/candidates/c/promote", b'{"force": "true", "reason": "r"}'),
])
async def test_admin_bodies_take_json_types_as_they_are(method: str, path: str,
                                                       body: bytes) -> None:
    """A string or boolean where a number or flag belongs, or NaN/Infinity, is a 422: lax
    coercion had made `"interval_s": true` a canary stepping every second."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}]) as gw, \
            aiohttp.ClientSession() as http:
        status, answer = await _call(http, method, gw.admin_url + path,
                                     data=body.replace(b"%s", sim.url.encode()),
                                     headers={"Content-Type": "application/json"})
        assert status == 422 and _is_error(answer, 422), answer
        _, view = await _call(http, "GET", gw.admin_url + "/candidates/c")
        assert view["forward_credentials"] is False and view["max_concurrency"] == 4
        assert (await _call(http, "GET", gw.admin_url + "/routing"))[1]["canary"] is None
        # Integers where floats belong are JSON numbers all the same.
        status, view = await _call(http, "PATCH", gw.admin_url + "/candidates/c",
                                   json={"sample_rate": 0, "request_timeout_s": 30})
        assert status == 200 and view["sample_rate"] == 0.0


async def test_non_utf8_session_and_request_ids_are_served_and_stored(tmp_path: Any) -> None:
    """Header bytes that are not UTF-8 reach the gateway as lone surrogates: they made every
    such request a 500 while a canary ran (or a sample rate was below 1), and failed the
    score writer's whole batch, other clients' exchanges with it."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'edge.db'}"
    async with run_sim(ttft_ms=1, itl_ms=1, tokens=4) as primary, \
            run_sim(ttft_ms=1, itl_ms=1, tokens=4) as candidate, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": candidate.url}],
                        evaluation={"enabled": True, "store": {"url": url}}) as gw, \
            aiohttp.ClientSession() as http:
        for i in range(4):
            assert await _raw_chat(gw.url, b"X-Request-Id: r-\xff\xfe-%d\r\n"
                                   b"X-Session-Id: s-\xc3\x28-%d\r\n" % (i, i)) == (
                b"HTTP/1.1 200 OK")
            assert await _raw_chat(gw.url, b"X-Request-Id: plain-%d\r\n" % i) == (
                b"HTTP/1.1 200 OK")
        await eventually(lambda: gw.written_records >= 8, within_s=30)

        status, _ = await _call(http, "POST", gw.admin_url + "/candidates/cand/canary",
                                json={"steps": [50, 100], "interval_s": 3600})
        assert status == 202
        for i in range(4):
            assert await _raw_chat(gw.url, b"X-Session-Id: s-\xff-%d\r\n" % i) == (
                b"HTTP/1.1 200 OK")


async def test_the_proxys_own_routes_answer_404_and_405_in_json() -> None:
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            for path in ("/health", "/metrics"):
                async with http.request(method, gw.url + path) as resp:
                    assert resp.status == 405, (method, path)
                    assert resp.content_type == "application/json"
                    assert _is_error(await resp.json(), 405)
                    assert resp.headers["Allow"] == "GET, HEAD"
        for path in ("/", "/v1", "/V1/models", "/admin/v1/candidates", "/nope?x=%ff"):
            status, body = await _call(http, "GET", gw.url + path)
            assert status == 404 and _is_error(body, 404), path
        async with http.head(gw.url + "/health") as resp:
            assert resp.status == 200
        status, body = await _call(http, "GET", gw.url + "/health")
        assert status == 200 and body["status"] == "ok"


async def test_a_candidate_cannot_take_a_routed_backends_name() -> None:
    """A candidate named as the primary (or as the rollback target, at another URL) would
    rewrite that backend's row in the store, under the scores it already has."""
    async with run_sim() as primary, run_sim(variant="b") as other, \
            run_gateway(primary.url, candidates=[{"name": "c", "url": other.url}]) as gw, \
            aiohttp.ClientSession() as http:
        candidates = gw.admin_url + "/candidates"
        status, body = await _call(http, "POST", candidates,
                                   json={"name": "primary", "url": other.url})
        assert status == 409 and _is_error(body, 409), body
        status, body = await _call(http, "POST", candidates + "/c/promote",
                                   json={"force": True, "reason": "edge test"})
        assert status == 200 and body["routing"]["previous"]["name"] == "primary", body
        status, body = await _call(http, "POST", candidates,
                                   json={"name": "c", "url": other.url})
        assert status == 409 and "primary" in body["error"]["message"]
        status, body = await _call(http, "POST", candidates,
                                   json={"name": "primary", "url": other.url})
        assert status == 409 and "rollback target" in body["error"]["message"]
        # The old primary, where it is, may be mirrored to (compared with its successor).
        status, _ = await _call(http, "POST", candidates,
                                json={"name": "primary", "url": primary.url})
        assert status == 201


async def _raw_admin(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


@pytest.mark.parametrize("authorization", [b"Bearer " + TOKEN.encode() + b"\xff",
                                           b"Bearer \xff\xfe", b"Bearer \xc3\x28"])
async def test_a_token_with_non_utf8_bytes_is_401_not_500(authorization: bytes) -> None:
    async with run_sim() as sim, run_gateway(sim.url, admin={"token": TOKEN}) as gw:
        answer = await _raw_admin(gw.admin_url, b"GET /admin/v1/routing HTTP/1.1\r\nHost: x\r\n"
                                  b"Authorization: " + authorization
                                  + b"\r\nConnection: close\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401 "), head
        assert _is_error(orjson.loads(body), 401)
        async with aiohttp.ClientSession() as http:
            status, _ = await _call(http, "GET", gw.admin_url + "/routing",
                                    headers={"Authorization": f"Bearer {TOKEN}"})
            assert status == 200


async def test_a_body_cut_short_is_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A client that leaves before its declared body is whole: nobody to answer, and no
    'Error handling request' traceback in the log either."""
    caplog.set_level(logging.DEBUG)
    async with run_sim() as sim, run_gateway(sim.url) as gw:
        for method, path in (("POST", "/candidates"), ("POST", "/rollback")):
            host, port = gw.admin_url.removeprefix("http://").split("/")[0].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"{method} /admin/v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
                         + b"Content-Length: 100\r\nConnection: close\r\n\r\n{\"name\"")
            writer.write_eof()
            async with asyncio.timeout(10):
                await reader.read()
            writer.close()
        async with aiohttp.ClientSession() as http:
            assert (await _call(http, "GET", gw.admin_url + "/routing"))[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("fields", [{"api_key": "k-s3cret\r\nX-Injected: 1"},
                                    {"api_key": "k-s3cret\u0000"},
                                    {"url": "http://127.0.0.1:8000/\u0000"},
                                    {"url": "http://127.0.0.1:8000/a b"}])
async def test_a_candidate_that_could_never_be_sent_to_is_422(
        fields: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    """A line break or NUL in the api_key (or a URL with one, or a space) was taken, then
    every mirrored request failed on it with a traceback in the log."""
    caplog.set_level(logging.DEBUG)
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        status, body = await _call(http, "POST", gw.admin_url + "/candidates",
                                   json={"name": "c", "url": sim.url, **fields})
        assert status == 422 and _is_error(body, 422), body
        assert "s3cret" not in body["error"]["message"]
        assert (await _call(http, "GET", gw.admin_url + "/candidates"))[1] == {"candidates": []}
    assert "s3cret" not in caplog.text


def test_a_configured_url_keeps_working_with_surrounding_whitespace() -> None:
    config = load_config(None, {"primary": {"url": " http://127.0.0.1:8000/v1\n"}})
    assert config.primary.url == "http://127.0.0.1:8000"


@pytest.mark.parametrize("interval_s", [1e-6, 0.5])
async def test_a_canary_interval_below_the_minimum_is_422(interval_s: float) -> None:
    """An interval of 1 µs had the judge run back to back: a core spent while it ran."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}]) as gw, \
            aiohttp.ClientSession() as http:
        status, body = await _call(http, "POST", gw.admin_url + "/candidates/c/canary",
                                   json={"steps": [50, 100], "interval_s": interval_s})
        assert status == 422 and "interval_s" in body["error"]["message"], body
        assert (await _call(http, "GET", gw.admin_url + "/routing"))[1]["canary"] is None
        status, _ = await _call(http, "POST", gw.admin_url + "/candidates/c/canary",
                                json={"steps": [50, 100], "interval_s": MIN_CANARY_INTERVAL_S})
        assert status == 202


async def test_the_number_of_candidates_is_bounded() -> None:
    """Each candidate holds worker tasks and a pool: 50 added with max_concurrency 1024 had
    made 51,200 tasks, and nothing stopped a thousand."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c0", "url": sim.url}]) as gw, \
            aiohttp.ClientSession() as http:
        for i in range(1, MAX_CANDIDATES):
            status, _ = await _call(http, "POST", gw.admin_url + "/candidates",
                                    json={"name": f"c{i}", "url": sim.url})
            assert status == 201
        status, body = await _call(http, "POST", gw.admin_url + "/candidates",
                                   json={"name": "one-more", "url": sim.url})
        assert status == 409 and "MAX_CANDIDATES" in body["error"]["message"], body
        assert (await _call(http, "DELETE", gw.admin_url + "/candidates/c0"))[0] == 200
        status, _ = await _call(http, "POST", gw.admin_url + "/candidates",
                                json={"name": "one-more", "url": sim.url})
        assert status == 201
    with pytest.raises(ValidationError, match="candidates"):
        load_config(None, {"candidates": [{"name": f"c{i}", "url": "http://127.0.0.1:1"}
                                          for i in range(MAX_CANDIDATES + 1)]})


def test_the_openapi_document_declares_the_413_and_503_the_api_answers() -> None:
    """A body over MAX_ADMIN_BODY_BYTES is a 413 and a change the store cannot take a 503
    (README), both in the error shape: the document had neither."""
    for path, operations in admin_openapi()["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "503" in responses, (method, path)
            assert ("413" in responses) == ("requestBody" in operation), (method, path)


async def test_a_body_over_the_limit_is_413_in_the_error_shape() -> None:
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        status, body = await _call(http, "POST", gw.admin_url + "/candidates",
                                   data=b" " * (MAX_ADMIN_BODY_BYTES + 1),
                                   headers={"Content-Type": "application/json"})
        assert status == 413 and _is_error(body, 413), body


async def _raw_request_line(url: str, target: bytes) -> tuple[bytes, bytes]:
    """GET ``target`` as sent (no client library resolves its dot segments): the status line
    and the body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(10):
            answer = await reader.read()
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], body


@pytest.mark.parametrize("target", [
    b"/v1/models/../../reset_prefix_cache", b"/v1/%2E%2E/%2e%2e/sleep", b"/v1/..%2fmetrics",
    b"/v1/./models", b"/v1/models/..", b"/v1/..\\metrics", b"/v1/models/%2e?x=1",
])
async def test_a_path_with_a_dot_segment_is_refused_not_forwarded(target: bytes) -> None:
    """``_relay`` rule 6: found by probing -- these reached the backend as sent, so anything
    between the two that resolves dot segments would expose the backend's other endpoints."""
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        status, body = await _raw_request_line(gw.url, target)
        assert status.startswith(b"HTTP/1.1 400 "), (target, status)
        assert _is_error(orjson.loads(body), 400), body
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        assert 'understudy_requests_rejected_total{reason="dot_segment"} 1.0' in text
        served, _ = await _raw_request_line(gw.url, b"/v1/models?name=a..b")
        assert served.startswith(b"HTTP/1.1 200 "), served


def test_a_candidate_name_cannot_be_a_dot_segment() -> None:
    for name in (".", ".."):
        with pytest.raises(ValidationError, match=r"cannot be '\.' or '\.\.'"):
            load_config(None, {"candidates": [{"name": name, "url": "http://127.0.0.1:9"}]})
    config = load_config(None, {"candidates": [{"name": "v1.2", "url": "http://127.0.0.1:9"}]})
    assert config.candidates[0].name == "v1.2"


async def test_head_on_an_admin_get_route_is_its_head_without_a_body() -> None:
    """Monitoring probes send HEAD: it was a 405 on every admin GET route."""
    async with run_sim() as sim, run_gateway(sim.url) as gw, aiohttp.ClientSession() as http:
        for path in ("/candidates", "/routing", "/openapi.json"):
            async with http.get(gw.admin_url + path) as got, \
                    http.head(gw.admin_url + path) as head:
                assert (head.status, head.content_type) == (200, got.content_type), path
                assert await head.read() == b""
        async with http.head(gw.admin_url + "/candidates/nobody") as resp:
            assert resp.status == 404


@pytest.mark.parametrize(("encoding", "body"), [
    (b"deflate", b"not deflate at all"),
    (b"gzip", gzip.compress(b'{"reason": "r"}')[:10] + b"\xff" * 12),  # a bad block
])
async def test_a_body_its_content_encoding_cannot_decode_is_400_not_500(
        encoding: bytes, body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp decodes an admin body's Content-Encoding as it reads it; one that does not
    decode raised past the handler: a 500 and an 'Unhandled exception' traceback."""
    async with run_sim() as sim, run_gateway(sim.url) as gw:
        answer = await _raw_admin(gw.admin_url, b"POST /admin/v1/rollback HTTP/1.1\r\n"
                                  b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                  b"Content-Encoding: "
                                  + encoding + b"\r\nContent-Length: %d\r\n"
                                  b"Connection: close\r\n\r\n" % len(body) + body)
        head, _, error = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), head
        assert _is_error(orjson.loads(error), 400)
        async with aiohttp.ClientSession() as http:
            assert (await _call(http, "GET", gw.admin_url + "/routing"))[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(("method", "path", "body", "message"), [
    ("POST", "/candidates/c/canary", {"steps": [50, 10]},
     "steps: steps must be increasing percentages in (0, 100]"),
    ("POST", "/candidates/c/canary", {"steps": [50, 100], "actor": "a\nb"},
     "actor: holds a control character (NUL, a line break, ...)"),
    ("POST", "/candidates", {"name": "d", "url": "ftp://x"},
     "url: upstream url must start with http:// or https://, got scheme 'ftp'"),
    ("POST", "/candidates", {"name": "d", "url": "http://"}, "url: upstream url names no host"),
    ("POST", "/candidates", {"name": "..", "url": "http://127.0.0.1:9"},
     "name: a candidate name cannot be '.' or '..'"),
])
async def test_a_422_says_what_is_wrong_in_plain_words(method: str, path: str,
                                                       body: dict[str, Any],
                                                       message: str) -> None:
    """A validator's own words came after pydantic's "Value error, " ("steps: Value error,
    steps must be increasing ..."): the CLI's config errors dropped it, the admin API did
    not. Found walking the README on a fresh clone."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}]) as gw, \
            aiohttp.ClientSession() as http:
        status, answer = await _call(http, method, gw.admin_url + path, json=body)
        assert status == 422 and _is_error(answer, 422), answer
        assert answer["error"]["message"] == message
