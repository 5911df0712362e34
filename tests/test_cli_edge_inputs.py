"""Bad command-line input is refused up front, with a usage error naming the option, before
anything heavy (a model load, a measurement) starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from backends.engine import plan_kv_command
from gateway._config import MAX_WINDOW_S
from gateway.cli import main

SECRET = "Zq9s3cr3tVALUE77"


@pytest.mark.parametrize("flag", ["--budget-bits", "--budget-bytes-per-token"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_plan_kv_refuses_a_non_finite_budget_before_measuring(flag: str, value: str) -> None:
    result = CliRunner().invoke(plan_kv_command, [flag, value])
    assert result.exit_code == 2, result.output
    assert flag in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    "args",
    [
        ["sim", "--host", "127.0.0.1"],
        ["serve", "--host", "127.0.0.1", "--primary", "http://127.0.0.1:9"],
    ],
    ids=["sim", "serve"],
)
def test_a_port_in_use_is_a_one_line_refusal_not_a_traceback(args: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *args, "--port", str(port)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "Error: cannot serve:" in done.stderr and "address already in use" in done.stderr


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1", "file:///etc", "http://"])
def test_an_admin_url_that_is_not_http_is_a_usage_error(url: str) -> None:
    result = CliRunner().invoke(main, ["routing", "--admin-url", url])
    assert result.exit_code == 2, result.output
    assert "--admin-url must be an http:// or https:// URL" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1"])
def test_load_refuses_a_url_that_is_not_http(url: str) -> None:
    result = CliRunner().invoke(main, ["load", "--url", url, "--sessions", "1"])
    assert result.exit_code == 2, result.output
    assert "--url must be an http:// or https:// URL" in result.output


def test_load_names_the_server_it_cannot_reach() -> None:
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        result = CliRunner().invoke(main, ["load", "--url", url, "--sessions", "1"])
    assert result.exit_code == 1, result.output
    assert f"cannot reach {url}" in result.output


@pytest.mark.parametrize(
    ("args", "problems"),
    [
        (
            ["serve", "--port", "70000"],
            ["server.port: Input should be less than or equal to 65535"],
        ),
        (
            ["serve", "--port", "70000", "--primary", "ftp://127.0.0.1"],
            [
                "server.port: Input should be less than or equal to 65535",
                "primary.url: upstream url must start with http:// or https://, got scheme 'ftp'",
            ],
        ),
        (["sim", "--fault-rate", "2"], ["fault_rate: Input should be less than or equal to 1"]),
        (
            ["engine", "--kv-gib", "0"],
            ["unified.kv_limit_bytes: Input should be greater than or equal to 1048576"],
        ),
        (
            ["load", "--url", "http://127.0.0.1:9", "--sessions", "0"],
            ["sessions: Input should be greater than or equal to 1"],
        ),
        (
            ["db", "upgrade", "--db", "nope"],
            ["evaluation.store.url: not a database URL: <invalid url>"],
        ),
        (
            ["report", "--db", "nope", "c"],
            ["evaluation.store.url: not a database URL: <invalid url>"],
        ),
    ],
    ids=["serve", "serve-two-fields", "sim", "engine", "load", "db", "report"],
)
def test_an_invalid_setting_reads_alike_in_every_command(
    args: list[str], problems: list[str]
) -> None:
    """A line per invalid field, no pydantic header nor URL, and a usage error's exit status."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"Error: {problem}" for problem in problems]
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_serve_refuses_a_misspelt_variable_in_one_line_naming_the_one_meant() -> None:
    secret = "t" * 20
    env = {name: value for name, value in os.environ.items()
           if not name.upper().startswith("UNDERSTUDY_")}  # fmt: skip
    env["UNDERSTUDY_ADMIN_TOKN"] = secret  # the admin token, misspelt
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--print-config"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr  # as any invalid setting (above)
    assert done.stderr.splitlines() == [
        "Error: UNDERSTUDY_ADMIN_TOKN: names no setting; did you mean UNDERSTUDY_ADMIN_TOKEN?"
    ]
    assert secret not in done.stderr + done.stdout


