"""``understudy candidates|promote|rollback|canary|canary-stop|routing`` against a running
gateway: what an operator types wrong is one line naming it, never a traceback nor another
route's action."""

from __future__ import annotations

import asyncio
import functools
import socket

import pytest
from click.testing import CliRunner, Result

from gateway.cli import main
from tests.utils import RunningGateway, run_gateway, run_sim

TOKEN = "cli-admin-token-0123456"


async def understudy(gw: RunningGateway, *args: str) -> Result:
    """The CLI in a thread (its HTTP client blocks; the gateway runs on this loop)."""
    env = {"UNDERSTUDY_ADMIN_URL": gw.admin_url, "UNDERSTUDY_ADMIN_TOKEN": TOKEN}
    return await asyncio.to_thread(CliRunner().invoke, main, list(args), env=env)


@pytest.mark.parametrize("name", ["a b", "caf\u00e9", "a\nb", "x?y", "x#y", "%63"])
async def test_a_name_that_is_no_candidate_is_a_404_naming_it(name: str) -> None:
    """The name went into the path unquoted: a space, a non-ASCII letter or a line break was
    a traceback from http.client, and ``x?y`` became a query (a 405 about another route)."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}],
                        admin={"token": TOKEN}) as gw:
        for args in (["candidates", "pause", name], ["promote", name, "--force",
                                                     "--reason", "r"]):
            result = await understudy(gw, *args)
            assert result.exit_code == 1 and result.exception is not None, result.output
            assert isinstance(result.exception, SystemExit), result.exception
            assert result.output == f"Error: 404: no candidate named {name!r}\n"


async def test_candidates_list_shows_every_cell_whole() -> None:
    """At 80 columns (a pipe, CliRunner) the list cut its cells: the URL read "http:/…", the
    role "candi…", the unit "sessi…". Found walking the README on a fresh clone."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[
                {"name": "fast-checkpoint", "url": sim.url + "/", "sampling_unit": "request"},
                {"name": "replica", "url": sim.url, "role": "secondary"}],
                admin={"token": TOKEN}) as gw:
        result = await understudy(gw, "candidates", "list")
    assert result.exit_code == 0, result.output
    assert "\u2026" not in result.output  # no cell cut with an ellipsis
    rows = {line.split("\u2502")[1].strip(): line for line in result.output.splitlines()
            if line.startswith("\u2502")}
    assert set(rows) == {"fast-checkpoint", "replica"}
    for cell in (sim.url, "candidate", "request"):
        assert cell in rows["fast-checkpoint"]
    assert "secondary" in rows["replica"] and "session" in rows["replica"]


@pytest.mark.parametrize("name", ["../c", "c/../c", "..", "../canary"])
async def test_a_name_with_a_slash_or_dots_never_reaches_another_route(name: str) -> None:
    """``candidates remove ../canary`` was ``DELETE /admin/v1/canary`` once the server
    resolved the dot segment: another action than the one typed."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}],
                        admin={"token": TOKEN}) as gw:
        result = await understudy(gw, "candidates", "remove", name)
        assert result.exit_code == 1, result.output
        assert result.output.startswith("Error: 404: "), result.output
        assert "c" in gw.state.mirror.candidates


@pytest.mark.parametrize(("args", "named"), [
    (["routing", "--admin-url", "http://[::1/admin/v1"], "--admin-url"),
    (["routing", "--token", "a\nb"], "--token"),
    (["routing", "--admin-url", "http://127.0.0.1:99999/admin/v1"], "--admin-url"),
])
async def test_a_url_or_token_that_cannot_be_sent_is_a_usage_error(args: list[str],
                                                                   named: str) -> None:
    async with run_sim() as sim, run_gateway(sim.url, admin={"token": TOKEN}) as gw:
        result = await understudy(gw, *args)
        assert result.exit_code == 2, result.output
        assert isinstance(result.exception, SystemExit), result.exception
        assert named in result.output and "Traceback" not in result.output


async def test_a_token_beyond_latin1_is_sent_as_the_gateway_compares_it() -> None:
    """http.client encodes a header as Latin-1: such a token was a UnicodeEncodeError."""
    token = "\u2603" * 20
    async with run_sim() as sim, run_gateway(sim.url, admin={"token": token}) as gw:
        result = await understudy(gw, "routing", "--token", token)
        assert result.exit_code == 0, result.output
        assert '"primary"' in result.output


async def test_rollback_and_promote_name_the_routing_they_were_decided_on() -> None:
    """The CLI sends the routing version it read (Promoter rule 6); the audit shows one
    change per command, and a rollback still rolls back."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}],
                        admin={"token": TOKEN}) as gw:
        result = await understudy(gw, "promote", "c", "--force", "--reason", "r")
        assert result.exit_code == 0, result.output
        assert gw.state.routing.primary.name == "c"
        result = await understudy(gw, "rollback")
        assert result.exit_code == 0, result.output
        assert gw.state.routing.primary.name == "primary" and gw.state.routing.version == 3


