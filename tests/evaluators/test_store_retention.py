"""Retention (evaluators/store/_retention.py, ScoreWriter rule 8, ``understudy db prune``),
on a SQLite file and on the real PostgreSQL (``db_url``, tests/fixtures_db.py: a test that
needs PostgreSQL fails when it is down, it never skips).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError
from sqlalchemy import event, func, inspect, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import await_only

from evaluators.store import (
    AuditEntry,
    BackendRow,
    ExchangeRow,
    ObservationRow,
    Pruned,
    ScoreRow,
    ScoreWriter,
    StoreConfig,
    TrafficCount,
    TrafficCountRow,
    VerdictRow,
    append_audit,
    create_engine,
    current_revision,
    downgrade,
    list_candidates,
    load_samples,
    prune_store,
    record_traffic,
    record_verdict,
    retention_cutoff,
    session_factory,
    upgrade,
)
from gateway.cli import main
from tests.evaluators.test_store import SCORES, count, make_exchange, make_observation, written
from tests.fixtures_db import migrated_engine, sqlite_url
from tests.utils import eventually

NOW = datetime.now(UTC)
OLD = NOW - timedelta(days=40)   # past the default bound (30 days)
RECENT = NOW - timedelta(days=1)
QUICK = {"flush_interval_s": 0.02, "retry_base_s": 0.01, "retry_max_s": 0.1,
         "prune_interval_s": 3600.0}  # passes run by hand unless a test says otherwise
REPO_ROOT = Path(__file__).resolve().parents[2]


def exchange_at(request_id: str, at: datetime, candidate: str = "cand-a") -> Any:
    t = at.timestamp()
    return make_exchange(request_id, candidate,
                         primary=make_observation(request_id, "primary", started_at=t),
                         started_at=t)


def config_for(engine: AsyncEngine, **overrides: Any) -> StoreConfig:
    return StoreConfig(url=engine.url.render_as_string(hide_password=False),
                       **{**QUICK, **overrides})


async def fill(engine: AsyncEngine, old: int, recent: int, *, candidates: int = 1) -> None:
    """``old`` exchanges from 40 days ago (oldest first, a second apart) and ``recent`` from
    yesterday, each mirrored to ``candidates`` candidates, scored twice each."""
    async with ScoreWriter(engine, config_for(engine)) as writer:
        for i in range(old):
            for c in range(candidates):
                assert writer.submit(exchange_at(f"old{i}", OLD + timedelta(seconds=i),
                                                 f"cand-{c}"), SCORES)
        for i in range(recent):
            for c in range(candidates):
                assert writer.submit(exchange_at(f"new{i}", RECENT, f"cand-{c}"), SCORES)
        await written(writer, (old + recent) * candidates)


async def dangling(engine: AsyncEngine) -> int:
    """Observations and scores whose exchange is gone."""
    async with engine.connect() as connection:
        found: int = (await connection.execute(text(
            "SELECT (SELECT count(*) FROM observations WHERE exchange_id NOT IN "
            "(SELECT id FROM exchanges)) + (SELECT count(*) FROM scores WHERE exchange_id "
            "NOT IN (SELECT id FROM exchanges))"))).scalar_one()
    return found


async def request_ids(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as connection:
        return set((await connection.execute(select(ExchangeRow.request_id))).scalars())


# -- what goes, what stays ---------------------------------------------------------------


async def test_prune_deletes_what_is_older_and_keeps_the_audited_history(
        engine: AsyncEngine) -> None:
    await fill(engine, old=12, recent=5, candidates=2)
    async with session_factory(engine)() as session, session.begin():
        await record_traffic(session, [
            TrafficCount(int(OLD.timestamp()), "", "seen", "route", "chat", 9),
            TrafficCount(int(RECENT.timestamp()), "", "seen", "route", "chat", 4)])
        # An old verdict and audit entry: the history an operator audits is never pruned.
        verdict = await record_verdict(session, candidate="cand-0", verdict="PASS",
                                       reasons=[], statistics={}, window_start=OLD,
                                       window_end=OLD)
        await session.execute(update(VerdictRow).values(created_at=OLD))
        await append_audit(session, actor="ops", action="promote", target="cand-0",
                           verdict_id=verdict, at=OLD)
    backends = await count(engine, BackendRow)

    pruned = await prune_store(engine, retention_cutoff(30), batch=5)

    # 2 observations per exchange (primary's shared) + 1 per further candidate; 2 scores
    # per candidate and exchange.
    assert pruned == Pruned(exchanges=12, observations=12 * 3, scores=12 * 2 * 2,
                            traffic_counts=1, batches=pruned.batches, seconds=pruned.seconds,
                            longest_batch_s=pruned.longest_batch_s)
    assert pruned.batches == 3 + 1  # 5 + 5 + 2 exchanges, then one batch of traffic counts
    assert await request_ids(engine) == {f"new{i}" for i in range(5)}
    assert await count(engine, ObservationRow) == 5 * 3
    assert await count(engine, ScoreRow) == 5 * 2 * 2
    assert await dangling(engine) == 0
    assert await count(engine, TrafficCountRow) == 1
    assert await count(engine, VerdictRow) == 1
    assert await count(engine, AuditEntry) == 1
    assert await count(engine, BackendRow) == backends
    # The report's queries read what is left.
    async with session_factory(engine)() as session:
        samples = await load_samples(session, "cand-0")
        assert {metric: len(s.candidate) for metric, s in samples.items()} == {
            "ttft_ratio": 5, "similarity": 5}
        assert {c.name for c in await list_candidates(session)} == {"cand-0", "cand-1"}
    # Nothing older is left: a second pass finds nothing.
    again = await prune_store(engine, retention_cutoff(30), batch=5)
    assert (again.exchanges, again.traffic_counts) == (0, 0)


async def test_batches_bound_each_statement_and_go_oldest_first(engine: AsyncEngine) -> None:
    await fill(engine, old=23, recent=2)
    deletes: list[tuple[str, int]] = []

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _seen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            bound = parameters if isinstance(parameters, list | tuple) else list(parameters)
            deletes.append((statement.split()[2], len(bound)))

    batches: list[Pruned] = []
    stopped_after = 2
    pruned = await prune_store(engine, retention_cutoff(30), batch=4,
                               should_stop=lambda: len(batches) >= stopped_after,
                               on_batch=batches.append)
    event.remove(engine.sync_engine, "before_cursor_execute", _seen)

    assert [b.exchanges for b in batches] == [4, 4]
    assert pruned.exchanges == 8
    # Every DELETE binds at most the batch's ids: a statement never grows with the backlog.
    assert deletes and all(size <= 4 for _, size in deletes), deletes
    assert {table for table, _ in deletes} == {"scores", "observations", "exchanges"}
    # Oldest first: the 8 oldest went, the rest of the backlog waits for the next pass.
    left = await request_ids(engine)
    assert left == {f"old{i}" for i in range(8, 23)} | {"new0", "new1"}
    rest = await prune_store(engine, retention_cutoff(30), batch=4)
    assert rest.exchanges == 15
    assert await request_ids(engine) == {"new0", "new1"}


# -- the writer's passes ------------------------------------------------------------------


async def test_pruning_during_writes_loses_no_accepted_exchange(engine: AsyncEngine) -> None:
    await fill(engine, old=600, recent=0)
    config = config_for(engine, prune_batch_exchanges=25, batch_rows=40)
    # A batch of deletions and a batch of inserts never overlap in one process (writer
    # rule 8): no INSERT runs between a pruning batch's pick and its commit.
    open_batches: set[int] = set()
    overlaps: list[str] = []

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _statement(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("SELECT exchanges.id"):
            open_batches.add(id(conn))
        elif statement.startswith("INSERT") and open_batches:
            overlaps.append(statement[:40])

    @event.listens_for(engine.sync_engine, "commit")
    def _commit(conn: Any) -> None:
        open_batches.discard(id(conn))

    async with ScoreWriter(engine, config) as writer:
        passes: list[Pruned] = []
        submitted = asyncio.Event()

        async def prune_while_writing() -> None:
            while not submitted.is_set() or writer.stats.queued_records or len(passes) < 3:
                passes.append(await writer.prune())

        pruning = asyncio.create_task(prune_while_writing())
        accepted = 0
        for i in range(400):
            # Fresh exchanges, and a few that arrive late for an old request while its
            # exchange row is being pruned (another candidate's answer): past the bound,
            # so written and then pruned, or written again after, but never dropped.
            late = i % 50 == 0
            exchange = (exchange_at(f"old{i}", OLD + timedelta(seconds=i), "cand-late")
                        if late else exchange_at(f"fresh{i}", NOW))
            accepted += writer.submit(exchange, SCORES)
            if i % 20 == 0:
                await asyncio.sleep(0)  # let the writer and the pruner take turns
        submitted.set()
        await written(writer, accepted)
        await pruning
        stats = writer.stats
    event.remove(engine.sync_engine, "before_cursor_execute", _statement)
    event.remove(engine.sync_engine, "commit", _commit)
    assert overlaps == []
    assert accepted == 400
    assert stats.written_records == 400
    assert sum(stats.dropped.values()) == 0
    await prune_store(engine, retention_cutoff(30))  # late rows written after the last pass
    left = await request_ids(engine)
    assert left == {f"fresh{i}" for i in range(400) if i % 50}
    assert stats.pruned_exchanges == sum(p.exchanges for p in passes) >= 600
    assert stats.prune_passes == len(passes)
    assert await dangling(engine) == 0
    async with engine.connect() as connection:
        fresh_scores = (await connection.execute(
            select(func.count()).select_from(ScoreRow).join(ExchangeRow)
            .where(ExchangeRow.request_id.like("fresh%")))).scalar_one()
    assert fresh_scores == 392 * len(SCORES)


async def test_the_writer_prunes_on_its_own_every_interval(engine: AsyncEngine) -> None:
    await fill(engine, old=30, recent=3)
    config = config_for(engine, prune_interval_s=0.05, prune_batch_exchanges=7)
    async with ScoreWriter(engine, config) as writer:
        await eventually(lambda: writer.stats.prune_passes >= 2, within_s=10)
        assert writer.stats.pruned_exchanges == 30
    assert await request_ids(engine) == {"new0", "new1", "new2"}


async def test_retention_zero_keeps_everything(engine: AsyncEngine) -> None:
    await fill(engine, old=3, recent=1)
    config = config_for(engine, retention_days=0, prune_interval_s=0.01)
    async with ScoreWriter(engine, config) as writer:
        assert writer.submit(exchange_at("another", NOW), SCORES)
        await written(writer, 1)  # a write waits out two pruning intervals
        assert await writer.prune() == Pruned()  # 0 is "forever", never "older than now"
        assert writer.stats.prune_passes == 0
    assert len(await request_ids(engine)) == 5


# -- another replica pruning mid-batch (PostgreSQL) ---------------------------------------
# On SQLite the race cannot happen: a batch's first INSERT takes the database's write lock
# until it commits, so no other process deletes in between.


@pytest.fixture
async def pg_engine(pg_database: str) -> AsyncIterator[AsyncEngine]:
    async with migrated_engine(pg_database) as engine:
        yield engine


def prune_from_another_replica(engine: AsyncEngine, before: str,
                               pruned: list[Pruned]) -> None:
    """Once, just before the writer's statement starting with ``before``, a second engine
    (another replica's writer) runs a whole pruning pass and commits it."""
    replica = create_engine(engine.url.render_as_string(hide_password=False))

    async def prune_and_dispose() -> None:
        try:
            pruned.append(await prune_store(replica, retention_cutoff(30)))
        finally:
            await replica.dispose()

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith(before) and not pruned:
            await_only(prune_and_dispose())  # the writer's statement waits for it


async def test_a_late_record_whose_exchange_is_pruned_mid_batch_is_dropped_alone(
        pg_engine: AsyncEngine) -> None:
    # The late record's exchange exists when the batch's INSERT ... ON CONFLICT DO NOTHING
    # skips it, and is gone (pruned and committed) by the lookup of the batch's exchange
    # ids: that record has nothing to refer to. The rest of its batch is stored.
    await fill(pg_engine, old=1, recent=0)
    pruned: list[Pruned] = []
    prune_from_another_replica(pg_engine, "SELECT exchanges.request_id", pruned)
    config = config_for(pg_engine, flush_interval_s=0.2)
    async with ScoreWriter(pg_engine, config) as writer:
        assert writer.submit(exchange_at("old0", OLD, "cand-late"), SCORES)
        for i in range(5):  # one batch: all submitted before the flush interval ends
            assert writer.submit(exchange_at(f"fresh{i}", NOW), SCORES)
        await eventually(lambda: writer.stats.written_records
                         + sum(writer.stats.dropped.values()) >= 6, within_s=10)
        stats = writer.stats
    assert [p.exchanges for p in pruned] == [1]
    assert stats.written_records == 5
    assert {k: v for k, v in stats.dropped.items() if v} == {"exchange_pruned": 1}
    assert await request_ids(pg_engine) == {f"fresh{i}" for i in range(5)}
    assert await count(pg_engine, ScoreRow) == 5 * len(SCORES)
    assert await dangling(pg_engine) == 0


async def test_an_exchange_a_batch_refers_to_is_left_to_the_next_pass(
        pg_engine: AsyncEngine) -> None:
    # Once the batch has looked up its exchange ids, a pruning replica skips those rows
    # (the lookup holds them FOR KEY SHARE until the batch commits) instead of deleting
    # them from under the batch's observations (a foreign-key violation that cost a
    # batch of one record its record, as "rejected").
    await fill(pg_engine, old=2, recent=0)
    pruned: list[Pruned] = []
    prune_from_another_replica(pg_engine, "INSERT INTO observations", pruned)
    async with ScoreWriter(pg_engine, config_for(pg_engine)) as writer:
        assert writer.submit(exchange_at("old0", OLD, "cand-late"), SCORES)
        await eventually(lambda: writer.stats.written_records
                         + sum(writer.stats.dropped.values()) >= 1, within_s=10)
        stats = writer.stats
    assert [p.exchanges for p in pruned] == [1]  # old1; old0 waits for the next pass
    assert stats.written_records == 1
    assert sum(stats.dropped.values()) == 0
    assert await count(pg_engine, ScoreRow) == 2 * len(SCORES)  # old0's, both candidates
    assert (await prune_store(pg_engine, retention_cutoff(30))).exchanges == 1
    assert await request_ids(pg_engine) == set()
    assert await dangling(pg_engine) == 0


# -- the migration -------------------------------------------------------------------------


def _exchange_indexes(connection: Any) -> set[str]:
    return {index["name"] for index in inspect(connection).get_indexes("exchanges")}


async def test_migration_0005_adds_and_removes_the_started_at_index(db_url: str) -> None:
    await upgrade(db_url, "0004")
    engine = create_engine(db_url)
    try:
        async with engine.connect() as connection:
            assert "ix_exchanges_started_at" not in await connection.run_sync(_exchange_indexes)
        await upgrade(db_url)
        assert await current_revision(db_url) == "0005"
        async with engine.connect() as connection:
            assert "ix_exchanges_started_at" in await connection.run_sync(_exchange_indexes)
            if engine.dialect.name == "postgresql":  # the batch's pick uses it
                await connection.execute(text("SET enable_seqscan = off"))
                plan = "\n".join((await connection.execute(text(
                    "EXPLAIN SELECT id FROM exchanges WHERE started_at < now() "
                    "ORDER BY started_at LIMIT 1000"))).scalars())
                assert "ix_exchanges_started_at" in plan, plan
        await downgrade(db_url, "0004")
        async with engine.connect() as connection:
            assert "ix_exchanges_started_at" not in await connection.run_sync(_exchange_indexes)
    finally:
        await engine.dispose()
        await downgrade(db_url, "base")


async def test_migration_0005_finds_the_index_an_operator_built_concurrently(
        pg_database: str) -> None:
    # On a large table the plain CREATE INDEX holds writes while it builds; the operator's
    # way out (0005's docstring, README) is to build it first without blocking.
    await upgrade(pg_database, "0004")
    engine = create_engine(pg_database)
    try:
        async with engine.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            await connection.exec_driver_sql(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_exchanges_started_at "
                "ON exchanges (started_at)")
        await upgrade(pg_database)
        assert await current_revision(pg_database) == "0005"
        await downgrade(pg_database, "0004")
        async with engine.connect() as connection:
            assert "ix_exchanges_started_at" not in await connection.run_sync(_exchange_indexes)
    finally:
        await engine.dispose()
        await downgrade(pg_database, "base")


# -- the configuration ---------------------------------------------------------------------


def test_retention_defaults_and_bounds() -> None:
    config = StoreConfig()
    assert (config.retention_days, config.prune_interval_s,
            config.prune_batch_exchanges) == (30, 300, 1000)
    assert StoreConfig(retention_days=0).retention_days == 0
    for bad in ({"retention_days": -1}, {"retention_days": math.nan},
                {"retention_days": math.inf}, {"retention_days": 1e9},
                {"prune_interval_s": 0}, {"prune_batch_exchanges": 0},
                {"prune_batch_exchanges": 100_000}):
        with pytest.raises(ValidationError):
            StoreConfig(**bad)
    with pytest.raises(ValueError, match="more than 0 days"):
        retention_cutoff(0)


# -- understudy db prune --------------------------------------------------------------------


@pytest.fixture
def file_store(tmp_path: Path) -> str:
    """A migrated SQLite file with 4 old exchanges and 2 recent ones."""
    url = sqlite_url(tmp_path)

    async def make() -> None:
        await upgrade(url)
        engine = create_engine(url)
        try:
            await fill(engine, old=4, recent=2)
        finally:
            await engine.dispose()

    asyncio.run(make())
    return url


def _left(url: str) -> set[str]:
    async def read() -> set[str]:
        engine = create_engine(url)
        try:
            return await request_ids(engine)
        finally:
            await engine.dispose()

    return asyncio.run(read())


def test_db_prune_end_to_end_on_a_file_store(file_store: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from gateway.cli import main; main()", "db", "prune",
         "--db", file_store, "--older-than", "35"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "deleted 4 exchanges (8 observations, 8 scores) and 0 traffic counts older " \
           "than 35 days" in done.stdout
    assert _left(file_store) == {"new0", "new1"}


def test_db_prune_counts_only_the_batches_that_deleted(file_store: str) -> None:
    """A prune of nothing said "deleted 0 exchanges ... in 2 batches": the lookup that
    found the end of each table counted as a batch."""
    args = ["db", "prune", "--db", file_store, "--older-than", "35"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "deleted 4 exchanges (8 observations, 8 scores) and 0 traffic counts older " \
           "than 35 days" in first.output
    assert " in 1 batch, " in first.output  # 4 exchanges, one batch; no traffic counts
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert "nothing older than 35 days (" in again.output
    assert "to delete" in again.output and "batch" not in again.output, again.output
    assert _left(file_store) == {"new0", "new1"}


async def test_a_prune_that_deletes_nothing_takes_no_batch(engine: AsyncEngine) -> None:
    await fill(engine, old=0, recent=2)
    nothing = await prune_store(engine, retention_cutoff(30), batch=5)
    assert (nothing.exchanges, nothing.traffic_counts, nothing.batches) == (0, 0, 0)
    await fill(engine, old=10, recent=0)
    exact = await prune_store(engine, retention_cutoff(30), batch=5)
    # Two full batches; the lookup that then finds the end deletes nothing, is no batch.
    assert (exact.exchanges, exact.batches) == (10, 2)


def test_db_prune_takes_the_configs_bound(file_store: str, tmp_path: Path) -> None:
    config = tmp_path / "understudy.toml"
    config.write_text(f'[evaluation.store]\nurl = "{file_store}"\nretention_days = 0\n')
    off = CliRunner().invoke(main, ["db", "prune", "--config", str(config)])
    assert off.exit_code == 0, off.output
    assert "retention is off" in off.output
    assert len(_left(file_store)) == 6
    config.write_text(f'[evaluation.store]\nurl = "{file_store}"\nretention_days = 0.5\n')
    on = CliRunner().invoke(main, ["db", "prune", "--config", str(config)])
    assert on.exit_code == 0, on.output
    assert "deleted 6 exchanges" in on.output  # "recent" is a day old: past half a day
    assert _left(file_store) == set()


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "--older-than: Input should be greater than or equal to 0"),
    ("0", "--older-than: Input should be greater than 0"),
    ("nan", "--older-than: Input should be a finite number"),
    ("inf", "--older-than: Input should be a finite number"),
    ("1e9", "--older-than: Input should be less than or equal to 36500"),
    ("a week", "--older-than: Input should be a valid number"),
])
def test_db_prune_refuses_a_bad_bound(file_store: str, value: str, message: str) -> None:
    result = CliRunner().invoke(main, ["db", "prune", "--db", file_store,
                                       "--older-than", value])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0].startswith(f"Error: {message}"), result.stderr
    assert len(_left(file_store)) == 6


