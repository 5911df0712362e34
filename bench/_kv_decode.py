"""Decode tokens/s of the engine under each served KV codec, side by side (bench/kvquant.py).

Rules of the measurement
------------------------
1. One engine per codec, all built before the first round, with the same calibration, the same
   KV memory (``DECODE_KV_MIB``, enough for every stream's whole sequence at fp32) and
   ``max_num_seqs`` = the most streams measured.  The engine's default decoded-block cache
   (64 MiB) holds the 8 streams' 160-token sequences decoded (8 x 10 blocks x 30 layers x
   24 KiB = 59 MB), as an operator would size it for the load: a cache smaller than the
   working set makes every step decode every block again, which measures the cache, not the
   codec.
2. A sample: ``streams`` requests of ``DECODE_PROMPT_TOKENS`` distinct token ids each (distinct
   per stream, per stream count and per round up to 23 rounds, so no prefix is shared),
   greedy, ``ignore_eos``, ``DECODE_TOKENS`` tokens each.  The clock starts when every stream
   has its first token (the prefill is not timed) and stops when the last one finishes; the
   rate is the tokens produced in between over that time.  Under a codec this covers what
   decode pays: reading decoded blocks through the pool's cache, a miss decoded again, and the
   block each stream completes encoded.
3. Rounds alternate the codecs (``DECODE_ROUNDS``, or ``--rounds``; each codec once per round,
   the order rotated by one each round so that no codec always runs first or last) and a
   codec's figure is its best round: the machine is shared, and the best round is the one
   least disturbed by others.  The ratios are what to read, not the absolute rates.  Beside it,
   each round gives a ratio between codecs measured minutes apart at most (``round_ratios``),
   and the median of those is reported too: on a loaded box the best rounds of two codecs may
   come from different minutes of load.
3a. Each sample also takes the engine process's CPU time (``time.process_time``: every thread
   of it, the lanes' included) and reports tokens per CPU second.  Wall tokens/s is what a
   client sees, but on a shared box it moves with the others' load (rounds of one codec
   differed by up to 2.5x); CPU time counts the engine's own work, which other processes do
   not add to, so its per-round ratios scatter far less (they still feel shared caches and
   memory bandwidth).  Both are printed per round with the load average (``os.getloadavg``).
3b. Every step of a sample is timed too, and where every round took the same steps (8 streams:
   no drafts, one token per stream and step, the streams in step, so each step position does
   the same work in every round -- the seals included, all streams sealing at the same step)
   the per-step floor is reported: each step position's least time over the rounds, summed,
   wall and CPU (``floor_N``, ``cpu_floor_N``; None at 1 stream, where drafts make the steps
   differ).  A disturbance hits a few steps of one round; the floor drops it without dropping
   the steps where a codec does its extra work.  CPU time is not a proxy for wall time
   where a codec's work runs on more threads than another's (the engine encodes the blocks a
   step completes on its decode threads, ``_coded_store`` rule 9: e8-2's C search uses the
   second one, kivi-2's numpy calls barely can), so both floors are checked: the wall floor
   is what a client sees, read on a quiet machine.
3c. Where the floor exists, it is also split by what the steps do (``seal_split``): the step in
   which the streams complete a block (the prompts end on a block boundary, so step ``i`` writes
   position ``DECODE_PROMPT_TOKENS + i``, and the step writing a block's last position seals it,
   every stream at once) against the steps that seal nothing.  Those read the cache and run the
   model by the same code under every codec, so their ratio says whether the codecs' read paths
   differ; the sealing steps' difference, wall and CPU, is what one codec's encoding costs
   over another's.
4. Every engine runs as served, prompt-lookup drafts included (``Engine`` rule 5; under a codec
   they stop short of a block's last position): the prompts count up token ids, so greedy
   answers repeat and drafts are accepted at 1 stream, where a step has rows to spare.

5. ``--encode`` first times what a stream pays when it completes a block: encoding one block
   (``DEFAULT_BLOCK_SIZE`` tokens, the model's own keys and values after the sink, calibrated
   as served) per layer and role, each codec's per-layer codecs over the same blocks, rounds
   alternating the codecs (``ENCODE_ROUNDS``, the best round), in microseconds per block and
   as a ratio to kivi-2's, wall and the thread's CPU time (``time.thread_time``, rule 3a).

Run alone on a few codecs (the same measurement as ``bench/kvquant.py --decode-only``, which
runs every served codec): ``.venv/bin/python bench/_kv_decode.py fp32 kivi-2 e8-2``;
``--encode`` adds the encode table, ``--encode-only`` runs just it (seconds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.engine import Engine, LlamaModel
from backends.engine.kv._store import DEFAULT_BLOCK_SIZE
from backends.engine.kv.codecs import KVCodec, Role, codec_by_name
from backends.engine.kv.codecs._codec import ROLES, Float32Array
from backends.engine.kv.codecs._quality import capture_kv
from backends.engine.kv.codecs._texts import CALIBRATION_TEXTS
from backends.engine.model._sampling import SamplingParams

__all__ = [
    "DECODE_KV_MIB",
    "DECODE_STREAMS",
    "Sample",
    "burst_sample",
    "decode_rows",
    "decode_targets",
    "encode_rows",
    "floor_rates",
    "render_seal_split",
    "round_ratios",
    "seal_split",
    "sealing_steps",
    "step_floors",
]

DECODE_STREAMS = (1, 8)
DECODE_PROMPT_TOKENS = 128
DECODE_TOKENS = 32
DECODE_ROUNDS = 2
DECODE_KV_MIB = 256
_FIRST_ID = 1_000  # ordinary text tokens: above SmolLM2's special and byte tokens
_BURST_IDS = max(DECODE_STREAMS) * DECODE_PROMPT_TOKENS  # one burst's prompts, all distinct
_ID_SPAN = 46 * _BURST_IDS  # ids stay below SmolLM2's 49,152; 46 bursts (23 rounds) apart
TARGET_E8_VS_KIVI2 = 1.0
TARGET_E8_VS_FP32 = 0.8
ENCODE_BLOCKS = 8
ENCODE_ROUNDS = 5


@dataclass(frozen=True, slots=True)
class Sample:
    """One burst (rule 2): decode tokens produced after every stream started, the wall time
    and the engine process's CPU time they took (rule 3a), and each of those steps' tokens,
    wall and CPU seconds (rule 3b)."""

    tokens: int
    wall_s: float
    cpu_s: float
    steps: tuple[tuple[int, float, float], ...]

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s

    @property
    def cpu_rate(self) -> float:
        return self.tokens / self.cpu_s


def burst_sample(engine: Engine, streams: int, round_number: int) -> Sample:
    """Rule 2: one burst of ``streams`` greedy streams; decode tokens once all have started."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    burst = round_number * len(DECODE_STREAMS) + DECODE_STREAMS.index(streams)
    base = _FIRST_ID + burst * _BURST_IDS % _ID_SPAN
    started: set[str] = set()
    for stream in range(streams):
        first = base + stream * DECODE_PROMPT_TOKENS
        prompt = list(range(first, first + DECODE_PROMPT_TOKENS))
        engine.add_request(f"decode-{round_number}-{streams}-{stream}", prompt, params)
    clock = cpu = 0.0
    steps: list[tuple[int, float, float]] = []
    while engine.has_unfinished_requests():
        step_clock, step_cpu = time.perf_counter(), time.process_time()
        events = engine.step()
        if len(started) < streams:
            started.update(event.request_id for event in events)
            if len(started) == streams:
                clock, cpu = time.perf_counter(), time.process_time()
            continue
        steps.append(
            (len(events), time.perf_counter() - step_clock, time.process_time() - step_cpu)
        )
    produced = sum(tokens for tokens, _, _ in steps)
    return Sample(produced, time.perf_counter() - clock, time.process_time() - cpu, tuple(steps))