@pytest.mark.parametrize("reason", [[], ["--reason", ""], ["--reason", "  "]],
                         ids=["none", "empty", "blank"])
async def test_promote_force_without_a_reason_is_a_usage_error_naming_the_flags(
        reason: list[str]) -> None:
    """The server answered it, naming its body's field ("422: force: true needs a reason"),
    not the flags typed. Now the CLI refuses it before any request. Found walking the README
    on a fresh clone."""
    connections: list[None] = []

    async def admin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(None)
        writer.close()

    server = await asyncio.start_server(admin, "127.0.0.1", 0)
    async with server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/admin/v1"
        result = await asyncio.to_thread(
            CliRunner().invoke, main, ["promote", "c", "--force", *reason, "--admin-url", url])
    assert result.exit_code == 2, result.output
    assert result.output.endswith("Error: --force needs --reason (why the judge is "
                                  "overruled)\n"), result.output
    assert connections == []


async def test_canary_stop_sends_the_canarys_sessions_back_to_the_primary() -> None:
    """The CLI could start a canary but not stop one (``DELETE /canary`` only by hand).
    Found walking the README on a fresh clone."""
    async with run_sim() as sim, \
            run_gateway(sim.url, candidates=[{"name": "c", "url": sim.url}],
                        admin={"token": TOKEN}) as gw:
        result = await understudy(gw, "canary", "c", "--steps", "10,100", "--interval-s", "600")
        assert result.exit_code == 0, result.output
        assert gw.state.routing.canary is not None
        result = await understudy(gw, "canary-stop", "--reason", "paging")
        assert result.exit_code == 0, result.output
        assert gw.state.routing.canary is None and gw.state.routing.primary.name == "primary"
        result = await understudy(gw, "canary-stop")  # none running: one line, no traceback
        assert result.exit_code == 1 and result.output.startswith("Error: 409: "), result.output


@pytest.mark.parametrize(("url", "exit_code"), [
    ("http://operator:{pw}@127.0.0.1:{port}/admin/v1", 1),    # unreachable
    ("ftp://operator:{pw}@127.0.0.1:{port}/admin/v1", 2),     # not http
    ("http://operator:{pw}@127.0.0.1:99999/admin/v1", 2),     # a port urlsplit refuses
    ("http://operator:{pw}@[::1/admin/v1", 2),                # a host urlsplit refuses
    ("http://operator:a/{pw}@127.0.0.1:{port}/admin/v1", 2),  # a '/' in the password
])
def test_an_admin_url_refused_never_shows_its_password(url: str, exit_code: int) -> None:
    """Each refusal quoted the --admin-url whole, password and all."""
    password = "Zq9-s3cr3t-VALUE-77"
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = url.format(pw=password, port=closed.getsockname()[1])
        result = CliRunner().invoke(main, ["routing", "--admin-url", url])
    assert result.exit_code == exit_code, result.output
    assert password not in result.output
    assert "operator:***@" in result.output  # the URL is still named, its password masked


