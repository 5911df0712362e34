"""PostgreSQL unreachable mid-run: the gateway keeps serving, the writer retries, counts
what it drops past its bound, and catches up when the database returns."""

from __future__ import annotations

from evaluators.store import upgrade
from tests.tcp_relay import QUICK_RETRIES, relayed_database
from tests.utils import eventually, run_gateway, run_sim, timed_chats


async def test_database_outage_never_reaches_the_client(pg_database: str) -> None:
    await upgrade(pg_database)
    async with relayed_database(pg_database) as (relay, through_relay):
        store = {"url": through_relay, **QUICK_RETRIES, "queue_rows": 100}
        async with run_sim(ttft_ms=1, itl_ms=0, tokens=4) as primary, \
                run_sim(ttft_ms=1, itl_ms=0, tokens=4) as candidate, \
                run_gateway(primary.url, candidates=[{"name": "c", "url": candidate.url}],
                            evaluation={"enabled": True, "store": store,
                                        "scorers": ["exact_match", "latency"]}) as gw:
            await timed_chats(gw, 5, "before")
            await eventually(lambda: gw.written_records >= 5, within_s=30)

            await relay.cut()
            during = await timed_chats(gw, 60, "during")  # every one answered
            assert max(during) < 2.0, "the outage must not reach the client"
            evaluation = gw.state.scorekeeper
            assert evaluation is not None

            def dropped_past_bound() -> bool:
                stats = evaluation.writer_stats
                return (stats is not None and stats.retries > 0
                        and stats.dropped.get("queue_full", 0) > 0)

            await eventually(dropped_past_bound, within_s=30)  # retrying, and counting drops
            assert gw.written_records == 5

            await relay.restore()
            await timed_chats(gw, 5, "after")
            await eventually(lambda: gw.written_records >= 5 + 5, within_s=60)