@pytest.mark.parametrize("window", ["nan", "inf", "-inf", "0", "-5", "1e11", "1e300"])
def test_report_refuses_a_window_that_is_not_a_positive_span(tmp_path: Path,
                                                             window: str) -> None:
    """As the admin API's ``window_s`` (a 422): not a traceback, nor (for 0) every score
    stored, nor (below 0) a window that starts in the future and judges nothing."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'never-opened.db'}"
    result = CliRunner().invoke(main, ["report", "c", "--db", url, f"--window-s={window}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"Error: --window-s: must be a positive number of seconds below {MAX_WINDOW_S:g}"]
    assert not (tmp_path / "never-opened.db").exists()  # refused before the store


@pytest.mark.parametrize("folder", ["missing-folder", "."], ids=["unreachable", "not-migrated"])
def test_report_on_a_store_it_cannot_read_is_one_line(tmp_path: Path, folder: str) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / folder / 'store.db'}"
    result = CliRunner().invoke(main, ["report", "c", "--db", url])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: {url}: "), line
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("flag", "problem"),
    [
        (f"http://user:{SECRET}@127.0.0.1:9", "expects NAME=URL[,rate=R]"),  # no NAME=
        (f"a=http://user:{SECRET[:6]},{SECRET[6:]}@127.0.0.1:9", "option 1 after the URL is not "
         "KEY=VALUE"),  # a ',' in the password
        (f"a=http://user:{SECRET[:6]},{SECRET[6:]}=x@127.0.0.1:9", "unknown --candidate option 1"),
    ],
    ids=["no-name", "comma-in-password", "comma-and-equals-in-password"],
)
def test_a_candidate_flag_refused_never_quotes_its_url(flag: str, problem: str) -> None:
    """``--candidate`` refusals quoted the flag, a URL's password and all (or its part after
    a ',')."""
    result = CliRunner().invoke(main, ["serve", "--candidate", flag, "--print-config"])
    assert result.exit_code == 2, result.output
    assert problem in result.stderr
    for part in (SECRET, SECRET[:6], SECRET[6:]):
        assert part not in result.output


def test_report_on_a_candidate_the_store_never_saw_says_so(tmp_path: Path) -> None:
    """A mistyped name printed an INCONCLUSIVE report ("no gated metric to judge") and
    exited 0, which a script reads as "wait for more data"; the admin API answers 404."""
    import asyncio

    from evaluators.store import StoreConfig, create_engine, register_backend, session_factory

    url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    runner = CliRunner()
    assert runner.invoke(main, ["db", "upgrade", "--db", url]).exit_code == 0
    empty = runner.invoke(main, ["report", "fast", "--db", url])
    assert empty.exit_code == 1, empty.output
    assert empty.stderr.splitlines() == [
        "Error: no candidate 'fast' in the store (none has been registered yet)"]

    async def register() -> None:
        engine = create_engine(StoreConfig(url=url))
        async with session_factory(engine)() as session, session.begin():
            await register_backend(session, "fast", role="candidate")
            await register_backend(session, "replica", role="secondary")
        await engine.dispose()

    asyncio.run(register())
    typo = runner.invoke(main, ["report", "fsat", "--db", url])
    assert typo.exit_code == 1, typo.output
    assert typo.stderr.splitlines() == [
        "Error: no candidate 'fsat' in the store (known: fast, replica)"]
    known = runner.invoke(main, ["report", "fast", "--db", url])
    assert known.exit_code == 0 and "INCONCLUSIVE" in known.output
    assert "(noise floor: replica)" in known.output


def test_report_from_the_store_alone_takes_the_replica_it_registered(tmp_path: Path) -> None:
    """``report NAME --db URL`` judged without the noise floor (``noise_floor_from: null``)
    where the admin API and ``report --config`` judged against the replica the gateway had
    registered as ``secondary``: the README's two report commands gave two verdicts. Found
    walking the README; ``--secondary`` still names another."""
    import asyncio

    import orjson

    from evaluators.store import StoreConfig, create_engine, register_backend, session_factory

    url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    runner = CliRunner()
    assert runner.invoke(main, ["db", "upgrade", "--db", url]).exit_code == 0

    async def register() -> None:
        engine = create_engine(StoreConfig(url=url))
        async with session_factory(engine)() as session, session.begin():
            await register_backend(session, "fast", role="candidate")
            await register_backend(session, "other", role="candidate")
            await register_backend(session, "replica", role="secondary")
        await engine.dispose()

    asyncio.run(register())
    judged = runner.invoke(main, ["report", "fast", "--db", url, "--json"])
    assert judged.exit_code == 0, judged.output
    assert orjson.loads(judged.stdout)["noise_floor_from"] == "replica"
    chosen = runner.invoke(main, ["report", "fast", "--db", url, "--json",
                                  "--secondary", "other"])
    assert orjson.loads(chosen.stdout)["noise_floor_from"] == "other"
