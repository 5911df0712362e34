"""Closing the routing LISTEN connection while the database is a black hole (there, never
answering) is bounded: a gateway's shutdown used to wait on it for ever."""

from __future__ import annotations

import asyncio

from evaluators.store import create_engine, listen_for_routing, upgrade
from tests.tcp_relay import relayed_database

CLOSE_WITHIN_S = 2.0 + 2.0  # LISTEN_CLOSE_TIMEOUT_S and a loaded machine's slack


async def test_closing_the_listener_of_a_black_holed_store_is_bounded(
        pg_database: str) -> None:
    await upgrade(pg_database)
    async with relayed_database(pg_database) as (relay, through_relay):
        engine = create_engine(through_relay)
        try:
            listener = await listen_for_routing(engine, lambda: None)
            assert listener is not None
            relay.black_hole()
            async with asyncio.timeout(CLOSE_WITHIN_S):
                await listener.close()
        finally:
            await relay.close()  # its connections aborted first: nothing waits on the hole
            await engine.dispose()
