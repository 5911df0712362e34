"""The ``understudy`` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from backends.engine import engine_command, kv_quality_command, plan_kv_command
from backends.openai_wire import ConfigError, config_error
from backends.sim import sim_command
from demo import demo_command
from gateway._admin import check_admin_binding
from gateway._app import run
from gateway._cli_admin import ADMIN_COMMANDS
from gateway._cli_eval import db, report
from gateway._config import load_config, parse_candidate_flag
from workload import load_command

__all__ = ["main"]


@click.group()
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def main(log_level: str) -> None:
    """understudy: mirror production LLM traffic to candidates and score them."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), help="TOML config file (see examples/understudy.toml).")
@click.option("--primary", help="Primary backend root URL, e.g. http://127.0.0.1:8000.")
@click.option("--host", help="Address to listen on.")
@click.option("--port", type=int, help="Port to listen on.")
@click.option("--candidate", "candidates", multiple=True, metavar="NAME=URL[,rate=R]",
              help="Mirror to a candidate (repeatable; replaces the file's candidates). "
                   "Options: rate=0..1, unit=request|session, concurrency=N, model=M.")
@click.option("--admin-port", type=int, help="Port of the admin API (off unless given).")
@click.option("--db", "db_url", help="Evaluation store URL: sqlite+aiosqlite:///FILE "
              "(default understudy.db) or postgresql+asyncpg://USER@HOST/DB.")
@click.option("--print-config", is_flag=True, help="Print the effective config and exit.")
def serve(config_path: Path | None, primary: str | None, host: str | None,
          port: int | None, candidates: tuple[str, ...], admin_port: int | None,
          db_url: str | None, print_config: bool) -> None:
    """Forward OpenAI-compatible traffic to the primary and mirror it to candidates."""
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
        click.echo(repr(config))
        return
    try:
        run(config)
    except OSError as exc:  # a port in use, an address not ours: refused, no traceback
        raise click.ClickException(f"cannot serve: {exc}") from exc


main.add_command(sim_command)
main.add_command(engine_command)
main.add_command(kv_quality_command)
main.add_command(plan_kv_command)
main.add_command(db)
main.add_command(report)
main.add_command(load_command)
main.add_command(demo_command)
for command in ADMIN_COMMANDS:
    main.add_command(command)
if __name__ == "__main__":
    main()