async def _answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     answer: bytes | None) -> None:
    """Read a request's head, then send ``answer`` and close (None: wait, answer nothing)."""
    try:
        await reader.readuntil(b"\r\n\r\n")
        if answer is None:
            await reader.read()  # until the client gives up
        else:
            writer.write(answer)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.mark.parametrize(("answer", "said"), [
    (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 6\r\n\r\n<html>",
     "not JSON"),                                      # a web page at that address
    (b"", "closed the connection"),                     # closed without an answer
    (b"SSH-2.0-OpenSSH_9.6\r\n", "not HTTP"),           # another protocol's server
    (None, "did not answer within"),                    # never answers
    (b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 22\r\n\r\n"
     b'{"detail":"Not Found"}', "404 Not Found; is --admin-url the admin API's (.../admin/v1)?"),
    # a vLLM, or the admin listener without /admin/v1
    (b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 58\r\n\r\n"
     b'{"error":{"message":"not found","type":"not_found_error"}}',
     "404 not found; is --admin-url the admin API's (.../admin/v1)?"),  # the proxy's port
])
async def test_an_admin_url_that_is_no_admin_api_is_one_line_not_a_traceback(
    answer: bytes | None, said: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --admin-url at the wrong port or host: a JSONDecodeError, RemoteDisconnected,
    BadStatusLine or TimeoutError traceback from the CLI."""
    monkeypatch.setattr("gateway._cli_admin.REQUEST_TIMEOUT_S", 0.5)
    server = await asyncio.start_server(lambda r, w: _answering(r, w, answer),
                                        "127.0.0.1", 0)
    async with server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/admin/v1"
        for args in (["routing"], ["candidates", "list"]):
            result = await asyncio.to_thread(CliRunner().invoke, main,
                                             [*args, "--admin-url", url]
                                             if args == ["routing"] else
                                             ["candidates", "--admin-url", url, *args[1:]])
            assert result.exit_code == 1, result.output
            assert isinstance(result.exception, SystemExit), result.exception
            assert result.output.startswith("Error: ") and said in result.output, result.output
            assert result.output.count("\n") == 1 and url in result.output


async def test_a_redirect_is_not_followed_with_the_token() -> None:
    """urllib follows a 3xx to wherever ``Location`` points and copies every header but the
    content ones: the bearer token went to another host (and over http from https). The
    admin API never redirects; a redirect is one line naming the URL, and nothing more is
    sent."""
    seen: list[bytes] = []

    async def elsewhere(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\n\r\n{}")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    other = await asyncio.start_server(elsewhere, "127.0.0.1", 0)
    async with other:
        target = f"http://127.0.0.1:{other.sockets[0].getsockname()[1]}/steal"
        for status in (b"301 Moved Permanently", b"302 Found", b"307 Temporary Redirect",
                       b"308 Permanent Redirect"):
            answer = (b"HTTP/1.1 " + status + b"\r\nLocation: " + target.encode()
                      + b"\r\nContent-Length: 0\r\n\r\n")
            server = await asyncio.start_server(functools.partial(_answering, answer=answer),
                                                "127.0.0.1", 0)
            async with server:
                url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/admin/v1"
                for args in (["routing"], ["rollback"]):
                    result = await asyncio.to_thread(
                        CliRunner().invoke, main, [*args, "--admin-url", url],
                        env={"UNDERSTUDY_ADMIN_TOKEN": TOKEN})
                    assert result.exit_code == 1, result.output
                    assert isinstance(result.exception, SystemExit), result.exception
                    assert result.output.count("\n") == 1 and url in result.output
                    assert "redirect" in result.output, result.output
    assert seen == [], seen  # nothing reached the other address, the token least of all