def step_floors(samples: Sequence[Sample]) -> list[tuple[int, float, float]] | None:
    """Rule 3b: each step position's tokens and least wall and CPU time over the rounds, or
    None where rounds took different steps (drafts)."""
    shapes = {tuple(tokens for tokens, _, _ in sample.steps) for sample in samples}
    if len(shapes) != 1:
        return None
    return [
        (tokens, min(sample.steps[i][1] for sample in samples),
         min(sample.steps[i][2] for sample in samples))
        for i, tokens in enumerate(next(iter(shapes)))
    ]


def floor_rates(steps: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """Rule 3b: tokens per wall and per CPU second of the per-step floor."""
    tokens = sum(count for count, _, _ in steps)
    return tokens / sum(wall for _, wall, _ in steps), tokens / sum(cpu for _, _, cpu in steps)


def sealing_steps(count: int) -> set[int]:
    """Rule 3c: the steps (from 0, after every stream started) that write a block's last
    position, so seal it."""
    return {
        i for i in range(count) if (DECODE_PROMPT_TOKENS + i + 1) % DEFAULT_BLOCK_SIZE == 0
    }


def seal_split(
    rows: list[dict[str, Any]], codec: str, other: str, streams: int
) -> tuple[float, float, float, int] | None:
    """Rule 3c: ``codec``'s tokens per CPU second over ``other``'s on the floor's steps that seal
    nothing, and ``codec``'s extra milliseconds on each sealing step, wall and CPU (their
    means), and how many there are; None without a floor for both."""
    by = {row["codec"]: row for row in rows}
    floors = by[codec][f"step_floors_{streams}"], by[other][f"step_floors_{streams}"]
    if floors[0] is None or floors[1] is None or len(floors[0]) != len(floors[1]):
        return None
    sealing = sealing_steps(len(floors[0]))
    if not sealing or len(sealing) == len(floors[0]):
        return None
    reads = [[step for i, step in enumerate(floor) if i not in sealing] for floor in floors]
    read_ratio = floor_rates(reads[0])[1] / floor_rates(reads[1])[1]
    wall, cpu = (
        statistics.mean(floors[0][i][part] - floors[1][i][part] for i in sealing) for part in (1, 2)
    )
    return read_ratio, wall * 1e3, cpu * 1e3, len(sealing)


def decode_rows(
    model: LlamaModel,
    codecs: Sequence[str],
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]],
    say: Callable[[str], None],
    rounds: int = DECODE_ROUNDS,
) -> list[dict[str, Any]]:
    """Per codec, decode tokens/s at each of ``DECODE_STREAMS`` (rules 1-3a): ``decode_N`` the
    best round's wall rate, ``cpu_N`` the best round's tokens per CPU second, and every round's
    in ``rounds_N`` and ``cpu_rounds_N`` (round order, for ``round_ratios``; plain floats, so
    the rows go to JSON as they are)."""
    engines = {
        name: Engine(
            model,
            DECODE_KV_MIB << 20,
            kv_codec=name,
            kv_calibration=calibration,
            max_num_seqs=max(DECODE_STREAMS),
        )
        for name in codecs
    }
    names = list(engines)
    samples: dict[tuple[str, int], list[Sample]] = {
        (name, streams): [] for name in names for streams in DECODE_STREAMS
    }
    for round_number in range(rounds):
        order = names[round_number % len(names) :] + names[: round_number % len(names)]
        for streams in DECODE_STREAMS:
            for name in order:
                sample = burst_sample(engines[name], streams, round_number)
                samples[name, streams].append(sample)
                say(
                    f"decode round {round_number} {name} x{streams}: {sample.rate:.2f} tokens/s,"
                    f" {sample.cpu_rate:.2f} per CPU s (load {_load()})"
                )
    rows: list[dict[str, Any]] = []
    for name in codecs:
        row: dict[str, Any] = {"codec": name}
        for streams in DECODE_STREAMS:
            rates = [x.rate for x in samples[name, streams]]
            cpu_rates = [x.cpu_rate for x in samples[name, streams]]
            row[f"decode_{streams}"], row[f"cpu_{streams}"] = max(rates), max(cpu_rates)
            row[f"rounds_{streams}"], row[f"cpu_rounds_{streams}"] = rates, cpu_rates
            steps = step_floors(samples[name, streams])
            row[f"step_floors_{streams}"] = steps
            floor = None if steps is None else floor_rates(steps)
            row[f"floor_{streams}"], row[f"cpu_floor_{streams}"] = floor or (None, None)
        rows.append(row)
    return rows


