"""Each ``backends`` package exports exactly the names pinned here (as httpx's
``tests/test_exported_members.py``): a change to a public surface is a change to this file.
"""

from __future__ import annotations

import importlib
import types

import pytest

# Sorted, as each package's ``__all__`` is (ruff's RUF022).
EXPORTED: dict[str, str] = {
    "backends.openai_wire": """
        DONE_EVENT JSON_CONTENT_TYPE LABELS SIMULATED_VLLM_VERSION SSE_CONTENT_TYPE AnswerWriter
        ClientGone RequestError RequestKind RequestOutcome ResponseIdentity ServedApp
        ServedModel StreamOptions Usage VLLMSeries chat_messages check_message_role check_room
        client_left completion_prompt decode_body embedding_response error_body
        install_openai_app invalid_value is_token_ids json_response metrics_response
        optional_bool optional_float optional_int request_object response_id schema_error
        serve_app serve_until_signalled sse_event stream_options
    """,
    "backends.sim": """
        MAX_RECORDED_REQUESTS SIM_STATS FaultMode RecordedRequest RunningSim SimConfig SimStats
        build_app running_sim sim_command
    """,
    "backends.engine": """
        BlockPool ChatTokenizer Engine EngineRole EngineServerConfig EngineStats FinishReason
        ForwardChunk KVBlock KVLayout LlamaModel ModelConfig NoFreeBlocksError
        PrefixCacheStats RunningEngineServer SamplingParams TokenEvent build_engine_app
        default_gguf_path engine_command hash_block running_engine_server
    """,
    "backends.vllm": """
        VLLMProfile VLLMServer VLLMServerError command default_vllm_home environment model_dir
        vllm_python
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
    public = {
        member
        for member, value in vars(module).items()
        if not member.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(module.__all__)


@pytest.mark.parametrize("name", INTERNAL_SUBPACKAGES)
def test_internal_subpackages_export_nothing(name: str) -> None:
    module = importlib.import_module(name)
    public = [
        member
        for member, value in vars(module).items()
        if not member.startswith("_") and not isinstance(value, types.ModuleType)
    ]
    assert not hasattr(module, "__all__") and public == []
