"""The canary's driver (``Promoter`` rules 3 and 5) against a real store, with a judge told
what to say: it holds, steps and promotes as the rule says, and it ends only when its
canary does, never on an answer it did not expect (a refusal, another replica's change).
A replica that starts on a stored canary drives it, and replicas driving one canary
together step it once per interval.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import MemorySink, Outcome
from evaluators.store import load_routing, save_routing
from gateway._config import CandidateConfig, CaptureConfig, MirrorConfig, UpstreamConfig
from gateway._headers import CREDENTIAL_HEADERS
from gateway._metrics import GatewayMetrics
from gateway._mirror import Mirror
from gateway._promotion import Promoter
from gateway._routing import Backend, Canary, Routing, Upstreams
from gateway._scorekeeper import Scorekeeper
from gateway._sync import RoutingSync
from tests.fixtures_db import migrated_engine, sqlite_url
from tests.utils import eventually

INTERVAL_S = 0.05


class ToldJudge:
    """A scorekeeper whose judge says ``outcome`` (``at_full`` of the 100 % step, where
    set); it counts its judgements."""

    def __init__(self, outcome: Outcome | None) -> None:
        self.outcome = outcome
        self.at_full: Outcome | None = None
        self.routing: Callable[[], Routing] | None = None
        self.judged = 0
        self.looks: list[int | None] = []

    async def read(self, candidate: str, since: Any = None) -> str:
        return candidate

    async def judge(self, inputs: Any, look: int | None = None) -> Any:
        self.judged += 1
        self.looks.append(look)
        outcome = self.outcome
        canary = self.routing().canary if self.routing is not None else None
        if self.at_full is not None and canary is not None and canary.percent == 100:
            outcome = self.at_full
        if outcome is None:
            raise RuntimeError("the judge broke")
        verdict = SimpleNamespace(outcome=outcome, reasons=(f"told {outcome}",))
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
        return [action for action, _ in await _actions(self.engine)]


@dataclass
class Replica:
    """One gateway replica's routing and promoter, wired as ``gateway/_app.py`` wires them:
    each routing it comes to serve is followed (``Promoter`` rule 5)."""

    promoter: Promoter
    sync: RoutingSync
    judge: ToldJudge

    @classmethod
    async def start(cls, engine: AsyncEngine, *, poll_interval_s: float = 60,
                    candidates: tuple[str, ...] = ("c",)) -> Replica:
        metrics = GatewayMetrics()
        mirror = Mirror(MirrorConfig(),
                        tuple(CandidateConfig(name=name, url="http://127.0.0.1:9")
                              for name in candidates),
                        CaptureConfig(), metrics, MemorySink(10))

        async def serve(routing: Routing) -> None:
            promoter.follow(routing)

        sync = RoutingSync(Routing.configured(Backend("primary", "http://127.0.0.1:8")), serve,
                           metrics, poll_interval_s=poll_interval_s)
        judge = ToldJudge(Outcome.MARGINAL)
        judge.routing = lambda: sync.routing
        promoter = Promoter(sync, mirror, metrics, cast(Scorekeeper, judge),
                            Upstreams(UpstreamConfig(), tuple(
                                c.config for c in mirror.candidates.values()),
                                credentials=CREDENTIAL_HEADERS))
        await sync.start(engine)
        return cls(promoter, sync, judge)

    async def stop(self) -> None:
        await self.promoter.close()
        await self.sync.stop()


async def _actions(engine: AsyncEngine) -> list[tuple[str, str]]:
    async with engine.connect() as connection:
        rows = await connection.execute(sa.text("SELECT action, actor FROM audit_log ORDER BY id"))
        return [(row.action, row.actor) for row in rows]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    async with migrated_engine(sqlite_url(tmp_path), down_after=False) as engine:
        yield engine


@pytest.fixture
async def driven(store: AsyncEngine) -> AsyncIterator[Driven]:
    # Polls far apart: this replica hears of another's change only when it asks.
    replica = await Replica.start(store)
    try:
        yield Driven(replica.promoter, replica.sync, replica.judge, store)
    finally:
        await replica.stop()


def _driving(promoter: Promoter) -> bool:
    task = promoter._canary_task  # the driver itself: whether it still runs
    return task is not None and not task.done()


async def test_marginal_holds_the_last_mirrored_step_and_a_pass_then_promotes(
        driven: Driven) -> None:
    """Rule 3a: the 100 % step mirrors nothing, so it is judged on the last mirrored step's
    scores; only a PASS there moves every session to the candidate (before, a MARGINAL did,
    and the canary then sat at 100 % on a verdict that could not turn)."""
    await driven.promoter.start_canary("c", actor="t", steps=(25.0, 50.0, 100.0),
                                       interval_s=INTERVAL_S)
    await eventually(lambda: (canary := driven.sync.routing.canary) is not None
                     and canary.percent == 50.0)  # MARGINAL steps up below the last one
    judged = driven.judge.judged
    await eventually(lambda: driven.judge.judged >= judged + 3)  # held, judged again
    canary = driven.sync.routing.canary
    assert canary is not None and canary.percent == 50.0
    assert driven.sync.routing.primary.name == "primary"
    assert _driving(driven.promoter)
    driven.judge.outcome = Outcome.PASS
    await eventually(lambda: driven.sync.routing.primary.name == "c")
    assert driven.sync.routing.canary is None
    await eventually(lambda: not _driving(driven.promoter))
    assert await driven.actions() == ["canary_start", "canary_step", "canary_step", "promote"]


async def test_a_held_step_is_judged_as_one_more_look_each_time(driven: Driven) -> None:
    """Rule 3c: the driver tells the judge which look at the step's window each judgement
    is, so that the gates spend their error rate over the looks; judgements are an
    interval apart at least, so each is a later look than the one before."""
    driven.judge.outcome = Outcome.INCONCLUSIVE  # holds any step
    await driven.promoter.start_canary("c", actor="t", steps=(25.0, 100.0),
                                       interval_s=INTERVAL_S)
    await eventually(lambda: len(driven.judge.looks) >= 4)
    looks = [look for look in driven.judge.looks[:4] if look is not None]
    assert len(looks) == 4 and looks[0] >= 1, driven.judge.looks
    assert all(b > a for a, b in itertools.pairwise(looks)), looks


@pytest.mark.parametrize("at_full", [Outcome.MARGINAL, Outcome.INCONCLUSIVE])
async def test_short_of_a_pass_at_100_goes_back_to_measure_more(driven: Driven,
                                                                 at_full: Outcome) -> None:
    """Rule 3b: at 100 % nothing new is scored, so holding that step would judge the same
    scores for ever: a verdict short of PASS takes the canary back to the step below,
    begun afresh; a PASS there and then at 100 % promotes."""
    driven.judge.outcome, driven.judge.at_full = Outcome.PASS, at_full
    started = await driven.promoter.start_canary("c", actor="t", steps=(50.0, 100.0),
                                                 interval_s=INTERVAL_S)
    assert started.routing.canary is not None
    full_from = 0.0

    def back_below() -> bool:
        nonlocal full_from
        canary = driven.sync.routing.canary
        if canary is not None and canary.percent == 100.0:
            full_from = canary.step_started_at
        return full_from > 0 and canary is not None and canary.percent == 50.0

    await eventually(back_below)
    back = driven.sync.routing.canary
    assert back is not None and back.step == 0 and back.actor == "t"
    assert back.step_started_at > full_from  # begun afresh: judged on new scores only
    assert back.judged_since == back.step_started_at
    assert driven.sync.routing.primary.name == "primary"
    assert _driving(driven.promoter)
    driven.judge.at_full = None  # the scores measured again say PASS at 100 % too
    await eventually(lambda: driven.sync.routing.primary.name == "c")
    actions = await driven.actions()
    assert actions[:3] == ["canary_start", "canary_step", "canary_step_back"], actions
    assert actions[-2:] == ["canary_step", "promote"], actions


async def test_a_canary_started_at_100_holds_short_of_a_pass(driven: Driven) -> None:
    """Rule 3b: with no step below there is nothing to go back to: it holds."""
    await driven.promoter.start_canary("c", actor="t", steps=(100.0,), interval_s=INTERVAL_S)
    judged = driven.judge.judged
    await eventually(lambda: driven.judge.judged >= judged + 3)
    canary = driven.sync.routing.canary
    assert canary is not None and canary.percent == 100.0
    assert _driving(driven.promoter)
    assert await driven.actions() == ["canary_start"]


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


async def test_a_replica_that_starts_on_a_stored_canary_drives_it(store: AsyncEngine) -> None:
    """The replica the canary was started on goes away; one that starts later on the same
    store takes the canary on from its stored step, in its starter's name."""
    first = await Replica.start(store)
    first.judge.outcome = Outcome.PASS
    await first.promoter.start_canary("c", actor="ops", steps=(25.0, 50.0, 100.0),
                                      interval_s=INTERVAL_S)
    await eventually(lambda: (canary := first.sync.routing.canary) is not None
                     and canary.percent == 50.0)
    await first.stop()  # gone mid-canary: nothing drives it now
    stored = await load_routing(store)
    assert stored is not None
    canary = Routing.from_dict(stored[1]).canary
    assert canary is not None and canary.percent in (50.0, 100.0)

    second = await Replica.start(store)
    try:
        second.judge.outcome = Outcome.PASS
        await eventually(lambda: second.sync.routing.primary.name == "c", within_s=10)
        assert second.sync.routing.canary is None
        actions = await _actions(store)
        assert actions[0] == ("canary_start", "ops") and actions[-1] == ("promote", "ops")
        assert [a for a, _ in actions].count("canary_step") == 2
        assert {actor for _, actor in actions} == {"ops"}
    finally:
        await second.stop()


