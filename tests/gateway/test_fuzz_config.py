"""Property-based fuzzing of ``load_config`` on arbitrary TOML documents.

Property: it returns a config or raises pydantic's ``ValidationError`` (which the commands print
as "Error: <field>: <message>" lines), never another type, and the message never holds a
secret value (API keys, the admin token, a URL's password).

Defects found here and fixed: top-level keys that are ``BaseSettings.__init__`` options
(``_env_file``, ``_secrets_dir``, ``_cli_parse_args``, ...) bypassed ``extra="forbid"`` (a bad
value raised TypeError, a traceback through the CLI); and the URL validator quoted the URL,
password included, when its scheme was not http(s).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from gateway import load_config
from gateway._config import (
    AdminConfig,
    CandidateConfig,
    CaptureConfig,
    EvaluationConfig,
    MirrorConfig,
    ServerConfig,
    UpstreamConfig,
)
from tests.utils import fuzz_settings

FUZZ = fuzz_settings(150, HealthCheck.function_scoped_fixture)

SECRET = "Zq9-s3cr3t-VALUE-77"


# --- a tiny TOML writer (tomli_w is not installed) ------------------------------------------


def _string(text: str) -> str:
    # JSON's escapes are TOML basic-string escapes; DEL must be escaped in TOML too.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007F")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_string(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def to_toml(document: dict[str, Any]) -> str:
    return "".join(f"{_string(k)} = {_value(v)}\n" for k, v in document.items())


# --- documents ---------------------------------------------------------------------------

_leaf = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "http://127.0.0.1:8000",
            "https://h/v1",
            "",
            "request",
            "session",
            "secondary",
            "sqlite+aiosqlite:///x.db",
        ]
    )
)
_values = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _section(model: type[BaseModel], secrets: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    names = sorted(model.model_fields)
    keys = st.sampled_from(names) | st.text(min_size=1, max_size=8)
    plain = st.dictionaries(keys, _values, max_size=5)
    if not secrets:
        return plain
    secret_values = st.sampled_from([SECRET, SECRET[:8], f"  {SECRET}  "])
    return st.tuples(plain, st.dictionaries(st.sampled_from(secrets), secret_values)).map(
        lambda pair: {**pair[0], **pair[1]}
    )


_candidate = st.tuples(
    _section(CandidateConfig, ("api_key",)),
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(["a", "b", "bad name", ""]),
            "url": st.sampled_from(["http://127.0.0.1:9", "http://x:1/v1/"]),
        },
    ),
).map(lambda pair: {**pair[0], **pair[1]})

_documents = st.fixed_dictionaries(
    {},
    optional={
        "server": _section(ServerConfig) | _values,
        "primary": _section(UpstreamConfig, ("api_key",)) | _values,
        "capture": _section(CaptureConfig),
        "mirror": _section(MirrorConfig),
        "candidates": st.lists(_candidate, max_size=3) | _values,
        "admin": _section(AdminConfig, ("token",)) | _values,
        "evaluation": _section(EvaluationConfig) | _values,
    },
).flatmap(
    lambda doc: st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: not k.startswith("_")), _values, max_size=2
    ).map(lambda extra: {**extra, **doc})
)


@pytest.fixture(autouse=True)
def _no_environment() -> Any:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UNDERSTUDY_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        yield


def _load(tmp_path: Path, document: dict[str, Any]) -> Exception | None:
    path = tmp_path / "fuzz.toml"
    path.write_text(to_toml(document), encoding="utf-8")
    try:
        load_config(path)
    except Exception as exc:  # the property is about which exceptions: judged below
        return exc
    return None


@FUZZ
@given(document=_documents)
def test_load_config_returns_or_raises_a_clear_validation_error(
    tmp_path: Path,
    document: dict[str, Any],
) -> None:
    error = _load(tmp_path, document)
    if error is None:
        return
    assert isinstance(error, ValidationError), f"{type(error).__name__}: {error}"
    message = str(error)
    assert "validation error" in message
    assert SECRET[:8] not in message, message


def test_the_toml_writer_round_trips() -> None:
    import tomllib

    document = {"a b": {"c": [1, 2.5, float("inf")], "d": 'x\x7f\u2028"\\\n'}, "e": True}
    assert tomllib.loads(to_toml(document)) == document


@pytest.mark.parametrize("line", ["_env_file = 5", "_env_prefix = 5", "_cli_parse_args = true"])
def test_settings_options_are_refused_as_unknown_keys(tmp_path: Path, line: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(line + "\n")
    with pytest.raises(ValidationError):
        load_config(path)


@pytest.mark.parametrize("section", ["[primary]", '[[candidates]]\nname = "a"'])
def test_a_url_password_is_not_echoed(tmp_path: Path, section: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'{section}\nurl = "ftp://user:{SECRET}@host"\n')
    with pytest.raises(ValidationError) as caught:
        load_config(path)
    assert SECRET not in str(caught.value)
