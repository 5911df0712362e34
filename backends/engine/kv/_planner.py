"""The mixed-precision planner: a codec per layer for K and for V, least loss under a KV budget.

Theory of operation
-------------------
1. Loss is measured, never guessed from bits: ``measure_sensitivity`` runs the real model over
   the prompts once at fp32 and then, for every layer, role (K or V) and candidate codec, again
   with only that layer's keys or values round-tripped through the codec (blocks of the
   engine's ``block_size``, the write-time semantics of ``_quality`` rule 2), starting at that
   layer from its captured fp32 input (the layers below are unchanged).  The loss of the cell
   is the next-token KL(p_fp32 || p) in nats, mean over the scored positions.  fp32 costs no
   loss and is not run.
2. Cost is measured too: each cell's bytes are those of an encoded block of the engine's
   ``block_size`` tokens (``_codec`` rule 3), the bytes ``PagedCodec`` pays.  A plan's bytes
   per token are the sum over layers and roles divided by ``block_size``: exactly the engine's
   ``understudy_kv_bytes_per_token`` for that plan.
3. The loss of a plan is taken as the sum of its cells' losses (separable, first order: small
   errors in different layers add), and ``choose`` minimises that sum subject to the budget by
   a dynamic program over items (layer, role) and exact integer bytes (divided by their common
   divisor): ``best[w]`` the least loss of the items so far in ``w`` units.  It is exact for
   the separable objective; a test holds it to brute force.
4. Additivity is an assumption, so the planner checks its result: ``plan-kv`` measures the
   plan's whole-model KL beside every uniform codec that fits the same budget and keeps the
   best measured (``PlanCheck``).
5. The sensitivity table is cached in a file keyed by the model's fingerprint, E8's calibration
   constants (``calibration_digest``) and the measurement's settings; another budget re-plans
   from it in milliseconds.
6. Per-token retention shares the budget (MultiAlloc's idea): a recent window of ``W`` tokens
   kept raw holds, at a context of ``L`` tokens, ``n = min(L, W - block_size) / block_size``
   complete blocks as float16 rows in place of their codes (``_paged_codec`` rule 9; with
   heavy hitters each keeps its choice, ``choice_bytes``), and its block being filled at
   float16 saves half the float32 one of a plain codec: ``((n - 1) * raw_block_bytes - n *
   (code_block_bytes - choice_bytes)) / L`` bytes per token against the plain codec (what
   ``PagedCodec.context_bits_per_element`` counts; the sink row is paid alike).  So the plan's
   codes (and heavy rows) are held for ``L - n * block_size`` of the ``L`` tokens, and
   ``split_budget`` plans the layers with what each window leaves of the budget over that
   share;
   the split is chosen by measurement, not by the table: ``check_retention`` measures every
   (plan, window) whole-model at that context and the least KL wins (the table's losses were
   measured without a window, so they cannot price one).
7. Heavy hitters share it too (``kv._heavy``): ``h`` rows per complete block, layer and KV head
   at float16 with a one-byte position, ``h * heavy_row_bytes / block_size`` bytes per token
   (``heavy_row_bytes``: one such row over all layers and KV heads, K and V; what
   ``PagedCodec.block_bytes`` adds).  ``split_budget`` tries every (heavy count, window) pair
   and ``check_retention`` measures each whole-model with the heavy hitters in place
   (``_quality`` rule 8); the least KL wins, as for windows.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import Float32Array, Float64Array
from ..model._model import LlamaModel
from ._plan import ENGINE_CODECS, KVPlan, write_whole
from .codecs._calibration_cache import cached_calibration
from .codecs._codec import ROLES, Role
from .codecs._quality import (
    DEFAULT_QUERIES,
    CodecChoice,
    CodecQuality,
    _forward,
    _log_softmax,
    layer_codecs,
    measure_quality,
    round_trip,
)
from .codecs._registry import codec_by_name
from .codecs._texts import PROMPTS

__all__ = [
    "DEFAULT_PLAN_CODECS",
    "DEFAULT_RETENTION_HEAVY",
    "DEFAULT_RETENTION_WINDOWS",
    "PlanCheck",
    "RetentionCheck",
    "SensitivityTable",
    "block_bytes",
    "calibration_digest",
    "check_plan",
    "check_retention",
    "choose",
    "heavy_bytes_per_token",
    "heavy_row_bytes",
    "measure_sensitivity",
    "plan_bytes_per_token",
    "plan_for_budget",
    "split_budget",
    "window_bytes_per_token",
    "window_held_blocks",
]

DEFAULT_PLAN_CODECS: tuple[str, ...] = ENGINE_CODECS
"""Codecs a plan may use, per layer and role (fp32 among them: no loss, the most bytes)."""
DEFAULT_RETENTION_WINDOWS: tuple[int, ...] = (0, 32, 64, 128)
"""Recent windows the budget split tries (rule 6): none, 2, 4 and 8 blocks (KIVI's 128)."""
DEFAULT_RETENTION_HEAVY: tuple[int, ...] = (0, 1, 2)
"""Heavy hitters per block and KV head the budget split tries (rule 7): each costs about one bit
per element at 16-token blocks."""


def block_bytes(name: str, role: Role, kv_heads: int, head_dim: int, block_size: int) -> int:
    """Bytes of one encoded block of one layer's K or V (rule 2)."""
    codec = codec_by_name(name)
    block = np.random.default_rng(0).standard_normal((block_size, kv_heads, head_dim), np.float32)
    return codec.nbytes(codec.encode(block, role))


@dataclass(frozen=True, slots=True)
class SensitivityTable:
    """Per layer, role and codec: the measured loss (KL nats) and the bytes of a block."""

    codecs: tuple[str, ...]
    loss: Float64Array
    """[layers, 2 (key, value), codecs] KL nats with only that cell quantized."""
    block_bytes: npt.NDArray[np.int64]
    """[2, codecs] bytes of one layer's encoded block of ``block_size`` tokens."""
    block_size: int
    settings: dict[str, Any] = field(default_factory=dict)
    """What was measured: model fingerprint, prompts, tokens, queries (the cache key)."""
    seconds: float = 0.0

    @property
    def num_layers(self) -> int:
        return int(self.loss.shape[0])

    def bytes_per_token(self, plan: KVPlan) -> float:
        """The plan's KV bytes per token, all layers, K and V (rule 2)."""
        index = {name: i for i, name in enumerate(self.codecs)}
        total = sum(
            int(self.block_bytes[0, index[c.key]] + self.block_bytes[1, index[c.value]])
            for c in plan.layers
        )
        return total / self.block_size

    def predicted_loss(self, plan: KVPlan) -> float:
        """The sum of the plan's cells' losses (rule 3)."""
        index = {name: i for i, name in enumerate(self.codecs)}
        return float(
            sum(
                self.loss[layer, 0, index[c.key]] + self.loss[layer, 1, index[c.value]]
                for layer, c in enumerate(plan.layers)
            )
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "codecs": list(self.codecs),
            "loss": self.loss.tolist(),
            "block_bytes": self.block_bytes.tolist(),
            "block_size": self.block_size,
            "settings": self.settings,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SensitivityTable:
        return cls(
            codecs=tuple(data["codecs"]),
            loss=np.asarray(data["loss"], dtype=np.float64),
            block_bytes=np.asarray(data["block_bytes"], dtype=np.int64),
            block_size=int(data["block_size"]),
            settings=dict(data["settings"]),
            seconds=float(data.get("seconds", 0.0)),
        )

    def save(self, path: Path) -> None:
        """Whole or not at all, as a plan (``_plan`` rule 7): two ``plan-kv`` runs sharing a
        cache never read half of one."""
        write_whole(path, json.dumps(self.to_dict()) + "\n")

    @classmethod
    def cached(cls, path: Path, settings: dict[str, Any]) -> SensitivityTable | None:
        """The table in ``path`` if it was measured with these ``settings`` (rule 5)."""
        try:
            table = cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return table if table.settings == settings else None


def calibration_digest(calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]]) -> str:
    """A short hash of E8's calibration constants, which a sensitivity table is measured
    under (rule 5): a table measured under other constants is measured again."""
    digest = hashlib.sha256()
    for arrays in calibration:
        for array in arrays:
            digest.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return digest.hexdigest()[:16]


