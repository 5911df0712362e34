"""Fixtures shared by the store's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.fixtures_db import migrated_engine


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on a migrated, empty database; migrated back down afterwards."""
    async with migrated_engine(db_url) as engine:
        yield engine
