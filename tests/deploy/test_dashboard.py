"""The Grafana dashboard asks only for series the code exports, with labels they carry.

The exported names come from the real registries and collectors (the gateway's metrics and
its evaluation collector, the engine server's and the router's, vLLM's series as
``backends.openai_wire`` names them), so a renamed metric breaks this test, not a dashboard
nobody looks at. The verdict panels' SQL names tables and columns of the store's schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from sqlalchemy.ext.asyncio import create_async_engine

from backends.engine.serving._metrics import EngineMetrics
from backends.engine.serving._router import RouterMetrics
from evaluators import EvaluationPipeline
from evaluators.store import StoreConfig
from evaluators.store._schema import Base
from evaluators.store._writer import ScoreWriter
from gateway import load_config
from gateway._metrics import EvaluationCollector, GatewayMetrics
from gateway._scorekeeper import Scorekeeper

from ._stack import DASHBOARD, PROMETHEUS_CONFIG

# Labels Prometheus adds to every series (its own, and the stack's target labels).
SCRAPE_LABELS = {"job", "instance"}
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "rate", "increase", "irate",
    "histogram_quantile", "le", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset",
}


def target_labels() -> set[str]:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    return {label for job in config["scrape_configs"] for static in job["static_configs"]
            for label in static.get("labels", {})}


def sample_names(family_name: str, kind: str) -> set[str]:
    """The series names Prometheus stores for one metric family."""
    if kind == "counter":
        return {f"{family_name}_total", f"{family_name}_created"}
    if kind == "histogram":
        return {f"{family_name}_{s}" for s in ("bucket", "sum", "count", "created")}
    return {family_name}


async def exported() -> dict[str, set[str]]:
    """Every series name the code exports, with the labels each carries."""
    names: dict[str, set[str]] = {}
    for registry in (GatewayMetrics().registry, EngineMetrics("m").registry,
                     RouterMetrics(1, 1).registry):
        # A labelled metric with no child yet exports no sample: take its declared labels.
        for metric, _ in registry._collector_to_names.items():
            labels = set(getattr(metric, "_labelnames", ()))
            for family in metric.collect():
                for name in sample_names(family.name, family.type):
                    names.setdefault(name, set()).update(labels)
    engine = create_async_engine("sqlite+aiosqlite://")
    try:
        pipeline = EvaluationPipeline(StoreConfig())
        writer = ScoreWriter(engine)
        scorekeeper = Scorekeeper(load_config(None, {}))
        collector = EvaluationCollector(
            lambda: pipeline.stats, lambda: writer.stats,
            lambda: (scorekeeper.store_status, scorekeeper.scoring_state))
        for family in collector.collect():
            # An empty labelled family (no drops yet) still declares its label names.
            labels = {label for sample in family.samples for label in sample.labels}
            labels |= set(getattr(family, "_labelnames", ()))
            for name in sample_names(family.name, family.type):
                names.setdefault(name, set()).update(labels)
    finally:
        await engine.dispose()
    return names


def prom_targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target.get("datasource", {}).get("type") == "prometheus":
                yield panel["title"], target["expr"]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"(?:understudy_|vllm:)[A-Za-z0-9_:]+", expr))


@pytest.fixture(scope="module")
def exports() -> dict[str, set[str]]:
    import asyncio

    return asyncio.run(exported())


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def test_every_metric_on_the_dashboard_is_exported(exports: dict[str, set[str]]) -> None:
    used = {name for _, expr in prom_targets(load_dashboard()) for name in metric_names(expr)}
    assert used, "the dashboard queries no understudy or vLLM series"
    assert used - set(exports) == set()


def test_grouping_labels_exist_on_the_series(exports: dict[str, set[str]]) -> None:
    extra = SCRAPE_LABELS | target_labels()
    for title, expr in prom_targets(load_dashboard()):
        names = metric_names(expr)
        carried = set.union(*(exports[name] for name in names)) | extra
        grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr)
                   for label in group.split(",")} - {"le"}
        selected = set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:!=|=~|!~|=)", expr))
        legends = set(re.findall(r"\{\{(\w+)\}\}", expr))
        assert grouped | selected | legends <= carried, (title, expr)


def test_the_dashboard_covers_what_the_issue_asks_for() -> None:
    dashboard = load_dashboard()
    exprs = " ".join(expr for _, expr in prom_targets(dashboard))
    for series in (
        "understudy_primary_ttft_seconds_bucket", "understudy_candidate_ttft_seconds_bucket",
        "understudy_primary_e2e_seconds_bucket", "understudy_candidate_e2e_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket", "understudy_mirror_queued_total",
        "understudy_mirror_dropped_total", "understudy_memory_budget_used_bytes",
        "vllm:kv_cache_usage_perc", "understudy_kv_bytes_per_token",
    ):
        assert series in exprs, series
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}," in exprs
    legends = {target["legendFormat"] for panel in dashboard["panels"]
               for target in panel.get("targets", []) if "legendFormat" in target}
    assert any("{{reason}}" in legend for legend in legends)
    sql = [target["rawSql"] for panel in dashboard["panels"]
           for target in panel.get("targets", []) if "rawSql" in target]
    assert any("verdict" in query for query in sql)


def test_verdict_queries_name_the_store_schema() -> None:
    tables = Base.metadata.tables
    for panel in load_dashboard()["panels"]:
        for target in panel.get("targets", []):
            if "rawSql" not in target:
                continue
            assert target["datasource"]["uid"] == "understudy-store"
            query = target["rawSql"]
            aliases = dict(re.findall(r"(?:FROM|JOIN) (\w+) (\w+)", query))
            assert aliases, query
            for alias, table in ((a, t) for t, a in aliases.items()):
                assert table in tables, table
                for column in re.findall(rf"\b{alias}\.(\w+)", query):
                    assert column in tables[table].columns, f"{table}.{column}"


def test_the_datasource_uids_match_the_provisioning() -> None:
    from ._stack import ROOT

    provisioned = yaml.safe_load((ROOT / "deploy" / "grafana" / "provisioning" / "datasources"
                                  / "understudy.yml").read_text())["datasources"]
    uids = {d["uid"]: d["type"] for d in provisioned}
    for panel in load_dashboard()["panels"]:
        for source in [panel.get("datasource"), *(t.get("datasource")
                                                  for t in panel.get("targets", []))]:
            if source is not None:
                assert uids.get(source["uid"]) == source["type"], (panel["title"], source)
