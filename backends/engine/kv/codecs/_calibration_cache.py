"""E8's calibration kept on disk, so that an engine does not recompute it at every start.

``calibrate(model)`` runs the model over seven passages (~20 s on a quiet 2-core machine, over
a minute under load) and gives per-layer constants that are a function of the weights and the
code alone.  Every e8 engine start paid it; this keeps its result in a file.

Rules
-----
1. A file is named by a hash of all the constants are a function of: the model's fingerprint
   (its weights) and the source of the codecs package (the calibration texts, the settings,
   the code) and of the model package (the forward pass it runs).  An edit of any of them
   names a new file, so a file is never stale.  Old files are of no more use: once a new file
   is written only the ``KEPT_FILES`` most recent stay (a process still reading an older one
   keeps its open file; one about to open it finds it gone and calibrates, as for rule 3).
2. The file is written under a temporary name in the same folder and renamed into place: a
   reader sees a whole file or none, and two processes calibrating at once write the same
   constants.
3. The cache never stops an engine: a file that cannot be read (truncated, not ours) is
   recomputed and written again, a folder that cannot be written leaves the result unkept;
   both with a warning.
4. The folder is ``$UNDERSTUDY_CACHE_DIR/kv-calibration``, else
   ``$XDG_CACHE_HOME/understudy/kv-calibration`` (``~/.cache/understudy/kv-calibration``).
   The numerics are not in the name: the same weights calibrated under another BLAS kernel
   differ in rounding only, and nodes that read one file share the constants exactly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ... import model as model_package
from ...model._model import LlamaModel
from . import _quality
from ._codec import Float32Array

__all__ = ["KEPT_FILES", "Calibration", "cache_dir", "cached_calibration"]

log = logging.getLogger("understudy.engine")

Calibration = tuple[list[Float32Array], list[Float32Array]]
"""What ``calibrate`` gives: per layer, the key means and the key transforms."""

_FORMAT = b"understudy-kv-calibration-1"

KEPT_FILES = 8
"""Calibration files a folder keeps (rule 1): ~1.5 MB each for SmolLM2-135M."""


def cache_dir() -> Path:
    """Rule 4."""
    explicit = os.environ.get("UNDERSTUDY_CACHE_DIR")
    if explicit:
        return Path(explicit) / "kv-calibration"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "understudy" / "kv-calibration"


def cached_calibration(
    model: LlamaModel,
    folder: Path | None = None,
    compute: Callable[[LlamaModel], Calibration] = _quality.calibrate,
) -> Calibration:
    """``compute(model)`` (``calibrate`` with its defaults), read from ``folder`` when an
    earlier run kept it there, else computed and kept (rules 1-3)."""
    path = (folder or cache_dir()) / f"{_key(model)}.npz"
    if path.exists():
        try:
            return _read(path, model.config.num_layers)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            log.warning("KV calibration file %s unreadable (%s): calibrating again", path, exc)
    calibration = compute(model)
    try:
        _write(path, calibration)
        _prune(path)
    except OSError as exc:
        log.warning("KV calibration not kept in %s: %s", path.parent, exc)
    return calibration


def _key(model: LlamaModel) -> str:
    digest = hashlib.sha256(_FORMAT)
    digest.update(model.fingerprint)
    for package in (Path(__file__).parent, Path(str(model_package.__file__)).parent):
        for source in sorted(package.glob("*.py")):
            digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:32]


def _read(path: Path, num_layers: int) -> Calibration:
    with path.open("rb") as handle, np.load(handle, allow_pickle=False) as stored:
        means = [np.asarray(stored[f"mean_{i}"], dtype=np.float32) for i in range(num_layers)]
        scales = [np.asarray(stored[f"scale_{i}"], dtype=np.float32) for i in range(num_layers)]
        if len(stored.files) != 2 * num_layers:
            raise ValueError(f"{len(stored.files)} arrays for {num_layers} layers")
    return means, scales


def _write(path: Path, calibration: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    means, scales = calibration
    arrays = {f"mean_{i}": m for i, m in enumerate(means)}
    arrays.update({f"scale_{i}": s for i, s in enumerate(scales)})
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            np.savez(out, allow_pickle=False, **arrays)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _prune(kept: Path) -> None:
    """Rule 1: the ``KEPT_FILES`` most recent files of ``kept``'s folder stay, ``kept`` among
    them."""
    others = [p for p in kept.parent.glob("*.npz") if p != kept]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in others[KEPT_FILES - 1:]:
        old.unlink(missing_ok=True)
