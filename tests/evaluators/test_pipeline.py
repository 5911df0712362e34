"""EvaluationPipeline: exchanges scored and stored by a child process, with every
exchange accounted for, and no child left behind (also when the parent is killed).

Real processes and a real SQLite file; the scorers are the cheap ones (no sentence
encoder to load), except where a test says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import pytest

from evaluators import (
    EvaluationPipeline,
    EvaluationProcessError,
    Exchange,
    PipelineState,
    Score,
    ScorerConfig,
)
from evaluators._pipeline import DEFAULT_BATCH_SIZE
from evaluators._scoring_process import (
    MAX_BATCH_SIZE,
    STATS_INTERVAL_S,
    ProcessSettings,
    _ScoringProcess,
)
from evaluators.store import ScoreWriter, StoreConfig, upgrade
from tests.evaluators.test_store import make_exchange
from tests.fixtures_db import sqlite_url
from tests.utils import eventually

REPO_ROOT = Path(__file__).resolve().parents[2]
CHEAP_SCORERS = ("exact_match", "edit_similarity", "latency", "reliability")
QUICK_STORE = {"flush_interval_s": 0.02}


@pytest.fixture
async def store(tmp_path: Path) -> StoreConfig:
    url = sqlite_url(tmp_path)
    await upgrade(url)
    return StoreConfig(url=url, **QUICK_STORE)


@pytest.fixture
async def pipeline(store: StoreConfig) -> AsyncIterator[EvaluationPipeline]:
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS)
    await pipeline.start()
    try:
        yield pipeline
    finally:
        await pipeline.close()


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie not yet reaped by its new parent counts)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _written(pipeline: EvaluationPipeline, records: int) -> bool:
    stats = pipeline.writer_stats
    return stats is not None and stats.written_records >= records


async def test_scores_and_stores_in_a_child_process(pipeline: EvaluationPipeline) -> None:
    assert pipeline.state is PipelineState.RUNNING
    assert pipeline.pid is not None and pipeline.pid != os.getpid()
    assert pipeline.writer_stats is not None  # reported before start returned
    for i in range(50):
        assert pipeline.submit(make_exchange(f"r{i}"))
    await eventually(lambda: _written(pipeline, 50), within_s=20)
    stats = pipeline.stats
    assert (stats.accepted, stats.scored, stats.pending, stats.dropped) == (50, 50, 0, {})
    # drained in batches of what was queued, each at most the pipeline's batch size
    assert 1 <= stats.batches <= 50 and 1 <= stats.batch_size <= DEFAULT_BATCH_SIZE
    assert stats.queue_depth == 0
    writer = pipeline.writer_stats
    assert writer is not None and writer.written_rows["scores"] > 0
    pid = pipeline.pid
    await pipeline.close()
    # read anew: mypy would keep pipeline.state narrowed to RUNNING across close()
    state: PipelineState = pipeline.state
    assert state is PipelineState.CLOSED and _gone(pid)
    assert not pipeline.submit(make_exchange("late"))


class _WriterRefusingOne:
    """A writer whose ``submit`` raises on one request id (fault injection)."""

    def __init__(self, bad: str) -> None:
        self.bad = bad
        self.taken: list[str] = []

    def submit(self, exchange: Exchange, scores: Sequence[Score] = ()) -> bool:
        if exchange.request_id == self.bad:
            raise RuntimeError("a record the writer cannot build")
        self.taken.append(exchange.request_id)
        return True


def test_an_exchange_the_writer_raises_on_costs_that_exchange_only(
        store: StoreConfig) -> None:
    settings = ProcessSettings(store, (), ScorerConfig(), batch_size=8, drain_timeout_s=1.0,
                               niceness=0, log_level=logging.INFO)
    parent, child = multiprocessing.Pipe()
    with contextlib.closing(parent), contextlib.closing(child):
        process = _ScoringProcess(settings, multiprocessing.Queue(), child, os.getpid())
        writer = _WriterRefusingOne("r1")
        batch: list[tuple[Exchange, list[Score]]] = [(make_exchange(f"r{i}"), [])
                                                     for i in range(4)]
        process._store(cast(ScoreWriter, writer), batch, errors=1)
    # the exchanges after the one refused are still submitted, and every one is counted
    assert writer.taken == ["r0", "r2", "r3"]
    assert process._scored == 3
    assert process._dropped == {"store_error": 1, "scoring_error": 1}


def test_batch_size_is_bounded(store: StoreConfig) -> None:
    for size in (0, MAX_BATCH_SIZE + 1):
        with pytest.raises(ValueError, match="batch_size"):
            EvaluationPipeline(store, CHEAP_SCORERS, batch_size=size)


async def test_submit_refuses_before_start(store: StoreConfig) -> None:
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS)
    assert not pipeline.submit(make_exchange("early"))
    await pipeline.close()
    assert pipeline.state is PipelineState.CLOSED


async def test_submit_is_a_bounded_put(store: StoreConfig) -> None:
    """The queue holds at most ``max_pending``: past it, submit refuses at once."""
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS, max_pending=5)
    await pipeline.start()
    try:
        exchange = make_exchange("same")
        started = time.perf_counter()
        results = [pipeline.submit(exchange) for _ in range(2_000)]
        per_call_s = (time.perf_counter() - started) / len(results)
        assert results[:5] == [True] * 5 and not all(results)
        assert per_call_s < 200e-6  # a put on a local buffer, never a wait on the child
    finally:
        await pipeline.close()
    stats = pipeline.stats
    assert stats.accepted == sum(results)
    assert stats.scored + sum(stats.dropped.values()) == stats.accepted


async def test_a_child_that_cannot_start_is_a_clear_error(store: StoreConfig) -> None:
    pipeline = EvaluationPipeline(store, ("no_such_scorer",))
    with pytest.raises(EvaluationProcessError, match="unknown scorers"):
        await pipeline.start()
    assert pipeline.state is PipelineState.CLOSED
    assert pipeline.pid is not None and _gone(pipeline.pid)


async def test_close_counts_what_was_not_scored_in_time(store: StoreConfig) -> None:
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS, drain_timeout_s=0.0, batch_size=1)
    await pipeline.start()
    accepted = sum(pipeline.submit(make_exchange(f"r{i}")) for i in range(500))
    await pipeline.close()
    stats = pipeline.stats
    assert stats.accepted == accepted and stats.pending == 0
    assert stats.scored + stats.dropped.get("shutdown", 0) == accepted
    writer = pipeline.writer_stats
    assert writer is not None  # the final report: everything scored was written
    assert writer.written_records + sum(writer.dropped.values()) == stats.scored


def _zombie_children() -> list[int]:
    """This process's children that exited and were not reaped."""
    zombies = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            text = status.read_text()
            if f"\nPPid:\t{os.getpid()}\n" in text and "\nState:\tZ" in text:
                zombies.append(int(status.parent.name))
    return zombies


