"""KV codecs in the engine's paged cache: attention reads decoded blocks and its own block (and
a recent window) raw, and prefix reuse, chunked prefill and the disaggregated transfer keep the
tokens bitwise.

One suite parametrised over the codecs the engine serves, the windowed ones among them, a mixed
plan (a codec per layer for keys and one for values, ``MIXED``) and e8-2 with a 32-token window
(``WINDOW32``: two blocks, so that blocks leave the window within the short prompts here) as
more codecs, and e8-2 keeping two heavy hitters per block and KV head (``HEAVY2``), alone and
with the 32-token window (``WINDOW32_HEAVY2``).  Engine tests are slow here (a step of SmolLM2
in numpy), so prompts are a few dozen tokens and answers a dozen.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from backends.engine import Engine, LlamaModel, SamplingParams
from backends.engine._arrays import Float32Array
from backends.engine.kv._coded_store import (
    DEFAULT_DECODED_CACHE_BYTES,
    SHRINK_MIN_SLOTS,
    CodedKVStorage,
)
from backends.engine.kv._paged_codec import SERVED_CODECS, PagedCodec
from backends.engine.kv._plan import KVPlan
from backends.engine.kv._store import KVLayout
from backends.engine.kv.codecs._quality import calibrate
from backends.engine.model._attention import OwnBlocks, attend, attend_decode, key_span
from backends.engine.model._lanes import RowLanes
from backends.engine.model._linear import TileWorkers
from backends.engine.model._numerics import attention_rows_independent
from backends.engine.serving._engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from backends.engine.serving._server_config import UnifiedServerConfig, engine_server_config

from . import test_transfer
from .test_transfer import KV_LIMIT, Node, _pull, _pull_fails, _retain, serving

# What calibrate() returns: E8's per-layer means and transforms.
Calibration = tuple[list[Float32Array], list[Float32Array]]

start_node = test_transfer.start_node  # the fixture: engines stepped by loops, stopped at teardown

MIXED = "mixed"
WINDOW32 = "e8-2+w32"
HEAVY2 = "e8-2+h2"
WINDOW32_HEAVY2 = "e8-2+w32+h2"
CODED = [*(name for name in SERVED_CODECS if name != "fp32"), MIXED, WINDOW32, HEAVY2]
EXACT_CODECS = ("fp8", "kivi-4", "e8-2", MIXED, "e8-2w", "kivi-2w", WINDOW32, HEAVY2)
WINDOWED = ("e8-2w", WINDOW32, WINDOW32_HEAVY2)
BS = 16
F32 = npt.NDArray[np.float32]
HEADS, GROUP, DIM = 3, 3, 64
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. " * 4 + "What does the fox do?"


# -- attention through the paged cache -------------------------------------------------------


def _qkv(seed: int, tokens: int) -> tuple[F32, F32, F32]:
    """Queries [tokens, HEADS, GROUP, DIM], keys transposed [HEADS, DIM, tokens] and values
    [HEADS, tokens, DIM], float32, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((tokens, HEADS, GROUP, DIM), dtype=np.float32) * np.float32(0.125)
    keys_t = rng.standard_normal((HEADS, DIM, tokens), dtype=np.float32)
    values = rng.standard_normal((HEADS, tokens, DIM), dtype=np.float32)
    return q, keys_t, values


def mixed_plan(num_layers: int) -> KVPlan:
    """Keys and values of each layer by different codecs, layers differing (fp32 among them)."""
    keys = ("kivi-4", "fp8", "e8-2", "fp32")
    values = ("e8-2", "kivi-2", "fp16", "kivi-8")
    return KVPlan.of(
        [keys[i % len(keys)] for i in range(num_layers)],
        [values[i % len(values)] for i in range(num_layers)],
    )


def _plan_or_name(name: str, num_layers: int) -> str | KVPlan:
    if name == MIXED:
        return mixed_plan(num_layers)
    if name == WINDOW32:
        return KVPlan.uniform("e8-2", num_layers, window_tokens=32)
    if name == HEAVY2:
        return KVPlan.uniform("e8-2", num_layers, heavy_tokens=2)
    if name == WINDOW32_HEAVY2:
        return KVPlan.uniform("e8-2", num_layers, window_tokens=32, heavy_tokens=2)
    return name


