"""The evaluation store, against SQLite (a temp file) and a real PostgreSQL (a fresh
database per test module; ``db_url`` and ``pg_database`` come from tests/fixtures_db.py):
migrations, the ScoreWriter's round trip and bounds, the report's queries. Faults (the
database going away mid-run) are in test_store_faults.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pydantic import SecretStr
from sqlalchemy import Connection, func, inspect, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from evaluators import Exchange, Observation, Usage
from evaluators._score import score_exchange
from evaluators.store import (
    AuditEntry,
    BackendRow,
    Base,
    ExchangeRow,
    ObservationRow,
    ScoreRow,
    ScoreWriter,
    StoreConfig,
    StoreRejected,
    VerdictRow,
    WriterState,
    WriterStateError,
    append_audit,
    create_engine,
    current_revision,
    downgrade,
    head_revision,
    list_candidates,
    load_samples,
    record_verdict,
    register_backend,
    session_factory,
    upgrade,
)
from evaluators.store._hash_key import keyed_digest, load_hash_key
from evaluators.store._rows import itl_stats
from tests.utils import eventually

STORE_TABLES = {"backends", "exchanges", "observations", "scores", "verdicts", "audit_log"}
REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK = {"flush_interval_s": 0.02, "retry_base_s": 0.01, "retry_max_s": 0.1}


# -- builders ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Score:
    """Stands in for the scorer family's Score (the same three fields)."""

    metric: str
    candidate: float | None
    primary: float | None = None


USAGE = Usage(prompt_tokens=12, completion_tokens=4)


def make_observation(request_id: str, backend: str, *, usage: Usage | None = USAGE,
                     gaps: tuple[float, ...] = (0.01, 0.02, 0.03),
                     text: str | None = "an answer", started_at: float | None = None,
                     error: str | None = None,
                     tool_calls: tuple[dict[str, Any], ...] = ()) -> Observation:
    return Observation(
        request_id=request_id, backend=backend, route="chat_completions", status=200,
        streamed=True, started_at=started_at if started_at is not None else 1_700_000_000.0,
        ttft_s=0.1, chunk_gaps_s=gaps, e2e_s=0.1 + sum(gaps),
        usage=usage,
        finish_reason="stop", text=text, tool_calls=tool_calls, model="m", bytes=321,
        truncated=False, error=error,
    )


def make_exchange(request_id: str, candidate: str = "cand-a", *,
                  primary: Observation | None = None, session_key: str = "session-1",
                  **observation: Any) -> Exchange:
    return Exchange(
        request_id=request_id, session_key=session_key, route="chat_completions",
        candidate=candidate,
        primary=primary or make_observation(request_id, "primary"),
        candidate_observation=make_observation(request_id, candidate, **observation),
    )


SCORES = (Score("ttft_ratio", 1.5, 1.0), Score("similarity", 0.9))


# -- databases ----------------------------------------------------------------------------


async def rows(engine: AsyncEngine, model: type[Base], *order: Any) -> list[Any]:
    async with session_factory(engine)() as session:
        return list((await session.scalars(select(model).order_by(*order))).all())


async def count(engine: AsyncEngine, model: type[Base]) -> int:
    async with engine.connect() as connection:
        return (await connection.execute(select(func.count()).select_from(model))).scalar_one()


def quick_config(engine: AsyncEngine, **overrides: Any) -> StoreConfig:
    return StoreConfig(url=engine.url.render_as_string(hide_password=False),
                       **{**QUICK, **overrides})


async def written(writer: ScoreWriter, records: int) -> None:
    await eventually(lambda: writer.stats.written_records >= records, within_s=10)


# -- the config ----------------------------------------------------------------------------


def test_config_picks_the_async_driver_and_hides_the_password() -> None:
    assert StoreConfig().url == "sqlite+aiosqlite:///understudy.db"
    assert StoreConfig(url="postgresql://u:pw@db/x").url == "postgresql+asyncpg://u:pw@db/x"
    assert StoreConfig(url="sqlite:///a.db").url == "sqlite+aiosqlite:///a.db"
    assert "pw" not in repr(StoreConfig(url="postgresql://u:pw@db/x"))
    for bad in ("mysql://db/x", "postgresql+psycopg2://db/x", "not a url"):
        with pytest.raises(ValueError):
            StoreConfig(url=bad)
    with pytest.raises(ValueError):
        StoreConfig(retry_base_s=2, retry_max_s=1)


