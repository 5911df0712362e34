"""Shared pytest configuration. Fixture families live in their own modules, listed here."""

import os

import pytest

pytest_plugins = ["tests.fixtures_vllm", "tests.fixtures_db", "tests.fixtures_engine"]


@pytest.fixture(autouse=True, scope="session")
def _hash_key_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Store writers create their hash key file (evaluators/store/_hash_key.py) under a
    temporary state directory, never in the home of whoever runs the tests."""
    os.environ.setdefault("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
