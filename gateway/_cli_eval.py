"""``understudy db ...`` and ``understudy report``: the store and the judge from a terminal."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from evaluators import Report
    from evaluators.store import Pruned, StoreConfig
    from gateway._config import GatewayConfig

# The evaluators, the store and the configuration (seconds of imports: SQLAlchemy, Alembic,
# scipy) are imported by the commands that use them, not for ``--help`` (gateway/cli.py).

__all__ = ["db", "report"]

MIN_TABLE_WIDTH = 132
_VERDICT_STYLE = {"PASS": "green", "MARGINAL": "yellow", "FAIL": "red",
                  "INCONCLUSIVE": "magenta"}


def _config(config_path: Path | None, db_url: str | None) -> GatewayConfig:
    from backends.openai_wire import ConfigError, config_error
    from gateway._config import load_config

    overrides: dict[str, Any] = {}
    if db_url:
        overrides = {"evaluation": {"store": {"url": db_url}}}
    try:
        return load_config(config_path, overrides)
    except ValidationError as exc:  # a ValueError: caught first, a line per field
        raise config_error(exc) from exc
    except (ValueError, OSError) as exc:  # no file, not TOML
        raise ConfigError([f"invalid configuration: {exc}"]) from exc


_config_option = click.option("--config", "config_path", type=click.Path(
    exists=True, dir_okay=False, path_type=Path), help="TOML config file.")
_db_option = click.option("--db", "db_url", help="Database URL (default: the config's "
                          "[evaluation.store] url, sqlite+aiosqlite:///understudy.db).")


@click.group()
def db() -> None:
    """Create or change the evaluation store's schema (Alembic), or prune its old rows."""


@db.command("upgrade")
@_config_option
@_db_option
@click.option("--revision", default="head", show_default=True)
def db_upgrade(config_path: Path | None, db_url: str | None, revision: str) -> None:
    """Upgrade the schema to REVISION (default: the newest)."""
    from evaluators.store import upgrade

    url = _config(config_path, db_url).evaluation.store.url
    _migrate(url, lambda: upgrade(url, revision), "--revision")


@db.command("downgrade")
@_config_option
@_db_option
@click.argument("revision")
def db_downgrade(config_path: Path | None, db_url: str | None, revision: str) -> None:
    """Downgrade the schema to REVISION (``base`` removes every table)."""
    from evaluators.store import downgrade

    url = _config(config_path, db_url).evaluation.store.url
    _migrate(url, lambda: downgrade(url, revision), "REVISION")


def _migrate(url: str, migration: Callable[[], Coroutine[Any, Any, None]],
             argument: str) -> None:
    """Run ``migration`` and say where the schema stands. A revision it cannot reach is the
    argument's fault (exit 2, as a bad option); a store it cannot reach or that refuses is
    one line naming the store (exit 1): never a traceback."""
    from backends.openai_wire import ConfigError
    from evaluators.store import StoreError, UnknownRevision, current_revision, masked_url

    try:
        asyncio.run(migration())
        at = asyncio.run(current_revision(url))
    except UnknownRevision as exc:
        raise ConfigError([f"{argument}: {exc}"]) from exc
    except StoreError as exc:
        raise click.ClickException(f"{masked_url(url)}: {exc}") from exc
    click.echo(f"{masked_url(url)}: at {at}")


@db.command("prune")
@_config_option
@_db_option
@click.option("--older-than", "older_than", metavar="DAYS",
              help="Delete exchanges (with their observations and scores) and traffic "
              "counts older than DAYS (default: the config's [evaluation.store] "
              "retention_days). Verdicts, the audit log, routing and backends stay.")
def db_prune(config_path: Path | None, db_url: str | None, older_than: str | None) -> None:
    """Delete per-exchange data older than the retention bound, in bounded batches."""
    from pydantic import TypeAdapter

    from backends.openai_wire import ConfigError
    from evaluators.store import RetentionDays, StoreError, masked_url, retention_cutoff

    store = _config(config_path, db_url).evaluation.store
    days = store.retention_days
    if older_than is not None:
        try:
            days = TypeAdapter(RetentionDays).validate_python(older_than)
        except ValidationError as exc:
            raise ConfigError([f"--older-than: {error['msg']}" for error in exc.errors(
                include_url=False, include_input=False, include_context=False)]) from exc
        if days == 0:  # as a bound 0 means "forever"; here it would mean "everything"
            raise ConfigError(["--older-than: Input should be greater than 0 (to keep "
                               "everything, prune nothing)"])
    if days == 0:
        click.echo(f"{masked_url(store.url)}: retention is off ([evaluation.store] "
                   "retention_days = 0): nothing pruned (--older-than DAYS prunes by hand)")
        return
    cutoff = retention_cutoff(days)
    try:
        pruned = asyncio.run(_prune(store, cutoff))
    except StoreError as exc:  # unreachable, or not migrated: say so, no traceback
        raise click.ClickException(f"{masked_url(store.url)}: {exc}") from exc
    older = f"older than {days:g} days ({cutoff:%Y-%m-%d %H:%M:%S} UTC)"
    if not pruned.batches:
        click.echo(f"{masked_url(store.url)}: nothing {older} to delete, "
                   f"{pruned.seconds:.2f} s")
        return
    click.echo(f"{masked_url(store.url)}: deleted {pruned.exchanges} exchanges "
               f"({pruned.observations} observations, {pruned.scores} scores) and "
               f"{pruned.traffic_counts} traffic counts {older} in {pruned.batches} "
               f"{'batch' if pruned.batches == 1 else 'batches'}, {pruned.seconds:.2f} s")


