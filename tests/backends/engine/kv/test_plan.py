"""KV plans: a codec per layer for keys and one for values, as data, as a file and in the
engine (a uniform plan is its codec; the pool and the bytes-per-token gauge follow the plan)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends.engine import Engine, LlamaModel
from backends.engine.kv._paged_codec import PagedCodec
from backends.engine.kv._plan import (
    ENGINE_CODECS,
    WINDOW_TOKENS,
    WINDOWED_CODECS,
    KVPlan,
    LayerCodecs,
)
from backends.engine.kv.codecs import codec_by_name
from backends.engine.serving._server_config import UnifiedServerConfig, engine_server_config

from .test_paged_codec import BS, DIM, HEADS, mixed_plan

LAYERS = 4


def _paged(plan: str | KVPlan, layers: int = LAYERS) -> PagedCodec:
    return PagedCodec(plan, num_layers=layers, kv_heads=HEADS, head_dim=DIM, block_size=BS)


def test_a_plan_round_trips_through_its_file(tmp_path: Path) -> None:
    plan = mixed_plan(LAYERS)
    path = tmp_path / "plan.json"
    plan.dump(path)
    data = json.loads(path.read_text())
    assert data["layers"][0] == {"k": "kivi-4", "v": "e8-2"}
    assert KVPlan.load(path) == plan
    assert KVPlan.from_dict(plan.to_dict()) == plan
    with_meta = KVPlan.from_dict({**plan.to_dict(), "meta": {"budget": 100}})
    assert with_meta == plan and with_meta.name == plan.name  # meta is not identity
    assert plan.name.startswith("mixed-") and plan.uniform_codec is None
    assert "kivi-4 K1/V0" in plan.describe()


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"layers": []},
        {"layers": [{"k": "kivi-4"}]},
        {"layers": [{"k": "kivi-4", "v": "e8-2w"}]},
        {"layers": [{"k": "int3", "v": "fp8"}]},
        {"layers": [{"k": "fp8", "v": "fp8"}], "budget": 1},
    ],
)
def test_bad_plans_are_refused(data: object) -> None:
    with pytest.raises(ValueError):
        KVPlan.from_dict(data)


def test_a_bad_plan_file_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json"):
        KVPlan.load(path)


_DUMP_PAST_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from pathlib import Path
from backends.engine.kv._plan import KVPlan
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))
try:
    KVPlan.uniform("kivi-4", 30).dump(Path(sys.argv[1]))
except OSError:
    sys.exit(3)
"""