async def test_a_child_that_dies_is_reaped_counted_and_restarted(store: StoreConfig) -> None:
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS, restart_backoff_s=0.05)
    await pipeline.start()
    try:
        for i in range(20):
            assert pipeline.submit(make_exchange(f"before{i}"))
        await eventually(lambda: _written(pipeline, 20), within_s=20)
        first = pipeline.pid
        assert first is not None
        # Exchanges the child holds when it dies: it cannot score them in time.
        for i in range(200):
            pipeline.submit(make_exchange(f"inflight{i}"))
        os.kill(first, signal.SIGKILL)
        await eventually(lambda: pipeline.state is not PipelineState.RUNNING, within_s=10)
        assert pipeline.submit(make_exchange("while-restarting"))  # queued for the next one
        await eventually(lambda: pipeline.state is PipelineState.RUNNING, within_s=30)
        assert pipeline.pid not in (None, first)
        assert _gone(first) and first not in _zombie_children()
        stats = pipeline.stats
        assert stats.restarts == 1
        assert stats.dropped.get("process_exit", 0) > 0
        for i in range(20):
            assert pipeline.submit(make_exchange(f"after{i}"))
        await eventually(lambda: pipeline.stats.pending == 0, within_s=20)
        writer = pipeline.writer_stats
        assert writer is not None
        # The new child's rows are added to the dead one's, not reset.
        await eventually(lambda: _written(pipeline, 20 + 21), within_s=20)
    finally:
        await pipeline.close()
    stats = pipeline.stats
    assert stats.accepted == stats.scored + sum(stats.dropped.values())
    assert pipeline.last_failure is not None and "exited unexpectedly" in pipeline.last_failure


