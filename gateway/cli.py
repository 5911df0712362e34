"""The ``understudy`` command line.

Importing this module is cheap: each command imports what it needs when it runs or shows its
own help (``understudy serve`` does not import the engine, ``--help`` imports none of them).
The commands that live elsewhere are named in ``SUBCOMMANDS`` with the first sentence of their
help, which ``understudy --help`` lists without importing them (a test holds the sentences to
the commands' own).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

__all__ = ["main"]


@dataclass(frozen=True, slots=True)
class Subcommand:
    """A command defined in another module, imported only when it is asked for."""

    target: str  # "module:attribute"
    summary: str  # the first sentence of its help, for the group's listing

    def load(self) -> click.Command:
        module, _, attribute = self.target.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.target} is not a click command")
        return command


SUBCOMMANDS: Mapping[str, Subcommand] = {
    "canary": Subcommand("gateway._cli_admin:canary", "Shift live sessions to candidate NAME "
                         "step by step while the judge passes."),
    "canary-stop": Subcommand("gateway._cli_admin:canary_stop",
                              "Stop the canary; its sessions go back to the primary."),
    "candidates": Subcommand("gateway._cli_admin:candidates", "List, add, change, pause, "
                             "resume or remove candidates on a running gateway."),
    "db": Subcommand("gateway._cli_eval:db",
                     "Create or change the evaluation store's schema (Alembic), or "
                     "prune its old rows."),
    "demo": Subcommand("demo:demo_command", "Run the real-model demo: a primary, its replica "
                       "and three candidates behind the gateway, agentic traffic, the "
                       "scorecard, and a promotion."),
    "engine": Subcommand("backends.engine:engine_command", "Serve the reference engine "
                         "(SmolLM2 in numpy) with vLLM's OpenAI API."),
    "kv-quality": Subcommand("backends.engine:kv_quality_command", "Measure KV codecs on the "
                             "real model against fp32: attention-output error per layer, "
                             "next-token KL and top-1 on real text, and agreement of greedy "
                             "answers."),
    "load": Subcommand("workload:load_command", "Drive agentic multi-turn sessions (or a "
                       "recorded replay) against URL."),
    "plan-kv": Subcommand("backends.engine:plan_kv_command", "Choose a KV codec per layer for "
                          "keys and for values under a memory budget, from measured quality "
                          "loss, and say what bounds a decode step on this machine."),
    "promote": Subcommand("gateway._cli_admin:promote",
                          "Promote candidate NAME to primary if the judge passes it."),
    "report": Subcommand("gateway._cli_eval:report",
                         "Judge CANDIDATE over its stored scores and print every statistic."),
    "rollback": Subcommand("gateway._cli_admin:rollback", "Switch back to the previous primary."),
    "routing": Subcommand("gateway._cli_admin:routing",
                          "Show the routing: primary, rollback target, canary."),
    "sim": Subcommand("backends.sim:sim_command", "Serve a vLLM OpenAI-protocol simulator (for "
                      "tests and benchmarks)."),
}


class _LazyGroup(click.Group):
    """A group that imports a command of ``SUBCOMMANDS`` only when it is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *SUBCOMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = self.commands.get(cmd_name)
        if command is None and cmd_name in SUBCOMMANDS:
            command = SUBCOMMANDS[cmd_name].load()
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click's own listing, from the summaries: asking each command would import them all.
        commands = [(name, self.commands.get(name)
                     or click.Command(name, help=SUBCOMMANDS[name].summary))
                    for name in self.list_commands(ctx)]
        commands = [(name, command) for name, command in commands if not command.hidden]
        if commands:
            limit = formatter.width - 6 - max(len(name) for name, _ in commands)
            with formatter.section("Commands"):
                formatter.write_dl([(name, command.get_short_help_str(limit))
                                    for name, command in commands])


@click.group(cls=_LazyGroup)
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def main(log_level: str) -> None:
    """understudy: mirror production LLM traffic to candidates and score them."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # Alembic logs each plugin it sets up when it is imported (at INFO): noise to an operator,
    # and a command imports it (through the store) only now, after logging is configured.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), help="TOML config file (see examples/understudy.toml).")
@click.option("--primary", help="Primary backend root URL, e.g. http://127.0.0.1:8000.")
@click.option("--host", help="Address to listen on.")
@click.option("--port", type=int, help="Port to listen on.")
@click.option("--candidate", "candidates", multiple=True, metavar="NAME=URL[,rate=R]",
              help="Mirror to a candidate (repeatable; replaces the file's candidates). "
                   "Options: rate=0..1, unit=request|session, concurrency=N, model=M.")
@click.option("--admin-port", type=int, help="Port of the admin API; beats [admin] port and "
              "UNDERSTUDY_ADMIN__PORT. Off unless one of them gives a port.")
@click.option("--db", "db_url", help="Evaluation store URL: sqlite+aiosqlite:///FILE "
              "(default understudy.db) or postgresql+asyncpg://USER@HOST/DB.")
@click.option("--print-config", is_flag=True, help="Print the effective config and exit.")
def serve(config_path: Path | None, primary: str | None, host: str | None,
          port: int | None, candidates: tuple[str, ...], admin_port: int | None,
          db_url: str | None, print_config: bool) -> None:
    """Forward OpenAI-compatible traffic to the primary and mirror it to candidates."""
    from backends.openai_wire import ConfigError, config_error
    from gateway._admin import check_admin_binding
    from gateway._app import run
    from gateway._config import load_config, parse_candidate_flag

    overrides: dict[str, Any] = {}
    try:
        if candidates:
            overrides["candidates"] = [parse_candidate_flag(c) for c in candidates]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--candidate") from exc
    if primary:
        overrides.setdefault("primary", {})["url"] = primary
    if host:
        overrides.setdefault("server", {})["host"] = host
    if port is not None:
        overrides.setdefault("server", {})["port"] = port
    if admin_port is not None:
        overrides.setdefault("admin", {})["port"] = admin_port
    if db_url:
        overrides["evaluation"] = {"store": {"url": db_url}}
    try:
        config = load_config(config_path, overrides)
        if not print_config:
            check_admin_binding(config.admin)  # refused here: a clear message, no traceback
    except ValidationError as exc:  # a ValueError: caught first, a line per field
        raise config_error(exc) from exc
    except (OSError, ValueError) as exc:  # no file, not TOML, an unguarded admin listener
        raise ConfigError([f"invalid configuration: {exc}"]) from exc
    if print_config:
        import orjson

        click.echo(orjson.dumps(config.printable(), option=orjson.OPT_INDENT_2).decode())
        return
    try:
        run(config)
    except OSError as exc:  # a port in use, an address not ours: refused, no traceback
        raise click.ClickException(f"cannot serve: {exc}") from exc


if __name__ == "__main__":
    main()
