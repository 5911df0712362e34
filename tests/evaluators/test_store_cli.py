"""``understudy db upgrade`` / ``db downgrade`` refusing what they cannot do: one line
naming the argument (exit 2) or the store (exit 1), never a traceback. ``db prune``'s
refusals are in test_store_retention.py."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from evaluators.store import current_revision, head_revision
from gateway.cli import main
from tests.fixtures_db import sqlite_url

ATTEMPTS = 40
"""A failed open printed a thread's traceback about one time in eight: 40 tries miss it
with a chance of 0.5 %."""


def invoke(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        result.exception)
    lines = [line for line in result.stderr.splitlines() if " INFO alembic." not in line]
    return result.exit_code, lines


@pytest.mark.parametrize(("args", "problem"), [
    (["upgrade", "--revision", "nonsense"],
     "--revision: 'nonsense': Can't locate revision identified by 'nonsense'"),
    (["upgrade", "--revision", "-1"],
     "--revision: '-1': Relative revision -1 didn't produce 1 migrations"),
    (["downgrade", "nonsense"], "REVISION: 'nonsense': Can't locate revision identified by "
     "'nonsense'"),
    (["downgrade", "head+1"], "REVISION: 'head+1': Walked too far"),
], ids=["unknown", "before-base", "down-unknown", "past-head"])
def test_a_revision_it_cannot_reach_is_one_line_and_a_usage_error(
        tmp_path: Path, args: list[str], problem: str) -> None:
    url = sqlite_url(tmp_path)
    status, lines = invoke("db", *args, "--db", url)
    assert (status, lines) == (2, [f"Error: {problem}"])
    assert asyncio.run(current_revision(url)) is None  # nothing ran


@pytest.mark.parametrize("revision", ["head+1", "head+2", "0001+9"])
def test_an_upgrade_walking_past_the_newest_revision_is_one_line_and_a_usage_error(
        tmp_path: Path, revision: str) -> None:
    """README: ``head+1`` is refused as ``Error: --revision: ...``, exit 2. Alembic fails an
    assertion resolving it (not a CommandError): it was a traceback, exit 1. Found walking
    the README on a fresh clone."""
    url = sqlite_url(tmp_path)
    refused = (2, [f"Error: --revision: {revision!r}: walks past the newest revision, "
                   f"{head_revision()!r}"])
    assert invoke("db", "upgrade", "--revision", revision, "--db", url) == refused
    assert asyncio.run(current_revision(url)) is None  # nothing ran
    assert invoke("db", "upgrade", "--db", url)[0] == 0
    assert invoke("db", "upgrade", "--revision", revision, "--db", url) == refused  # at head


def test_a_store_it_cannot_open_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        for verb in (["upgrade"], ["downgrade", "base"]):
            status, lines = invoke("db", *verb, "--db", f"postgresql://u:secret@127.0.0.1:{port}/x")
            assert status == 1
            assert len(lines) == 1
            assert lines[0].startswith(f"Error: postgresql+asyncpg://u:***@127.0.0.1:{port}/x: "
                                       "ConnectionRefusedError"), lines


def test_a_sqlite_file_in_a_missing_folder_is_one_line_and_no_thread_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # aiosqlite reported the failed open from its worker thread to a loop asyncio.run had
    # closed by then, about one time in eight: "Exception in thread ..." after the error.
    missing = sqlite_url(tmp_path / "no-such-folder")
    thread_errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: thread_errors.append(args.exc_value))
    for _ in range(ATTEMPTS):
        status, lines = invoke("db", "upgrade", "--db", missing)
        assert (status, lines) == (1, [
            f"Error: {missing}: OperationalError: unable to open database file: no folder "
            f"{str(tmp_path / 'no-such-folder')!r}"])
    for thread in threading.enumerate():  # aiosqlite's workers, done or finishing
        if "_connection_worker_thread" in thread.name:
            thread.join(timeout=5)
    assert thread_errors == []


def test_upgrade_and_downgrade_say_where_the_schema_stands(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    result = CliRunner().invoke(main, ["db", "upgrade", "--db", url])
    assert (result.exit_code, result.stdout) == (0, f"{url}: at {head_revision()}\n")
    result = CliRunner().invoke(main, ["db", "downgrade", "0004", "--db", url])
    assert (result.exit_code, result.stdout) == (0, f"{url}: at 0004\n")