def test_itl_stats_mean_and_nearest_rank_p99() -> None:
    assert itl_stats(()) == (None, None)
    assert itl_stats((0.5,)) == (0.5, 0.5)
    gaps = tuple(float(i) for i in range(1, 201))  # p99 by nearest rank: the 198th
    mean, p99 = itl_stats(gaps)
    assert mean == pytest.approx(100.5)
    assert p99 == 198.0


# -- migrations ------------------------------------------------------------------------------


def _table_names(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


def _schema_drift(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, Base.metadata))


def _index_and_constraint_names(connection: Connection) -> set[str]:
    inspector = inspect(connection)
    names: set[str] = set()
    for table in STORE_TABLES:
        names.update(i["name"] for i in inspector.get_indexes(table) if i["name"])
        names.update(u["name"] for u in inspector.get_unique_constraints(table) if u["name"])
        names.update(f["name"] for f in inspector.get_foreign_keys(table) if f["name"])
    return names


async def test_migrations_upgrade_from_empty_and_downgrade_to_empty(db_url: str) -> None:
    assert await current_revision(db_url) is None
    await upgrade(db_url)
    assert await current_revision(db_url) == head_revision()
    engine = create_engine(db_url)
    try:
        async with engine.connect() as connection:
            assert STORE_TABLES <= await connection.run_sync(_table_names)
            # The migrations made exactly what the models describe.
            assert await connection.run_sync(_schema_drift) == []
            names = await connection.run_sync(_index_and_constraint_names)
        assert {
            "ix_scores_candidate_id_metric_created_at", "ix_exchanges_session_key",
            "ix_observations_backend_id", "uq_observations_exchange_id_backend_id",
            "uq_exchanges_request_id",
        } <= names
        await upgrade(db_url)  # idempotent at head
        await downgrade(db_url, "base")
        async with engine.connect() as connection:
            assert not STORE_TABLES & await connection.run_sync(_table_names)
        assert await current_revision(db_url) is None
    finally:
        await engine.dispose()


