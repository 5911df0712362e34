"""Typed configuration: file, environment and flags, in that order of precedence."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway import GatewayConfig, load_config
from gateway._config import OTHER_ENVIRONMENT, check_environment

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


def test_print_config_shows_every_url_with_its_password_masked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """README: ``--print-config`` "shows the effective config with secrets masked", and a
    URL's password as ``***``. It printed ``repr(config)``, which leaves every URL out: the
    primary, the candidates and the store it would use were not shown. Found walking the
    README on a fresh clone."""
    import orjson
    from click.testing import CliRunner

    from gateway.cli import main

    token = "t0ken-" + "x" * 20
    monkeypatch.setenv("UNDERSTUDY_ADMIN_TOKEN", token)
    result = CliRunner().invoke(main, [
        "serve", "--primary", "http://u:pw-primary@127.0.0.1:8000/v1",
        "--candidate", "fast=http://c:pw-candidate@127.0.0.1:8001,rate=0.1",
        "--db", "postgresql://s:pw-store@db.internal/understudy", "--print-config"])
    assert result.exit_code == 0, result.output
    for secret in ("pw-primary", "pw-candidate", "pw-store", token):
        assert secret not in result.output
    shown = orjson.loads(result.stdout)
    assert shown["primary"]["url"] == "http://u:***@127.0.0.1:8000"
    assert [(c["name"], c["url"], c["sample_rate"]) for c in shown["candidates"]] == [
        ("fast", "http://c:***@127.0.0.1:8001", 0.1)]
    assert shown["evaluation"]["store"]["url"] == \
        "postgresql+asyncpg://s:***@db.internal/understudy"
    assert shown["admin"]["token"] == "**********"


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


def test_serve_help_says_the_file_or_environment_opens_the_admin_api_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --help`` said ``--admin-port`` was "off unless given", but ``[admin] port``
    (or UNDERSTUDY_ADMIN__PORT) opens the admin API as well, as the README says. Found walking
    the README on a fresh clone."""
    import orjson
    from click.testing import CliRunner

    from gateway.cli import main

    _clear_understudy_environment(monkeypatch)
    shown = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=80)
                     .output.split())
    assert "[admin] port" in shown and "UNDERSTUDY_ADMIN__PORT" in shown, shown
    assert "off unless given" not in shown
    path = tmp_path / "c.toml"
    path.write_text("[admin]\nport = 8091\n")

    def admin_port(*flags: str) -> object:
        result = CliRunner().invoke(main, ["serve", "--config", str(path), *flags,
                                           "--print-config"])
        assert result.exit_code == 0, result.output
        return orjson.loads(result.stdout)["admin"]["port"]

    assert admin_port() == 8091
    monkeypatch.setenv("UNDERSTUDY_ADMIN__PORT", "8092")
    assert admin_port() == 8092
    assert admin_port("--admin-port", "8093") == 8093


