"""The admin API over TLS (``[admin] tls_cert_file``/``tls_key_file``): a real listener from
``serve``, a certificate from a test authority (trustme), the ``openai``-free admin CLI as an
operator runs it. Before, the admin API spoke plain HTTP only, so a non-loopback admin API
carried its bearer token across the network in clear."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from click.testing import CliRunner
from pydantic import ValidationError

from gateway._admin import check_admin_binding, warn_if_in_clear
from gateway._app import serve
from gateway._config import AdminConfig, load_config
from gateway.cli import main
from tests.utils import free_port, run_sim

TOKEN = "tls-admin-token-0123456789"


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def pem(authority: trustme.CA, tmp_path: Path) -> dict[str, Path]:
    """The server's certificate chain and key, and the authority's certificate."""
    server = authority.issue_cert("127.0.0.1", "localhost")
    files = {"cert": tmp_path / "admin.pem", "key": tmp_path / "admin-key.pem",
             "ca": tmp_path / "ca.pem"}
    server.private_key_pem.write_to_path(str(files["key"]))
    with files["cert"].open("wb") as out:
        for blob in server.cert_chain_pems:
            out.write(blob.bytes())
    authority.cert_pem.write_to_path(str(files["ca"]))
    return files


@asynccontextmanager
async def serving_gateway(admin: dict[str, Any]) -> AsyncIterator[int]:
    """``serve`` with evaluation off and the admin listener ``admin``: its admin port."""
    admin_port = free_port()
    async with run_sim() as sim:
        config = load_config(None, {
            "primary": {"url": sim.url}, "evaluation": {"enabled": False},
            "server": {"host": "127.0.0.1", "port": 0},
            "admin": {"port": admin_port, "token": TOKEN, **admin}})
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(serve(config, stop=stop, on_ready=ready.set_result))
        try:
            await asyncio.wait_for(ready, 30)
            yield admin_port
        finally:
            stop.set()
            async with asyncio.timeout(30):
                await serving


async def _routing(url: str, context: ssl.SSLContext | bool) -> int:
    async with aiohttp.ClientSession() as http, http.get(
            url + "/admin/v1/routing", ssl=context,
            headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        await resp.read()
        return resp.status


async def test_the_admin_api_serves_https_only_with_its_certificate(
        pem: dict[str, Path], caplog: Any) -> None:
    caplog.set_level(logging.INFO, "understudy")
    trusting = ssl.create_default_context(cafile=str(pem["ca"]))
    async with serving_gateway({"tls_cert_file": str(pem["cert"]),
                                "tls_key_file": str(pem["key"])}) as port:
        assert await _routing(f"https://127.0.0.1:{port}", trusting) == 200
        # Not the authority's client: the handshake fails, nothing is answered.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await _routing(f"https://127.0.0.1:{port}", ssl.create_default_context())
        # Plain HTTP to the TLS port gets no admin answer (the token never goes in clear
        # to an answer; the connection is dropped at the handshake).
        with pytest.raises(aiohttp.ClientError):
            await _routing(f"http://127.0.0.1:{port}", False)
    assert f"admin API on https://127.0.0.1:{port}/admin/v1" in caplog.text
    assert "in clear" not in caplog.text


async def test_the_admin_cli_reaches_an_https_admin_api_through_the_authority_it_trusts(
        pem: dict[str, Path]) -> None:
    async with serving_gateway({"tls_cert_file": str(pem["cert"]),
                                "tls_key_file": str(pem["key"])}) as port:
        env = {"UNDERSTUDY_ADMIN_URL": f"https://127.0.0.1:{port}/admin/v1",
               "UNDERSTUDY_ADMIN_TOKEN": TOKEN}
        trusted = await asyncio.to_thread(CliRunner().invoke, main, ["routing"],
                                          env={**env, "SSL_CERT_FILE": str(pem["ca"])})
        assert trusted.exit_code == 0, trusted.output
        assert '"primary"' in trusted.output
        untrusted = await asyncio.to_thread(CliRunner().invoke, main, ["routing"], env=env)
        assert untrusted.exit_code == 1
        assert untrusted.output.startswith("Error: admin API at https://127.0.0.1:")
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.output
        assert "Traceback" not in untrusted.output


def test_a_non_loopback_admin_api_in_plain_http_is_warned_of(
        pem: dict[str, Path], caplog: Any) -> None:
    """Checked on the config (tests listen on loopback only): the warning ``serve`` logs as
    the admin listener starts."""
    caplog.set_level(logging.WARNING, "understudy")
    warn_if_in_clear(AdminConfig(host="127.0.0.1"))
    warn_if_in_clear(AdminConfig(host="192.0.2.1", token=TOKEN, tls_cert_file=pem["cert"],
                                 tls_key_file=pem["key"]))
    assert "in clear" not in caplog.text
    warn_if_in_clear(AdminConfig(host="192.0.2.1", token=TOKEN))
    assert "the admin API on 192.0.2.1 serves plain HTTP" in caplog.text


def test_tls_files_come_together_and_must_load(pem: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="both tls_cert_file and tls_key_file"):
        AdminConfig(tls_cert_file=pem["cert"])
    with pytest.raises(ValidationError, match="tls_key_file"):
        AdminConfig(tls_cert_file=pem["cert"], tls_key_file=tmp_path / "missing.pem")
    # The authority's certificate is no key for the server's: refused at start, one line.
    mismatched = AdminConfig(port=0, tls_cert_file=pem["cert"], tls_key_file=pem["ca"])
    with pytest.raises(ValueError, match="admin TLS: cannot load the certificate"):
        check_admin_binding(mismatched)


def test_serve_refuses_tls_files_that_do_not_load_in_one_line(pem: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, [
        "serve", "--admin-port", "0", "--primary", "http://127.0.0.1:9"],
        env={"UNDERSTUDY_ADMIN__TLS_CERT_FILE": str(pem["cert"]),
             "UNDERSTUDY_ADMIN__TLS_KEY_FILE": str(pem["ca"])})
    assert result.exit_code != 0
    assert "admin TLS: cannot load the certificate" in result.output
    assert "Traceback" not in result.output


def test_print_config_names_the_tls_files(pem: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["serve", "--print-config"], env={
        "UNDERSTUDY_ADMIN__TLS_CERT_FILE": str(pem["cert"]),
        "UNDERSTUDY_ADMIN__TLS_KEY_FILE": str(pem["key"])})
    assert result.exit_code == 0, result.output
    assert str(pem["cert"]) in result.output and str(pem["key"]) in result.output


@pytest.fixture
def client_pem(authority: trustme.CA, tmp_path: Path) -> Path:
    """A client certificate the authority signed, its key in the same file."""
    client = authority.issue_cert("operator@example.org")
    path = tmp_path / "operator.pem"
    client.private_key_and_cert_chain_pem.write_to_path(str(path))
    return path


async def test_a_client_authority_makes_the_admin_api_ask_for_a_certificate_and_the_token(
        pem: dict[str, Path], client_pem: Path) -> None:
    """Mutual TLS (``tls_client_ca_file``): before, anyone holding the token reached every
    route; now a client also needs a certificate the configured authority signed."""
    async with serving_gateway({"tls_cert_file": str(pem["cert"]),
                                "tls_key_file": str(pem["key"]),
                                "tls_client_ca_file": str(pem["ca"])}) as port:
        url = f"https://127.0.0.1:{port}"
        anonymous = ssl.create_default_context(cafile=str(pem["ca"]))
        with pytest.raises(aiohttp.ClientError):  # the handshake is refused: no answer
            await _routing(url, anonymous)
        holding = ssl.create_default_context(cafile=str(pem["ca"]))
        holding.load_cert_chain(str(client_pem))
        assert await _routing(url, holding) == 200
        async with aiohttp.ClientSession() as http, http.get(
                url + "/admin/v1/routing", ssl=holding) as resp:
            assert resp.status == 401  # the certificate alone opens nothing either
        # A certificate from another authority is refused as no certificate is.
        stranger = trustme.CA().issue_cert("intruder@example.org")
        foreign = ssl.create_default_context(cafile=str(pem["ca"]))
        stranger_pem = client_pem.with_name("stranger.pem")
        stranger.private_key_and_cert_chain_pem.write_to_path(str(stranger_pem))
        foreign.load_cert_chain(str(stranger_pem))
        with pytest.raises(aiohttp.ClientError):
            await _routing(url, foreign)


async def test_the_admin_cli_shows_its_client_certificate_from_the_environment(
        pem: dict[str, Path], client_pem: Path, tmp_path: Path) -> None:
    async with serving_gateway({"tls_cert_file": str(pem["cert"]),
                                "tls_key_file": str(pem["key"]),
                                "tls_client_ca_file": str(pem["ca"])}) as port:
        env = {"UNDERSTUDY_ADMIN_URL": f"https://127.0.0.1:{port}/admin/v1",
               "UNDERSTUDY_ADMIN_TOKEN": TOKEN, "SSL_CERT_FILE": str(pem["ca"])}
        run = CliRunner().invoke
        without = await asyncio.to_thread(run, main, ["routing"], env=env)
        assert without.exit_code == 1
        assert ("an admin API that asks for a client certificate needs "
                "$UNDERSTUDY_ADMIN_CLIENT_CERT") in without.output
        assert "Traceback" not in without.output
        shown = await asyncio.to_thread(run, main, ["routing"], env={
            **env, "UNDERSTUDY_ADMIN_CLIENT_CERT": str(client_pem)})
        assert shown.exit_code == 0, shown.output
        assert '"primary"' in shown.output
        not_pem = tmp_path / "not.pem"
        not_pem.write_text("not a certificate\n")
        broken = await asyncio.to_thread(run, main, ["routing"], env={
            **env, "UNDERSTUDY_ADMIN_CLIENT_CERT": str(not_pem)})
        assert broken.exit_code == 2
        assert f"$UNDERSTUDY_ADMIN_CLIENT_CERT {not_pem}: not a client certificate" \
            in broken.output
        assert "Traceback" not in broken.output


def test_a_client_authority_needs_the_server_certificate_and_must_load(
        pem: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="client certificates are asked for over TLS"):
        AdminConfig(tls_client_ca_file=pem["ca"])
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not an authority\n")
    unloadable = AdminConfig(port=0, tls_cert_file=pem["cert"], tls_key_file=pem["key"],
                             tls_client_ca_file=not_pem)
    with pytest.raises(ValueError, match="admin TLS: cannot load the client authorities"):
        check_admin_binding(unloadable)
