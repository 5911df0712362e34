"""The gateway and the evaluators export exactly the names pinned here (as httpx's
``tests/test_exported_members.py``): a change to a public surface is a change to this file.
The ``backends`` packages are pinned in ``tests/backends/test_exported_members.py``.
"""

from __future__ import annotations

import importlib
import types

import pytest

# Sorted, as each package's ``__all__`` is (ruff's RUF022).
EXPORTED: dict[str, str] = {
    "gateway": """
        STATE GatewayConfig build_app load_config make_runner run serve
    """,
    "evaluators": """
        DEFAULT_SCORERS METRICS SCORERS Capture EvaluationPipeline EvaluationProcessError
        EvaluationSink Exchange Gates MemorySink MetricGate MetricSamples MetricVerdict
        Observation Outcome PipelineState PipelineStats Report Score Scorer ScorerConfig
        Usage Verdict build_report judge observe turn_depth_bucket
    """,
    "evaluators.store": """
        DEFAULT_STORE_URL TRAFFIC_SEEN AuditEntry AuditNote BackendRole BackendRow Base
        CandidateSummary ConditionedSamples DropReason EvaluatedRequests ExchangeRow
        ObservationRow RoutingListener ScoreLike ScoreRow ScoreWriter StoreConfig
        StoreError StoreRejected StoreUnavailable StoredSamples TrafficCount
        TrafficCountRow VerdictRow WriterState WriterStateError WriterStats append_audit
        create_engine current_revision downgrade head_revision list_candidates
        listen_for_routing load_conditioned_samples load_evaluated_requests load_routing
        load_samples load_traffic lock_for_migration masked_url record_change
        record_traffic record_verdict register_backend save_routing session_factory upgrade
    """,
}


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_all_is_pinned(name: str) -> None:
    module = importlib.import_module(name)
    assert list(module.__all__) == EXPORTED[name].split()


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_every_public_name_is_exported(name: str) -> None:
    module = importlib.import_module(name)
    public = {
        member
        for member, value in vars(module).items()
        if not member.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(module.__all__)
