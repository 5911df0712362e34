"""``config_error``: a pydantic ValidationError as the command line's one line per field."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from backends.openai_wire import ConfigError, config_error

SECRET = "hunter2-hunter2"


class _Settings(BaseModel):
    port: int = Field(0, le=65535)
    name: str = ""

    @field_validator("name")
    @classmethod
    def _short(cls, name: str) -> str:
        if len(name) > 4:
            raise ValueError("name is too long\nat most 4 characters")
        return name

    @model_validator(mode="after")
    def _not_both(self) -> _Settings:
        if self.port == 1 and self.name == "a":
            raise ValueError("port 1 and name 'a' together")
        return self


def _error(**values: object) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        _Settings.model_validate(values)
    return caught.value


def test_a_line_per_field_without_the_value_or_pydantic_words() -> None:
    error = config_error(_error(port=70000, name=SECRET))
    assert error.problems == (
        "port: Input should be less than or equal to 65535",
        "name: name is too long at most 4 characters",
    )
    assert error.exit_code == 2


def test_a_model_wide_problem_is_named_by_the_model() -> None:
    assert config_error(_error(port=1, name="a")).problems == (
        "_Settings: port 1 and name 'a' together",
    )


def test_it_ends_a_command_with_an_error_line_each_and_status_2() -> None:
    @click.command()
    def command() -> None:
        raise config_error(_error(port=70000, name=SECRET))

    result = CliRunner().invoke(command, [])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "Error: port: Input should be less than or equal to 65535",
        "Error: name: name is too long at most 4 characters",
    ]
    assert SECRET not in result.output and "errors.pydantic.dev" not in result.output
    assert isinstance(ConfigError(["x"]), click.ClickException)
