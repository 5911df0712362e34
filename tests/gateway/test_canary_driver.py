"""The canary's driver (``Promoter`` rule 3) against a real store, with a judge told
what to say: it holds, steps and promotes as the rule says, and it ends only when its
canary does, never on an answer it did not expect (a refusal, another replica's change).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import MemorySink, Outcome
from evaluators.store import create_engine, load_routing, save_routing, upgrade
from gateway._config import CandidateConfig, CaptureConfig, MirrorConfig
from gateway._metrics import GatewayMetrics
from gateway._mirror import Mirror
from gateway._promotion import Promoter
from gateway._routing import Backend, Canary, Routing
from gateway._scorekeeper import Scorekeeper
from gateway._sync import RoutingSync
from tests.fixtures_db import sqlite_url
from tests.utils import eventually

INTERVAL_S = 0.05


class ToldJudge:
    """A scorekeeper whose judge says ``outcome``; it counts its judgements."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.judged = 0

    async def read(self, candidate: str, since: Any = None) -> str:
        return candidate

    async def judge(self, inputs: Any) -> Any:
        self.judged += 1
        verdict = SimpleNamespace(outcome=self.outcome, reasons=(f"told {self.outcome}",))
        return SimpleNamespace(verdict=verdict, verdict_id=None)

    async def record(self, report: Any) -> Any:
        return report


@dataclass
class Driven:
    promoter: Promoter
    sync: RoutingSync
    judge: ToldJudge
    engine: AsyncEngine

    async def actions(self) -> list[str]:
        async with self.engine.connect() as connection:
            rows = await connection.execute(sa.text("SELECT action FROM audit_log ORDER BY id"))
            return [row.action for row in rows]


@pytest.fixture
async def driven(tmp_path: Path) -> AsyncIterator[Driven]:
    url = sqlite_url(tmp_path)
    await upgrade(url)
    engine = create_engine(url)
    metrics = GatewayMetrics()
    mirror = Mirror(MirrorConfig(), (CandidateConfig(name="c", url="http://127.0.0.1:9"),),
                    CaptureConfig(), metrics, MemorySink(10))

    async def nothing(_: Routing) -> None:
        pass

    # Polls far apart: this replica hears of another's change only when it asks.
    sync = RoutingSync(Routing.configured(Backend("primary", "http://127.0.0.1:8")), nothing,
                       metrics, poll_interval_s=60)
    await sync.start(engine)
    judge = ToldJudge(Outcome.MARGINAL)
    promoter = Promoter(sync, mirror, metrics, cast(Scorekeeper, judge))
    try:
        yield Driven(promoter, sync, judge, engine)
    finally:
        await promoter.close()
        await sync.stop()
        await engine.dispose()


def _driving(promoter: Promoter) -> bool:
    task = promoter._canary_task  # the driver itself: whether it still runs
    return task is not None and not task.done()


async def test_marginal_holds_the_last_step_and_a_pass_then_promotes(driven: Driven) -> None:
    await driven.promoter.start_canary("c", actor="t", steps=(50.0, 100.0),
                                       interval_s=INTERVAL_S)
    await eventually(lambda: (canary := driven.sync.routing.canary) is not None
                     and canary.percent == 100.0)
    judged = driven.judge.judged
    await eventually(lambda: driven.judge.judged >= judged + 3)  # held, judged again
    canary = driven.sync.routing.canary
    assert canary is not None and canary.percent == 100.0
    assert driven.sync.routing.primary.name == "primary"
    assert _driving(driven.promoter)  # before: a refused promotion ended the driver
    driven.judge.outcome = Outcome.PASS
    await eventually(lambda: driven.sync.routing.primary.name == "c")
    assert driven.sync.routing.canary is None
    await eventually(lambda: not _driving(driven.promoter))
    assert await driven.actions() == ["canary_start", "canary_step", "promote"]


async def test_the_driver_outlives_another_replicas_change(driven: Driven) -> None:
    driven.judge.outcome = Outcome.INCONCLUSIVE
    await driven.promoter.start_canary("c", actor="t", steps=(50.0, 100.0),
                                       interval_s=INTERVAL_S)
    seen = driven.sync.routing
    assert seen.canary is not None
    # Another replica restarts the canary with three steps; this one has not heard yet.
    theirs = seen.with_canary(Canary(seen.canary.backend, (25.0, 50.0, 100.0), 0,
                                     INTERVAL_S, seen.canary.step_started_at))
    assert await save_routing(driven.engine, theirs.version, theirs.to_dict(),
                              expected=seen.version)
    judged = driven.judge.judged
    await eventually(lambda: driven.judge.judged > judged)
    driven.judge.outcome = Outcome.PASS  # this driver's next step meets their routing
    await eventually(lambda: driven.sync.routing.version > theirs.version, within_s=10)
    stored = await load_routing(driven.engine)
    assert stored is not None
    canary = Routing.from_dict(stored[1]).canary
    # Their canary, stepped on from their routing: never this replica's two steps again.
    assert canary is not None and canary.steps == (25.0, 50.0, 100.0)
    assert _driving(driven.promoter) or driven.sync.routing.primary.name == "c"
    await eventually(lambda: driven.sync.routing.primary.name == "c", within_s=10)
    await asyncio.sleep(0)
