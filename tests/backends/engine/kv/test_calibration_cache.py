"""E8's calibration cache (``kv/codecs/_calibration_cache``): computed once, read back exactly,
never stale, never in the way.  ``compute`` stands in for ``calibrate`` (20 s of real forwards)
with arrays of the real shapes; the engine's own use of the cache runs in the engine suites."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from backends.engine import LlamaModel
from backends.engine.kv.codecs._calibration_cache import (
    KEPT_FILES,
    Calibration,
    cache_dir,
    cached_calibration,
)


class Counting:
    """A ``calibrate`` of random constants of the model's shapes, counting its calls."""

    def __init__(self, seed: int = 0) -> None:
        self.calls = 0
        self._seed = seed

    def __call__(self, model: LlamaModel) -> Calibration:
        self.calls += 1
        cfg = model.config
        rng = np.random.default_rng(self._seed)
        heads, dim = cfg.num_kv_heads, cfg.head_dim
        layers = range(cfg.num_layers)
        means = [rng.standard_normal((heads, dim)).astype(np.float32) for _ in layers]
        scales = [rng.standard_normal((heads, dim, dim)).astype(np.float32) for _ in layers]
        return means, scales


def _equal(a: Calibration, b: Calibration) -> bool:
    return all(
        x.dtype == y.dtype and np.array_equal(x, y)
        for left, right in zip(a, b, strict=True)
        for x, y in zip(left, right, strict=True)
    )


def test_computed_once_then_read_back_bit_for_bit(engine_model: LlamaModel, tmp_path: Path) -> None:
    compute = Counting()
    first = cached_calibration(engine_model, tmp_path, compute)
    second = cached_calibration(engine_model, tmp_path, compute)
    assert compute.calls == 1
    assert _equal(first, second)
    assert [p.suffix for p in tmp_path.iterdir()] == [".npz"]  # no temporary left behind


def test_an_unreadable_file_is_computed_again_and_replaced(
    engine_model: LlamaModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compute = Counting()
    cached_calibration(engine_model, tmp_path, compute)
    (path,) = tmp_path.iterdir()
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, logger="understudy.engine"):
        again = cached_calibration(engine_model, tmp_path, compute)
    assert compute.calls == 2 and "unreadable" in caplog.text
    assert _equal(again, cached_calibration(engine_model, tmp_path, compute))
    assert compute.calls == 2


def test_a_folder_that_cannot_be_written_leaves_it_unkept(
    engine_model: LlamaModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    compute = Counting()
    with caplog.at_level(logging.WARNING, logger="understudy.engine"):
        result = cached_calibration(engine_model, blocked / "cache", compute)
    assert compute.calls == 1 and "not kept" in caplog.text
    assert len(result[0]) == engine_model.config.num_layers


def test_another_model_or_code_names_another_file(
    engine_model: LlamaModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached_calibration(engine_model, tmp_path, Counting())
    monkeypatch.setattr(engine_model, "fingerprint", bytes(32))
    other = Counting(seed=1)
    cached_calibration(engine_model, tmp_path, other)
    assert other.calls == 1 and len(list(tmp_path.iterdir())) == 2


def test_only_the_most_recent_files_are_kept(engine_model: LlamaModel, tmp_path: Path) -> None:
    old = [tmp_path / f"{i:032x}.npz" for i in range(KEPT_FILES + 2)]
    for age, path in enumerate(old):  # old[0] the most recent of them
        path.write_bytes(b"an earlier calibration")
        os.utime(path, (1e9 - age, 1e9 - age))
    cached_calibration(engine_model, tmp_path, Counting())
    left = sorted(tmp_path.glob("*.npz"))
    assert len(left) == KEPT_FILES
    assert set(old[: KEPT_FILES - 1]) < set(left)  # the newest old ones, and the new file
    other = tmp_path / "notes.txt"
    other.write_text("not a calibration")
    cached_calibration(engine_model, tmp_path, Counting())  # read back: nothing removed
    assert len(list(tmp_path.glob("*.npz"))) == KEPT_FILES and other.exists()


def test_folder_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("UNDERSTUDY_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path / "kv-calibration"
    monkeypatch.delenv("UNDERSTUDY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "understudy" / "kv-calibration"
