"""``understudy candidates|promote|rollback|canary|canary-stop|routing``: the admin API from a
terminal."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import click
from rich.table import Table

from gateway._environment import (
    ADMIN_CLIENT_CERT_ENV,
    ADMIN_CLIENT_KEY_ENV,
    ADMIN_TOKEN_ENV,
    ADMIN_URL_ENV,
)
from gateway.terminal import print_table

__all__ = ["ADMIN_COMMANDS"]

DEFAULT_ADMIN_URL = "http://127.0.0.1:8081/admin/v1"
REQUEST_TIMEOUT_S = 120.0  # a promotion runs the judge first


def _segment(name: str) -> str:
    """``name`` as one segment of a path, whatever it holds: a ``/``, ``?``, ``#``, ``%`` or
    space is the name's (the server answers that no candidate has it), and ``.`` or ``..``
    cannot resolve to another route (no candidate is named so)."""
    quoted = urllib.parse.quote(name, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


def _shown(url: str) -> str:
    """``url`` as an error prints it: a password in it (``http://user:pw@host``) as ``***``.
    Found by hand, not parsed: a URL the parser refuses is shown too, a password holding a
    ``/``, ``?`` or ``#`` among them (the userinfo ends at the last ``@``; one in a query
    masks more than the password, never less)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, after = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{after}"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is answered as the error it is, never followed: urllib's redirect copies every
    header but the content ones to wherever ``Location`` points, the bearer token with them
    (another host, or plain http from https). The admin API itself never redirects."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> None:
        return None


def _opener() -> urllib.request.OpenerDirector:
    """An opener that follows no redirect and, where ``$UNDERSTUDY_ADMIN_CLIENT_CERT`` names
    one, shows that client certificate to an admin API that asks for it (mutual TLS); the
    authorities it trusts are the default ones or ``$SSL_CERT_FILE``'s."""
    cert = os.environ.get(ADMIN_CLIENT_CERT_ENV)
    if not cert:
        return urllib.request.build_opener(_NoRedirect)
    key = os.environ.get(ADMIN_CLIENT_KEY_ENV) or None
    context = ssl.create_default_context()
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        files = f"${ADMIN_CLIENT_CERT_ENV} {cert}" + (f" with ${ADMIN_CLIENT_KEY_ENV} {key}"
                                                      if key else "")
        raise click.UsageError(f"{files}: not a client certificate and its key "
                               f"({getattr(exc, 'reason', None) or exc})") from None
    return urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=context))


def _call(admin: tuple[str, str | None], method: str, path: str,
          body: dict[str, Any] | None = None) -> Any:
    url, token = admin[0].rstrip("/"), admin[1]
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - checked now: urllib would raise it mid-request
    except ValueError as exc:
        raise click.UsageError(f"--admin-url {_shown(admin[0])!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        # urllib would raise on 'notaurl' and open file:// or ftp:// URLs as they come
        raise click.UsageError("--admin-url must be an http:// or https:// URL, got "
                               f"{_shown(admin[0])!r}")
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in token):
            raise click.UsageError(f"--token (or ${ADMIN_TOKEN_ENV}) has a control character; "
                                   "no header can carry it")
        # http.client sends a header as Latin-1: these are the token's UTF-8 bytes, as the
        # gateway compares them (a token beyond Latin-1 was a UnicodeEncodeError).
        request.add_header("Authorization", f"Bearer {token}".encode().decode("latin-1"))
    # Whatever answers at a wrong --admin-url (a web page, another protocol, nothing) is one
    # line naming the URL, never a traceback.
    try:
        with _opener().open(request, timeout=REQUEST_TIMEOUT_S) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            exc.close()
            raise click.ClickException(f"{_shown(url)}{path}: {exc.code} redirects elsewhere; "
                                       "not followed, the token would go with it: give "
                                       "--admin-url the admin API's own address") from None
        try:
            error = json.loads(exc.read())["error"]
            message, kind = error["message"], error.get("type")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, kind = exc.reason, None
        # The admin API's own 404 names what it lacks (a candidate), with its headers; any
        # other is a path it does not serve: --admin-url without /admin/v1, the proxy's port,
        # a vLLM. It printed "Error: 404: Not Found", naming neither the URL nor the mistake.
        if exc.code == 404 and (kind != "not_found_error"
                                or exc.headers.get("X-Frame-Options") != "DENY"):
            raise click.ClickException(f"{_shown(url)}{path}: 404 {message}; is --admin-url "
                                       "the admin API's (.../admin/v1)?") from None
        raise click.ClickException(f"{exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise click.ClickException(f"admin API at {_shown(url)} unreachable: {exc.reason}"
                                   f"{_certificate_hint(exc.reason)}") from None
    except TimeoutError:
        raise click.ClickException(f"admin API at {_shown(url)} did not answer within "
                                   f"{REQUEST_TIMEOUT_S:g} s") from None
    except http.client.RemoteDisconnected:
        # Under TLS 1.3 a server that wants a client certificate drops the connection after
        # the handshake: its alert never reaches urllib.
        maybe = _certificate_hint(None, possible=True) if parts.scheme == "https" else ""
        raise click.ClickException(f"{_shown(url)} closed the connection without an answer; "
                                   f"is --admin-url the admin API's?{maybe}") from None
    except http.client.HTTPException as exc:
        raise click.ClickException(f"{_shown(url)} answered something that is not HTTP "
                                   f"({type(exc).__name__}); is --admin-url the admin "
                                   "API's?") from None
    except OSError as exc:  # the connection reset mid-answer
        raise click.ClickException(f"admin API at {_shown(url)}: {exc}"
                                   f"{_certificate_hint(exc)}") from None
    try:
        return json.loads(raw or b"null")
    except ValueError:
        raise click.ClickException(f"{_shown(url)} answered with something that is not JSON; "
                                   "is --admin-url the admin API's (.../admin/v1)?") from None


