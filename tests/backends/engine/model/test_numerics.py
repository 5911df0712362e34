"""The load-time choice of product paths, in processes forced onto other OpenBLAS kernels.

Each case runs a short script in a fresh interpreter (``OPENBLAS_CORETYPE`` is read when
OpenBLAS loads) on synthetic weights of the model's shapes; no model is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Haswell is what OpenBLAS picks on AVX2-only CPUs (Zen included); Sandybridge runs on every
# x86-64 CPU with AVX.  Both run on this machine whatever its native kernel.
FORCED_KERNELS = ("Haswell", "Sandybridge")

_SCRIPT = """
import json
import numpy as np
from backends.engine.model._linear import TileWorkers
from backends.engine.model._numerics import Numerics

rng = np.random.default_rng(11)
shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 8192)}
weights = {k: rng.standard_normal(s, dtype=np.float32) * np.float32(0.05)
           for k, s in shapes.items()}
workers = TileWorkers(2)
numerics = Numerics.choose(weights, 64, workers)
workers.close()
print(json.dumps({"kernel": numerics.kernel, "exact": numerics.exact,
                  "fingerprint": numerics.fingerprint.hex(), "line": numerics.describe(),
                  "paths": {k: p.path for k, p in numerics.plans.items()}}))
"""


def _choose(kernel: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if kernel is not None:
        env["OPENBLAS_CORETYPE"] = kernel
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("kernel", [None, *FORCED_KERNELS])
def test_every_kernel_gets_paths_that_keep_rows_independent(kernel: str | None) -> None:
    result = _choose(kernel)
    if kernel is not None:
        assert result["kernel"] == kernel
    assert result["exact"] is True, result["line"]
    assert "promise kept" in str(result["line"])
    if kernel == "Haswell":  # its sgemm breaks row independence: every product is lane-mapped
        assert set(result["paths"].values()) == {"lanes"}  # type: ignore[attr-defined]


def test_the_fingerprint_names_the_bits_not_the_process() -> None:
    """Two processes on one kernel agree; processes on different kernels, whose bits differ,
    do not -- so a KV transfer between them is refused (``NUMERICS_MISMATCH``), not trusted."""
    first, second, other = _choose("Haswell"), _choose("Haswell"), _choose("Sandybridge")
    assert first["fingerprint"] == second["fingerprint"]
    assert first["fingerprint"] != other["fingerprint"]
