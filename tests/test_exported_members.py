"""Each package exports exactly the names pinned here (as httpx's
``tests/test_exported_members.py``): a change to a public surface is a change to this file.
Subpackages that only group a package's private modules export nothing.
"""

from __future__ import annotations

import importlib
import types

import pytest

# Sorted, as each package's ``__all__`` is (ruff's RUF022).
EXPORTED: dict[str, str] = {
    "backends.openai_wire": """
        DONE_EVENT JSON_CONTENT_TYPE LABELS SIMULATED_VLLM_VERSION SSE_CONTENT_TYPE AnswerWriter
        ClientGone ConfigError RequestError RequestKind RequestOutcome ResponseIdentity
        SamplingFields ServedApp ServedModel StopFields StreamOptions Usage VLLMSeries
        chat_messages chat_template_kwargs
        check_message_content check_message_role check_room choice_count client_left
        completion_prompt
        config_error decode_body embedding_response encode_body error_body install_openai_app
        invalid_value is_token_ids json_response metrics_response optional_bool optional_float
        optional_int request_object request_seed requested_max_tokens response_id sampling_fields
        schema_error serve_app serve_until_signalled sse_event stop_fields stream_options
        validation_problems
    """,
    "backends.sim": """
        MAX_RECORDED_REQUESTS SIM_STATS FaultMode RecordedRequest RunningSim SimConfig SimStats
        build_app running_sim sim_command
    """,
    "backends.engine": """
        BlockPool ChatTokenizer DecodeServerConfig Engine EngineRole EngineServerConfig
        EngineStats FinishReason ForwardChunk KVBlock KVLayout KVPlan LlamaModel ModelConfig
        NoFreeBlocksError PrefillServerConfig PrefixCacheStats RouterServerConfig
        RunningEngineServer SamplingParams TokenEvent UnifiedServerConfig build_engine_app
        default_gguf_path engine_command engine_server_config hash_block kv_quality_command
        plan_kv_command running_engine_server
    """,
    "backends.engine.kv.codecs": """
        CODECS CodecQuality EncodedBlock KVCodec QualityReport Role codec_by_name measure_quality
    """,
    "backends.vllm": """
        VLLMProfile VLLMServer VLLMServerError command default_vllm_home environment model_dir
        vllm_python
    """,
    "gateway": """
        STATE GatewayConfig build_app load_config make_admin_runner make_runner run serve
    """,
    "evaluators": """
        DEFAULT_SCORERS METRICS SCORERS Capture EvaluationPipeline EvaluationProcessError
        EvaluationSink Exchange Gates MemorySink MetricGate MetricSamples MetricVerdict
        Observation Outcome PipelineState PipelineStats Report ReportInputs Score Scorer
        ScorerConfig Usage Verdict build_report json_requested judge judge_inputs load_report_inputs
        observe record_report requested_choices turn_depth_bucket
    """,
    "evaluators.store": """
        DEFAULT_STORE_URL TRAFFIC_SEEN AuditEntry AuditNote BackendRole BackendRow Base
        CandidateSummary ConditionedSamples DropReason EvaluatedRequests ExchangeRow
        ObservationRow Pruned RetentionDays RoutingListener ScoreLike ScoreRow ScoreWriter
        StoreConfig
        StoreError StoreRejected StoreUnavailable StoredCounts StoredSamples TrafficCount
        TrafficCountRow UnknownRevision ValueCounts VerdictRow WriterState WriterStateError
        WriterStats
        append_audit
        create_engine current_revision downgrade head_revision list_candidates
        listen_for_routing load_conditioned_samples load_evaluated_requests load_routing
        load_samples load_samples_by_turn_depth load_traffic load_value_counts
        lock_for_migration masked_url
        newest_scores_start prune_store record_change record_traffic record_verdict
        register_backend retention_cutoff save_routing session_factory upgrade
    """,
    "demo": """
        CandidateCard DemoSpec Scorecard demo_command run_demo
    """,
    "workload": """
        DEFAULT_SESSION_HEADER SYSTEM_PROMPT TOOLS DepthStats OnTurn ReplaySpec SessionScript
        TrafficRecord TurnResult WorkloadSpec WorkloadSummary load_command read_records
        replay_workload run_workload summary_table tool_result
    """,
}
# Subpackages that group a package's private modules; they export nothing of their own.
INTERNAL_SUBPACKAGES = ("backends.engine.model", "backends.engine.kv", "backends.engine.serving")


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_all_is_pinned(name: str) -> None:
    module = importlib.import_module(name)
    assert list(module.__all__) == EXPORTED[name].split()


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_every_public_name_is_exported(name: str) -> None:
    module = importlib.import_module(name)
    for member in module.__all__:  # a package may load its exports on first use (PEP 562)
        getattr(module, member)
    assert _public_names(module) == set(module.__all__)


def _public_names(module: types.ModuleType) -> set[str]:
    return {
        member
        for member, value in vars(module).items()
        if not member.startswith("_") and not isinstance(value, types.ModuleType)
    }


@pytest.mark.parametrize("name", INTERNAL_SUBPACKAGES)
def test_internal_subpackages_export_nothing(name: str) -> None:
    module = importlib.import_module(name)
    assert not hasattr(module, "__all__") and not _public_names(module)
