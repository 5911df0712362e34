"""Each KV codec's quality on the real model: attention-output error, next-token KL, top-1.

Theory of operation
-------------------
1. The model runs here in a plain numpy forward over the engine's own weights (``LlamaModel``'s
   arrays, its RMS norm and RoPE), without the paged cache: attention must see, per query, a
   mix of round-tripped and full-precision keys (rule 3), which one ``K^T`` per chunk cannot
   express.  Its fp32 logits are checked against ``LlamaModel.forward`` on the first prompt
   (``QualityReport.reference_logit_gap``, ~1e-4: the same arithmetic in another order).
2. Write-time semantics, as a quantized paged cache has them: every K and V that attention
   reads went through ``codec.encode`` then ``decode``, the prompt's own included (the engine's
   prefill reads its K/V back from the cache), in blocks of ``encode_tokens`` consecutive
   positions, per layer.  A block is encoded whole, as a prefill writes it.
3. Read-time exceptions, the cache's policy (``_codec`` rule 4): the attention sink (position
   0) is read raw; with a window ``w``, a query at position ``i`` reads the keys and values of
   positions ``i - w < j <= i`` at float16 (the precision the window is counted at), the rest
   through the codec.
4. Attention-output error, per layer: the fp32 pass gives each layer's queries, keys and values;
   the last ``queries`` queries attend over the round-tripped K/V (rules 2-3) and over the fp32
   ones; the error is ``||O_codec - O|| / ||O||`` over those queries and all heads.  Each layer
   is judged on exact inputs, so this is the codec's error alone, layer by layer.
5. Next-token KL and top-1: the whole forward runs again with every layer reading round-tripped
   K/V, so errors compound as in a quantized engine; at the last ``queries`` positions (teacher
   forcing: the text's own tokens) ``KL(p_fp32 || p_codec)`` in nats and whether the argmax
   agrees.  This equals decoding those tokens one by one over a quantized cache (causal
   attention: a position sees only the K/V before it), with rule 2's whole blocks.  With
   ``semantics="decode"`` the positions before the scored ones are computed at full precision
   (a prefill that attends over its exact K/V, as KIVI's does, and only then stores them
   encoded): the scored positions read every K/V through the codec, but the prompt's hidden
   states carry no codec error.  ``write`` is what an engine whose prefill reads its K/V back
   from an encoded cache gets; ``decode`` is the lower bound of the loss for the last few
   positions.  With ``semantics="step"`` every scored position is one decode step over a cache
   holding the codec's round trip of the exact K/V (the fp32 pass's, its own row included,
   which a real step would compute itself): errors compound through the layers of a position
   but not from one position to the next, the mildest of the three where many are scored.
6. Calibration is not evaluation: the E8 key means and key transforms come from
   ``CALIBRATION_TEXTS`` (seven passages, ~2,300 tokens), never from the prompts that are scored.
7. Bits: a codec's bits per element are measured from its encoded arrays at ``encode_tokens``;
   at a context of ``L`` tokens the sink costs 32 bits, the window 16, the rest the codec's
   (``CodecQuality.effective_bits``), and the longest context that fits a KV budget follows.
8. Heavy hitters (a plan's ``heavy_tokens`` = ``h``, ``kv._heavy``): in each complete block of
   ``encode_tokens`` positions the ``h`` rows per KV head that the block's last query chooses
   (the query of this pass, as the engine's is that of its own forward) are read at float16 in
   place of their round trip, as the engine writes them over the decoded rows.  They cost
   ``h / encode_tokens * (16 + 4 / head_dim)`` bits per element more (float16 K and V rows and a
   one-byte position per KV head), added to the codec's bits as the engine adds them to a
   block's bytes.
9. Setups (``QualitySetup``): a text set and what of it is scored, under one name.  The default
   is the table above (``PROMPTS``, ~450 tokens each, the last 128 positions, write semantics);
   ``ISSUE_SETUP`` is issue 14's own (3 texts x 1,500 tokens, no recent window): the
   ``LONG_PROMPTS`` cut to 1,500 tokens, every position from 128 on scored, step semantics:
   of the variants tried (write, decode and step; the last 128 positions, every one from 128
   on) the only one whose top-1 matches what the issue quotes for fp8, KIVI-4 and KIVI-2 (95.6,
   96.5 and 77-81 %); every variant matches its attention errors, which do not depend on the
   semantics (rule 4).  ``bench/kvquant.py --setup issue`` reports them side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from ...model._model import ForwardChunk, LlamaModel, _rms_norm, _rope
from .._heavy import heavy_hitters
from .._plan import KVPlan
from .._store import KVLayout, KVStorage
from ._codec import DEFAULT_ENCODE_TOKENS, DEFAULT_SEED, ROLES, Float32Array, KVCodec, Role
from ._e8_codec import (
    KEY_TRANSFORM_POWER,
    KEY_TRANSFORM_SHRINK,
    E8Codec,
    key_transform_from,
)
from ._registry import codec_by_name
from ._texts import CALIBRATION_TEXTS, LONG_PROMPTS, PROMPTS

__all__ = [
    "DEFAULT_CONFIGS",
    "ISSUE_SETUP",
    "CodecChoice",
    "CodecQuality",
    "QualityReport",
    "QualitySetup",
    "Semantics",
    "calibrate",
    "capture_kv",
    "heavy_bits_per_element",
    "keep_heavy_hitters",
    "layer_codecs",
    "measure_quality",
    "measure_setup",
    "plan_bits",
    "round_trip",
    "tune_tau",
]

DEFAULT_CONFIGS: tuple[tuple[str, int], ...] = (
    ("fp32", 0),
    ("fp16", 0),
    ("fp8", 0),
    ("fp8", 128),
    ("kivi-8", 0),
    ("kivi-8", 128),
    ("kivi-4", 0),
    ("kivi-4", 128),
    ("kivi-2", 0),
    ("kivi-2", 128),
    ("e8-2", 0),
    ("e8-2w", 128),
)
"""(codec, window) pairs measured by default: every codec without a window and the lossy ones
with KIVI's 128-token window (``e8-2w`` is ``e8-2`` with it)."""
DEFAULT_QUERIES = 128
Semantics = Literal["write", "decode", "step"]
"""Rule 5: ``write``, every read goes through the codec, the prompt's own included; ``decode``,
the prompt before the scored positions is computed at full precision (KIVI's prefill); ``step``,
each scored position reads the round trip of the exact K/V (one decode step per position)."""
ISSUE_CONFIGS: tuple[tuple[str, int], ...] = (
    ("fp8", 0),
    ("kivi-4", 0),
    ("kivi-2", 0),
    ("kivi-2", 128),
    ("e8-2", 0),
    ("e8-2w", 128),
)
"""The codecs issue 14 quotes figures for in its setup: without a window, and ``kivi-2`` and
``e8-2w`` with KIVI's 128-token one."""
ISSUE_TOKENS = 1500
ISSUE_UNSCORED = 128
"""Positions before the first scored one in the issue's setup (rule 9)."""