async def test_a_replica_without_the_candidate_finishes_its_canary(store: AsyncEngine) -> None:
    """The canary's candidate was added at runtime on the replica that started it, so no
    other replica has it, and that replica went away. Before, the replica left drove the
    canary to 100 % and there, on a PASS, looked the candidate up to promote it: 'no
    candidate named c' every interval, for ever, every session held on the canary. The
    canary's backend is in the routing (rule 5): it is promoted from there."""
    first = await Replica.start(store)
    await first.promoter.start_canary("c", actor="ops", steps=(50.0, 100.0),
                                      interval_s=INTERVAL_S)
    await first.stop()
    second = await Replica.start(store, candidates=())
    try:
        second.judge.outcome = Outcome.PASS
        await eventually(lambda: second.sync.routing.primary.name == "c", within_s=10)
        routing = second.sync.routing
        assert routing.canary is None
        assert routing.primary.url == "http://127.0.0.1:9"
        assert routing.previous is not None and routing.previous.name == "primary"
        actions = await _actions(store)
        assert actions[0] == ("canary_start", "ops") and actions[-1] == ("promote", "ops")
        await eventually(lambda: not _driving(second.promoter))
    finally:
        await second.stop()


async def test_replicas_driving_one_canary_step_it_once_per_interval(store: AsyncEngine) -> None:
    """Two replicas, each driving the canary they both serve: every step is taken once,
    and no sooner than an interval after the one before."""
    interval_s = 0.3
    replicas = [await Replica.start(store, poll_interval_s=0.05) for _ in range(2)]
    try:
        for replica in replicas:
            replica.judge.outcome = Outcome.PASS
        started = await replicas[0].promoter.start_canary(
            "c", actor="ops", steps=(25.0, 50.0, 100.0), interval_s=interval_s)
        assert started.routing.canary is not None
        await eventually(lambda: replicas[1].sync.routing.canary is not None)
        assert _driving(replicas[1].promoter)  # it adopted the canary and drives it too
        await eventually(lambda: all(r.sync.routing.primary.name == "c" for r in replicas),
                         within_s=15)
        promoted_at = time.time()
        actions = [action for action, _ in await _actions(store)]
        assert actions == ["canary_start", "canary_step", "canary_step", "promote"]
        # Three judged steps, each at least an interval old when it was judged.
        assert promoted_at - started.routing.canary.step_started_at >= 3 * interval_s
        assert sum(r.judge.judged for r in replicas) >= 3
    finally:
        for replica in replicas:
            await replica.stop()


async def test_a_judgement_that_fails_is_tried_again(driven: Driven) -> None:
    """An error the driver did not foresee (here the judge's own) is logged and the step is
    judged again next interval: the driver does not die and leave its canary where it is."""
    driven.judge.outcome = None  # the judge raises
    await driven.promoter.start_canary("c", actor="t", steps=(50.0, 100.0),
                                       interval_s=INTERVAL_S)
    await eventually(lambda: driven.judge.judged >= 2)
    assert _driving(driven.promoter)
    driven.judge.outcome = Outcome.PASS
    await eventually(lambda: driven.sync.routing.primary.name == "c", within_s=10)
    assert await driven.actions() == ["canary_start", "canary_step", "promote"]