async def _prune(store: StoreConfig, cutoff: datetime) -> Pruned:
    from evaluators.store import create_engine, prune_store

    engine = create_engine(store)
    try:
        return await prune_store(engine, cutoff, batch=store.prune_batch_exchanges)
    finally:
        await engine.dispose()


@click.command()
@_config_option
@_db_option
@click.argument("candidate")
@click.option("--window-s", type=float, help="Judge only scores of the last N seconds.")
@click.option("--secondary", help="The replica of the primary whose scores are the noise "
              "floor (default: the config's candidate with role = \"secondary\", else the "
              "store's, the one scored last).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def report(config_path: Path | None, db_url: str | None, candidate: str,
           window_s: float | None, secondary: str | None, as_json: bool) -> None:
    """Judge CANDIDATE over its stored scores and print every statistic."""
    from backends.openai_wire import ConfigError
    from evaluators.store import StoreError, masked_url
    from gateway._config import MAX_WINDOW_S

    # NaN fails the comparison too: no traceback from timedelta, and 0 is no "all time".
    if window_s is not None and not 0 < window_s < MAX_WINDOW_S:
        raise ConfigError([f"--window-s: must be a positive number of seconds below "
                           f"{MAX_WINDOW_S:g}"])
    config = _config(config_path, db_url)
    since = None if window_s is None else datetime.now(UTC) - timedelta(seconds=window_s)
    secondary = secondary or next((c.name for c in config.candidates
                                   if c.role == "secondary"), None)
    url = config.evaluation.store.url
    try:
        result = asyncio.run(_build(config, candidate, secondary, since))
    except StoreError as exc:  # unreachable, or not migrated: one line, as ``db`` says it
        raise click.ClickException(f"{masked_url(url)}: {exc}") from exc
    if as_json:
        click.echo(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        _print(result)


async def _build(config: GatewayConfig, candidate: str, secondary: str | None,
                 since: datetime | None) -> Report:
    from evaluators import build_report
    from evaluators.store import create_engine, list_candidates, session_factory

    engine = create_engine(config.evaluation.store)
    try:
        async with session_factory(engine)() as session, session.begin():
            summaries = await list_candidates(session)
            known = [c.name for c in summaries]
            if candidate not in known:  # a typo is not "too few samples" (the admin's 404)
                have = f"known: {', '.join(known)}" if known else \
                    "none has been registered yet"
                raise click.ClickException(f"no candidate {candidate!r} in the store ({have})")
            if secondary is None:  # ``--db`` alone: the replica the gateways registered
                replicas = [c for c in summaries if c.role == "secondary"]
                newest = max(replicas, default=None,
                             key=lambda c: c.last_scored_at or datetime.min.replace(tzinfo=UTC))
                secondary = newest.name if newest else None
            return await build_report(session, candidate, config.evaluation.gates,
                                      secondary=secondary, since=since, record=False)
    finally:
        await engine.dispose()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _columns(metric: dict[str, Any]) -> tuple[Any, Any, str, Any]:
    """(candidate, baseline, relative shift with its CI, tail ratio) of one metric; a
    rate's (its counts compared, no bootstrap) are its rates and their change in points."""
    rates, stats = metric.get("rates"), metric.get("statistics")
    if rates:
        change = (f"{rates['change'] * 100:+.1f} pts [{rates['change_ci_low'] * 100:+.1f}, "
                  f"{rates['change_ci_high'] * 100:+.1f}]")
        return rates["rate_candidate"], rates["rate_baseline"], change, None
    if not stats:
        return None, None, "-", None
    if "n_baseline" in stats:  # per-backend: candidate against the primary
        comparison: dict[str, Any] | None = stats
        candidate, baseline = stats.get("median_candidate"), stats.get("median_baseline")
    else:  # pairwise: its mean, and the noise floor's when a secondary was mirrored
        comparison = stats.get("noise_floor")
        candidate = stats.get("mean")
        baseline = comparison.get("mean_baseline") if comparison else None
    if not comparison or comparison.get("relative_shift") is None:
        return candidate, baseline, "-", None
    shift = (f"{comparison['relative_shift']:+.1%} [{comparison['relative_ci_low']:+.1%}, "
             f"{comparison['relative_ci_high']:+.1%}]")
    return candidate, baseline, shift, comparison.get("tail_ratio")


def _confidence(data: dict[str, Any]) -> str:
    """The intervals' confidence as the table's header says it ("98% "), read from the
    report's statistics (the gates' ``confidence``); empty where no metric has any."""
    for metric in data["metrics"]:
        for figures in (metric.get("rates"), metric.get("statistics")):
            if figures and figures.get("confidence") is not None:
                return f"{100 * figures['confidence']:g}% "
    return ""


def _print(result: Report) -> None:
    console = Console(width=max(Console().width, MIN_TABLE_WIDTH))
    data = result.to_dict()
    style = _VERDICT_STYLE.get(data["verdict"], "")
    floor = f"  (noise floor: {result.secondary})" if result.secondary else ""
    console.print(f"candidate [bold]{result.candidate}[/]: [{style} bold]{data['verdict']}[/]"
                  + floor)
    for reason in data["reasons"]:
        console.print(f"  - {reason}")
    if result.capped_at is not None and result.since is not None:
        console.print(f"  (judged the newest {result.capped_at} scored exchanges, since "
                      f"{result.since:%Y-%m-%d %H:%M:%S} UTC: raise max_judged_exchanges "
                      "to read more)")
        if result.rates_counted:
            console.print(f"  (rates counted over the whole window, n per metric as shown: "
                          f"{', '.join(result.rates_counted)})")
    for reason, unscored in result.unscored.items():
        console.print(f"  ({unscored['exchanges']} exchanges without quality values, "
                      f"{reason}: candidate {unscored['candidate']}, primary "
                      f"{unscored['primary']}; {unscored['why']})")
    table = Table(title=f"{result.candidate} against the primary")
    for column in ("metric", "n", "verdict", "candidate", "primary / floor",
                   f"relative shift, a rate's change [{_confidence(data)}CI]", "tail ratio"):
        table.add_column(column)
    for metric in data["metrics"]:
        candidate, baseline, shift, tail = _columns(metric)
        verdict = metric["verdict"]
        table.add_row(metric["metric"], _fmt(result.samples.get(metric["metric"])),
                      f"[{_VERDICT_STYLE.get(verdict, '')}]{verdict}[/]", _fmt(candidate),
                      _fmt(baseline), shift, _fmt(tail))
    console.print(table)
    _print_conditions(console, data)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _print_conditions(console: Console, data: dict[str, Any]) -> None:
    """Like with like: matched-load comparisons, load curves, cache, sample bias, estimate."""
    matched = Table(title="latency and throughput at matched load (what the verdict reads)")
    for column in ("metric", "compared with", "n cand / base", "shift [CI]", "p", "strata"):
        matched.add_column(column)
    for metric in data["metrics"]:
        m = metric.get("matched")
        if metric.get("basis", "primary") == "primary" or (
                m is None and not metric["metric"].startswith("latency.")):
            continue
        stats = m or metric.get("statistics") or {}
        n = (f"{stats.get('n_candidate_matched', stats.get('n_candidate'))} / "
             f"{stats.get('n_baseline_matched', stats.get('n_baseline'))}")
        shift = (f"{_pct(stats.get('relative_shift'))} [{_pct(stats.get('relative_ci_low'))}, "
                 f"{_pct(stats.get('relative_ci_high'))}]")
        strata = "-" if m is None else m["reason"]
        matched.add_row(metric["metric"], metric["basis"], n, shift,
                        _fmt(stats.get("p_value")), strata)
    if matched.row_count:
        console.print(matched)
    curves = Table(title="latency and throughput vs concurrency (median per load; slope "
                   "per request in flight)")
    for column in ("metric", "backend", "points (load: median)", "slope [CI]"):
        curves.add_column(column)
    for metric, by_backend in data["conditions"].get("load_curves", {}).items():
        for backend, curve in by_backend.items():
            points = ", ".join(f"{p['concurrency']}: {p['median']:.3g}"
                               for p in curve["points"][:8])
            slope = ("-" if curve["slope"] is None else
                     f"{curve['slope']:.3g} [{curve['slope_ci_low']:.3g}, "
                     f"{curve['slope_ci_high']:.3g}]")
            curves.add_row(metric, backend, points, slope)
    if curves.row_count:
        console.print(curves)
    cache = data["conditions"].get("cache") or {}
    if cache.get("hit_rates"):
        hits = Table(title="prefix-cache hit rate (cached / prompt tokens)")
        for column in ("backend", "hit rate", "requests known / unknown"):
            hits.add_column(column)
        for backend, hit in cache["hit_rates"].items():
            hits.add_row(backend, _fmt(hit["hit_rate"]), f"{hit['known']} / {hit['unknown']}")
        console.print(hits)
    strata = cache.get("ttft_within_cache_strata")
    if strata:
        console.print(f"TTFT within cache strata: {_pct(strata['relative_shift'])} "
                      f"(p={_fmt(strata['p_value'])}; {strata['reason']})")
    bias = data.get("sample_bias")
    if bias:
        flag = "REFUSED" if bias["refuse"] else "SKEW" if bias["skew"] else "ok"
        console.print(f"sample bias: [bold]{flag}[/] ({bias['n_evaluated']} evaluated of "
                      f"{bias['n_seen']} seen; drops {bias['drops_by_reason'] or 'none'})")
        for reason in bias["reasons"]:
            console.print(f"  - {reason}")
    if data.get("more_samples_needed") is not None:
        console.print(f"samples: about {data['more_samples_needed']} more per side for the "
                      "inconclusive metrics to decide")