def _certificate_hint(reason: object, *, possible: bool = False) -> str:
    """A hint where the admin API refused the handshake for want of a client certificate
    (its alert, ``reason``, says so) or, ``possible``, may have, and none is set."""
    refused = possible or "CERTIFICATE_REQUIRED" in str(reason)
    if refused and not os.environ.get(ADMIN_CLIENT_CERT_ENV):
        return (f"; an admin API that asks for a client certificate needs "
                f"${ADMIN_CLIENT_CERT_ENV} (and ${ADMIN_CLIENT_KEY_ENV} where the key is in "
                "a file of its own)")
    return ""


def _routing_version(admin: tuple[str, str | None]) -> int:
    """The routing version a change is decided on (Promoter rule 6): two operators rolling
    back at once get one rollback and a 409, not a rollback undone."""
    return int(_call(admin, "GET", "/routing")["version"])


def _echo(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


@click.group()
@click.option("--admin-url", default=DEFAULT_ADMIN_URL, show_default=True,
              envvar=ADMIN_URL_ENV, help="The admin API's root.")
@click.option("--token", envvar=ADMIN_TOKEN_ENV, help=f"Bearer token (default ${ADMIN_TOKEN_ENV}).")
@click.pass_context
def candidates(ctx: click.Context, admin_url: str, token: str | None) -> None:
    """List, add, change, pause, resume or remove candidates on a running gateway."""
    ctx.obj = (admin_url, token)


@candidates.command("list")
@click.pass_context
def candidates_list(ctx: click.Context) -> None:
    table = Table()
    for column in ("name", "role", "url", "rate", "unit", "concurrency", "paused", "queued",
                   "in flight"):
        table.add_column(column, overflow="fold")  # never "http:/…": every cell whole
    for c in _call(ctx.obj, "GET", "/candidates")["candidates"]:
        table.add_row(c["name"], c["role"], c["url"], str(c["sample_rate"]),
                      c["sampling_unit"], str(c["max_concurrency"]), str(c["paused"]),
                      str(c["queued"]), str(c["in_flight"]))
    print_table(table)


@candidates.command("add")
@click.argument("name")
@click.argument("url")
@click.option("--rate", type=float, default=1.0, show_default=True)
@click.option("--unit", type=click.Choice(["session", "request"]), default="session")
@click.option("--concurrency", type=int, default=4, show_default=True)
@click.option("--secondary", is_flag=True, help="A replica of the primary (noise floor).")
@click.pass_context
def candidates_add(ctx: click.Context, name: str, url: str, rate: float, unit: str,
                   concurrency: int, secondary: bool) -> None:
    _echo(_call(ctx.obj, "POST", "/candidates", {
        "name": name, "url": url, "sample_rate": rate, "sampling_unit": unit,
        "max_concurrency": concurrency, "role": "secondary" if secondary else "candidate"}))


@candidates.command("set")
@click.argument("name")
@click.option("--rate", type=float)
@click.option("--concurrency", type=int)
@click.option("--buffer-items", type=int)
@click.pass_context
def candidates_set(ctx: click.Context, name: str, rate: float | None, concurrency: int | None,
                   buffer_items: int | None) -> None:
    changes = {"sample_rate": rate, "max_concurrency": concurrency, "buffer_items": buffer_items}
    _echo(_call(ctx.obj, "PATCH", f"/candidates/{_segment(name)}",
                {k: v for k, v in changes.items() if v is not None}))


@candidates.command("pause")
@click.argument("name")
@click.pass_context
def candidates_pause(ctx: click.Context, name: str) -> None:
    _echo(_call(ctx.obj, "POST", f"/candidates/{_segment(name)}/pause"))


@candidates.command("resume")
@click.argument("name")
@click.pass_context
def candidates_resume(ctx: click.Context, name: str) -> None:
    _echo(_call(ctx.obj, "POST", f"/candidates/{_segment(name)}/resume"))


@candidates.command("remove")
@click.argument("name")
@click.pass_context
def candidates_remove(ctx: click.Context, name: str) -> None:
    _echo(_call(ctx.obj, "DELETE", f"/candidates/{_segment(name)}"))


@click.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Promote whatever the judge says (needs --reason).")
@click.option("--reason")
@click.option("--actor", default=lambda: os.environ.get("USER", "admin"))
@click.option("--admin-url", default=DEFAULT_ADMIN_URL, envvar=ADMIN_URL_ENV)
@click.option("--token", envvar=ADMIN_TOKEN_ENV)
def promote(name: str, force: bool, reason: str | None, actor: str, admin_url: str,
            token: str | None) -> None:
    """Promote candidate NAME to primary if the judge passes it."""
    if force and not (reason and reason.strip()):
        # Refused here, in the flags' names: the server's "force: true needs a reason" names
        # its body's field, not what was typed.
        raise click.UsageError("--force needs --reason (why the judge is overruled)")
    admin = (admin_url, token)
    _echo(_call(admin, "POST", f"/candidates/{_segment(name)}/promote",
                {"force": force, "reason": reason, "actor": actor,
                 "routing_version": _routing_version(admin)}))


@click.command()
@click.option("--reason")
@click.option("--actor", default=lambda: os.environ.get("USER", "admin"))
@click.option("--admin-url", default=DEFAULT_ADMIN_URL, envvar=ADMIN_URL_ENV)
@click.option("--token", envvar=ADMIN_TOKEN_ENV)
def rollback(reason: str | None, actor: str, admin_url: str, token: str | None) -> None:
    """Switch back to the previous primary."""
    admin = (admin_url, token)
    _echo(_call(admin, "POST", "/rollback", {"reason": reason, "actor": actor,
                                             "routing_version": _routing_version(admin)}))


@click.command()
@click.argument("name")
@click.option("--steps", default="1,5,25,50,100", show_default=True)
@click.option("--interval-s", type=float, default=60.0, show_default=True)
@click.option("--actor", default=lambda: os.environ.get("USER", "admin"))
@click.option("--admin-url", default=DEFAULT_ADMIN_URL, envvar=ADMIN_URL_ENV)
@click.option("--token", envvar=ADMIN_TOKEN_ENV)
def canary(name: str, steps: str, interval_s: float, actor: str, admin_url: str,
           token: str | None) -> None:
    """Shift live sessions to candidate NAME step by step while the judge passes."""
    try:
        percents = [float(s) for s in steps.split(",")]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--steps") from None
    _echo(_call((admin_url, token), "POST", f"/candidates/{_segment(name)}/canary",
                {"steps": percents, "interval_s": interval_s, "actor": actor}))


@click.command("canary-stop")
@click.option("--reason")
@click.option("--actor", default=lambda: os.environ.get("USER", "admin"))
@click.option("--admin-url", default=DEFAULT_ADMIN_URL, envvar=ADMIN_URL_ENV)
@click.option("--token", envvar=ADMIN_TOKEN_ENV)
def canary_stop(reason: str | None, actor: str, admin_url: str, token: str | None) -> None:
    """Stop the canary; its sessions go back to the primary."""
    admin = (admin_url, token)
    _echo(_call(admin, "DELETE", "/canary", {"reason": reason, "actor": actor,
                                             "routing_version": _routing_version(admin)}))


@click.command()
@click.option("--admin-url", default=DEFAULT_ADMIN_URL, envvar=ADMIN_URL_ENV)
@click.option("--token", envvar=ADMIN_TOKEN_ENV)
def routing(admin_url: str, token: str | None) -> None:
    """Show the routing: primary, rollback target, canary."""
    _echo(_call((admin_url, token), "GET", "/routing"))


ADMIN_COMMANDS: tuple[click.Command, ...] = (candidates, promote, rollback, canary, canary_stop,
                                              routing)