async def test_alembic_cli_migrates_through_the_async_environment(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "alembic", "-c", str(REPO_ROOT / "alembic.ini"), "-x", f"url={url}",
        "upgrade", "head", cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(done.communicate(), timeout=90)
    assert done.returncode == 0, output.decode()
    assert await current_revision(url) == head_revision()


async def test_sqlite_engine_uses_wal_and_a_busy_timeout(tmp_path: Any) -> None:
    engine = create_engine(StoreConfig(url=f"sqlite:///{tmp_path / 'x.db'}",
                                       sqlite_busy_timeout_s=3))
    try:
        async with engine.connect() as connection:
            assert (await connection.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await connection.execute(text("PRAGMA busy_timeout"))).scalar() == 3000
            assert (await connection.execute(text("PRAGMA foreign_keys"))).scalar() == 1
    finally:
        await engine.dispose()


async def test_a_new_sqlite_store_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """SQLite made the file (and its -wal, -shm) with the process's umask, world-readable
    under the usual 022: it holds the routing, whose backend URLs keep their passwords
    (every replica connects with them), and prompts and answers with ``store_prompts`` or
    ``store_answers``. Another user on the host could read them."""
    path = tmp_path / "store.db"
    url = f"sqlite+aiosqlite:///{path}"
    old = os.umask(0o022)
    try:
        await upgrade(url)
        engine = create_engine(StoreConfig(url=url))
        try:
            async with engine.connect() as connection:
                await connection.execute(text("SELECT count(*) FROM backends"))
                assert _modes(tmp_path) == {"store.db": 0o600, "store.db-shm": 0o600,
                                            "store.db-wal": 0o600}
        finally:
            await engine.dispose()
    finally:
        os.umask(old)


async def test_a_store_or_hash_key_others_can_read_is_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store made by an older release (0644 under the usual umask), or a hash key file
    copied without its mode, keeps its mode: that was silent, although the store holds
    backend URLs with their passwords and the key lets anyone test guesses of session keys
    against the stored hashes. Each is now logged once, naming the file and its mode."""
    path = tmp_path / "store.db"
    url = f"sqlite+aiosqlite:///{path}"
    await upgrade(url)
    key_file = tmp_path / "hash.key"
    key_file.write_bytes(b"k" * 64 + b"\n")
    caplog.set_level("WARNING", logger="understudy.store")
    for mode in (0o600, 0o644):
        caplog.clear()
        path.chmod(mode)
        key_file.chmod(mode)
        await create_engine(StoreConfig(url=url)).dispose()
        assert load_hash_key(StoreConfig(url=url, hash_key_file=key_file)) == b"k" * 64
        warned = [r.getMessage() for r in caplog.records]
        if mode == 0o600:
            assert warned == []
        else:
            assert len(warned) == 2, warned
            assert f"{path} holds the routing" in warned[0] and "(mode 644)" in warned[0]
            assert f"{key_file} holds the key" in warned[1]


def _modes(folder: Path) -> dict[str, int]:
    return {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}


# -- the writer ------------------------------------------------------------------------------


async def test_session_keys_and_prompts_are_stored_as_keyed_hashes(
        engine: AsyncEngine, tmp_path: Path) -> None:
    base = quick_config(engine)
    key_file = tmp_path / "state" / "hash.key"
    hashed = base.model_copy(update={"hash_key_file": key_file})
    async with ScoreWriter(engine, hashed) as writer:
        assert writer.submit(make_exchange("h1", "cand-a", session_key="u:bob@example.com"),
                             SCORES, prompt=b'{"user":"bob@example.com"}')
        await written(writer, 1)
    key = key_file.read_bytes().strip()
    assert len(key) == 64 and (key_file.stat().st_mode & 0o777) == 0o600
    assert load_hash_key(hashed) == key  # read back, not made anew
    clear = base.model_copy(update={"store_session_keys": True, "hash_key": SecretStr("k" * 32)})
    async with ScoreWriter(engine, clear) as writer:
        assert writer.submit(make_exchange("h2", "cand-a", session_key="u:bob@example.com"),
                             SCORES, prompt=b"p")
        await written(writer, 1)
    exchanges = {e.request_id: e for e in await rows(engine, ExchangeRow, ExchangeRow.request_id)}
    assert exchanges["h1"].session_key == "k:" + keyed_digest(key, b"u:bob@example.com")
    assert "bob" not in (exchanges["h1"].session_key + str(exchanges["h1"].prompt))
    assert exchanges["h1"].prompt_hash == keyed_digest(key, b'{"user":"bob@example.com"}')
    assert exchanges["h2"].session_key == "u:bob@example.com"  # store_session_keys
    assert exchanges["h2"].prompt_hash == keyed_digest(b"k" * 32, b"p")


async def test_writer_round_trip_shares_the_primary_observation(engine: AsyncEngine) -> None:
    primary = make_observation("r1", "primary", usage=Usage(12, 5, 8), gaps=(0.01, 0.03))
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        assert writer.state is WriterState.RUNNING
        assert writer.submit(make_exchange("r1", "cand-a", primary=primary,
                                           usage=Usage(12, 6, None)), SCORES, prompt=b"{}")
        assert writer.submit(make_exchange("r1", "cand-b", primary=primary), SCORES)
        assert writer.submit(make_exchange("r2", "cand-a", session_key="session-2",
                                           usage=None, gaps=()), [Score("x", None, 2.0)])
        await written(writer, 3)
    stats = writer.stats
    assert stats.state is WriterState.CLOSED
    assert (stats.submitted, stats.accepted, stats.written_records) == (3, 3, 3)
    assert sum(stats.dropped.values()) == 0
    assert stats.written_rows["scores"] == 5

    exchanges = await rows(engine, ExchangeRow, ExchangeRow.request_id)
    key = load_hash_key(quick_config(engine))
    # Never in clear (issue 12 item 8): keyed hashes, equal for equal sessions.
    assert [(e.request_id, e.session_key) for e in exchanges] == [
        ("r1", "k:" + keyed_digest(key, b"session-1")),
        ("r2", "k:" + keyed_digest(key, b"session-2"))]
    assert exchanges[0].prompt_hash == keyed_digest(key, b"{}")
    assert exchanges[0].prompt is None and len(exchanges[0].prompt_hash or "") == 64
    assert exchanges[1].prompt_hash is None
    assert exchanges[0].started_at == datetime.fromtimestamp(1_700_000_000, UTC)

    backends = {b.id: b for b in await rows(engine, BackendRow, BackendRow.name)}
    assert sorted((b.name, b.role) for b in backends.values()) == [
        ("cand-a", "candidate"), ("cand-b", "candidate"), ("primary", "primary")]

    observations = await rows(engine, ObservationRow, ObservationRow.id)
    by_key = {(o.exchange_id, backends[o.backend_id].name): o for o in observations}
    r1, r2 = exchanges[0].id, exchanges[1].id
    # One row per backend per exchange: the primary's answer to r1 is stored once.
    assert sorted(by_key) == sorted([(r1, "primary"), (r1, "cand-a"), (r1, "cand-b"),
                                     (r2, "primary"), (r2, "cand-a")])
    p = by_key[(r1, "primary")]
    assert (p.prompt_tokens, p.completion_tokens, p.cached_tokens) == (12, 5, 8)
    assert (p.chunks, p.itl_mean_s, p.itl_p99_s) == (3, pytest.approx(0.02), 0.03)
    assert (p.status, p.streamed, p.finish_reason, p.bytes, p.truncated) == (
        200, True, "stop", 321, False)
    assert p.answer is None and p.error is None  # answers are off by default
    assert by_key[(r1, "cand-a")].cached_tokens is None  # unknown, not 0
    unknown = by_key[(r2, "cand-a")]
    assert (unknown.prompt_tokens, unknown.completion_tokens, unknown.cached_tokens) == (
        None, None, None)
    assert (unknown.chunks, unknown.itl_mean_s, unknown.itl_p99_s) == (1, None, None)

    scores = await rows(engine, ScoreRow, ScoreRow.id)
    assert sorted((s.exchange_id, backends[s.candidate_id].name, s.metric, s.candidate_value,
                   s.primary_value) for s in scores) == sorted([
        (r1, "cand-a", "ttft_ratio", 1.5, 1.0), (r1, "cand-a", "similarity", 0.9, None),
        (r1, "cand-b", "ttft_ratio", 1.5, 1.0), (r1, "cand-b", "similarity", 0.9, None),
        (r2, "cand-a", "x", None, 2.0)])
    assert all(s.created_at.tzinfo is not None for s in scores)


async def test_the_scorer_family_scores_are_score_like(engine: AsyncEngine) -> None:
    scoring = pytest.importorskip("evaluators._score")
    metric = next(name for name, spec in scoring.METRICS.items() if spec.kind == "per_backend")
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        assert writer.submit(make_exchange("r1"), [scoring.Score(metric, 2.0, 1.0)])
        await written(writer, 1)
    (score,) = await rows(engine, ScoreRow)
    assert (score.metric, score.candidate_value, score.primary_value) == (metric, 2.0, 1.0)


async def test_writer_keeps_texts_only_when_configured(engine: AsyncEngine) -> None:
    config = quick_config(engine, store_prompts=True, store_answers=True)
    async with ScoreWriter(engine, config) as writer:
        call = {"name": "lookup", "arguments": '{"city": "Paris"}'}
        assert writer.submit(make_exchange("r1", text="candidate says", tool_calls=(call,),
                                           error="x" * 5000), SCORES,
                             prompt=b'{"messages": []}')
        await written(writer, 1)
    (exchange,) = await rows(engine, ExchangeRow)
    assert exchange.prompt == '{"messages": []}'
    primary, candidate = sorted(await rows(engine, ObservationRow),
                                key=lambda o: o.answer or "")
    assert (primary.answer, primary.tool_calls) == ("an answer", None)
    assert (candidate.answer, candidate.tool_calls) == ("candidate says", [call])
    assert candidate.error == "x" * 2000  # cut to its bound


async def test_resubmitted_exchange_is_not_counted_twice(engine: AsyncEngine) -> None:
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        exchange = make_exchange("r1")
        assert writer.submit(exchange, SCORES)
        await written(writer, 1)
        assert writer.submit(exchange, SCORES)  # a later batch: conflicts, no duplicates
        await written(writer, 2)
    assert await count(engine, ExchangeRow) == 1
    assert await count(engine, ObservationRow) == 2
    assert await count(engine, ScoreRow) == 2


async def test_bounded_queue_drops_are_counted_and_close_flushes(engine: AsyncEngine) -> None:
    # 2 scores + exchange + 2 observations = 5 rows a record; room for 4 records.
    config = quick_config(engine, queue_rows=20, batch_rows=1000, flush_interval_s=60)
    writer = ScoreWriter(engine, config)
    await writer.start()
    results = [writer.submit(make_exchange(f"r{i}"), SCORES) for i in range(10)]
    assert results == [True] * 4 + [False] * 6
    stats = writer.stats
    assert (stats.accepted, stats.dropped["queue_full"], stats.queued_rows) == (4, 6, 20)
    assert await count(engine, ScoreRow) == 0  # nothing due yet: 60 s interval, big batch
    await writer.close()
    stats = writer.stats
    assert (stats.written_records, stats.queued_records, stats.held_records) == (4, 0, 0)
    assert stats.dropped["close_timeout"] == 0
    assert await count(engine, ExchangeRow) == 4
    assert await count(engine, ScoreRow) == 8


async def test_batches_flush_by_size_before_the_interval(engine: AsyncEngine) -> None:
    config = quick_config(engine, batch_rows=10, flush_interval_s=60)
    async with ScoreWriter(engine, config) as writer:
        for i in range(4):
            writer.submit(make_exchange(f"r{i}"), SCORES)  # 5 rows each: two full batches
        await written(writer, 4)
        assert writer.stats.batches == 2


async def test_submit_is_refused_outside_the_running_state(engine: AsyncEngine) -> None:
    writer = ScoreWriter(engine, quick_config(engine))
    assert not writer.submit(make_exchange("r0"), SCORES)
    await writer.start()
    with pytest.raises(WriterStateError):
        await writer.start()
    await writer.close()
    await writer.close()  # idempotent
    assert not writer.submit(make_exchange("r1"), SCORES)
    assert writer.stats.dropped["not_running"] == 2
    assert writer.stats.submitted == 2


async def test_unstorable_records_are_refused_and_counted(engine: AsyncEngine) -> None:
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        assert not writer.submit(make_exchange("r1"), [Score("m" * 300, 1.0)])
        assert not writer.submit(make_exchange("x" * 500), SCORES)
        assert not writer.submit(make_exchange("r2"), [Score("m", "high")])  # type: ignore[arg-type]
        assert writer.submit(make_exchange("r3"), SCORES)
        await written(writer, 1)
    assert writer.stats.dropped["invalid"] == 3
    assert writer.stats.last_error is not None


async def test_a_score_or_time_no_store_holds_is_refused_and_counted(engine: AsyncEngine) -> None:
    """NaN was stored as NaN on PostgreSQL and as NULL on SQLite (one NaN made the judge
    refuse the metric's every sample), an infinity as given; a start time past year 9999
    raised out of submit, the record neither accepted nor counted (``_rows`` rule 2)."""
    far = 1e12  # year 33658
    bad = [(make_exchange("nan"), [Score("ttft_ratio", float("nan"), 1.0)]),
           (make_exchange("inf"), [Score("similarity", float("inf"))]),
           (make_exchange("big"), [Score("similarity", 10**400)]),
           (make_exchange("far", primary=make_observation("far", "primary", started_at=far),
                          started_at=far), SCORES)]
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        assert [writer.submit(exchange, scores) for exchange, scores in bad] == [False] * 4
        assert writer.submit(make_exchange("ok"), SCORES)
        await written(writer, 1)
    stats = writer.stats
    assert (stats.submitted, stats.accepted, stats.dropped["invalid"]) == (5, 1, 4)
    async with session_factory(engine)() as session:
        assert await load_samples(session, "cand-a") == {
            "ttft_ratio": ([1.5], [1.0]), "similarity": ([0.9], [])}


async def test_a_backends_impossible_token_counts_cost_no_record(engine: AsyncEngine) -> None:
    """A candidate's usage of 10**30 or -3 tokens is unknown (``_observation`` rule 5): it
    was stored as given, which PostgreSQL refused (the record lost, scores and all) and
    SQLite could not bind (the whole batch lost, other candidates' records too), and a
    negative count priced the candidate below zero."""
    scoring = pytest.importorskip("evaluators._scorers")
    prices = {name: {"mode": "per_token", "prompt_usd_per_mtok": 1.0,
                     "completion_usd_per_mtok": 2.0} for name in ("primary", "cand-a")}
    scorers = scoring.build_scorers(["cost", "cache"], scoring.ScorerConfig.model_validate(
        {"prices": prices}))
    wire = [{"prompt_tokens": 12, "completion_tokens": 10**30},
            {"prompt_tokens": 12, "completion_tokens": -3,
             "prompt_tokens_details": {"cached_tokens": 10**40}},
            {"prompt_tokens": 12, "completion_tokens": 4}]
    exchanges = [make_exchange(f"r{i}", usage=Usage.from_json(usage))
                 for i, usage in enumerate(wire)]
    async with ScoreWriter(engine, quick_config(engine, flush_interval_s=0.2)) as writer:
        for exchange in exchanges:  # one batch
            assert writer.submit(exchange, score_exchange(exchange, scorers))
        await written(writer, 3)
    assert sum(writer.stats.dropped.values()) == 0
    observations = await rows(engine, ObservationRow, ObservationRow.id)
    assert {(o.prompt_tokens, o.completion_tokens, o.cached_tokens) for o in observations} == {
        (12, 4, None), (12, None, None)}
    costs = [s.candidate_value for s in await rows(engine, ScoreRow, ScoreRow.id)
             if s.metric.startswith("cost.") and s.candidate_value is not None]
    assert costs and min(costs) >= 0


async def test_a_time_that_is_not_a_number_is_unknown_on_every_backend(
        engine: AsyncEngine) -> None:
    """An observation's NaN latency was stored as NaN on PostgreSQL and as NULL on SQLite
    (the same record read differently by backend), an infinity as given on both; a time
    that is not a finite number is unknown (``_observation`` rule 11): NULL on both."""
    nan, inf = float("nan"), float("inf")
    odd: dict[str, dict[str, Any]] = {
        "nan": {"ttft_s": nan, "e2e_s": nan, "chunk_gaps_s": (0.01, nan, 0.02)},
        "inf": {"ttft_s": inf, "e2e_s": -inf, "chunk_gaps_s": (0.01, inf)}}
    exchanges = [make_exchange(name, primary=dataclasses.replace(
        make_observation(name, "primary"), **times)) for name, times in odd.items()]
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        for exchange in exchanges:
            assert writer.submit(exchange, SCORES)
        await written(writer, 2)
    assert sum(writer.stats.dropped.values()) == 0
    async with engine.connect() as connection:
        stored = (await connection.execute(
            select(BackendRow.name, ObservationRow.ttft_s, ObservationRow.e2e_s,
                   ObservationRow.itl_mean_s, ObservationRow.itl_p99_s, ObservationRow.chunks)
            .join(BackendRow, BackendRow.id == ObservationRow.backend_id)
            .order_by(ObservationRow.id))).all()
    by_backend = {name: [tuple(row)[1:] for row in stored if row[0] == name]
                  for name in ("primary", "cand-a")}
    assert by_backend == {"primary": [(None, None, None, None, 0)] * 2, "cand-a": [
        (0.1, pytest.approx(0.16), pytest.approx(0.02), 0.03, 4)] * 2}


async def test_a_value_the_driver_cannot_bind_costs_its_record_alone(engine: AsyncEngine) -> None:
    """SQLite's driver raised a bare OverflowError for an int past 64 bits, which failed the
    whole batch; PostgreSQL's out-of-range error was rejected and split down to the record."""
    primary = dataclasses.replace(make_observation("r", "primary"), backend_running=10**30)
    async with ScoreWriter(engine, quick_config(engine, flush_interval_s=0.2)) as writer:
        for exchange in (make_exchange("ok1"), make_exchange("bad", primary=primary),
                         make_exchange("ok2")):  # one batch
            assert writer.submit(exchange, SCORES)
        await written(writer, 2)
    assert writer.stats.dropped["rejected"] == 1 and writer.stats.dropped["failed"] == 0
    assert {e.request_id for e in await rows(engine, ExchangeRow)} == {"ok1", "ok2"}


# -- the report's queries ----------------------------------------------------------------------


async def test_load_samples_by_metric_and_time(engine: AsyncEngine) -> None:
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        for i in range(3):
            writer.submit(make_exchange(f"a{i}", "cand-a"),
                          [Score("ttft", 1.0 + i, 0.5), Score("similarity", 0.9),
                           Score("cost", None, 3.0)])
        writer.submit(make_exchange("b0", "cand-b"), [Score("ttft", 9.0, 0.5)])
        await written(writer, 4)
    async with session_factory(engine)() as session:
        samples = await load_samples(session, "cand-a")
        assert set(samples) == {"ttft", "similarity", "cost"}
        candidate, primary = samples["ttft"]
        assert candidate == [1.0, 2.0, 3.0] and primary == [0.5, 0.5, 0.5]
        assert samples["similarity"] == ([0.9, 0.9, 0.9], [])  # pairwise: no primary value
        assert samples["cost"] == ([], [3.0, 3.0, 3.0])  # unknown candidate values skipped
        assert set(await load_samples(session, "cand-a", metrics=["ttft"])) == {"ttft"}
        future = datetime.now(UTC) + timedelta(hours=1)
        assert await load_samples(session, "cand-a", since=future) == {}
        past = datetime.now(UTC) - timedelta(hours=1)
        assert len((await load_samples(session, "cand-a", since=past))["ttft"].candidate) == 3
        assert await load_samples(session, "nobody") == {}


async def test_list_candidates_with_sample_counts(engine: AsyncEngine) -> None:
    async with ScoreWriter(engine, quick_config(engine)) as writer:
        for i in range(3):
            writer.submit(make_exchange(f"a{i}", "cand-a"), SCORES)
        writer.submit(make_exchange("b0", "cand-b"), [Score("ttft_ratio", 2.0, 1.0)])
        await written(writer, 4)
    async with session_factory(engine)() as session, session.begin():
        await register_backend(session, "cand-c", role="candidate", url="http://c:8000")
    async with session_factory(engine)() as session:
        summaries = {s.name: s for s in await list_candidates(session)}
    assert set(summaries) == {"cand-a", "cand-b", "cand-c"}  # not the primary
    a = summaries["cand-a"]
    assert (a.samples, dict(a.metrics)) == (6, {"similarity": 3, "ttft_ratio": 3})
    assert a.last_scored_at is not None and a.last_scored_at.tzinfo is not None
    assert summaries["cand-b"].samples == 1
    c = summaries["cand-c"]
    assert (c.samples, c.url, c.role, c.last_scored_at) == (0, "http://c:8000", "candidate", None)


async def test_register_backend_creates_then_updates(engine: AsyncEngine) -> None:
    factory = session_factory(engine)
    async with factory() as session, session.begin():
        first = await register_backend(session, "b", role="candidate")
    async with factory() as session, session.begin():
        again = await register_backend(session, "b", role="primary", url="http://b")
    assert first == again
    (backend,) = await rows(engine, BackendRow)
    assert (backend.role, backend.url) == ("primary", "http://b")


async def test_verdict_and_audit_commit_together(engine: AsyncEngine) -> None:
    factory = session_factory(engine)
    start = datetime(2025, 1, 1, tzinfo=UTC)
    async with factory() as session, session.begin():
        await register_backend(session, "cand-a", role="candidate")
        verdict_id = await record_verdict(
            session, candidate="cand-a", verdict="pass", reasons=["ttft within 5%"],
            statistics={"ttft": {"p_value": 0.3, "n": 120}},
            window_start=start, window_end=start + timedelta(hours=1))
        audit_id = await append_audit(session, actor="alice", action="promote",
                                      target="cand-a", detail={"from": "primary"},
                                      verdict_id=verdict_id)
    (verdict,) = await rows(engine, VerdictRow)
    assert verdict.id == verdict_id
    assert (verdict.verdict, verdict.reasons) == ("pass", ["ttft within 5%"])
    assert verdict.statistics == {"ttft": {"p_value": 0.3, "n": 120}}
    assert (verdict.window_start, verdict.window_end) == (start, start + timedelta(hours=1))
    (entry,) = await rows(engine, AuditEntry)
    assert (entry.id, entry.actor, entry.action, entry.target, entry.detail,
            entry.verdict_id) == (audit_id, "alice", "promote", "cand-a", {"from": "primary"},
                                  verdict_id)
    assert entry.at.tzinfo is not None

    async with factory() as session:
        with pytest.raises(StoreRejected):
            async with session.begin():
                await record_verdict(session, candidate="nobody", verdict="fail", reasons=[],
                                     statistics={})