def _load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def round_ratios(
    rows: list[dict[str, Any]], codec: str, other: str, streams: int
) -> list[list[float]]:
    """Rule 3: ``codec``'s rate over ``other``'s in each round, wall and per CPU second."""
    by = {row["codec"]: row for row in rows}
    return [
        [a / b for a, b in zip(by[codec][key], by[other][key], strict=True)]
        for key in (f"rounds_{streams}", f"cpu_rounds_{streams}")
    ]


def encode_rows(
    model: LlamaModel,
    codecs: Sequence[str],
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]],
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Per codec, microseconds to encode one block of one layer and role (rule 5)."""
    layers = model.config.num_layers
    ids = model.tokenizer.encode(CALIBRATION_TEXTS[0])[: 1 + ENCODE_BLOCKS * DEFAULT_BLOCK_SIZE]
    keys, values = capture_kv(model, ids)
    means, scales = calibration
    work: list[tuple[int, Role, Float32Array]] = [
        (layer, role, kv[layer][start : start + DEFAULT_BLOCK_SIZE])
        for layer in range(layers)
        for role, kv in zip(ROLES, (keys, values), strict=True)
        for start in range(1, len(ids) - DEFAULT_BLOCK_SIZE + 1, DEFAULT_BLOCK_SIZE)
    ]
    built: dict[str, list[KVCodec]] = {
        name: [
            codec_by_name(name, layer=layer, key_mean=means[layer], key_scale=scales[layer])
            for layer in range(layers)
        ]
        for name in codecs
    }
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    for round_number in range(ENCODE_ROUNDS):
        for name, per_layer in built.items():
            clock, cpu = time.perf_counter(), time.thread_time()
            for layer, role, block in work:
                per_layer[layer].encode(block, role)
            micros = (time.perf_counter() - clock) / len(work) * 1e6
            cpu_micros = (time.thread_time() - cpu) / len(work) * 1e6
            best[name] = min(micros, best.get(name, float("inf")))
            best_cpu[name] = min(cpu_micros, best_cpu.get(name, float("inf")))
            say(
                f"encode round {round_number} {name}: {micros:.0f} us per block"
                f" ({cpu_micros:.0f} us CPU)"
            )
    return [
        {"codec": name, "encode_us": best[name], "encode_cpu_us": best_cpu[name]} for name in codecs
    ]


def render_encode(rows: list[dict[str, Any]]) -> None:
    """The encode table (rule 5), with each codec's ratio to kivi-2's where measured."""
    kivi = next((row["encode_us"] for row in rows if row["codec"] == "kivi-2"), None)
    kivi_cpu = next((row["encode_cpu_us"] for row in rows if row["codec"] == "kivi-2"), None)
    for row in rows:
        ratio = "" if kivi is None else f" ({row['encode_us'] / kivi:.2f}x kivi-2)"
        cpu = "" if kivi_cpu is None else f" ({row['encode_cpu_us'] / kivi_cpu:.2f}x)"
        print(
            f"{row['codec']:>8}: encode {row['encode_us']:.0f} us per block{ratio},"
            f" {row['encode_cpu_us']:.0f} us CPU{cpu}"
        )


def decode_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """e8-2's decode rate against kivi-2's and fp32's, at each stream count (issue 14): the
    best rounds' wall rates (rule 3), the median over rounds of the per-round ratio of
    tokens per CPU second (rule 3a), and the step floors', wall and CPU (rule 3b)."""
    by = {row["codec"]: row for row in rows}
    if "e8-2" not in by:
        return []
    checks = []
    for other, target in (("kivi-2", TARGET_E8_VS_KIVI2), ("fp32", TARGET_E8_VS_FP32)):
        if other not in by:
            continue
        for streams in DECODE_STREAMS:
            key = f"decode_{streams}"
            best = by["e8-2"][key] / by[other][key]
            cpu = statistics.median(round_ratios(rows, "e8-2", other, streams)[1])
            what = f"e8-2 decode tokens/s at {streams} stream(s) >= {target:g}x {other}'s"
            checks.append(
                {"what": f"{what} (best rounds)", "measured": best, "met": best >= target}
            )
            checks.append(
                {"what": f"{what} (CPU s, median round)", "measured": cpu, "met": cpu >= target}
            )
            for clock, prefix in (("wall", ""), ("CPU s", "cpu_")):
                key = f"{prefix}floor_{streams}"
                floors = by["e8-2"][key], by[other][key]
                if None not in floors:
                    ratio = floors[0] / floors[1]
                    checks.append(
                        {
                            "what": f"{what} ({clock}, step floor)",
                            "measured": ratio,
                            "met": ratio >= target,
                        }
                    )
    return checks