@dataclass(frozen=True, slots=True)
class QualitySetup:
    """What a measurement reads and scores (rule 9): ``prompts`` each cut to ``tokens``, the
    last ``queries`` positions of each scored under ``semantics``, the ``configs`` measured."""

    name: str
    prompts: tuple[str, ...]
    tokens: int
    queries: int
    semantics: Semantics
    configs: tuple[tuple[str, int], ...]


ISSUE_SETUP = QualitySetup(
    name="issue",
    prompts=LONG_PROMPTS,
    tokens=ISSUE_TOKENS,
    queries=ISSUE_TOKENS - ISSUE_UNSCORED,
    semantics="step",
    configs=ISSUE_CONFIGS,
)
"""Issue 14's setup: 3 texts x 1,500 tokens, no window (but the windowed pair), every position
from 128 on scored, step semantics (rule 9)."""
SINK_BITS = 32
WINDOW_BITS = 16
FP16_BITS = 16


@dataclass(frozen=True, slots=True)
class CodecQuality:
    """One codec at one window, measured over the prompts (see the module comment)."""

    codec: str
    window_tokens: int
    bits_per_element: float
    """Measured from the encoded arrays, scales included (rule 7)."""
    elements_per_token: int
    """K and V elements one token holds in the cache: layers x 2 x kv_heads x head_dim."""
    attention_error_per_layer: tuple[float, ...]
    kl_nats: float
    top1: float
    positions: int
    """Positions the KL and top-1 are averaged over (all prompts)."""

    @property
    def attention_error(self) -> float:
        """The attention-output relative error, mean over layers."""
        return float(np.mean(self.attention_error_per_layer))

    def effective_bits(self, context_tokens: int) -> float:
        """Bits per element of a whole context: sink, window and the rest (rule 7)."""
        if context_tokens < 1:
            raise ValueError("a context holds at least one token")
        window = min(self.window_tokens, context_tokens - 1)
        coded = context_tokens - 1 - window
        total = SINK_BITS + window * WINDOW_BITS + coded * self.bits_per_element
        return total / context_tokens

    def kv_bytes(self, context_tokens: int) -> float:
        return self.effective_bits(context_tokens) * self.elements_per_token * context_tokens / 8

    def longest_context(self, budget_bytes: int) -> int:
        """The most tokens whose K/V fit ``budget_bytes`` (0 if not even the sink fits)."""
        budget_bits = 8 * budget_bytes / self.elements_per_token
        fixed = SINK_BITS + self.window_tokens * WINDOW_BITS
        if budget_bits < SINK_BITS:
            return 0
        if budget_bits <= fixed:
            return 1 + int((budget_bits - SINK_BITS) // WINDOW_BITS)
        return 1 + self.window_tokens + int((budget_bits - fixed) // self.bits_per_element)

    def compression_vs_fp16(self, context_tokens: int) -> float:
        return FP16_BITS / self.effective_bits(context_tokens)


@dataclass(frozen=True, slots=True)
class QualityReport:
    """What ``measure_quality`` measured, codec by codec."""

    prompt_tokens: tuple[int, ...]
    queries: int
    encode_tokens: int
    semantics: Semantics
    reference_logit_gap: float
    """Largest |logit| difference of this module's fp32 forward from ``LlamaModel.forward``."""
    results: tuple[CodecQuality, ...]
    seconds: float
    key_mean_norms: tuple[float, ...] = field(default=())
    """Norm of each layer's calibrated key mean, averaged over heads (what centring removes)."""


def round_trip(
    codec: KVCodec, x: Float32Array, role: Role, encode_tokens: int = DEFAULT_ENCODE_TOKENS
) -> Float32Array:
    """``x`` [tokens, kv_heads, head_dim] encoded and decoded block by block (rule 2)."""
    out = np.empty_like(x)
    for start in range(0, x.shape[0], encode_tokens):
        part = np.ascontiguousarray(x[start : start + encode_tokens])
        out[start : start + encode_tokens] = codec.decode(codec.encode(part, role))
    return out


def _attention(
    q: Float32Array,
    first: int,
    k: Float32Array,
    v: Float32Array,
    far: tuple[Float32Array, Float32Array] | None,
    window: int,
    exact_before: int = 0,
) -> Float32Array:
    """Causal attention of queries ``q`` [n, heads, d] at positions ``first ..`` (rule 3).

    ``k``, ``v``: [first + n, kv_heads, d] at full precision; ``far``: their round trips, read
    outside the sink and the window (None: all full precision); queries at positions before
    ``exact_before`` read everything at full precision (rule 5's prefill semantics).
    Returns [n, heads * d].
    """
    n, heads, dim = q.shape
    tokens, kv_heads, _ = k.shape
    group = heads // kv_heads
    rows = q.reshape(n, kv_heads, group, dim).transpose(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    pos_q = np.repeat(np.arange(first, first + n), group)[:, None]
    pos_k = np.arange(tokens)[None, :]
    if far is None:
        scores = rows @ k.transpose(1, 2, 0)
    else:
        near_k, near_v = k, v
        if window:
            near_k = k.astype(np.float16).astype(np.float32)
            near_v = v.astype(np.float16).astype(np.float32)
            near_k[0], near_v[0] = k[0], v[0]
        near = (pos_q - pos_k < window) | (pos_k == 0) | (pos_q < exact_before)
        scores = np.where(near, rows @ near_k.transpose(1, 2, 0), rows @ far[0].transpose(1, 2, 0))
    scores = np.where(pos_k <= pos_q, scores, -np.inf).astype(np.float32)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    if far is None:
        out = scores @ v.transpose(1, 0, 2)
    else:
        out = (scores * near) @ near_v.transpose(1, 0, 2)
        out += (scores * ~near) @ far[1].transpose(1, 0, 2)
    result = out.reshape(kv_heads, n, group, dim).transpose(1, 0, 2, 3).reshape(n, heads * dim)
    return np.asarray(result, dtype=np.float32)


ReadKV = Callable[
    [int, Float32Array, Float32Array, Float32Array], tuple[Float32Array, Float32Array] | None
]
"""What attention reads at a layer besides the exact K/V: their round trips (None: exact),
given the layer, every position's queries [tokens, heads, head_dim], keys and values."""


@dataclass(slots=True)
class _Pass:
    """One forward: logits of the last rows, and per layer K, V, the last queries and outputs."""

    logits: Float32Array
    keys: list[Float32Array]
    values: list[Float32Array]
    queries: list[Float32Array]
    outputs: list[Float32Array]
    hidden: list[Float32Array] = field(default_factory=list)
    all_queries: list[Float32Array] = field(default_factory=list)
    """Each layer's queries at every position, when captured (they choose heavy hitters)."""
    """Each layer's input (the residual stream entering it), when captured."""


def _forward(
    model: LlamaModel,
    ids: Sequence[int],
    *,
    read: ReadKV | None = None,
    window: int = 0,
    exact_before: int = 0,
    last: int = 1,
    capture: bool = False,
    start: int = 0,
    hidden: Float32Array | None = None,
    exact: _Pass | None = None,
) -> _Pass:
    """The model over ``ids`` (rule 1); attention reads ``read(layer, k, v)`` (rules 2-3).

    ``start``/``hidden``: begin at layer ``start`` from its captured input (the layers below
    are those of a pass already run); ``exact``: a captured pass whose K/V attention reads in
    place of this pass's own (rule 5's step semantics)."""
    cfg = model.config
    tokens = len(ids)
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_end = heads * dim
    k_end = q_end + kv_heads * dim
    inter = cfg.intermediate_size
    if hidden is None:
        x = np.array(model.embed[np.asarray(ids, dtype=np.intp)], dtype=np.float32)
    else:
        x = np.array(hidden, dtype=np.float32)
    cos = model.rope_cos[:tokens][:, None, :]
    sin = model.rope_sin[:tokens][:, None, :]
    run = _Pass(np.zeros(0, dtype=np.float32), [], [], [], [])
    for layer in range(start, cfg.num_layers):
        if capture:
            run.hidden.append(x.copy())
        h = _rms_norm(x, model.attn_norm[layer], cfg.rms_norm_eps)
        qkv = h @ model.w_qkv[layer]
        q = _rope(qkv[:, :q_end].reshape(tokens, heads, dim), cos, sin)
        k = _rope(qkv[:, q_end:k_end].reshape(tokens, kv_heads, dim), cos, sin)
        v = np.ascontiguousarray(qkv[:, k_end:].reshape(tokens, kv_heads, dim))
        if exact is not None:
            k, v = exact.keys[layer], exact.values[layer]
        far = None if read is None else read(layer, q, k, v)
        attn = _attention(q, 0, k, v, far, window, exact_before)
        if capture:
            run.keys.append(k)
            run.values.append(v)
            run.queries.append(q[tokens - last :].copy())
            run.all_queries.append(q)
            run.outputs.append(attn[tokens - last :].copy())
        x += attn @ model.w_o[layer]
        h = _rms_norm(x, model.ffn_norm[layer], cfg.rms_norm_eps)
        gate_up = h @ model.w_gate_up[layer]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        x += (gate / (1.0 + np.exp(-gate)) * up) @ model.w_down[layer]
    final = _rms_norm(x[tokens - last :], model.final_norm, cfg.rms_norm_eps)
    run.logits = final @ model.lm_head
    return run


def _engine_logits(model: LlamaModel, ids: Sequence[int], last: int) -> Float32Array:
    """The engine's own logits of the last ``last`` positions (for rule 1's check)."""
    layout = KVLayout.for_model(model.config)
    blocks = -(-len(ids) // layout.block_size)
    storage = KVStorage(layout, blocks + 1)
    table = tuple(range(1, blocks + 1))
    head, tail = list(ids[: len(ids) - last]), list(ids[len(ids) - last :])
    if head:
        model.forward([ForwardChunk(tuple(head), 0, table, logits="none")], storage)
    (logits,) = model.forward([ForwardChunk(tuple(tail), len(head), table, logits="all")], storage)
    return logits


def capture_kv(
    model: LlamaModel, ids: Sequence[int]
) -> tuple[list[Float32Array], list[Float32Array]]:
    """Each layer's fp32 keys and values ([tokens, kv_heads, head_dim]) over ``ids``."""
    run = _forward(model, ids, capture=True)
    return run.keys, run.values


def calibrate(
    model: LlamaModel,
    texts: Sequence[str] = CALIBRATION_TEXTS,
    *,
    value_power: float | None = None,
    key_power: float = KEY_TRANSFORM_POWER,
    shrink: float = KEY_TRANSFORM_SHRINK,
) -> tuple[list[Float32Array], list[Float32Array]]:
    """Per layer, the E8 codec's constants (``_e8_codec`` rules 1-2) over the calibration
    ``texts`` (rule 6), each run on its own, their sinks excluded: the key and value means
    stacked [2, kv_heads, head_dim] and the key and value transforms stacked [2, kv_heads,
    head_dim, head_dim].  The keys' transform weighs by the queries' second moment, the values'
    by the output projection each KV head's values go through (``w_o``'s rows of its query
    heads, from the weights); ``value_power`` None: keys only, the values' transform the
    identity."""
    cfg = model.config
    heads, dim = cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // heads
    count = 0
    shape = (heads, dim, dim)
    sums = [[np.zeros((heads, dim)) for _ in range(cfg.num_layers)] for _ in ROLES]
    products = [[np.zeros(shape) for _ in range(cfg.num_layers)] for _ in ROLES]
    query_moments = [np.zeros(shape) for _ in range(cfg.num_layers)]
    for text in texts:
        ids = model.tokenizer.encode(text)
        run = _forward(model, ids, last=len(ids), capture=True)
        count += len(ids) - 1
        for layer in range(cfg.num_layers):
            queries = run.queries[layer][1:].reshape(-1, heads, group, dim)
            query_moments[layer] += np.einsum("nhgi,nhgj->hij", queries, queries)
            for role, x in enumerate((run.keys[layer], run.values[layer])):
                rows = x[1:].astype(np.float64)
                sums[role][layer] += rows.sum(axis=0)
                products[role][layer] += np.einsum("nhi,nhj->hij", rows, rows)
    means, transforms = [], []
    for layer in range(cfg.num_layers):
        mean = [sums[role][layer] / count for role in range(2)]
        moment = [
            products[role][layer] / count - np.einsum("hi,hj->hij", mean[role], mean[role])
            for role in range(2)
        ]
        key = key_transform_from(query_moments[layer] / count, moment[0], key_power, shrink)
        if value_power is None:
            means.append(np.ascontiguousarray(mean[0], dtype=np.float32))
            transforms.append(key)
            continue
        w_o = np.asarray(model.w_o[layer], dtype=np.float64).reshape(heads, group, dim, -1)
        output_metric = np.einsum("hgio,hgjo->hij", w_o, w_o)
        value = key_transform_from(output_metric, moment[1], value_power, shrink)
        means.append(np.ascontiguousarray(np.stack(mean), dtype=np.float32))
        transforms.append(np.ascontiguousarray(np.stack([key, value]), dtype=np.float32))
    return means, transforms


def key_means(keys: Sequence[Float32Array]) -> list[Float32Array]:
    """Each layer's key mean per head, the sink excluded (it is kept raw, rule 3)."""
    return [np.ascontiguousarray(k[1:].mean(axis=0), dtype=np.float32) for k in keys]


def tune_tau(
    keys: Sequence[Float32Array],
    values: Sequence[Float32Array],
    taus: Sequence[float],
    *,
    seed: int = DEFAULT_SEED,
) -> dict[float, float]:
    """Relative RMS round-trip error of E8 over these K/V (centred keys) for each ``tau``."""
    means = key_means(keys)
    errors: dict[float, float] = {}
    for tau in taus:
        err = total = 0.0
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            codec = E8Codec(layer=layer, seed=seed, key_mean=means[layer], tau=tau)
            for x, role, offset in ((k, "key", means[layer]), (v, "value", 0.0)):
                body = x[1:]
                back = round_trip(codec, body, role)  # type: ignore[arg-type]
                err += float(np.square(back - body).sum())
                total += float(np.square(body - offset).sum())
        errors[tau] = float(np.sqrt(err / total))
    return errors


def _log_softmax(logits: Float32Array) -> npt.NDArray[np.float64]:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out


@dataclass(slots=True)
class _Tally:
    layer_errors: list[list[float]] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)


CodecChoice = str | KVPlan
"""A codec by name (every layer and role) or a plan (a codec per layer for K and for V)."""
LayerCodecPairs = list[tuple[KVCodec, KVCodec]]


def layer_codecs(
    choice: CodecChoice,
    num_layers: int,
    means: Sequence[Float32Array],
    key_scales: Sequence[Float32Array],
    seed: int = DEFAULT_SEED,
    window: int = 0,
) -> LayerCodecPairs:
    """Per layer, the codec of its keys and the codec of its values, built as the engine builds
    them for a cache with a ``window`` (``codec_by_name``'s ``windowed``)."""
    # A name may be any registry codec (e8-2w too); a plan names served codecs only.
    if isinstance(choice, str):
        names = [(choice, choice)] * num_layers
    else:
        names = [(layer.key, layer.value) for layer in choice.layers]
    if len(names) != num_layers:
        raise ValueError(f"a KV plan of {len(names)} layers for a {num_layers}-layer model")
    built: dict[tuple[int, str], KVCodec] = {}
    for layer, pair in enumerate(names):
        for name in pair:
            if (layer, name) not in built:
                built[layer, name] = codec_by_name(
                    name,
                    layer=layer,
                    seed=seed,
                    key_mean=means[layer],
                    key_scale=key_scales[layer],
                    windowed=window > 0,
                )
    return [(built[i, k], built[i, v]) for i, (k, v) in enumerate(names)]


def role_bits(codec: KVCodec, role: Role, kv_heads: int, head_dim: int, tokens: int) -> float:
    """Bits per element of one role's block of ``tokens`` tokens, measured (``_codec`` rule 3)."""
    block = np.random.default_rng(0).standard_normal((tokens, kv_heads, head_dim), np.float32)
    return 8.0 * codec.nbytes(codec.encode(block, role)) / block.size


def plan_bits(pairs: LayerCodecPairs, kv_heads: int, head_dim: int, tokens: int) -> float:
    """Mean bits per element over layers and roles."""
    bits = [
        role_bits(codec, role, kv_heads, head_dim, tokens)
        for pair in pairs
        for codec, role in zip(pair, ROLES, strict=True)
    ]
    return float(np.mean(bits))


def keep_heavy_hitters(
    q: Float32Array,
    k: Float32Array,
    v: Float32Array,
    far: tuple[Float32Array, Float32Array],
    heavy_tokens: int,
    encode_tokens: int,
) -> None:
    """Write each complete block's heavy hitters over ``far``'s round trips, at float16 (rule 8)."""
    far_k, far_v = far
    heads = np.arange(k.shape[1])[:, None]
    for start in range(0, k.shape[0] - encode_tokens + 1, encode_tokens):
        last = q[start + encode_tokens - 1]
        block = slice(start, start + encode_tokens)
        chosen = heavy_hitters(last, k[block], heavy_tokens, skip_sink=start == 0)
        rows = start + chosen.astype(np.intp)  # positions past 255 too
        far_k[rows, heads] = k[rows, heads].astype(np.float16)
        far_v[rows, heads] = v[rows, heads].astype(np.float16)


def heavy_bits_per_element(heavy_tokens: int, head_dim: int, encode_tokens: int) -> float:
    """The bits per element heavy hitters add to a codec's (rule 8)."""
    return heavy_tokens / encode_tokens * (16 + 4 / head_dim)


def _reader(pairs: LayerCodecPairs, encode_tokens: int, heavy_tokens: int = 0) -> ReadKV:
    def read(
        layer: int, q: Float32Array, k: Float32Array, v: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        key_codec, value_codec = pairs[layer]
        far = (
            round_trip(key_codec, k, "key", encode_tokens),
            round_trip(value_codec, v, "value", encode_tokens),
        )
        if heavy_tokens:
            keep_heavy_hitters(q, k, v, far, heavy_tokens, encode_tokens)
        return far

    return read


def _made(fars: Sequence[tuple[Float32Array, Float32Array] | None]) -> ReadKV:
    """Round trips already made, per layer, read as they are (rule 5's step semantics)."""

    def read(
        layer: int, q: Float32Array, k: Float32Array, v: Float32Array
    ) -> tuple[Float32Array, Float32Array] | None:
        return fars[layer]

    return read


def _heavy_tokens(choice: CodecChoice) -> int:
    return choice.heavy_tokens if isinstance(choice, KVPlan) else 0


def choice_label(choice: CodecChoice) -> str:
    return choice if isinstance(choice, str) else choice.name


def measure_quality(
    model: LlamaModel,
    *,
    configs: Sequence[tuple[CodecChoice, int]] = DEFAULT_CONFIGS,
    prompts: Sequence[str] = PROMPTS,
    max_prompts: int | None = None,
    max_tokens: int | None = None,
    queries: int = DEFAULT_QUERIES,
    encode_tokens: int = DEFAULT_ENCODE_TOKENS,
    seed: int = DEFAULT_SEED,
    semantics: Semantics = "write",
    progress: Callable[[str], None] | None = None,
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]] | None = None,
) -> QualityReport:
    """Measure every ``(codec or plan, window)`` of ``configs`` on ``prompts`` (see the module
    comment).

    ``max_prompts`` takes the first prompts only, ``max_tokens`` cuts each; ``queries``: the
    last positions scored per prompt; ``calibration``: ``calibrate(model)`` if already run.
    """
    started = time.perf_counter()
    say = progress or (lambda _: None)
    cfg = model.config
    layers = cfg.num_layers
    means, key_scales = calibration if calibration is not None else calibrate(model)
    keyed = [(choice_label(choice), window, choice) for choice, window in configs]
    pairs = {
        (label, window): layer_codecs(choice, layers, means, key_scales, seed, window)
        for label, window, choice in keyed
    }
    tallies = {(label, window): _Tally() for label, window, _ in keyed}
    heavy = {label: _heavy_tokens(choice) for label, _, choice in keyed}
    prompt_tokens: list[int] = []
    gap = 0.0
    for number, text in enumerate(prompts[:max_prompts]):
        ids = model.tokenizer.encode(text)[:max_tokens]
        if len(ids) <= queries:
            raise ValueError(f"prompt {number} has {len(ids)} tokens, not more than {queries}")
        prompt_tokens.append(len(ids))
        first = len(ids) - queries
        reference = _forward(model, ids, last=queries, capture=True)
        if number == 0:
            engine = _engine_logits(model, ids, queries)
            gap = float(np.abs(engine - reference.logits).max())
        ref_logp = _log_softmax(reference.logits)
        for label, window, _ in keyed:
            tally = tallies[label, window]
            read = _reader(pairs[label, window], encode_tokens, heavy[label])
            errors, fars = [], []
            for layer in range(layers):
                k, v = reference.keys[layer], reference.values[layer]
                far = read(layer, reference.all_queries[layer], k, v)
                out = _attention(reference.queries[layer], first, k, v, far, window)
                exact = reference.outputs[layer]
                errors.append(float(np.linalg.norm(out - exact) / np.linalg.norm(exact)))
                fars.append(far)
            tally.layer_errors.append(errors)
            exact_before = first if semantics == "decode" else 0
            step = semantics == "step"
            run = _forward(
                model,
                ids,
                read=_made(fars) if step else read,
                window=window,
                exact_before=exact_before,
                last=queries,
                exact=reference if step else None,
            )
            logp = _log_softmax(run.logits)
            kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)
            tally.kl.extend(float(value) for value in kl)
            tally.agree.extend(
                bool(a == b) for a, b in zip(ref_logp.argmax(-1), logp.argmax(-1), strict=True)
            )
            say(
                f"prompt {number} ({len(ids)} tokens) {label} w{window}: attention error "
                f"{np.mean(errors):.4f}, KL {kl.mean():.5f}"
            )
    elements = layers * 2 * cfg.num_kv_heads * cfg.head_dim
    results = tuple(
        CodecQuality(
            codec=label,
            window_tokens=window,
            bits_per_element=plan_bits(
                pairs[label, window], cfg.num_kv_heads, cfg.head_dim, encode_tokens
            )
            + heavy_bits_per_element(heavy[label], cfg.head_dim, encode_tokens),
            elements_per_token=elements,
            attention_error_per_layer=tuple(
                float(e) for e in np.mean(tallies[label, window].layer_errors, axis=0)
            ),
            kl_nats=float(np.mean(tallies[label, window].kl)),
            top1=float(np.mean(tallies[label, window].agree)),
            positions=len(tallies[label, window].kl),
        )
        for label, window, _ in keyed
    )
    return QualityReport(
        prompt_tokens=tuple(prompt_tokens),
        queries=queries,
        encode_tokens=encode_tokens,
        semantics=semantics,
        reference_logit_gap=gap,
        results=results,
        seconds=time.perf_counter() - started,
        key_mean_norms=tuple(
            float(np.linalg.norm(m[0] if m.ndim == 3 else m, axis=-1).mean()) for m in means
        ),
    )


def measure_setup(
    model: LlamaModel,
    setup: QualitySetup = ISSUE_SETUP,
    *,
    configs: Sequence[tuple[CodecChoice, int]] | None = None,
    max_prompts: int | None = None,
    max_tokens: int | None = None,
    queries: int | None = None,
    encode_tokens: int = DEFAULT_ENCODE_TOKENS,
    progress: Callable[[str], None] | None = None,
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]] | None = None,
) -> QualityReport:
    """``measure_quality`` in ``setup`` (rule 9); ``configs``, ``max_prompts``, ``max_tokens``
    and ``queries`` override the setup's (a cut-down run), and a cut without ``queries`` keeps
    the setup's unscored head: ``max_tokens - (setup.tokens - setup.queries)`` scored."""
    tokens = setup.tokens if max_tokens is None else max_tokens
    if queries is None:
        queries = tokens - (setup.tokens - setup.queries)
    return measure_quality(
        model,
        configs=setup.configs if configs is None else configs,
        prompts=setup.prompts,
        max_prompts=max_prompts,
        max_tokens=tokens,
        queries=queries,
        encode_tokens=encode_tokens,
        semantics=setup.semantics,
        progress=progress,
        calibration=calibration,
    )
