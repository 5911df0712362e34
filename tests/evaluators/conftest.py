"""Fixtures shared by the store's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators.store import create_engine, downgrade, upgrade


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on a migrated, empty database; migrated back down afterwards."""
    await upgrade(db_url)
    engine = create_engine(db_url)
    try:
        yield engine
    finally:
        await engine.dispose()
        await downgrade(db_url, "base")
