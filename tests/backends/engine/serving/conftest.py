"""Fixtures of the serving tests."""

from __future__ import annotations

import pytest

from backends.engine import LlamaModel


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the model fails the test: what is refused must be refused before it loads."""

    def no_load(*_: object, **__: object) -> LlamaModel:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LlamaModel, "load", no_load)