def _codec(name: str) -> PagedCodec:
    return PagedCodec(
        _plan_or_name(name, 1), num_layers=1, kv_heads=HEADS, head_dim=DIM, block_size=BS
    )


def _sealed(codec: PagedCodec, q: F32, keys_t: F32, values: F32, blocks: int) -> tuple[F32, F32]:
    """Stored K^T/V with every block decoded (sink raw), as the cache holds complete blocks;
    ``q`` [tokens, HEADS, GROUP, DIM] gives each block's last query (heavy hitters)."""
    stored_k, stored_v = keys_t.copy(), values.copy()
    for block in range(blocks):
        cols = slice(block * BS, (block + 1) * BS)
        last = q[(block + 1) * BS - 1].reshape(HEADS * GROUP, DIM)
        k, v = codec.seal(0, block + 1, keys_t[:, :, cols], values[:, cols], block == 0, last)
        stored_k[:, :, cols], stored_v[:, cols] = k, v
    return stored_k, stored_v


def _raw_columns(codec: PagedCodec, position: int) -> slice:
    """The key columns a query at ``position`` reads raw: its block and its window's."""
    block = position // BS
    return slice(max(0, block - codec.window_blocks + 1) * BS, (block + 1) * BS)


@pytest.mark.parametrize("name", CODED)
def test_attention_reads_decoded_blocks_and_its_window_raw(name: str) -> None:
    tokens = 256
    q, keys_t, values = _qkv(3, tokens)
    codec = _codec(name)
    assert codec.window_blocks == {"e8-2w": 8, "kivi-4w": 8, "kivi-2w": 8, WINDOW32: 2}.get(name, 1)
    stored_k, stored_v = _sealed(codec, q, keys_t, values, tokens // BS)
    own = OwnBlocks(keys_t, values, 0, BS, codec.window_blocks)
    out = attend(q, 0, stored_k, stored_v, own=own)
    for position in (0, 5, 16, 47, 100, 127, 200, 255):
        k = stored_k.astype(np.float64)
        v = stored_v.astype(np.float64)
        cols = _raw_columns(codec, position)
        k[:, :, cols], v[:, cols] = keys_t[:, :, cols], values[:, cols]
        assert np.array_equal(stored_k[:, :, 0], keys_t[:, :, 0])  # the sink stays raw
        scores = np.einsum("hgd,hdt->hgt", q[position].astype(np.float64), k[:, :, : position + 1])
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        expected = np.einsum("hgt,htd->hgd", weights, v[:, : position + 1])
        np.testing.assert_allclose(out[position], expected, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["kivi-4", "e8-2", MIXED, "e8-2w", WINDOW32, HEAVY2])
def test_a_prefill_row_has_the_bits_of_a_lone_decode(name: str) -> None:
    """Rows of one prefill tile see different versions of a block, yet each row's output is the
    one decode gives it, where its own block is not sealed yet and its window's blocks are read
    raw (``_attention`` rule 5)."""
    tokens = 256
    q, keys_t, values = _qkv(4, tokens)
    codec = _codec(name)
    sealed_k, sealed_v = _sealed(codec, q, keys_t, values, tokens // BS)
    # Where this kernel's own products break row independence (Haswell), the engine lane-maps
    # them and decodes each query through ``attend``: check that path instead.
    lanes = None if attention_rows_independent(64) else RowLanes()
    window = codec.window_blocks
    prefill = attend(q, 0, sealed_k, sealed_v, lanes, own=OwnBlocks(keys_t, values, 0, BS, window))
    for position in (3, 20, 33, 95, 126, 180, 255):
        block = position // BS
        cols = slice(block * BS, (block + 1) * BS)
        # At decode time the own block is raw in the store and later blocks are not written;
        # the window's blocks are stored decoded and their raw rows read beside them.
        stored_k, stored_v = sealed_k.copy(), sealed_v.copy()
        stored_k[:, :, cols], stored_v[:, cols] = keys_t[:, :, cols], values[:, cols]
        stored_k[:, :, position + 1 :], stored_v[:, position + 1 :] = 0.0, 0.0
        raw_k, raw_v = keys_t.copy(), values.copy()
        raw_k[:, :, position + 1 :], raw_v[:, position + 1 :] = 0.0, 0.0
        raw = _raw_columns(codec, position)
        own = OwnBlocks(
            np.ascontiguousarray(raw_k[:, :, raw]),
            np.ascontiguousarray(raw_v[:, raw]),
            raw.start // BS,
            BS,
            window,
        )
        span = key_span(position + 1)
        key_blocks = stored_k[:, :, :span].reshape(HEADS, DIM, span // BS, BS)
        key_blocks = key_blocks.transpose(0, 2, 1, 3)[None]
        if lanes is None:
            out = attend_decode(
                q[position : position + 1],
                np.array([position]),
                np.ascontiguousarray(key_blocks),
                stored_v[None, :, :span],
                [own],
            )
            assert np.array_equal(out[0], prefill[position])
        lone = attend(q[position : position + 1], position, stored_k, stored_v, lanes, own=own)
        assert np.array_equal(lone[0], prefill[position])


@pytest.mark.parametrize("name", CODED)
def test_a_packed_block_round_trips_and_its_size_is_measured(name: str) -> None:
    rng = np.random.default_rng(5)
    codec = _codec(name)
    keys_t = rng.standard_normal((HEADS, DIM, BS), dtype=np.float32)
    values = rng.standard_normal((HEADS, BS, DIM), dtype=np.float32)
    query = rng.standard_normal((HEADS * GROUP, DIM), dtype=np.float32)
    for first in (False, True):
        k, v = codec.seal(0, 1, keys_t, values, first, query)
        packed = codec.export(1)
        assert packed.size == codec.packed_bytes(first)
        other = _codec(name)
        ((k2, v2),) = other.load(7, packed, first)
        assert np.array_equal(k, k2) and np.array_equal(v, v2)
    assert codec.block_bytes < HEADS * DIM * BS * 2 * 4


def test_fp32_is_no_paged_codec_and_a_window_is_whole_blocks() -> None:
    with pytest.raises(ValueError, match="fp32"):
        _codec("fp32")
    with pytest.raises(ValueError, match="multiple"):
        PagedCodec(
            KVPlan.uniform("e8-2", 1, window_tokens=40),
            num_layers=1,
            kv_heads=HEADS,
            head_dim=DIM,
            block_size=BS,
        )
    with pytest.raises(ValueError, match="e8-3w"):
        engine_server_config(kv_codec="e8-3w")
    windowed = engine_server_config(kv_codec="e8-2w")
    assert isinstance(windowed, UnifiedServerConfig) and windowed.kv_codec == "e8-2w"
    with pytest.raises(ValueError, match="router"):
        engine_server_config(
            role="router", kv_codec="fp8", prefill_urls=("http://a",), decode_urls=("http://b",)
        )
    assert UnifiedServerConfig().kv_codec == "fp32"


# -- the engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kivi-2", "e8-2", MIXED, WINDOW32_HEAVY2])
def test_blocks_sealed_together_on_decode_threads_are_the_bytes_of_blocks_sealed_alone(
    name: str,
) -> None:
    """``_coded_store`` rule 9: one ``seal`` of six blocks shared by two decode threads keeps
    the codes, sink rows and decoded rows that sealing them on the caller's thread keeps."""
    blocks = np.arange(1, 7, dtype=np.intp)
    q, keys_t, values = _qkv(5, blocks.size * BS)
    layout = KVLayout(1, HEADS, DIM, BS)
    stores = [CodedKVStorage(layout, 8, _codec(name)) for _ in range(2)]
    for store in stores:
        for block in blocks.tolist():
            cols = slice((block - 1) * BS, block * BS)
            slots = (np.full(BS, block, dtype=np.intp), np.arange(BS, dtype=np.intp))
            k, v = keys_t[:, :, cols].transpose(2, 0, 1), values[:, cols].transpose(1, 0, 2)
            store.write(0, slots, k, v)
    firsts = blocks == 1
    queries = q[BS - 1 :: BS].reshape(blocks.size, HEADS * GROUP, DIM)
    workers = TileWorkers(2)
    try:
        stores[0].seal(0, blocks, firsts, queries, workers)
    finally:
        workers.close()
    stores[1].seal(0, blocks, firsts, queries)
    shared, alone = stores
    for block in blocks.tolist():
        assert shared.export(block).tobytes() == alone.export(block).tobytes()
    for got, want in zip(shared.gather(0, blocks), alone.gather(0, blocks), strict=True):
        assert got.tobytes() == want.tobytes()
    assert shared.codec.sink_blocks() == alone.codec.sink_blocks() == [1]


@pytest.fixture(scope="module")
def calibration(engine_model: LlamaModel) -> Calibration:
    return calibrate(engine_model)


def _engine(
    model: LlamaModel,
    name: str,
    calibration: Calibration,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    *,
    enable_prefix_caching: bool = True,
    kv_decoded_cache_bytes: int = DEFAULT_DECODED_CACHE_BYTES,
) -> Engine:
    plan = _plan_or_name(name, model.config.num_layers)
    if max_num_seqs is None:  # a windowed sequence's 128-token raw window is paid up front
        max_num_seqs = 4 if name.endswith("w") else DEFAULT_MAX_NUM_SEQS
    return Engine(
        model,
        KV_LIMIT,
        kv_codec=plan,
        kv_calibration=calibration,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        kv_decoded_cache_bytes=kv_decoded_cache_bytes,
    )


def _run(engine: Engine, prompt: list[int], seed: int | None = None) -> list[tuple[int, float]]:
    params = SamplingParams(
        max_tokens=12, temperature=0.0 if seed is None else 0.8, seed=seed, ignore_eos=True
    )
    engine.add_request("r", prompt, params)
    out: list[tuple[int, float]] = []
    while engine.has_unfinished_requests():
        out += [(e.token_id, e.logprob) for e in engine.step() if e.request_id == "r"]
    return out


@pytest.mark.parametrize("name", EXACT_CODECS)
def test_unified_prefix_cached_and_chunked_prefill_are_bitwise_equal(
    engine_model: LlamaModel,
    calibration: Calibration,
    name: str,
) -> None:
    prompt = engine_model.tokenizer.encode(PROMPT_TEXT)
    unified = _engine(engine_model, name, calibration)
    fresh = _run(unified, prompt)
    assert _run(unified, prompt) == fresh  # prefix-cached
    # A 32-token window has moved past the prompt's blocks by the answer's end: cut back to 0.
    assert (unified.pool.stats().hits > 0) == (name != WINDOW32)
    chunked = _engine(engine_model, name, calibration, max_num_batched_tokens=20, max_num_seqs=4)
    assert _run(chunked, prompt) == fresh
    assert _run(unified, prompt, seed=7) == _run(chunked, prompt, seed=7)
    assert unified.pool.bytes_per_token < Engine(engine_model, KV_LIMIT).pool.bytes_per_token


@pytest.mark.parametrize("name", [WINDOW32, WINDOW32_HEAVY2])
def test_a_window_block_holds_its_rows_not_its_codes_and_the_bits_are_counted(
    engine_model: LlamaModel,
    calibration: Calibration,
    name: str,
) -> None:
    """``_paged_codec`` rule 9: after every step, a complete block in the running window holds
    its float16 rows and no codes, an older one its codes and no rows, and what the cache holds
    for the sequence -- codes, heavy-hitter choices, sink, window and filling rows -- is
    ``context_bits_per_element`` of its computed tokens.  The codes a block keeps when it
    leaves the window are those a seal of its window rows makes."""
    prompt = engine_model.tokenizer.encode(PROMPT_TEXT)
    engine = _engine(engine_model, name, calibration)
    # 46 + 40 tokens: blocks leave the window however many tokens the greedy answer's drafts
    # let a step take (at 20, the e8-2 codes of tau 0.85 drafted past block 2's exit).
    engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    storage, codec = engine.pool.storage, engine.pool.codec
    assert isinstance(storage, CodedKVStorage) and codec is not None
    cfg = engine_model.config
    reference = PagedCodec(
        _plan_or_name(name, cfg.num_layers),
        num_layers=cfg.num_layers,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        block_size=BS,
        key_means=calibration[0],
        key_scales=calibration[1],
    )
    query = np.ones((cfg.num_heads, cfg.head_dim), np.float32)  # heavy rows: not compared
    codes_bytes = reference.layer_bytes[0] - reference.choice_bytes // cfg.num_layers * (
        1 + 4 * cfg.head_dim
    )
    elements = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    rows: dict[int, list[tuple[F32, F32]]] = {}
    steps = left = 0
    while engine.has_unfinished_requests():
        engine.step()
        request = engine._requests.get("r")
        if request is None:
            break
        computed = request.num_computed
        complete = request.block_table[: computed // BS]
        window = set(complete[len(complete) - codec.window_blocks + 1 :])
        assert storage.window_blocks() == window
        for index, block in enumerate(complete):
            kept = [codec.has_layer(layer, block) for layer in range(cfg.num_layers)]
            assert kept == [block not in window] * cfg.num_layers
            if block in window:
                rows[block] = [
                    storage.raw_rows(layer, np.array([block])) for layer in range(cfg.num_layers)
                ]
            elif block in rows:  # it left the window in this step
                for layer, (keys_t, values) in enumerate(rows.pop(block)):
                    reference.seal(layer, 1, keys_t, values, index == 0, query)
                    assert (
                        codec.export_layer(layer, block)[:codes_bytes]
                        == reference.export_layer(layer, 1)[:codes_bytes]
                    )
                left += 1
        if computed % BS == 0:  # the next block is not handed out yet; the count holds it
            continue
        raw = len(window) + storage.stats().raw_slots // cfg.num_layers
        held = codec.resident_bytes + raw * codec.window_bytes
        bits = 8.0 * held / (computed * elements)
        assert bits == pytest.approx(codec.context_bits_per_element(computed))
        steps += 1
    assert steps >= 2 and left >= 2  # at least blocks 1 and 2 of 46 + 40 tokens


# -- the disaggregated transfer --------------------------------------------------------------


def test_a_windowed_prefix_hit_reads_its_window_raw_or_is_cut_back(
    engine_model: LlamaModel,
    calibration: Calibration,
) -> None:
    """A conversation's next turn reuses all of its history (the last window's raw rows are kept
    as the released conversation's tail); a prompt that branches off further back than the
    window finds no raw rows there and recomputes, giving a fresh engine's tokens both times."""
    prompt = engine_model.tokenizer.encode(PROMPT_TEXT)
    engine = _engine(engine_model, WINDOW32, calibration)
    answer = [token for token, _ in _run(engine, prompt)]
    turn = [*prompt, *answer, *prompt[:8]]
    branch = [*prompt[:40], *prompt[:20]]
    for tokens, hit in ((turn, (len(prompt) + len(answer) - 1) // BS * BS), (branch, 0)):
        before = engine.pool.stats().hits
        out = _run(engine, tokens)
        assert engine.pool.stats().hits - before == hit
        fresh = _engine(engine_model, WINDOW32, calibration, enable_prefix_caching=False)
        assert out == _run(fresh, tokens)


@pytest.mark.parametrize("name", ["kivi-4", "e8-2", MIXED, "e8-2w", WINDOW32, WINDOW32_HEAVY2])
async def test_a_codec_transfer_moves_fewer_bytes_and_gives_the_unified_tokens(
    engine_model: LlamaModel,
    calibration: Calibration,
    start_node: Callable[[Engine], Node],
    name: str,
) -> None:
    prompt = engine_model.tokenizer.encode(PROMPT_TEXT)[:33]
    sizes = {}
    for codec in ("fp32", name):
        async with serving(start_node(_engine(engine_model, codec, calibration))) as owner:
            retained = await _retain(owner.node, prompt)
            puller = start_node(_engine(engine_model, codec, calibration))
            assert await _pull(puller, owner.source(retained), prompt) == 2
            sizes[codec] = puller.sample("understudy_kv_pulled_bytes_total")
        if codec == name:
            answer = await puller.loop.call(lambda e: _run(e, prompt))
            assert answer == _run(_engine(engine_model, name, calibration), prompt)
            assert puller.engine.pool.stats().hits == 32
    if name in WINDOWED:  # both blocks lie in the window: they travel with their float16 rows
        heavy = 2 * 2 / BS / 4 if name == WINDOW32_HEAVY2 else 0.0  # 2 rows of 16 at half fp32's
        assert sizes["fp32"] / 2 < sizes[name] < sizes["fp32"] * (0.65 + heavy)
    else:
        assert sizes[name] < sizes["fp32"] / (2 if name == MIXED else 4)  # MIXED: fp32 layers
    print(f"{name}: {sizes[name]:.0f} bytes on the wire, fp32 {sizes['fp32']:.0f}")


@pytest.mark.parametrize(
    ("owner_codec", "puller_codec"),
    [
        ("kivi-4", "fp8"),
        (MIXED, "kivi-4"),
        ("kivi-4", MIXED),
        ("e8-2w", "e8-2"),
        ("e8-2", WINDOW32),
    ],
)
async def test_a_node_refuses_blocks_of_another_codec_and_counts_it(
    engine_model: LlamaModel,
    calibration: Calibration,
    start_node: Callable[[Engine], Node],
    owner_codec: str,
    puller_codec: str,
) -> None:
    """A plan is compared whole: a mixed plan's blocks are refused by a node of one of its own
    codecs, and the other way round, counted as a codec mismatch."""
    prompt = engine_model.tokenizer.encode(PROMPT_TEXT)[:33]
    async with serving(start_node(_engine(engine_model, owner_codec, calibration))) as owner:
        retained = await _retain(owner.node, prompt)
        puller = start_node(_engine(engine_model, puller_codec, calibration))
        assert await _pull_fails(puller, owner.source(retained), prompt) == "codec"
    assert puller.pulls() == {"codec": 1}
    answer = await puller.loop.call(lambda e: _run(e, prompt))
    assert answer == _run(_engine(engine_model, puller_codec, calibration), prompt)


# -- the pool holds codes: memory and the decoded-block cache --------------------------------


@pytest.mark.parametrize("name", ["e8-2", WINDOW32_HEAVY2])
@pytest.mark.parametrize("cache_bytes", [0, 3 * 24576])
def test_a_decoded_cache_too_small_to_hold_anything_gives_the_same_tokens(
    engine_model: LlamaModel,
    calibration: Calibration,
    cache_bytes: int,
    name: str,
) -> None:
    """Every read a miss (or nearly): blocks decoded again from their codes give the bits the
    cache gives, through prefill, prefix reuse and decode; under a window, a block held as rows
    is decoded from codes made again from its rows (``_coded_store`` rule 8)."""
    prompt = engine_model.tokenizer.encode(PROMPT_TEXT)
    roomy = _engine(engine_model, name, calibration)
    tight = _engine(
        engine_model, name, calibration, max_num_seqs=4, kv_decoded_cache_bytes=cache_bytes
    )
    fresh = _run(roomy, prompt)
    assert _run(tight, prompt) == fresh
    assert _run(tight, prompt) == fresh  # prefix-cached, decoded again
    stats = tight.stats().decoded_cache
    assert stats is not None and stats.misses > 0
    assert stats.bytes <= cache_bytes
    roomy_stats = roomy.stats().decoded_cache
    assert roomy_stats is not None and roomy_stats.hits > 0


@pytest.mark.parametrize("name", ["kivi-4", "e8-2"])
def test_a_decoded_cache_smaller_than_the_blocks_read_still_hits(
    engine_model: LlamaModel,
    calibration: Calibration,
    name: str,
) -> None:
    """``_coded_store`` rule 3b: every step reads the sequence's blocks, layer by layer, in the
    same order; with room for about half of them, a cache that put each miss on top would evict
    every block just before it is read again (no hits once decoding starts); blocks decoded on a
    miss enter at the bottom, so decoding finds the cache's share of them.  Same tokens."""
    prompt = engine_model.tokenizer.encode(PROMPT_TEXT)
    layers = engine_model.config.num_layers
    read = (len(prompt) // BS) * layers  # complete blocks a decode step reads, all layers
    roomy = _engine(engine_model, name, calibration)
    fresh = _run(roomy, prompt)
    roomy_stats = roomy.stats().decoded_cache
    assert roomy_stats is not None
    half = _engine(engine_model, name, calibration,
                   kv_decoded_cache_bytes=read // 2 * roomy_stats.entry_bytes)
    assert _run(half, prompt) == fresh
    stats = half.stats().decoded_cache
    assert stats is not None and 0 < stats.capacity < read and stats.misses > 0
    assert stats.hits >= 0.3 * (stats.hits + stats.misses), stats


# fp16 holds 8 blocks here after its reserve (one running sequence's raw block and sink row,
# and the decoded cache's quarter of the limit).
FIXED_KV = (8 * 368640 + 737280 + 46080) * 4 // 3 + 4


def test_a_fixed_kv_memory_admits_the_codec_ratio_more_tokens_and_answers_them(
    engine_model: LlamaModel,
    calibration: Calibration,
) -> None:
    """The longest prompt an engine admits at one --kv-gib, asked of the engines: e8-2 holds
    3,240 bytes a token against fp16's 23,040 (7.11x), so it admits >= 7x fp16's prompt, and it
    answers that prompt; the pool's codes and sinks stay within the memory paid for them."""
    longest = {}
    engines = {}
    for name in ("fp32", "fp16", "e8-2"):
        engine = Engine(
            engine_model, FIXED_KV, kv_codec=name, kv_calibration=calibration, max_num_seqs=1
        )
        engines[name] = engine
        longest[name] = engine.longest_admitted_prompt(max_tokens=2)
    ratio = engines["fp16"].pool.bytes_per_token / engines["e8-2"].pool.bytes_per_token
    assert ratio == pytest.approx(23040 / 3240)
    assert longest["fp16"] > longest["fp32"]  # < 2x at so small a limit: fp16 pays the reserve
    assert longest["e8-2"] >= 7 * longest["fp16"]
    e8 = engines["e8-2"]
    text = (PROMPT_TEXT + " ") * 40
    prompt = engine_model.tokenizer.encode(text)[: longest["e8-2"]]
    assert len(prompt) == longest["e8-2"]
    e8.add_request("long", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    answer = []
    while e8.has_unfinished_requests():
        answer += [e.token_id for e in e8.step()]
    assert len(answer) == 2
    pool = e8.pool
    codec = pool.codec
    assert codec is not None
    assert codec.resident_bytes <= pool.num_blocks * codec.block_bytes + codec.sink_bytes
    stats = e8.stats()
    assert stats.kv_bytes_per_token == 3240
    assert stats.decoded_cache is not None
    assert stats.decoded_cache.bytes <= FIXED_KV // 4


@pytest.mark.parametrize("name", ["kivi-2", WINDOW32_HEAVY2])
def test_an_arena_gives_memory_back_after_a_burst(name: str) -> None:
    """``_coded_store`` rule 10: a burst of blocks (written raw, then sealed into the decoded
    cache or kept as window rows) grew an arena that stayed at its high-water mark, rows
    written and resident, after the blocks were forgotten. Now it is cut once a quarter or
    less of it is in use; what the blocks still held read as before, bit for bit, and a
    second burst grows it again."""
    burst = 120
    blocks = np.arange(1, burst + 1, dtype=np.intp)
    q, keys_t, values = _qkv(7, burst * BS)
    layout = KVLayout(1, HEADS, DIM, BS)
    store = CodedKVStorage(layout, burst + 1, _codec(name))

    def fill(into: CodedKVStorage, which: npt.NDArray[np.intp]) -> None:
        for block in which.tolist():
            cols = slice((block - 1) * BS, block * BS)
            slots = (np.full(BS, block, dtype=np.intp), np.arange(BS, dtype=np.intp))
            k, v = keys_t[:, :, cols].transpose(2, 0, 1), values[:, cols].transpose(1, 0, 2)
            into.write(0, slots, k, v)
        queries = q[BS - 1 :: BS][which - 1].reshape(which.size, HEADS * GROUP, DIM)
        into.seal(0, which, which == 1, queries)

    fill(store, blocks)
    kept = blocks[:2]
    before = [a.tobytes() for a in store.gather(0, kept)]
    peak = store.arena_bytes
    for block in blocks[2:].tolist():
        store.forget(block)
    # Each arena at most SHRINK_MIN_SLOTS slots: float32 rows, and float16 window rows.
    assert store.arena_bytes <= SHRINK_MIN_SLOTS * store.entry_bytes * 3 // 2 < peak
    assert [a.tobytes() for a in store.gather(0, kept)] == before
    fill(store, blocks[2:])  # the burst again, on the cut arena
    fresh = CodedKVStorage(layout, burst + 1, _codec(name))
    fill(fresh, blocks)
    assert store.arena_bytes == peak
    for got, want in zip(store.gather(0, blocks), fresh.gather(0, blocks), strict=True):
        assert got.tobytes() == want.tobytes()
