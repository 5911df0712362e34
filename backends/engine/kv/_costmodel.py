"""What bounds a decode step: compute, weight reads or KV reads, from this machine's timings.

Theory of operation ("The Price of Precision": a smaller KV is worth what it saves of the
step's binding cost, and dequantizing it costs compute)
-----------------------------------------------------------------------------------------
1. A decode step of ``batch`` sequences at ``context`` tokens does three things whose times
   are estimated apart, each from a micro-benchmark run here (``calibrate_costs``):
   - weight reads: every linear layer's weights stream once per step whatever the batch;
     timed as one batch-1 pass through the model's own weight matrices (all layers and the
     LM head): ``weight_bytes / weight_bytes_per_s``;
   - compute: ``2 x batch x parameters`` flops of those products (plus attention's
     ``4 x batch x context x heads x head_dim`` per layer), at the flop rate of the same
     products timed at a batch large enough to be compute-bound, plus dequantizing the KV:
     ``batch x context x layers x`` the codec's decode time per token and layer, timed on
     encoded blocks (zero for fp32);
   - KV reads: ``batch x context x kv_bytes_per_token`` (the codec's or plan's true bytes) at
     the rate attention reads float32 K/V at decode, timed over a context too large for the
     caches.
2. The step is bound by the largest of the three (``StepEstimate.bound``); the estimate of the
   step's time is that largest term (the others overlap with it at best), a lower bound.
3. The estimate prices a kernel that reads K/V in its encoded form and dequantizes as it
   reads; the reference engine instead keeps a decoded float32 copy of every block
   (``_paged_codec`` rule 4), so for it a codec saves memory, not KV read time.
4. Micro-benchmarks are bounded: a fixed number of repetitions, the median taken, a few
   seconds in all on two cores.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .._arrays import Float32Array
from ..model._model import LlamaModel
from ._plan import KVPlan
from ._store import DEFAULT_BLOCK_SIZE
from .codecs._codec import EncodedBlock, KVCodec
from .codecs._registry import codec_by_name

__all__ = ["Bound", "CostCalibration", "StepEstimate", "calibrate_costs", "estimate_step"]

Bound = Literal["compute", "weights", "kv"]

_REPEATS = 5
_COMPUTE_ROWS = 256
_COMPUTE_LAYERS = 4
_KV_PROBE_TOKENS = 32768
_DECODE_PROBE_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class CostCalibration:
    """This machine's rates, measured (rule 1)."""

    weight_bytes: int
    parameters: int
    weight_bytes_per_s: float
    flops_per_s: float
    kv_bytes_per_s: float
    dequant_s_per_token_layer: Mapping[str, float]
    """Per codec: decoding one token's K and V of one layer."""
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """One decode step's terms, seconds (rule 1), and what binds it (rule 2)."""

    codec: str
    batch: int
    context: int
    kv_bytes_per_token: float
    compute_s: float
    dequant_s: float
    weights_s: float
    kv_s: float

    @property
    def bound(self) -> Bound:
        terms: dict[Bound, float] = {
            "compute": self.compute_s + self.dequant_s,
            "weights": self.weights_s,
            "kv": self.kv_s,
        }
        return max(terms, key=lambda name: terms[name])

    @property
    def step_s(self) -> float:
        return max(self.compute_s + self.dequant_s, self.weights_s, self.kv_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


def _median_time(run: Callable[[], object], repeats: int = _REPEATS) -> float:
    run()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _weights(model: LlamaModel) -> list[Float32Array]:
    mats: list[Float32Array] = []
    for layer in range(model.config.num_layers):
        mats += [
            model.w_qkv[layer],
            model.w_o[layer],
            model.w_gate_up[layer],
            model.w_down[layer],
        ]
    return mats


def calibrate_costs(
    model: LlamaModel, codecs: Sequence[str], block_size: int = DEFAULT_BLOCK_SIZE
) -> CostCalibration:
    """Time the parts of a decode step on this machine (rules 1, 4)."""
    cfg = model.config
    mats = _weights(model)
    head = model.lm_head
    weight_bytes = sum(int(m.nbytes) for m in mats) + int(head.nbytes)
    parameters = weight_bytes // 4
    rng = np.random.default_rng(0)

    def one_row() -> None:
        for m in mats:
            np.ones((1, m.shape[0]), np.float32) @ m
        np.ones((1, head.shape[0]), np.float32) @ head

    weight_s = _median_time(one_row)
    some = mats[: 4 * _COMPUTE_LAYERS]
    inputs = [rng.standard_normal((_COMPUTE_ROWS, m.shape[0]), np.float32) for m in some]

    def many_rows() -> None:
        for x, m in zip(inputs, some, strict=True):
            x @ m

    compute_s = _median_time(many_rows)
    flops = 2.0 * _COMPUTE_ROWS * sum(int(m.size) for m in some)
    kv_heads, dim = cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // kv_heads
    keys_t = rng.standard_normal((kv_heads, dim, _KV_PROBE_TOKENS), np.float32)
    values = rng.standard_normal((kv_heads, _KV_PROBE_TOKENS, dim), np.float32)
    q = rng.standard_normal((kv_heads, group, dim), np.float32)

    def attend() -> None:
        scores = q @ keys_t
        scores @ values

    kv_s = _median_time(attend)
    kv_bytes = keys_t.nbytes + values.nbytes
    dequant: dict[str, float] = {"fp32": 0.0}
    tokens = block_size
    for name in codecs:
        if name == "fp32":
            dequant[name] = 0.0
            continue
        codec = codec_by_name(name)
        blocks = [
            (
                codec.encode(rng.standard_normal((tokens, kv_heads, dim), np.float32), "key"),
                codec.encode(rng.standard_normal((tokens, kv_heads, dim), np.float32), "value"),
            )
            for _ in range(_DECODE_PROBE_BLOCKS)
        ]

        def decode_all(
            blocks: list[tuple[EncodedBlock, EncodedBlock]] = blocks, codec: KVCodec = codec
        ) -> None:
            for k, v in blocks:
                codec.decode(k)
                codec.decode(v)

        dequant[name] = _median_time(decode_all) / (_DECODE_PROBE_BLOCKS * tokens)
    return CostCalibration(
        weight_bytes=weight_bytes,
        parameters=parameters,
        weight_bytes_per_s=weight_bytes / weight_s,
        flops_per_s=flops / compute_s,
        kv_bytes_per_s=kv_bytes / kv_s,
        dequant_s_per_token_layer=dequant,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


def estimate_step(
    costs: CostCalibration,
    codec: str | KVPlan,
    kv_bytes_per_token: float,
    batch: int,
    context: int,
) -> StepEstimate:
    """One decode step of ``batch`` sequences at ``context`` tokens with this KV (rule 1)."""
    if isinstance(codec, str):
        dequant_layers = costs.num_layers * costs.dequant_s_per_token_layer[codec]
        label = codec
    else:
        dequant_layers = sum(
            (costs.dequant_s_per_token_layer[c.key] + costs.dequant_s_per_token_layer[c.value]) / 2
            for c in codec.layers
        )
        label = codec.name
    attention_flops = 4.0 * batch * context * costs.num_heads * costs.head_dim * costs.num_layers
    return StepEstimate(
        codec=label,
        batch=batch,
        context=context,
        kv_bytes_per_token=kv_bytes_per_token,
        compute_s=(2.0 * batch * costs.parameters + attention_flops) / costs.flops_per_s,
        dequant_s=batch * context * dequant_layers,
        weights_s=costs.weight_bytes / costs.weight_bytes_per_s,
        kv_s=batch * context * kv_bytes_per_token / costs.kv_bytes_per_s,
    )
