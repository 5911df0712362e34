"""Exchanges scored per second per core by the default scorers, one at a time vs in
batches as the scoring child takes them, side by side in one run.

    .venv/bin/python bench/score.py [--quick] [--rounds N] [--batch-size N]

The workload is what a candidate that is not word for word the primary produces:
exchanges with 200-token answers (WordPiece tokens, the encoder reads up to 256), the
candidate's answer a paraphrase-like rewrite of the primary's (a fifth of its words
changed), streamed, with usage, under the default scorers (all of them, the sentence
encoder included) and a token price and a GPU-hour price so that cost is computed.

Rules of the measurement:
1. One process, BLAS held to one thread (the encoder's default), so CPU time is one
   core's: rate per core = exchanges / process CPU seconds (``time.process_time``).
   Wall-clock rate is reported too; the machine's load average is printed with it.
2. Each round scores the same exchanges both ways, alternating which goes first:
   "single" calls ``score_exchange`` per exchange (what the child did before), "batched"
   calls ``score_batch`` over slices of ``--batch-size`` (the child's default), each
   with its own fresh scorers (the throughput window is state) and the one encoder.
3. The batched scores are checked against the single ones (within 1e-5); a mismatch
   fails the run.
4. Target (issue 15): >= 200 exchanges/s per core. The median over rounds is reported.

Results go to stdout and to bench/results/score.json.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import (  # noqa: E402
    RESULTS_DIR,
    div,
    loadavg,
    median,
    num,
    render_table,
    write_results,
)

from evaluators import DEFAULT_SCORERS, Exchange, Observation, Usage  # noqa: E402
from evaluators._embedding import SentenceEncoder  # noqa: E402
from evaluators._pipeline import DEFAULT_BATCH_SIZE  # noqa: E402
from evaluators._price import GpuHourPrice, TokenPrice  # noqa: E402
from evaluators._score import Score, Scorer, score_batch, score_exchange  # noqa: E402
from evaluators._scorers import ScorerConfig, build_scorers  # noqa: E402

RESULTS_PATH = RESULTS_DIR / "score.json"
ANSWER_TOKENS = 200
CHANGED_SHARE = 0.2
TARGET_PER_CORE = 200.0
TOLERANCE = 1e-5
PRICES = {"primary": TokenPrice(prompt_usd_per_mtok=0.5, completion_usd_per_mtok=1.5),
          "cand": GpuHourPrice(gpu_usd_per_hour=2.0)}
VOCABULARY = (
    "the gateway mirrors a sample of traffic to each candidate deployment and compares "
    "answers on quality latency throughput and cost while the primary keeps serving every "
    "client request with its own stream of tokens prefix cache memory budget buffer "
    "session replica promotion rollback canary judge statistics evaluation model engine "
    "quantized kernel attention batch decode prefill router transfer block hash store"
).split()


def _answer(rng: random.Random, tokenizer_len: Any) -> str:
    words: list[str] = []
    while tokenizer_len(" ".join(words)) < ANSWER_TOKENS:
        words.append(rng.choice(VOCABULARY))
    return " ".join(words)


def workload(count: int, encoder: SentenceEncoder) -> list[Exchange]:
    rng = random.Random(15)
    tokenizer = encoder._tokenizer  # the bench sizes answers in the encoder's tokens

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    exchanges = []
    for i in range(count):
        primary_text = _answer(rng, tokens)
        words = primary_text.split()
        for j in rng.sample(range(len(words)), int(len(words) * CHANGED_SHARE)):
            words[j] = rng.choice(VOCABULARY)
        started = 1_000.0 + i * 0.05
        primary = Observation(
            request_id=f"r{i}", backend="primary", route="chat_completions", status=200,
            streamed=True, started_at=started, ttft_s=0.05,
            chunk_gaps_s=tuple(0.02 for _ in range(ANSWER_TOKENS - 1)), e2e_s=4.0,
            usage=Usage(prompt_tokens=300, completion_tokens=ANSWER_TOKENS,
                        cached_tokens=None),
            finish_reason="stop", text=primary_text, tool_calls=(), model="m", bytes=40_000,
            truncated=False, error=None)
        candidate = Observation(
            request_id=f"r{i}", backend="cand", route="chat_completions", status=200,
            streamed=True, started_at=started + 0.001, ttft_s=0.06,
            chunk_gaps_s=tuple(0.021 for _ in range(ANSWER_TOKENS - 1)), e2e_s=4.3,
            usage=Usage(prompt_tokens=300, completion_tokens=ANSWER_TOKENS,
                        cached_tokens=128),
            finish_reason="stop", text=" ".join(words), tool_calls=(), model="m",
            bytes=40_000, truncated=False, error=None)
        exchanges.append(Exchange(request_id=f"r{i}", session_key=f"s{i}",
                                  route="chat_completions", candidate="cand",
                                  primary=primary, candidate_observation=candidate))
    return exchanges


def _scorers(encoder: SentenceEncoder) -> list[Scorer]:
    return build_scorers(DEFAULT_SCORERS, ScorerConfig(prices=PRICES), encoder=encoder)


def run_single(exchanges: list[Exchange], encoder: SentenceEncoder
               ) -> tuple[list[list[Score]], float, float]:
    scorers = _scorers(encoder)
    cpu, wall = time.process_time(), time.perf_counter()
    scores = [score_exchange(e, scorers) for e in exchanges]
    return scores, time.process_time() - cpu, time.perf_counter() - wall


def run_batched(exchanges: list[Exchange], encoder: SentenceEncoder, batch_size: int
                ) -> tuple[list[list[Score]], float, float]:
    scorers = _scorers(encoder)
    scores: list[list[Score]] = []
    cpu, wall = time.process_time(), time.perf_counter()
    for start in range(0, len(exchanges), batch_size):
        for result in score_batch(exchanges[start:start + batch_size], scorers):
            if isinstance(result, Exception):
                raise result
            scores.append(result)
    return scores, time.process_time() - cpu, time.perf_counter() - wall


def max_difference(a: list[list[Score]], b: list[list[Score]]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            assert s.metric == t.metric
            for u, v in ((s.candidate, t.candidate), (s.primary, t.primary)):
                if (u is None) != (v is None):
                    return math.inf
                if u is not None and v is not None:
                    worst = max(worst, abs(u - v))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 32 exchanges")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 3; 1 quick)")
    parser.add_argument("--exchanges", type=int, default=0,
                        help="exchanges per round (default 128; 32 quick)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    count = args.exchanges or (32 if args.quick else 128)

    encoder = SentenceEncoder()
    exchanges = workload(count, encoder)
    run_batched(exchanges[:2], encoder, 2)  # warm up: first BLAS calls, allocator
    print(f"{count} exchanges of {ANSWER_TOKENS}-token answers, default scorers "
          f"({len(DEFAULT_SCORERS)}), batch size {args.batch_size}, {rounds} round(s); "
          f"loadavg {loadavg()}, {os.cpu_count()} cores", flush=True)
    per_round: list[dict[str, Any]] = []
    for r in range(rounds):
        order = ("single", "batched") if r % 2 == 0 else ("batched", "single")
        figures: dict[str, Any] = {}
        results: dict[str, list[list[Score]]] = {}
        for mode in order:
            if mode == "single":
                scores, cpu, wall = run_single(exchanges, encoder)
            else:
                scores, cpu, wall = run_batched(exchanges, encoder, args.batch_size)
            results[mode] = scores
            figures[mode] = {"cpu_s": cpu, "wall_s": wall, "per_core": div(count, cpu),
                             "per_s_wall": div(count, wall)}
        figures["max_difference"] = max_difference(results["single"], results["batched"])
        if figures["max_difference"] > TOLERANCE:
            print(f"batched scores differ from single ones by {figures['max_difference']}")
            return 1
        per_round.append(figures)
        print(f"round {r + 1}: single {num(figures['single']['per_core'])}/s per core, "
              f"batched {num(figures['batched']['per_core'])}/s per core", flush=True)

    summary = {mode: {key: median(f[mode][key] for f in per_round)
                      for key in ("per_core", "per_s_wall", "cpu_s")}
               for mode in ("single", "batched")}
    single, batched = summary["single"]["per_core"], summary["batched"]["per_core"]
    rows = [[mode, num(summary[mode]["per_core"]), num(summary[mode]["per_s_wall"]),
             num(div(1000.0, summary[mode]["per_core"]))] for mode in ("single", "batched")]
    print(render_table("exchanges scored (medians over rounds)",
                       ["mode", "per core /s", "wall /s", "CPU ms/exchange"], rows))
    met = "met" if (batched or 0) >= TARGET_PER_CORE else "NOT met"
    print(f"batched / single: {num(div(batched, single), 2)}x; target "
          f"{TARGET_PER_CORE:g}/s per core: {met}"
          f"; max |batched - single| {max(f['max_difference'] for f in per_round):.1e}")
    document = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "loadavg": loadavg()},
                "exchanges": count, "answer_tokens": ANSWER_TOKENS,
                "batch_size": args.batch_size, "rounds": per_round, "summary": summary,
                "target_per_core": TARGET_PER_CORE, "quick": args.quick}
    print(write_results(RESULTS_PATH, document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
