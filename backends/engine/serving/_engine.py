"""A synchronous inference engine: requests, a vLLM-style scheduler, batched steps.

Rules
-----
1. ``step()`` runs one scheduler iteration and one forward pass: every running request gets its
   next tokens (one for a decode, a chunk of its prompt for a prefill), then waiting requests are
   admitted first come first served while the token budget (``max_num_batched_tokens``), the
   sequence limit (``max_num_seqs``) and free KV blocks allow.  All rows go through the linear
   layers together, so decodes of many sequences cost one product per layer.
2. A request admitted from the queue reuses the longest cached prefix of FULL blocks of its
   tokens (at most ``len - 1`` tokens, so the last prompt token is always computed and gives the
   logits); ``cached_tokens`` reports that length.
3. Blocks fill as tokens are computed; a full computed block is registered under its chained
   hash at once, so a later request -- or the same conversation's next turn, which includes the
   answer -- reuses it.
4. When a running request needs a block and none is free, the most recently admitted running
   request is preempted: its blocks are released (its cached blocks stay reusable) and it goes
   back to the front of the queue with the tokens it has, to be recomputed mostly from the cache.
5. Greedy decodes may carry prompt-lookup drafts in the rows a small batch pads anyway
   (``_speculation``); a draft counts as computed only once the model produced it, so the
   tokens are exactly those of plain decoding, sometimes several per step.
6. A request finishes on a stop token (the model's eos / ``<|im_end|>`` unless ``ignore_eos``,
   or ``stop_token_ids``), at ``max_tokens``, or at ``max_model_len``; its blocks are released.
7. A request added with ``retain_kv_s`` keeps its full blocks (prompt + answer) for that long
   after it finishes, under a ticket on its last event (``_retention``), for another node to
   pull with ``export_retained``.  When blocks run short, retained sets are reclaimed, oldest
   first, before any running request is preempted.
8. With a KV codec other than fp32 (``kv_codec``: a codec's name, or a ``KVPlan`` naming one
   per layer for keys and one for values), complete blocks are stored encoded and read
   back decoded, a query's own block raw (``kv._paged_codec``, ``_attention`` rule 5) -- and,
   under a codec with a recent window, the blocks of its window, whose raw rows the pool keeps
   while a running request's window or a released conversation's tail holds them (settled
   after every step, ``BlockPool`` rule 8); the pool is sized by the codec's true bytes per
   block.  Drafts (rule 5) stop short of a block's last position: a rejected draft that
   completed a block would have sealed it with tokens that are not the sequence's.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..kv._blockpool import BlockHash, BlockPool, ExtraKey, KVBlock, NoFreeBlocksError, hash_blocks
from ..kv._coded_store import DEFAULT_DECODED_CACHE_BYTES
from ..kv._paged_codec import PagedCodec
from ..kv._plan import KVPlan
from ..kv._retention import KVRetention, RetainedKV
from ..kv._store import DEFAULT_BLOCK_SIZE, KVLayout
from ..kv.codecs._calibration_cache import cached_calibration
from ..model._attention import MIN_GEMM_ROWS
from ..model._model import ForwardChunk, LlamaModel
from ..model._sampling import SamplingParams, sample_token
from ._request import EngineStats, FinishReason, Request, TokenEvent
from ._speculation import propose_drafts

__all__ = [
    "DEFAULT_KV_CODEC",
    "DEFAULT_KV_LIMIT_BYTES",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_RETAINED_KV_SHARE",
    "Engine",
]

DEFAULT_KV_LIMIT_BYTES = 1 << 30
DEFAULT_KV_CODEC = "fp32"
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# At most this share of the KV pool is held for other nodes to pull (a set must fit in it
# whole; under pressure retained sets are reclaimed before any request is preempted).
DEFAULT_RETAINED_KV_SHARE = 0.75

Float32Array = npt.NDArray[np.float32]


class Engine:
    """Continuous-batching engine over one ``LlamaModel`` and one ``BlockPool``."""

    __slots__ = (
        "_ids",
        "_requests",
        "_running",
        "_stop_ids",
        "_waiting",
        "max_num_batched_tokens",
        "max_num_seqs",
        "model",
        "pool",
        "retention",
        "speculative_tokens",
    )

    def __init__(
        self,
        model: LlamaModel,
        kv_limit_bytes: int = DEFAULT_KV_LIMIT_BYTES,
        *,
        enable_prefix_caching: bool = True,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        speculative_tokens: int = MIN_GEMM_ROWS - 1,
        retained_kv_share: float = DEFAULT_RETAINED_KV_SHARE,
        kv_codec: str | KVPlan = DEFAULT_KV_CODEC,
        kv_calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]] | None = None,
        kv_decoded_cache_bytes: int = DEFAULT_DECODED_CACHE_BYTES,
    ) -> None:
        """``kv_codec``: how complete KV blocks are stored (rule 8); ``kv_calibration``: E8's
        per-layer key means and scales (``calibrate(model)``, when None read from or kept in the
        calibration cache, ``kv/codecs/_calibration_cache``);
        ``kv_decoded_cache_bytes``: the bound of the decoded blocks attention reads through
        under a codec (paid out of ``kv_limit_bytes``, see ``BlockPool.for_memory``)."""
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError("need max_num_batched_tokens >= max_num_seqs >= 1")
        self.model = model
        layout = KVLayout.for_model(model.config, block_size)
        codec = _paged_codec(kv_codec, model, layout, kv_calibration)
        self.pool = BlockPool.for_memory(
            layout,
            kv_limit_bytes,
            seed=model.fingerprint,
            enable_prefix_caching=enable_prefix_caching,
            codec=codec,
            raw_blocks=max_num_seqs,
            decoded_cache_bytes=kv_decoded_cache_bytes,
        )
        self.retention = KVRetention(self.pool, int(self.pool.num_blocks * retained_kv_share))
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculative_tokens = max(0, speculative_tokens)
        self._stop_ids = model.tokenizer.stop_token_ids
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._ids = itertools.count()

    @property
    def kv_codec(self) -> str:
        codec = self.pool.codec
        return "fp32" if codec is None else codec.name

    @property
    def kv_codec_fingerprint(self) -> bytes:
        """What a node pulling this engine's blocks must match (zeros for fp32)."""
        codec = self.pool.codec
        return bytes(32) if codec is None else codec.fingerprint

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        retain_kv_s: float | None = None,
    ) -> None:
        """Queue a request; ``cache_salt`` isolates its prefix-cache entries from others';
        ``retain_kv_s`` keeps its full blocks that long after it finishes (rule 7)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= self.model.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens >= max_model_len")
        needed = -(
            -min(len(prompt) + params.max_tokens, self.model.max_model_len) // self.block_size
        )
        if needed > self.pool.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks, the pool has {self.pool.num_blocks}"
            )
        extra: tuple[ExtraKey, ...] = (cache_salt,) if cache_salt is not None else ()
        request = Request(
            request_id=request_id,
            prompt_len=len(prompt),
            params=params,
            rng=np.random.default_rng(params.seed),
            extra_keys=extra,
            tokens=prompt,
            retain_kv_s=retain_kv_s,
        )
        self._rehash(request)
        self._requests[request_id] = request
        self._waiting.append(request)

    def longest_admitted_prompt(self, max_tokens: int = 1) -> int:
        """The longest prompt ``add_request`` accepts with ``max_tokens`` to generate, found by
        asking it (bisection; every probe is withdrawn at once)."""
        params = SamplingParams(max_tokens=max_tokens)
        lo, hi = 0, self.model.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            probe = f"probe-{next(self._ids)}"
            try:
                self.add_request(probe, [0] * mid, params)
            except ValueError:
                hi = mid - 1
            else:
                self.abort(probe)
                lo = mid
        return lo

    def abort(self, request_id: str) -> bool:
        """Drop a request, queued or running; False if unknown (or already finished)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request in self._running:
            self._running.remove(request)
            self.pool.release(request.block_table)
        else:
            self._waiting.remove(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def stats(self) -> EngineStats:
        return EngineStats(
            len(self._running),
            len(self._waiting),
            self.pool.stats(),
            self.retention.num_blocks,
            self.pool.bytes_per_token,
            self.pool.decoded_cache_stats(),
        )

    # -- KV exchange (disaggregation) --------------------------------------------------------

    def cached_prefix_blocks(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> list[int]:
        """Ids of the cached blocks covering the longest cached prefix of ``token_ids``."""
        extra: tuple[ExtraKey, ...] = (cache_salt,) if cache_salt is not None else ()
        hashes = hash_blocks(self.pool.seed, token_ids, self.block_size, extra)
        return self.pool.lookup(hashes)

    def export_kv(
        self, token_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> list[KVBlock]:
        """The cached KV blocks of the longest cached prefix of ``token_ids``."""
        return self.pool.export_blocks(self.cached_prefix_blocks(token_ids, cache_salt=cache_salt))

    def import_kv(
        self, blocks: Sequence[KVBlock], *, prefix: Sequence[BlockHash] = ()
    ) -> list[int]:
        """Register blocks exported by another node (same model) in the prefix cache,
        reclaiming retained sets if the pool has no room (``NoFreeBlocksError`` if still none).
        The cached blocks of ``prefix`` (what the imported blocks extend) are not evicted for
        them."""
        while True:
            try:
                return self.pool.import_blocks(blocks, keep=self.pool.lookup(prefix))
            except NoFreeBlocksError:
                if not self.retention.reclaim_oldest():
                    raise

    def export_retained(self, ticket: bytes, start: int, count: int) -> list[KVBlock]:
        """Blocks ``[start, start + count)`` of a retained set (``UnknownTicketError`` if it
        expired or never existed)."""
        return self.retention.export(ticket, start, count)

    def release_retained(self, ticket: bytes) -> bool:
        return self.retention.release(ticket)

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One scheduler iteration and one batched forward pass."""
        self.retention.expire()
        scheduled = self._schedule()
        if not scheduled:
            return []
        self._add_drafts(scheduled)
        chunks = []
        for request, count in scheduled:
            start = request.num_computed
            known = request.tokens[start : start + count]
            if request.drafts:
                logits: Literal["none", "last", "all"] = "all"
            else:
                logits = "last" if start + count == len(request.tokens) else "none"
            chunks.append(
                ForwardChunk(
                    token_ids=(*known, *request.drafts),
                    start=start,
                    block_table=tuple(request.block_table),
                    logits=logits,
                )
            )
        outputs = self.model.forward(chunks, self.pool.storage)
        events: list[TokenEvent] = []
        for (request, count), rows in zip(scheduled, outputs, strict=True):
            request.num_computed += count
            if rows.shape[0]:
                events.extend(self._emit(request, rows))
            else:
                self._register_full_blocks(request)
        self._settle_window()
        return events

    def _settle_window(self) -> None:
        """Under a codec with a recent window, keep raw rows only where a window reads them
        (``BlockPool`` rule 8): the complete blocks of each running request's window."""
        codec = self.pool.codec
        if codec is None or codec.window_blocks == 1:
            return
        live: list[int] = []
        for request in self._running:
            end = request.num_computed // self.block_size
            live += request.block_table[max(0, end - codec.window_blocks + 1) : end]
        self.pool.settle_window(live)

    def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> list[int]:
        """Run one request to completion on an otherwise idle engine; its output token ids."""
        if self._requests:
            raise RuntimeError("generate() needs an idle engine; use add_request() and step()")
        request_id = f"generate-{next(self._ids)}"
        self.add_request(request_id, prompt_token_ids, params)
        output: list[int] = []
        while self._requests:
            output.extend(e.token_id for e in self.step() if e.request_id == request_id)
        return output

    # -- internals --------------------------------------------------------------------------

    def _rehash(self, request: Request) -> None:
        request.block_hashes = hash_blocks(
            self.pool.seed,
            request.tokens,
            self.block_size,
            request.extra_keys,
            parents=request.block_hashes,
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            count = min(len(request.tokens) - request.num_computed, budget)
            need = self._blocks_for(request.num_computed + count) - len(request.block_table)
            self._reclaim_retained(need)
            while need > self.pool.num_free_blocks and self._running[-1] is not request:
                self._preempt(self._running[-1])
                preempted = True
            if need > self.pool.num_free_blocks:
                self._preempt(request)
                preempted = True
                break
            request.block_table.extend(self.pool.allocate(need))
            scheduled.append((request, count))
            budget -= count
            index += 1
        while self._waiting and budget > 0 and not preempted:
            if len(self._running) >= self.max_num_seqs:
                break
            request = self._waiting[0]
            limit = (len(request.tokens) - 1) // self.block_size
            hits = self.pool.lookup(request.block_hashes[:limit])
            computed = len(hits) * self.block_size
            count = min(len(request.tokens) - computed, budget)
            need = self._blocks_for(computed + count) - len(hits)
            revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
            # Reclaiming retained sets evicts nothing: the hits stay valid (some revived).
            while need > self.pool.num_free_blocks - revived and self.retention.reclaim_oldest():
                revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
            if need > self.pool.num_free_blocks - revived:
                break
            self._waiting.popleft()
            self.pool.acquire(hits)
            request.block_table = hits + self.pool.allocate(need)
            request.num_computed = computed
            request.num_registered = len(hits)
            self.pool.record_query(len(request.tokens), computed)
            if request.cached_tokens is None:
                request.cached_tokens = computed
            self._running.append(request)
            scheduled.append((request, count))
            budget -= count
        return scheduled

    def _reclaim_retained(self, need: int) -> None:
        while need > self.pool.num_free_blocks and self.retention.reclaim_oldest():
            pass

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.pool.release(request.block_table)
        request.block_table = []
        request.num_computed = 0
        request.num_registered = 0
        self._waiting.appendleft(request)

    def _register_full_blocks(self, request: Request) -> None:
        full = min(request.num_computed // self.block_size, len(request.block_hashes))
        bs = self.block_size
        for index in range(request.num_registered, full):
            parent = request.block_hashes[index - 1] if index else self.pool.seed
            self.pool.register(
                request.block_table[index],
                request.block_hashes[index],
                parent,
                request.tokens[index * bs : (index + 1) * bs],
                request.extra_keys if index == 0 else (),
            )
        request.num_registered = max(request.num_registered, full)

    def _retain(self, request: Request) -> RetainedKV | None:
        """Hold the cached blocks of the request's computed full blocks (rule 7)."""
        assert request.retain_kv_s is not None
        hashes = request.block_hashes[: request.num_computed // self.block_size]
        ids = self.pool.lookup(hashes)  # the cached copy of each, wherever it was computed
        return self.retention.retain(ids, hashes[: len(ids)], request.retain_kv_s)

    def _add_drafts(self, scheduled: list[tuple[Request, int]]) -> None:
        """Fill the padding rows of a small decode batch with prompt-lookup drafts."""
        spare = MIN_GEMM_ROWS - sum(count for _, count in scheduled)
        if spare <= 0 or not self.speculative_tokens:
            return
        for request, count in scheduled:
            if spare <= 0:
                break
            remaining = len(request.tokens) - request.num_computed
            if count != remaining or count != 1 or not request.params.greedy:
                continue
            room = min(
                spare,
                self.speculative_tokens,
                request.params.max_tokens - request.num_output - 1,
                self.model.max_model_len - len(request.tokens) - 1,
            )
            if self.pool.codec is not None:  # rule 8: no draft completes a block
                room = min(room, self.block_size - 1 - len(request.tokens) % self.block_size)
            drafts = propose_drafts(request.tokens, room)
            need = self._blocks_for(len(request.tokens) + len(drafts)) - len(request.block_table)
            if not drafts or need > self.pool.num_free_blocks:
                continue
            request.block_table.extend(self.pool.allocate(need))
            request.drafts = drafts
            spare -= len(drafts)

    def _emit(self, request: Request, rows: Float32Array) -> list[TokenEvent]:
        """Sample from the logits rows, verify drafts, append tokens, finish if done."""
        drafts, request.drafts = request.drafts, []
        params = request.params
        events = []
        finish: FinishReason | None = None
        for index, row in enumerate(rows if drafts else rows[-1:]):
            token, logprob = sample_token(row, params, request.rng)
            request.tokens.append(token)
            if token in params.stop_token_ids or (
                not params.ignore_eos and token in self._stop_ids
            ):
                finish = "stop"
            elif (
                request.num_output >= params.max_tokens
                or len(request.tokens) >= self.model.max_model_len
            ):
                finish = "length"
            events.append(
                TokenEvent(
                    request_id=request.request_id,
                    token_id=token,
                    logprob=logprob,
                    index=request.num_output - 1,
                    num_prompt_tokens=request.prompt_len,
                    cached_tokens=request.cached_tokens or 0,
                    finish_reason=finish,
                )
            )
            if finish is not None or index >= len(drafts) or token != drafts[index]:
                break
            request.num_computed += 1  # the draft at the next position was the real token
        self._rehash(request)
        self._register_full_blocks(request)
        if finish is not None:
            if request.retain_kv_s is not None:
                events[-1] = dataclasses.replace(events[-1], retained=self._retain(request))
            self._running.remove(request)
            self.pool.release(request.block_table)
            del self._requests[request.request_id]
        return events


def _paged_codec(
    name: str | KVPlan,
    model: LlamaModel,
    layout: KVLayout,
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]] | None,
) -> PagedCodec | None:
    names = {name} if isinstance(name, str) else {*name.keys, *name.values}
    if names == {"fp32"}:
        return None
    if calibration is None and any(n.startswith("e8") for n in names):
        calibration = cached_calibration(model)
    means, scales = calibration if calibration is not None else (None, None)
    return PagedCodec(
        name,
        num_layers=layout.num_layers,
        kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        key_means=means,
        key_scales=scales,
    )