def test_a_plan_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    """A writer stopped part-way (here a file-size limit, as a full disk would; or Ctrl-C, or a
    second plan-kv racing it) left the first bytes of the new plan in place of the old one: an
    engine started then read half a plan.  Now the old plan stays whole, and no temporary file
    is left beside it."""
    path = tmp_path / "plan.json"
    KVPlan.uniform("fp8", 30).dump(path)
    before = path.read_bytes()
    assert len(before) > 512
    done = subprocess.run(
        [sys.executable, "-c", _DUMP_PAST_A_FILE_SIZE_LIMIT, str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    KVPlan.uniform("kivi-4", 30).dump(path)  # without the limit it is replaced, mode kept
    assert KVPlan.load(path) == KVPlan.uniform("kivi-4", 30)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_plan_written_through_a_link_replaces_the_file_it_names(tmp_path: Path) -> None:
    target = tmp_path / "plans" / "current.json"
    target.parent.mkdir()
    target.write_text("{}")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    KVPlan.uniform("fp8", 30).dump(link)
    assert link.is_symlink()
    assert KVPlan.load(target) == KVPlan.uniform("fp8", 30)


def test_a_plan_file_nested_past_the_parsers_depth_is_not_a_plan(tmp_path: Path) -> None:
    """json's parser recurses once per level: a hostile file raised RecursionError, which no
    command caught (a traceback)."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep\.json: not a KV plan: nested too deeply"):
        KVPlan.load(path)


@pytest.mark.parametrize(
    ("plan", "refusal"),
    [
        (KVPlan.uniform("fp8", LAYERS + 1), f"{LAYERS + 1} layers for a {LAYERS}-layer model"),
        (KVPlan.uniform("fp8", LAYERS, window_tokens=BS + 1), "not a multiple"),
        (KVPlan.uniform("fp8", LAYERS, heavy_tokens=BS), "not below"),
    ],
    ids=["layers", "window", "heavy"],
)
def test_a_plan_checks_an_engine_as_its_paged_codec_would(plan: KVPlan, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        plan.check_engine(num_layers=LAYERS, block_size=BS)
    with pytest.raises(ValueError):
        _paged(plan)


def test_a_plan_that_checks_an_engine_builds_its_paged_codec() -> None:
    plan = KVPlan.uniform("kivi-4", LAYERS, window_tokens=2 * BS, heavy_tokens=BS - 1)
    plan.check_engine(num_layers=LAYERS, block_size=BS)
    assert _paged(plan).plan == plan


@pytest.mark.parametrize("name", [n for n in ENGINE_CODECS if n != "fp32"])
def test_a_uniform_plan_is_its_codec(name: str) -> None:
    plan = KVPlan.uniform(name, LAYERS)
    assert plan.name == name and plan.uniform_codec == name
    by_plan, by_name = _paged(plan), _paged(name)
    assert by_plan.fingerprint == by_name.fingerprint
    assert by_plan.block_bytes == by_name.block_bytes


def test_a_mixed_plan_pays_each_layers_and_roles_own_bytes() -> None:
    plan = mixed_plan(LAYERS)
    mixed = _paged(plan)
    block = np.random.default_rng(0).standard_normal((BS, HEADS, DIM), dtype=np.float32)
    expected = sum(
        codec_by_name(layer.key).encode(block, "key").nbytes
        + codec_by_name(layer.value).encode(block, "value").nbytes
        for layer in plan.layers
    )
    assert mixed.block_bytes == expected
    assert mixed.bytes_per_token() == expected / BS
    reordered = KVPlan(plan.layers[::-1])
    swapped = KVPlan(tuple(LayerCodecs(c.value, c.key) for c in plan.layers))
    fingerprints = {_paged(p).fingerprint for p in (plan, reordered, swapped, "kivi-4")}
    assert len(fingerprints) == 4
    with pytest.raises(ValueError, match="layers"):
        _paged(plan, LAYERS + 1)
    with pytest.raises(ValueError, match="fp32"):
        _paged(KVPlan.uniform("fp32", LAYERS))


def test_the_server_config_takes_a_plan_or_a_codec(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    mixed_plan(30).dump(path)
    assert UnifiedServerConfig(kv_plan=path).kv_plan == path
    with pytest.raises(ValueError, match="exclusive"):
        engine_server_config(kv_plan=path, kv_codec="fp8")
    with pytest.raises(ValueError, match="exclusive"):  # given, even as the default's name
        engine_server_config(kv_plan=path, kv_codec="fp32")
    with pytest.raises(ValueError, match="router"):
        engine_server_config(
            role="router", kv_plan=path, prefill_urls=("http://a",), decode_urls=("http://b",)
        )


def test_the_engine_pool_and_gauge_follow_the_plan(engine_model: LlamaModel) -> None:
    layers = engine_model.config.num_layers
    limit = 64 << 20
    fp32 = Engine(engine_model, limit)
    assert Engine(engine_model, limit, kv_codec=KVPlan.uniform("fp32", layers)).pool.codec is None
    half = KVPlan.of(["fp16"] * layers, ["fp8"] * layers)
    engine = Engine(engine_model, limit, kv_codec=half)
    assert engine.kv_codec == half.name
    fp16 = Engine(engine_model, limit, kv_codec="fp16").pool.bytes_per_token
    fp8 = Engine(engine_model, limit, kv_codec="fp8").pool.bytes_per_token
    assert engine.pool.bytes_per_token == pytest.approx((fp16 + fp8) / 2)
    assert engine.pool.bytes_per_token < fp32.pool.bytes_per_token / 2
    assert engine.stats().kv_bytes_per_token == engine.pool.bytes_per_token


@pytest.mark.parametrize("name", ["e8-2w", "kivi-4w", "kivi-2w"])
def test_a_windowed_codec_is_its_base_codec_with_kivis_window(name: str) -> None:
    plan = KVPlan.uniform(name, LAYERS)
    assert plan.name == name and plan.window_tokens == WINDOW_TOKENS
    assert set(plan.keys) == {WINDOWED_CODECS[name]}
    windowed, base = _paged(name), _paged(WINDOWED_CODECS[name])
    assert windowed.fingerprint != base.fingerprint  # a node of one refuses the other's blocks
    # e8-2 is built as e8-2w under a window: its values drop the block-scale bits (a byte per
    # token-head of 64); the other bases are built as they are.
    dropped = LAYERS * BS * HEADS * DIM // 64 if name == "e8-2w" else 0
    assert windowed.block_bytes == base.block_bytes - dropped
    assert windowed.window_blocks == WINDOW_TOKENS // BS
    assert windowed.window_bytes == LAYERS * 2 * HEADS * DIM * BS * 2  # float16 rows
    assert windowed.packed_sizes == tuple(
        sorted(windowed.packed_bytes(f, w) for f in (False, True) for w in (False, True))
    )


def test_a_plan_with_a_window_round_trips_and_names_it(tmp_path: Path) -> None:
    plan = KVPlan.of(mixed_plan(LAYERS).keys, mixed_plan(LAYERS).values)
    windowed = KVPlan(plan.layers, window_tokens=32)
    path = tmp_path / "plan.json"
    windowed.dump(path)
    assert json.loads(path.read_text())["window_tokens"] == 32
    assert KVPlan.load(path) == windowed != plan
    assert windowed.name != plan.name
    assert KVPlan.uniform("e8-2", LAYERS, window_tokens=32).name == "e8-2+w32"
    with pytest.raises(ValueError, match="window_tokens"):
        KVPlan.from_dict({**plan.to_dict(), "window_tokens": -16})


def test_a_plan_with_heavy_hitters_round_trips_and_names_them(tmp_path: Path) -> None:
    plan = mixed_plan(LAYERS)
    heavy = KVPlan(plan.layers, window_tokens=32, heavy_tokens=2)
    path = tmp_path / "plan.json"
    heavy.dump(path)
    assert json.loads(path.read_text())["heavy_tokens"] == 2
    assert KVPlan.load(path) == heavy != KVPlan(plan.layers, window_tokens=32)
    assert "heavy_tokens" not in plan.to_dict()  # default 0: today's file
    assert heavy.name not in (plan.name, KVPlan(plan.layers, window_tokens=32).name)
    assert KVPlan.uniform("e8-2", LAYERS, heavy_tokens=2).name == "e8-2+h2"
    assert KVPlan.uniform("e8-2w", LAYERS, heavy_tokens=1).name == "e8-2w+h1"
    assert KVPlan.uniform("kivi-4", LAYERS, window_tokens=32, heavy_tokens=3).name == (
        "kivi-4+w32+h3"
    )
    # Nodes exchange blocks only under one fingerprint: heavy hitters change it, mixed or not.
    prints = {
        _paged(KVPlan(plan.layers, heavy_tokens=h, window_tokens=w)).fingerprint
        for h in (0, 2)
        for w in (0, 32)
    }
    assert len(prints) == 4
    assert _paged(KVPlan.uniform("e8-2", LAYERS, heavy_tokens=2)).fingerprint != (
        _paged("e8-2").fingerprint
    )


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_bad_heavy_hitter_counts_are_refused_with_the_field_named(bad: object) -> None:
    data = {**mixed_plan(LAYERS).to_dict(), "heavy_tokens": bad}
    with pytest.raises(ValueError, match="heavy_tokens"):
        KVPlan.from_dict(data)


@pytest.mark.parametrize("heavy", [BS, BS + 1])
def test_a_block_keeps_fewer_heavy_hitters_than_its_rows(heavy: int) -> None:
    with pytest.raises(ValueError, match="heavy-hitter tokens of a 16-token block"):
        _paged(KVPlan.uniform("kivi-4", LAYERS, heavy_tokens=heavy))


def test_heavy_hitters_are_paid_in_the_blocks_bytes_and_bits() -> None:
    """Each layer's blob holds, per KV head, h float16 K rows, h float16 V rows and h uint8
    positions; the block's bytes, its packed sizes and the context's bits count them."""
    plain, heavy = _paged("kivi-2"), _paged(KVPlan.uniform("kivi-2", LAYERS, heavy_tokens=3))
    extra = LAYERS * HEADS * 3 * (2 * DIM * 2 + 1)
    assert heavy.block_bytes == plain.block_bytes + extra
    assert heavy.bytes_per_token() == plain.bytes_per_token() + extra / BS
    assert heavy.packed_bytes(True) == plain.packed_bytes(True) + extra
    elements = LAYERS * 2 * HEADS * DIM
    for tokens in (16, 100, 1000):
        more = heavy.context_bits_per_element(tokens) - plain.context_bits_per_element(tokens)
        assert more == pytest.approx(8 * extra * (tokens // BS) / (tokens * elements))
