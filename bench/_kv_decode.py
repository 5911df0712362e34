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
   per stream and per round, so no prefix is shared), greedy, ``ignore_eos``, ``DECODE_TOKENS``
   tokens each.  The clock starts when every stream has its first token (the prefill is not
   timed) and stops when the last one finishes; the rate is the tokens produced in between over
   that time.  Under a codec this covers what decode pays: reading decoded blocks through the
   pool's cache, a miss decoded again, and the block each stream completes encoded.
3. Rounds alternate the codecs (``DECODE_ROUNDS``, or ``--rounds``; each codec once per round,
   in order) and a codec's figure is its best round: the machine is shared, and the best round
   is the one least disturbed by others.  The ratios are what to read, not the absolute rates.
4. Every engine runs as served, prompt-lookup drafts included (``Engine`` rule 5; under a codec
   they stop short of a block's last position): the prompts count up token ids, so greedy
   answers repeat and drafts are accepted at 1 stream, where a step has rows to spare.

5. ``--encode`` first times what a stream pays when it completes a block: encoding one block
   (``DEFAULT_BLOCK_SIZE`` tokens, the model's own keys and values after the sink, calibrated
   as served) per layer and role, each codec's per-layer codecs over the same blocks, rounds
   alternating the codecs (``ENCODE_ROUNDS``, the best round), in microseconds per block and
   as a ratio to kivi-2's.

Run alone on a few codecs (the same measurement as ``bench/kvquant.py --decode-only``, which
runs every served codec): ``.venv/bin/python bench/_kv_decode.py fp32 kivi-2 e8-2``;
``--encode`` adds the encode table, ``--encode-only`` runs just it (seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from backends.engine import Engine, LlamaModel
from backends.engine.kv._store import DEFAULT_BLOCK_SIZE
from backends.engine.kv.codecs import KVCodec, Role, codec_by_name
from backends.engine.kv.codecs._codec import ROLES, Float32Array
from backends.engine.kv.codecs._quality import capture_kv
from backends.engine.kv.codecs._texts import CALIBRATION_TEXTS
from backends.engine.model._sampling import SamplingParams

__all__ = ["DECODE_STREAMS", "decode_rows", "decode_targets", "encode_rows"]

DECODE_STREAMS = (1, 8)
DECODE_PROMPT_TOKENS = 128
DECODE_TOKENS = 32
DECODE_ROUNDS = 2
DECODE_KV_MIB = 256
_FIRST_ID = 1_000  # ordinary text tokens: above SmolLM2's special and byte tokens
_ROUND_STRIDE = 10_000
TARGET_E8_VS_KIVI2 = 1.0
TARGET_E8_VS_FP32 = 0.8
ENCODE_BLOCKS = 8
ENCODE_ROUNDS = 5


def _sample(engine: Engine, streams: int, round_number: int) -> float:
    """Rule 2: one burst of ``streams`` greedy streams; decode tokens/s once all have started."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    base = _FIRST_ID + round_number * _ROUND_STRIDE
    started: set[str] = set()
    for stream in range(streams):
        first = base + stream * DECODE_PROMPT_TOKENS
        prompt = list(range(first, first + DECODE_PROMPT_TOKENS))
        engine.add_request(f"decode-{round_number}-{streams}-{stream}", prompt, params)
    clock = 0.0
    produced = 0
    while engine.has_unfinished_requests():
        events = engine.step()
        if len(started) < streams:
            started.update(event.request_id for event in events)
            if len(started) == streams:
                clock = time.perf_counter()
            continue
        produced += len(events)
    return produced / (time.perf_counter() - clock)


def decode_rows(
    model: LlamaModel,
    codecs: Sequence[str],
    calibration: tuple[Sequence[Float32Array], Sequence[Float32Array]],
    say: Callable[[str], None],
    rounds: int = DECODE_ROUNDS,
) -> list[dict[str, Any]]:
    """Per codec, decode tokens/s at each of ``DECODE_STREAMS`` (rules 1-3), best of
    ``rounds``."""
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
    best: dict[tuple[str, int], float] = {}
    for round_number in range(rounds):
        for streams in DECODE_STREAMS:
            for name, engine in engines.items():
                rate = _sample(engine, streams, round_number)
                best[name, streams] = max(rate, best.get((name, streams), 0.0))
                say(f"decode round {round_number} {name} x{streams}: {rate:.1f} tokens/s")
    return [
        {"codec": name, **{f"decode_{streams}": best[name, streams] for streams in DECODE_STREAMS}}
        for name in codecs
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
    for round_number in range(ENCODE_ROUNDS):
        for name, per_layer in built.items():
            clock = time.perf_counter()
            for layer, role, block in work:
                per_layer[layer].encode(block, role)
            micros = (time.perf_counter() - clock) / len(work) * 1e6
            best[name] = min(micros, best.get(name, float("inf")))
            say(f"encode round {round_number} {name}: {micros:.0f} us per block")
    return [{"codec": name, "encode_us": best[name]} for name in codecs]


def render_encode(rows: list[dict[str, Any]]) -> None:
    """The encode table (rule 5), with each codec's ratio to kivi-2's where measured."""
    kivi = next((row["encode_us"] for row in rows if row["codec"] == "kivi-2"), None)
    for row in rows:
        ratio = "" if kivi is None else f" ({row['encode_us'] / kivi:.2f}x kivi-2)"
        print(f"{row['codec']:>8}: encode {row['encode_us']:.0f} us per block{ratio}")


def decode_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """e8-2's decode rate against kivi-2's and fp32's, at each stream count (issue 14)."""
    by = {row["codec"]: row for row in rows}
    if "e8-2" not in by:
        return []
    checks = []
    for other, target in (("kivi-2", TARGET_E8_VS_KIVI2), ("fp32", TARGET_E8_VS_FP32)):
        if other not in by:
            continue
        for streams in DECODE_STREAMS:
            key = f"decode_{streams}"
            ratio = by["e8-2"][key] / by[other][key]
            checks.append(
                {
                    "what": f"e8-2 decode tokens/s at {streams} stream(s) >= {target:g}x {other}'s",
                    "measured": ratio,
                    "met": ratio >= target,
                }
            )
    return checks


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
    with threadpool_limits(args.threads, "blas"):
        if args.encode or args.encode_only:
            render_encode(encode_rows(model, args.codecs, calibration, say))
        rows = (
            []
            if args.encode_only
            else decode_rows(model, args.codecs, calibration, say, args.rounds)
        )
    model.close()
    fp32 = next((row for row in rows if row["codec"] == "fp32"), None)
    for row in rows:
        cells = []
        for streams in DECODE_STREAMS:
            rate = row[f"decode_{streams}"]
            ratio = "" if fp32 is None else f" ({rate / fp32[f'decode_{streams}']:.2f}x fp32)"
            cells.append(f"{streams} stream(s) {rate:.2f} tokens/s{ratio}")
        print(f"{row['codec']:>8}: " + ", ".join(cells))
    for check in decode_targets(rows):
        print(f"{'met' if check['met'] else 'MISSED'}: {check['what']} ({check['measured']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
