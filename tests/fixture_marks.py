"""Marks for the tests that use an expensive session fixture (the real model, real vLLM)."""

from __future__ import annotations

import pytest


def mark_users(items: list[pytest.Item], fixture: str, marker: pytest.MarkDecorator,
               timeout_s: float) -> None:
    """Give every test that uses ``fixture`` ``marker`` (so that ``-m`` can deselect it) and,
    unless it sets its own, a timeout of ``timeout_s`` that covers the fixture's setup."""
    for item in items:
        if fixture not in getattr(item, "fixturenames", ()):
            continue
        item.add_marker(marker)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout_s))