def test_db_prune_refuses_a_bad_configured_bound(tmp_path: Path) -> None:
    config = tmp_path / "understudy.toml"
    config.write_text("[evaluation.store]\nretention_days = -3\n")
    result = CliRunner().invoke(main, ["db", "prune", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(
        "Error: evaluation.store.retention_days: Input should be greater than or equal to 0")


def test_db_prune_on_a_store_never_migrated_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["db", "prune", "--db", sqlite_url(tmp_path, "empty.db"),
                                       "--older-than", "1"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: sqlite+aiosqlite:///"), result.stderr
    assert "exchanges" in result.stderr


# -- the count, from the scoring child to the gateway's metrics ---------------------------------


async def test_the_scoring_childs_pruning_is_counted_in_the_gateways_metrics(
        tmp_path: Path) -> None:
    from evaluators import EvaluationPipeline
    from gateway._metrics import EvaluationCollector

    url = sqlite_url(tmp_path)
    await upgrade(url)
    store = StoreConfig(url=url, flush_interval_s=0.02, prune_interval_s=0.2)
    pipeline = EvaluationPipeline(store, ("exact_match", "latency"))
    await pipeline.start()
    try:
        for i in range(20):  # make_exchange's started_at is 2023's: past the 30-day bound
            assert pipeline.submit(make_exchange(f"r{i}"))

        def pruned() -> int:
            stats = pipeline.writer_stats
            return stats.pruned_exchanges if stats is not None else 0

        await eventually(lambda: pruned() == 20, within_s=30)
        collector = EvaluationCollector(lambda: pipeline.stats, lambda: pipeline.writer_stats)
        samples = {sample.name: sample.value for family in collector.collect()
                   for sample in family.samples}
        assert samples["understudy_store_pruned_exchanges_total"] == 20
    finally:
        await pipeline.close()
    engine = create_engine(url)
    try:
        assert await request_ids(engine) == set()
    finally:
        await engine.dispose()