def render_rounds(rows: list[dict[str, Any]]) -> None:
    """Every round's ratio of each codec to the first one named, wall and CPU (rule 3, 3a)."""
    if len(rows) < 2:
        return
    for row in rows[1:]:
        for other in rows:
            if other is row or (other is not rows[0] and other["codec"] != "kivi-2"):
                continue
            for streams in DECODE_STREAMS:
                wall, cpu = round_ratios(rows, row["codec"], other["codec"], streams)
                print(
                    f"{row['codec']:>8} / {other['codec']:<7} x{streams}:"
                    f" wall {' '.join(f'{r:.2f}' for r in wall)}"
                    f" (median {statistics.median(wall):.2f});"
                    f" CPU {' '.join(f'{r:.2f}' for r in cpu)}"
                    f" (median {statistics.median(cpu):.2f})"
                )


def render_seal_split(rows: list[dict[str, Any]]) -> None:
    """Rule 3c for each codec against kivi-2 where both have a floor."""
    if not any(row["codec"] == "kivi-2" for row in rows):
        return
    for row in rows:
        for streams in DECODE_STREAMS:
            split = None if row["codec"] == "kivi-2" else seal_split(
                rows, row["codec"], "kivi-2", streams)
            if split is None:
                continue
            read_ratio, extra_wall_ms, extra_cpu_ms, sealing = split
            print(
                f"{row['codec']:>8} / kivi-2  x{streams}, step floor: {read_ratio:.3f} on the"
                f" steps that seal nothing; {extra_wall_ms:+.1f} ms wall, {extra_cpu_ms:+.1f} ms"
                f" CPU on each of the {sealing} sealing step(s)"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """The decode table for the codecs named (rules 1-3), with e8-2's targets where measured."""
    from threadpoolctl import threadpool_limits

    from backends.engine.kv.codecs._quality import calibrate

    parser = argparse.ArgumentParser(description="Engine decode tokens/s per KV codec")
    parser.add_argument("codecs", nargs="+", help="served codecs, e.g. fp32 kivi-2 e8-2")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (1: a shared box)")
    parser.add_argument("--rounds", type=int, default=DECODE_ROUNDS, help="decode rounds (rule 3)")
    parser.add_argument("--encode", action="store_true", help="also time encoding (rule 5)")
    parser.add_argument("--encode-only", action="store_true", help="only time encoding")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"  {time.strftime('%H:%M:%S')} {line}", flush=True)

    model = LlamaModel.load()
    calibration = calibrate(model)
    say(f"load average {_load()}")
    with threadpool_limits(args.threads, "blas"):
        if args.encode or args.encode_only:
            render_encode(encode_rows(model, args.codecs, calibration, say))
        rows = (
            []
            if args.encode_only
            else decode_rows(model, args.codecs, calibration, say, args.rounds)
        )
    model.close()
    say(f"load average {_load()}")
    fp32 = next((row for row in rows if row["codec"] == "fp32"), None)
    for row in rows:
        cells = []
        for streams in DECODE_STREAMS:
            rate, cpu = row[f"decode_{streams}"], row[f"cpu_{streams}"]
            ratio = "" if fp32 is None else f" ({rate / fp32[f'decode_{streams}']:.2f}x fp32)"
            cells.append(f"{streams} stream(s) {rate:.2f} tokens/s{ratio}, {cpu:.2f} per CPU s")
            if row[f"floor_{streams}"] is not None:
                cells[-1] += (
                    f" (step floor {row[f'floor_{streams}']:.2f} tokens/s,"
                    f" {row[f'cpu_floor_{streams}']:.2f} per CPU s)"
                )
        print(f"{row['codec']:>8}: " + ", ".join(cells))
    render_rounds(rows)
    render_seal_split(rows)
    for check in decode_targets(rows):
        print(f"{'met' if check['met'] else 'MISSED'}: {check['what']} ({check['measured']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