def measure_sensitivity(
    model: LlamaModel,
    *,
    codecs: Sequence[str] = DEFAULT_PLAN_CODECS,
    block_size: int,
    prompts: Sequence[str] = PROMPTS,
    max_prompts: int | None = None,
    max_tokens: int | None = None,
    queries: int = DEFAULT_QUERIES,
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> SensitivityTable:
    """Each (layer, role, codec) cell's KL with only that cell quantized (rule 1)."""
    started = time.perf_counter()
    say = progress or (lambda _: None)
    cfg = model.config
    layers = cfg.num_layers
    means, scales = calibration if calibration is not None else cached_calibration(model)
    pairs = {name: layer_codecs(name, layers, means, scales) for name in codecs}
    loss = np.zeros((layers, 2, len(codecs)), dtype=np.float64)
    texts = list(prompts[:max_prompts])
    used: list[int] = []
    for number, text in enumerate(texts):
        ids = model.tokenizer.encode(text)[:max_tokens]
        if len(ids) <= queries:
            raise ValueError(f"prompt {number} has {len(ids)} tokens, not more than {queries}")
        used.append(len(ids))
        reference = _forward(model, ids, last=queries, capture=True)
        ref_logp = _log_softmax(reference.logits)
        ref_p = np.exp(ref_logp)
        for layer in range(layers):
            for r, role in enumerate(ROLES):
                for c, name in enumerate(codecs):
                    if name == "fp32":
                        continue
                    codec = pairs[name][layer][r]

                    def read(
                        at: int,
                        _q: Float32Array,
                        k: Float32Array,
                        v: Float32Array,
                        layer: int = layer,
                        role: Role = role,
                        codec: Any = codec,
                    ) -> tuple[Float32Array, Float32Array] | None:
                        if at != layer:
                            return None
                        if role == "key":
                            return round_trip(codec, k, "key", block_size), v
                        return k, round_trip(codec, v, "value", block_size)

                    run = _forward(
                        model,
                        ids,
                        read=read,
                        last=queries,
                        start=layer,
                        hidden=reference.hidden[layer],
                    )
                    kl = (ref_p * (ref_logp - _log_softmax(run.logits))).sum(axis=-1)
                    loss[layer, r, c] += float(kl.mean()) / len(texts)
            say(f"prompt {number} layer {layer}: KL K {loss[layer, 0].round(5).tolist()}")
    sizes = np.array(
        [
            [block_bytes(name, role, cfg.num_kv_heads, cfg.head_dim, block_size) for name in codecs]
            for role in ROLES
        ],
        dtype=np.int64,
    )
    return SensitivityTable(
        codecs=tuple(codecs),
        loss=loss,
        block_bytes=sizes,
        block_size=block_size,
        settings={
            "model": model.fingerprint.hex(),
            "calibration": calibration_digest((means, scales)),
            "codecs": list(codecs),
            "prompt_tokens": used,
            "queries": queries,
            "block_size": block_size,
        },
        seconds=time.perf_counter() - started,
    )


def choose(
    weights: Sequence[Sequence[int]], losses: Sequence[Sequence[float]], budget: int
) -> list[int] | None:
    """For each item the option minimising the total loss with total weight <= ``budget``
    (rule 3); None if not even the lightest options fit.  ``weights``/``losses``: [items][
    options], weights non-negative integers."""
    items = len(weights)
    if items == 0:
        return []
    unit = 0
    for row in weights:
        for w in row:
            unit = math.gcd(unit, int(w))
    unit = unit or 1
    cap = budget // unit
    if cap < 0:
        return None
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks = np.zeros((items, cap + 1), dtype=np.int16)
    for item in range(items):
        new = np.full(cap + 1, np.inf)
        for option, (w, cost) in enumerate(zip(weights[item], losses[item], strict=True)):
            step = int(w) // unit
            if step > cap:
                continue
            moved = np.full(cap + 1, np.inf)
            moved[step:] = best[: cap + 1 - step] + cost
            better = moved < new
            new[better] = moved[better]
            picks[item, better] = option
        best = new
    end = int(np.argmin(best))
    if not np.isfinite(best[end]):
        return None
    chosen = [0] * items
    for item in range(items - 1, -1, -1):
        option = int(picks[item, end])
        chosen[item] = option
        end -= int(weights[item][option]) // unit
    return chosen


def plan_for_budget(table: SensitivityTable, budget_bytes_per_token: float) -> KVPlan | None:
    """The plan of least predicted loss whose bytes per token fit the budget (None: none fits)."""
    weights, losses = [], []
    for layer in range(table.num_layers):
        for r in range(2):
            weights.append([int(b) for b in table.block_bytes[r]])
            losses.append([float(x) for x in table.loss[layer, r]])
    budget = math.floor(budget_bytes_per_token * table.block_size + 1e-9)
    chosen = choose(weights, losses, budget)
    if chosen is None:
        return None
    names = [table.codecs[option] for option in chosen]
    return KVPlan.of(names[0::2], names[1::2])


@dataclass(frozen=True, slots=True)
class PlanCheck:
    """The plan against every uniform codec that fits the same budget, measured (rule 4)."""

    budget_bytes_per_token: float
    plan: KVPlan
    plan_bytes_per_token: float
    predicted_kl: float
    """The sum of the plan's cells' losses (rule 3)."""
    measured: tuple[CodecQuality, ...]
    """The plan first, then each uniform codec that fits, whole-model KL and top-1."""
    uniform_bytes_per_token: dict[str, float]
    prompt_tokens: tuple[int, ...]

    @property
    def plan_quality(self) -> CodecQuality:
        return self.measured[0]

    @property
    def best_uniform(self) -> CodecQuality | None:
        uniform = self.measured[1:]
        return min(uniform, key=lambda q: q.kl_nats) if uniform else None

    @property
    def chosen(self) -> KVPlan:
        """The plan, or the best uniform codec where it measured a lower KL."""
        best = self.best_uniform
        if best is not None and best.kl_nats < self.plan_quality.kl_nats:
            return KVPlan.uniform(best.codec, self.plan.num_layers)
        return self.plan

    def against_best_uniform(self) -> dict[str, Any]:
        """The plan's size and measured quality beside the best uniform codec's (what
        ``plan-kv`` and ``bench/kvquant.py`` report)."""
        best = self.best_uniform
        return {
            "plan_bytes_per_token": self.plan_bytes_per_token,
            "plan_kl": self.plan_quality.kl_nats,
            "plan_top1": self.plan_quality.top1,
            "best_uniform": None if best is None else best.codec,
            "best_uniform_bytes_per_token": None
            if best is None
            else self.uniform_bytes_per_token[best.codec],
            "best_uniform_kl": None if best is None else best.kl_nats,
            "best_uniform_top1": None if best is None else best.top1,
        }


def check_plan(
    model: LlamaModel,
    table: SensitivityTable,
    plan: KVPlan,
    budget_bytes_per_token: float,
    *,
    prompts: Sequence[str],
    max_tokens: int | None,
    queries: int,
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlanCheck:
    """Measure the plan and the uniform codecs that fit its budget on ``prompts`` (rule 4)."""
    uniform = {
        name: table.bytes_per_token(KVPlan.uniform(name, table.num_layers)) for name in table.codecs
    }
    fitting = [name for name, size in uniform.items() if size <= budget_bytes_per_token]
    configs: list[tuple[CodecChoice, int]] = [(plan, 0)]
    configs += [(name, 0) for name in fitting if KVPlan.uniform(name, table.num_layers) != plan]
    report = measure_quality(
        model,
        configs=configs,
        prompts=prompts,
        max_tokens=max_tokens,
        queries=queries,
        encode_tokens=table.block_size,
        calibration=calibration,
        progress=progress,
    )
    return PlanCheck(
        budget_bytes_per_token=budget_bytes_per_token,
        plan=plan,
        plan_bytes_per_token=table.bytes_per_token(plan),
        predicted_kl=table.predicted_loss(plan),
        measured=report.results,
        uniform_bytes_per_token=uniform,
        prompt_tokens=report.prompt_tokens,
    )


def window_held_blocks(window_tokens: int, context_tokens: int, block_size: int) -> int:
    """Complete blocks a recent window holds as float16 rows, not codes, at ``context_tokens``
    (rule 6)."""
    if window_tokens == 0:
        return 0
    return min(context_tokens // block_size, max(1, window_tokens // block_size) - 1)


def window_bytes_per_token(
    window_tokens: int,
    context_tokens: int,
    block_size: int,
    raw_block_bytes: int,
    *,
    code_block_bytes: float,
    choice_bytes: int = 0,
) -> float:
    """Bytes per token a recent window adds at ``context_tokens`` against the plain plan (rule
    6): its raw rows, less the codes its complete blocks do not hold.  ``raw_block_bytes``: one
    block's float16 K and V rows (as a window holds them), all layers; ``code_block_bytes``: one
    block's codes and heavy rows under the plan; ``choice_bytes``: one block's heavy-hitter
    positions, all layers (``PagedCodec.choice_bytes``)."""
    if window_tokens == 0:
        return 0.0
    held = window_held_blocks(window_tokens, context_tokens, block_size)
    # Under a window the block being filled is float16 too: half the float32 one of a plain codec.
    rows = (held - 1) * raw_block_bytes
    return (rows - held * (code_block_bytes - choice_bytes)) / context_tokens


def heavy_row_bytes(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one heavy-hitter row per block over every layer and KV head: float16 K and V and
    a one-byte position (rule 7, ``_paged_codec`` rule 10)."""
    return num_layers * kv_heads * (2 * head_dim * 2 + 1)


def heavy_bytes_per_token(heavy_tokens: int, block_size: int, row_bytes: int) -> float:
    """Bytes per token ``heavy_tokens`` heavy hitters per block add (rule 7)."""
    return heavy_tokens * row_bytes / block_size


def split_budget(
    table: SensitivityTable,
    budget_bytes_per_token: float,
    *,
    context_tokens: int,
    raw_block_bytes: int,
    windows: Sequence[int] = DEFAULT_RETENTION_WINDOWS,
    heavies: Sequence[int] = (0,),
    row_bytes: int = 0,
    choice_bytes: int = 0,
) -> list[KVPlan]:
    """For each heavy-hitter count and window that leave room for a plan, the layers' plan of
    least predicted loss in what they leave, carrying both (rules 6 and 7; ``row_bytes``:
    ``heavy_row_bytes``, needed when a count is not 0; ``choice_bytes``: one heavy hitter's
    positions in a block, all layers, what a window's block keeps of each)."""
    if any(heavies) and row_bytes <= 0:
        raise ValueError("pricing heavy hitters needs the bytes of one heavy row")
    bs = table.block_size
    largest = table.num_layers * int(table.block_bytes.max(axis=1).sum()) / bs
    plans = []
    for heavy in heavies:
        for window in windows:
            held = window_held_blocks(window, context_tokens, bs)
            share = 1.0 - held * bs / context_tokens  # of the tokens whose codes are held
            rows = window_bytes_per_token(
                window,
                context_tokens,
                bs,
                raw_block_bytes,
                code_block_bytes=0.0,
                choice_bytes=heavy * choice_bytes,
            )
            left = budget_bytes_per_token - rows
            if left < 0:
                continue
            heavy_cost = heavy_bytes_per_token(heavy, bs, row_bytes)
            # Every complete block in the window: no codes held, any plan fits.
            room = largest if share <= 0 else min(largest, left / share - heavy_cost)
            plan = plan_for_budget(table, room)
            if plan is not None:
                plans.append(KVPlan(plan.layers, window_tokens=window, heavy_tokens=heavy))
    return plans


def plan_bytes_per_token(
    table: SensitivityTable,
    plan: KVPlan,
    context_tokens: int,
    raw_block_bytes: int,
    row_bytes: int,
    choice_bytes: int,
) -> float:
    """A plan's codes, heavy hitters and window at ``context_tokens``, per token (rules 6, 7)."""
    codes = table.bytes_per_token(plan) + heavy_bytes_per_token(
        plan.heavy_tokens, table.block_size, row_bytes
    )
    return codes + window_bytes_per_token(
        plan.window_tokens,
        context_tokens,
        table.block_size,
        raw_block_bytes,
        code_block_bytes=codes * table.block_size,
        choice_bytes=plan.heavy_tokens * choice_bytes,
    )


@dataclass(frozen=True, slots=True)
class RetentionCheck:
    """Each split of one budget between heavy hitters, a window and the layers' codecs,
    measured (rules 6 and 7)."""

    budget_bytes_per_token: float
    context_tokens: int
    plans: tuple[KVPlan, ...]
    bytes_per_token: tuple[float, ...]
    """Each plan's codes, heavy hitters and window's raw rows, per token at ``context_tokens``."""
    measured: tuple[CodecQuality, ...]

    @property
    def chosen(self) -> KVPlan:
        """The split of least measured KL."""
        best = min(range(len(self.plans)), key=lambda i: self.measured[i].kl_nats)
        return self.plans[best]


def check_retention(
    model: LlamaModel,
    table: SensitivityTable,
    budget_bytes_per_token: float,
    *,
    prompt: str,
    max_tokens: int | None,
    queries: int,
    windows: Sequence[int] = DEFAULT_RETENTION_WINDOWS,
    heavies: Sequence[int] = DEFAULT_RETENTION_HEAVY,
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RetentionCheck:
    """Split the budget at the context of ``prompt`` (cut to ``max_tokens``) and measure every
    split on it (rules 6 and 7)."""
    cfg = model.config
    context = len(model.tokenizer.encode(prompt)[:max_tokens])
    raw_block = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * table.block_size * 2
    row_bytes = heavy_row_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    choice_bytes = cfg.num_layers * cfg.num_kv_heads
    plans = split_budget(
        table,
        budget_bytes_per_token,
        context_tokens=context,
        raw_block_bytes=raw_block,
        windows=windows,
        heavies=heavies,
        row_bytes=row_bytes,
        choice_bytes=choice_bytes,
    )
    if not plans:
        raise ValueError(f"no split of {budget_bytes_per_token:.0f} bytes per token fits a plan")
    report = measure_quality(
        model,
        configs=[(plan, plan.window_tokens) for plan in plans],
        prompts=[prompt],
        max_tokens=max_tokens,
        queries=queries,
        encode_tokens=table.block_size,
        calibration=calibration,
        progress=progress,
    )
    sizes = tuple(
        plan_bytes_per_token(table, plan, context, raw_block, row_bytes, choice_bytes)
        for plan in plans
    )
    return RetentionCheck(budget_bytes_per_token, context, tuple(plans), sizes, report.results)
