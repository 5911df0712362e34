"""Typed configuration: file, environment and flags, in that order of precedence."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway import GatewayConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "understudy.toml"


def test_example_config_loads() -> None:
    config = load_config(EXAMPLE)
    assert config.primary.url == "http://127.0.0.1:8100"
    assert config.server.port == 8080


def test_environment_overrides_file_and_flags_override_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UNDERSTUDY_PRIMARY__URL", "http://127.0.0.1:9000/v1")
    monkeypatch.setenv("UNDERSTUDY_SERVER__PORT", "9999")
    config = load_config(EXAMPLE)
    assert config.primary.url == "http://127.0.0.1:9000"  # /v1 is stripped
    assert config.server.port == 9999
    config = load_config(EXAMPLE, {"server": {"port": 7000}})
    assert config.server.port == 7000
    assert config.primary.url == "http://127.0.0.1:9000"


def test_secrets_are_masked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[primary]\nurl = "http://127.0.0.1:1"\napi_key = "sk-very-secret"\n')
    config = load_config(path)
    assert "sk-very-secret" not in repr(config)
    assert "sk-very-secret" not in str(config.model_dump())
    assert config.primary.api_key is not None
    assert config.primary.api_key.get_secret_value() == "sk-very-secret"


@pytest.mark.parametrize(
    "text",
    ['[primary]\nurl = "ftp://x"\n', "[server]\nport = -1\n", "[nope]\nx = 1\n",
     "[primary]\nidle_timeout_s = 0\n"],
)
def test_invalid_config_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValidationError):
        load_config(path)


def test_the_admin_token_variable_beats_the_nested_one_and_flags_beat_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[admin]\ntoken = "{"f" * 20}"\nport = 1\n')
    assert load_config(path).admin.token.get_secret_value() == "f" * 20  # type: ignore[union-attr]
    monkeypatch.setenv("UNDERSTUDY_ADMIN__TOKEN", "n" * 20)
    assert load_config(path).admin.token.get_secret_value() == "n" * 20  # type: ignore[union-attr]
    monkeypatch.setenv("UNDERSTUDY_ADMIN_TOKEN", "t" * 20)
    config = load_config(path)
    assert config.admin.token.get_secret_value() == "t" * 20  # type: ignore[union-attr]
    assert config.admin.port == 1  # sections merge key by key, not replaced whole
    config = load_config(path, {"admin": {"token": "o" * 20}})
    assert config.admin.token.get_secret_value() == "o" * 20  # type: ignore[union-attr]


def test_a_named_file_must_exist_and_configs_are_one_type(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.toml")
    assert type(load_config(EXAMPLE)) is GatewayConfig
    assert load_config(EXAMPLE) == load_config(EXAMPLE)