async def test_past_the_restart_budget_it_gives_up(store: StoreConfig) -> None:
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS, max_restarts=1,
                                  restart_backoff_s=0.05)
    await pipeline.start()
    try:
        first = pipeline.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await eventually(lambda: pipeline.state is PipelineState.RUNNING
                         and pipeline.pid != first, within_s=30)
        second = pipeline.pid
        assert second is not None
        os.kill(second, signal.SIGKILL)
        await eventually(lambda: pipeline.state is PipelineState.FAILED, within_s=10)
        assert not pipeline.submit(make_exchange("after"))
        assert pipeline.stats.restarts == 1
        assert pipeline.last_failure is not None and "restarts within" in pipeline.last_failure
        await eventually(lambda: not _zombie_children(), within_s=10)
    finally:
        await pipeline.close()
    assert pipeline.state is PipelineState.CLOSED


async def test_held_writes_wait_for_the_release(store: StoreConfig) -> None:
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS, hold_writes=True)
    await pipeline.start()
    try:
        for i in range(10):
            assert pipeline.submit(make_exchange(f"r{i}"))
        await eventually(lambda: pipeline.stats.scored == 10, within_s=20)
        await asyncio.sleep(0.3)
        writer = pipeline.writer_stats
        assert writer is not None and writer.written_records == 0
        assert writer.queued_records == 10
        pipeline.release_writes()
        await eventually(lambda: _written(pipeline, 10), within_s=20)
    finally:
        await pipeline.close()


async def test_close_while_held_counts_what_the_writer_held(store: StoreConfig) -> None:
    pipeline = EvaluationPipeline(store, CHEAP_SCORERS, hold_writes=True)
    await pipeline.start()
    for i in range(5):
        assert pipeline.submit(make_exchange(f"r{i}"))
    await eventually(lambda: pipeline.stats.scored == 5, within_s=20)
    started = time.monotonic()
    await pipeline.close()
    assert time.monotonic() - started < store.close_timeout_s  # no wait for a store not ready
    writer = pipeline.writer_stats
    assert writer is not None and writer.dropped["store_unready"] == 5


PARENT = """
import asyncio, sys
from evaluators import EvaluationPipeline
from evaluators.store import StoreConfig

async def main():
    pipeline = EvaluationPipeline(StoreConfig(url=sys.argv[1]), ("latency",))
    await pipeline.start()
    print(pipeline.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@asynccontextmanager
async def _parent(script: str, store: StoreConfig) -> AsyncIterator[tuple[Process, int]]:
    """``script`` run as a parent process that starts a pipeline and prints its child's pid;
    yields the parent and that pid, and kills the parent on the way out if it still runs."""
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, store.url, cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert parent.stdout is not None
        yield parent, int(await parent.stdout.readline())
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()


async def test_the_child_exits_when_its_parent_is_killed(store: StoreConfig) -> None:
    async with _parent(PARENT, store) as (parent, child):
        assert not _gone(child)
        parent.kill()  # no chance to close the pipeline: the child must notice alone
        await parent.wait()
        await eventually(lambda: _gone(child), within_s=10 + STATS_INTERVAL_S)


FORGETFUL_PARENT = """
import asyncio, sys
from evaluators import EvaluationPipeline
from evaluators.store import StoreConfig

PIPELINES = []  # still referenced at exit: its pipe to the child stays open

async def main():
    pipeline = EvaluationPipeline(StoreConfig(url=sys.argv[1]), ("latency",))
    await pipeline.start()
    PIPELINES.append(pipeline)
    print(pipeline.pid, flush=True)

asyncio.run(main())  # returns without closing the pipeline
"""


async def test_a_parent_that_exits_without_closing_does_not_hang(store: StoreConfig) -> None:
    async with _parent(FORGETFUL_PARENT, store) as (parent, child):
        async with asyncio.timeout(20):
            assert await parent.wait() == 0
        assert _gone(child)
