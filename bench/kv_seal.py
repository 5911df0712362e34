"""The parallel seal against a serial one, and e8-2 against kivi-2, side by side in one process.

    .venv/bin/python bench/kv_seal.py [--rounds 9]

What ``_coded_store`` rule 9 changed (the blocks a decode step completes are encoded on the
model's decode threads) is measured against a control in the same process: three engines on one
model, 8 streams each -- kivi-2 and e8-2 as served, and an e8-2 engine whose storage seals on
the caller's thread alone, as before that rule (this script replaces ``CodedKVStorage.seal``
for that one storage; the tree has no serial switch).  Rounds alternate the engines, the
order rotated each round; each sample is ``bench/_kv_decode.py``'s (its rules 1-2).  Printed
per engine: the per-step wall floor over the rounds (rule 3b), its steps that seal nothing,
and the sealing step's wall and CPU time, with each ratio to kivi-2.  The two e8-2 engines run
the same code on the steps that seal nothing: their difference there is the host's noise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _kv_decode import (
    DECODE_KV_MIB,
    Sample,
    burst_sample,
    floor_rates,
    sealing_steps,
    step_floors,
)

from backends.engine import Engine, LlamaModel
from backends.engine.kv._coded_store import CodedKVStorage
from backends.engine.kv.codecs._quality import calibrate
from backends.engine.model._linear import TileWorkers

STREAMS = 8
ENGINES = (("kivi-2", "kivi-2"), ("e8-2", "e8-2"), ("e8-2 serial seal", "e8-2"))
"""(label, served codec) of each engine; the last seals serially (the control)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Parallel against serial sealing, side by side")
    parser.add_argument("--rounds", type=int, default=9, help="rounds (each engine once)")
    args = parser.parse_args(argv)
    model = LlamaModel.load()
    calibration = calibrate(model)
    serial: set[int] = set()
    parallel_seal = CodedKVStorage.seal

    def seal(
        self: CodedKVStorage,
        layer: int,
        blocks: npt.NDArray[np.intp],
        firsts: npt.NDArray[np.bool_],
        queries: npt.NDArray[np.float32] | None = None,
        workers: TileWorkers | None = None,
    ) -> None:
        parallel_seal(self, layer, blocks, firsts, queries, None if id(self) in serial else workers)

    CodedKVStorage.seal = seal  # type: ignore[method-assign]
    with threadpool_limits(1, "blas"):
        engines = {
            label: Engine(
                model,
                DECODE_KV_MIB << 20,
                kv_codec=codec,
                kv_calibration=calibration,
                max_num_seqs=STREAMS,
            )
            for label, codec in ENGINES
        }
        serial.add(id(engines[ENGINES[-1][0]].pool.storage))
        labels = list(engines)
        samples: dict[str, list[Sample]] = {label: [] for label in labels}
        for round_number in range(args.rounds):
            shift = round_number % len(labels)
            for label in labels[shift:] + labels[:shift]:
                samples[label].append(burst_sample(engines[label], STREAMS, round_number))
    model.close()
    base: tuple[float, float, float] | None = None
    for label in labels:
        floors = step_floors(samples[label])
        if floors is None:
            print(f"{label}: the rounds took different steps (no floor)")
            return 1
        sealing = sealing_steps(len(floors))
        reads = [step for i, step in enumerate(floors) if i not in sealing]
        figures = (
            floor_rates(floors)[0],
            floor_rates(reads)[0],
            sum(floors[i][1] for i in sealing) * 1e3,
        )
        base = base or figures
        cpu_ms = sum(floors[i][2] for i in sealing) * 1e3
        print(
            f"{label:>17}: wall floor {figures[0]:.2f} tokens/s ({figures[0] / base[0]:.3f}x"
            f" kivi-2), steps that seal nothing {figures[1]:.2f} ({figures[1] / base[1]:.3f}x),"
            f" sealing steps {figures[2]:.1f} ms wall ({figures[2] - base[2]:+.1f}),"
            f" {cpu_ms:.1f} ms CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
