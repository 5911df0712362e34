"""Invalid settings on the command line, worded and ended alike by every ``understudy`` command.

A command that builds a pydantic model from its flags, a file or the environment (``serve``,
``sim``, ``engine``, ``load``) turns the ``ValidationError`` into ``config_error(exc)``: one
line per invalid field, ``Error: <field>: <message>``, without pydantic's header, its
``errors.pydantic.dev`` URL or the value given (it may be a token or a password), and exit
status 2, a usage error, as click gives a bad flag.  ``validation_problems`` words each field
the same way for every surface that reports a ``ValidationError`` (the admin API's 422s too), a
validator's own words without pydantic's ``Value error, ``.  It lives here, beside
``serve_until_signalled``, because this is the package every command can import: ``backends``
imports neither ``gateway`` nor ``workload``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any

import click
from pydantic import ValidationError

__all__ = ["CONFIG_ERROR_EXIT_STATUS", "ConfigError", "config_error", "validation_problems"]

CONFIG_ERROR_EXIT_STATUS = 2
"""Click's own for a usage error (a bad flag, a missing argument)."""
_VALUE_ERROR_PREFIX = "Value error, "
"""What pydantic puts before a validator's own words."""


class ConfigError(click.ClickException):
    """Settings a command refuses: ``Error: <problem>`` for each, exit status 2."""

    exit_code = CONFIG_ERROR_EXIT_STATUS

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(" ".join(problem.splitlines()) for problem in problems)
        super().__init__("\n".join(self.problems))

    def show(self, file: IO[Any] | None = None) -> None:
        for problem in self.problems:  # ``err``: stderr unless ``file`` is given
            click.echo(f"Error: {problem}", file=file, err=True)


def validation_problems(exc: ValidationError, whole: str | None = None) -> list[str]:
    """``exc`` as one ``<field>: <message>`` per invalid field, in plain words: a validator's
    ``ValueError`` without the ``Value error, `` pydantic puts before it, and neither the value
    given nor a URL. ``whole`` names an error of the whole input (``exc.title`` if not given)."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        field = ".".join(str(part) for part in error["loc"]) or whole or exc.title
        message = error["msg"]
        if error["type"] == "value_error":
            message = message.removeprefix(_VALUE_ERROR_PREFIX)
        problems.append(f"{field}: {message}")
    return problems


def config_error(exc: ValidationError) -> ConfigError:
    """``exc`` as one ``<field>: <message>`` problem per invalid field."""
    return ConfigError(validation_problems(exc))