def test_a_named_file_must_exist_and_configs_are_one_type(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.toml")
    assert type(load_config(EXAMPLE)) is GatewayConfig
    assert load_config(EXAMPLE) == load_config(EXAMPLE)


# Misspelt names are set on purpose here: the scan below skips this file.
@pytest.mark.parametrize(
    ("variable", "problem"),
    [
        ("UNDERSTUDY_ADMIN_TOKN", "names no setting; did you mean UNDERSTUDY_ADMIN_TOKEN?"),
        ("UNDERSTUDY_SERVER_PORT", "names no setting; did you mean UNDERSTUDY_SERVER__PORT?"),
        ("UNDERSTUDY_PRIMARY__URLL", "names no setting; did you mean UNDERSTUDY_PRIMARY__URL?"),
        ("UNDERSTUDY_SERVER__PORT__X", "names no setting; did you mean UNDERSTUDY_SERVER__PORT?"),
        ("understudy_hom", "names no setting; did you mean UNDERSTUDY_HOME?"),
        ("UNDERSTUDY_QQQQ", "names no setting"),
    ],
)
def test_an_unknown_understudy_variable_is_refused_with_the_name_it_is_closest_to(
    monkeypatch: pytest.MonkeyPatch, variable: str, problem: str
) -> None:
    _clear_understudy_environment(monkeypatch)
    monkeypatch.setenv(variable, "s3cret-value-not-echoed")
    with pytest.raises(ValidationError) as caught:
        load_config(EXAMPLE)
    errors = caught.value.errors(include_url=False)
    assert [(error["loc"], error["msg"]) for error in errors] == [((variable,), problem)]
    assert "s3cret-value-not-echoed" not in str(caught.value)


def test_every_setting_and_every_variable_read_elsewhere_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clear_understudy_environment(monkeypatch)
    check_environment({name: "" for name in OTHER_ENVIRONMENT})
    check_environment({
        "UNDERSTUDY_SERVER__PORT": "1",
        "understudy_server__port": "1",  # pydantic-settings reads names case-insensitively
        "UNDERSTUDY_PRIMARY": "{}",  # a whole section, as JSON
        "UNDERSTUDY_EVALUATION__STORE__URL": "sqlite+aiosqlite:///x.db",
        "UNDERSTUDY_EVALUATION__SCORING__PRICES__MY_MODEL__MODE": "per_token",  # a mapping's key
        "UNDERSTUDY_CANDIDATES": "[]",
        "PATH": "/bin", "NOT_UNDERSTUDY_X": "",
    })  # fmt: skip
    monkeypatch.setenv("UNDERSTUDY_HOME", "/nowhere")
    monkeypatch.setenv("UNDERSTUDY_SERVER__PORT", "9999")
    assert load_config(EXAMPLE).server.port == 9999


_READERS = ("gateway", "evaluators", "backends", "workload", "demo", "bench", "tests", "scripts",
            "migrations", "deploy", "docs", "examples", ".ci")  # fmt: skip
_READER_FILES = ("docker-compose.yml", "Dockerfile", "alembic.ini", "README.md")
_NAME = re.compile(r"\bUNDERSTUDY_[A-Za-z0-9_]*[A-Za-z0-9]")
_NOT_VARIABLES = {
    "UNDERSTUDY_IMAGE",  # tests/deploy/_stack.py: a Python constant, the image tag
    "UNDERSTUDY_ADMIN_TOKN",  # README.md: its example of a misspelt name and the refusal
}


def test_every_understudy_variable_the_tree_names_is_known() -> None:
    """A variable read by a script, a test or another package is in OTHER_ENVIRONMENT, so that
    the gateway does not refuse it; every other name the tree mentions is a setting."""
    root = EXAMPLE.parents[1]
    files = [path for folder in _READERS for path in (root / folder).rglob("*") if path.is_file()]
    files += [root / name for name in _READER_FILES]
    skipped = {Path(__file__).resolve(), root / "tests" / "test_cli_edge_inputs.py"}
    named = set()
    for path in files:
        if path.resolve() in skipped or path.suffix in (".so", ".pyc", ".png", ".gguf"):
            continue
        try:
            named.update(_NAME.findall(path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    assert "UNDERSTUDY_HOME" in named and "UNDERSTUDY_ADMIN_URL" in named  # the scan works
    unknown = sorted(name for name in named - _NOT_VARIABLES if not _known(name))
    assert not unknown, f"read somewhere but refused by the gateway: {unknown}"


def _known(name: str) -> bool:
    try:
        check_environment({name: ""})
    except ValidationError:
        return False
    return True


def _clear_understudy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("UNDERSTUDY_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("primary_name", [None, "prod"])
@pytest.mark.parametrize("role", ["candidate", "secondary"])
def test_a_candidate_named_as_the_primary_is_refused_at_start(
    primary_name: str | None, role: str
) -> None:
    """The store knows a backend by its name: such a candidate shared the primary's row, and
    each exchange kept one of its two observations (the admin API answers it 409)."""
    primary: dict[str, str] = {"url": "http://127.0.0.1:9"}
    if primary_name is not None:
        primary["name"] = primary_name
    name = primary_name or "primary"
    candidates = [{"name": "other", "url": "http://127.0.0.1:8"},
                  {"name": name, "url": "http://127.0.0.1:7", "role": role}]
    with pytest.raises(ValidationError) as caught:
        load_config(None, {"primary": primary, "candidates": candidates})
    errors = caught.value.errors(include_url=False)
    assert [(error["loc"], error["msg"]) for error in errors] == [(
        ("candidates",), f"Value error, candidate {name!r} has the primary's name; a primary "
        "is not its own candidate (pick another name)")]
    assert load_config(None, {"primary": primary, "candidates": candidates[:1]}).candidates
