"""Closing the routing LISTEN connection while the database is a black hole (there, never
answering) is bounded: a gateway's shutdown used to wait on it for ever."""

from __future__ import annotations

import asyncio

from sqlalchemy.engine import make_url

from evaluators.store import create_engine, listen_for_routing, upgrade
from tests.tcp_relay import TcpRelay

CLOSE_WITHIN_S = 2.0 + 2.0  # LISTEN_CLOSE_TIMEOUT_S and a loaded machine's slack


async def test_closing_the_listener_of_a_black_holed_store_is_bounded(
        pg_database: str) -> None:
    await upgrade(pg_database)
    url = make_url(pg_database)
    relay = TcpRelay(url.host or "127.0.0.1", url.port or 5432)
    await relay.start()
    engine = create_engine(url.set(port=relay.port).render_as_string(hide_password=False))
    try:
        listener = await listen_for_routing(engine, lambda: None)
        assert listener is not None
        relay.black_hole()
        async with asyncio.timeout(CLOSE_WITHIN_S):
            await listener.close()
    finally:
        await relay.close()
        await engine.dispose()
