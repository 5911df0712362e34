"""``understudy``'s command group: ``--help`` and each command's ``--help`` import only what
that command needs (the whole app stack took seconds before the first line of help), and the
listing it prints from ``SUBCOMMANDS`` is the one the commands themselves give."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from gateway.cli import SUBCOMMANDS, main

# Modules that take seconds to import (the app stack, the store, the statistics, the engine,
# the openai client) or that only another command needs.
HEAVY = ("gateway._app", "gateway._config", "evaluators", "sqlalchemy", "alembic", "scipy",
         "backends.engine", "openai", "workload", "demo")

_IMPORTED_BY = """
import sys
from click.testing import CliRunner
from gateway.cli import main
result = CliRunner().invoke(main, sys.argv[1:])
assert result.exit_code == 0, result.output
print(" ".join(sorted(sys.modules)))
"""


@pytest.mark.parametrize(("args", "own"), [
    (["--help"], None), (["serve", "--help"], None), (["db", "--help"], None),
    (["db", "upgrade", "--help"], None), (["report", "--help"], None),
    (["promote", "--help"], None), (["candidates", "add", "--help"], None),
    (["routing", "--help"], None), (["sim", "--help"], None),
    (["load", "--help"], "workload"), (["demo", "--help"], "demo"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "-")
def test_help_imports_nothing_heavy(args: list[str], own: str | None) -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORTED_BY, *args], capture_output=True,
                          text=True, timeout=60, check=True)
    heavy = [module for module in done.stdout.split()
             if any(module == h or module.startswith(h + ".") for h in HEAVY if h != own)]
    assert heavy == []  # load: not the openai client; demo: not the gateway, store, workload


def test_every_summary_is_its_commands_own() -> None:
    for name, subcommand in SUBCOMMANDS.items():
        command = subcommand.load()
        assert command.name == name
        assert command.get_short_help_str(limit=10_000) == subcommand.summary, name


@pytest.mark.parametrize("width", [60, 80, 200])
def test_the_listing_is_the_one_click_prints_for_the_loaded_commands(width: int) -> None:
    loaded = click.Group("understudy", params=main.params, help=main.help,
                         commands={**{n: s.load() for n, s in SUBCOMMANDS.items()},
                                   **main.commands})
    with click.Context(main, info_name="understudy", terminal_width=width) as lazy, \
            click.Context(loaded, info_name="understudy", terminal_width=width) as eager:
        assert main.get_help(lazy) == loaded.get_help(eager)


def test_a_misspelled_command_is_refused() -> None:
    result = CliRunner().invoke(main, ["rollbak"])
    assert result.exit_code == 2 and "No such command 'rollbak'" in result.output
