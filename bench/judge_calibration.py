"""How often the judge calls an identical candidate worse, and how often it catches a worse one.

    .venv/bin/python bench/judge_calibration.py [--quick] [--trials N] [--sizes N ...]
                                                [--looks K] [--rev GIT_REV]

The judge (``evaluators.judge``) gates ~17 metrics with ~25 checks, each a test at the
gates' confidence. This benchmark feeds it synthetic windows whose truth is known and counts
its verdicts over many seeded trials:

- ``identical``: candidate and primary drawn from the same distributions (an A/A test);
  every FAIL is a false alarm, and every verdict but PASS holds back a candidate that is
  as good as the primary;
- ``identical + replica``: the same with a noise-floor replica, so the pairwise metrics
  are judged against the floor (what the README recommends);
- ``worse``: the candidate 30 % slower (TTFT, inter-token latency, end to end), with 10
  points fewer exact matches and 3 points more errors: every verdict but FAIL misses it;
- ``slightly slower``: 4 % slower, inside the 10 % median-shift gate: a FAIL is a false
  alarm there too.

Rules of the measurement:
1. Trial ``t`` of a cell draws from a generator seeded by (scenario, size, t) and judges
   with seed ``t``, so a cell is the same on every run and under every code revision.
2. The distributions: latencies log-normal (median 0.2 s, sigma 0.3), decode rate their
   inverse, cost gamma, 0/1 rates and agreements Bernoulli (success 0.99, JSON validity
   0.95, exact match 0.7, tool calls 0.9, finish reason 0.95), similarities beta (mean
   0.91 and 0.8), cache ratio uniform (not gated), any other 0/1 metric Bernoulli 0.99.
   The windows are chat traffic's: no embeddings answer, so no ``quality.embedding_distance``.
   Per-exchange latency ratios are ratios of two latencies.
3. ``--looks K`` also judges each trial as a canary judges a held step: every interval
   again, on its growing window. Trial ``t``'s window of the largest size is judged at
   ``K`` nested prefixes (``n/K``, ``2n/K``, ... ``n``); a FAIL before the first PASS is a
   rollback (a PASS moves the canary on), and a FAIL at any look is counted too. Each
   look is judged twice: at the gates' confidence every time ("one level", how canaries
   were judged before), and at the level the canary spends on that look
   (``Gates.for_look``, "spent"), where the revision has it.
4. ``--rev`` judges the same trials with another revision's ``evaluators`` (``git
   archive``), in a second process at the same time, and prints the two side by side.
   The figures are counts, not timings: the machine's load does not change them.

Results go to stdout and to bench/results/judge_calibration.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import code_revision, export_code, git_commit, popen, run_main  # noqa: E402
from _report import RESULTS_DIR, render_table, write_results  # noqa: E402

OUTCOMES = ("PASS", "MARGINAL", "INCONCLUSIVE", "FAIL")
SCENARIOS = ("identical", "identical + replica", "worse", "slightly slower")
RESULTS = RESULTS_DIR / "judge_calibration.json"
LATENCY_MEDIAN_S = 0.2
LATENCY_SIGMA = 0.3
RATES = {"reliability.success": 0.99, "quality.json_valid": 0.95,
         "quality.choices_complete": 0.999}
OTHER_RATE = 0.99
"""Any other 0/1 per-backend metric's rate."""
AGREEMENTS = {"quality.exact_match": 0.7, "quality.tool_call_match": 0.9,
              "quality.finish_reason_match": 0.95}
SIMILARITIES = {"quality.semantic_similarity": (20.0, 2.0), "quality.edit_similarity": (8.0, 2.0),
                "quality.token_f1": (8.0, 2.0)}
WORSE = {"slowdown": 1.3, "quality.exact_match": -0.10, "reliability.success": -0.03}
SLIGHTLY_SLOWER = 1.04

Window = dict[str, Any]


def _window(rng: np.random.Generator, n: int, scenario: str, metrics: Any,
            samples_type: Any) -> Window:
    """One judged window of ``n`` exchanges a side (rule 2)."""
    slowdown = {"worse": WORSE["slowdown"], "slightly slower": SLIGHTLY_SLOWER}.get(scenario, 1.0)
    worse = scenario == "worse"

    def latency(scale: float = 1.0) -> Any:
        return rng.lognormal(np.log(LATENCY_MEDIAN_S), LATENCY_SIGMA, n) * scale

    def bernoulli(p: float) -> Any:
        return (rng.random(n) < p).astype(float)

    def per_backend(name: str, unit: str, candidate: bool) -> Any:
        scale = slowdown if candidate else 1.0
        if unit == "1/0":
            drop = WORSE.get(name, 0.0) if worse and candidate else 0.0
            return bernoulli(RATES.get(name, OTHER_RATE) + drop)
        if name.startswith("throughput."):
            return 10.0 / latency(scale)
        if name.startswith("cost."):
            return rng.gamma(4.0, 0.001, n)
        if name.startswith("cache."):
            return rng.random(n)
        return latency(scale)

    out: Window = {}
    for name, spec in metrics.items():
        if name == "quality.embedding_distance":
            continue  # chat traffic: no embeddings answer to compare
        if spec.kind == "per_backend":
            out[name] = samples_type(candidate=per_backend(name, spec.unit, True),
                                     baseline=per_backend(name, spec.unit, False))
            continue
        if name in AGREEMENTS:
            p = AGREEMENTS[name]
            values = bernoulli(p + (WORSE.get(name, 0.0) if worse else 0.0))
            floor_values = bernoulli(p)
        elif spec.unit == "ratio":
            values = latency(slowdown) / latency()
            floor_values = latency() / latency()
        else:
            a, b = SIMILARITIES.get(name, (8.0, 2.0))
            values, floor_values = rng.beta(a, b, n), rng.beta(a, b, n)
        replica = scenario != "identical"
        out[name] = samples_type(candidate=values,
                                 noise_floor=floor_values if replica else None)
    return out


def judge_cells(sizes: list[int], trials: int) -> dict[str, dict[str, int]]:
    """Every (scenario, size) cell's verdict counts, judged by the ``evaluators`` on
    ``sys.path``."""
    from evaluators._gates import Gates
    from evaluators._judge import judge
    from evaluators._score import METRICS
    from evaluators._verdicts import MetricSamples

    directions = {name: spec.direction for name, spec in METRICS.items()}
    gates = Gates()
    cells: dict[str, dict[str, int]] = {}
    for scenario in SCENARIOS:
        for n in sizes:
            counts: Counter[str] = Counter()
            for t in range(trials):
                seed = zlib.crc32(f"{scenario}/{n}/{t}".encode())
                window = _window(np.random.default_rng(seed), n, scenario, METRICS,
                                 MetricSamples)
                counts[judge(window, gates, directions, seed=t).outcome.value] += 1
            cells[f"{scenario}|{n}"] = {o: counts[o] for o in OUTCOMES}
    return cells


HELD = ("rolled back", "FAIL at any look", "moved on", "held throughout")


POLICIES = ("one level", "spent")


def held_step_cells(n: int, trials: int, looks: int) -> dict[str, dict[str, dict[str, int]]]:
    """Rule 3: each scenario's counts, by policy, of what a canary does with one held step
    judged at ``looks`` nested prefixes of a window of ``n``."""
    import dataclasses

    from evaluators._gates import Gates
    from evaluators._judge import judge
    from evaluators._score import METRICS
    from evaluators._verdicts import MetricSamples

    def prefix(window: Window, size: int) -> Window:
        return {name: dataclasses.replace(samples, **{
            field: values[:size] for field in ("candidate", "baseline", "noise_floor")
            if (values := getattr(samples, field)) is not None})
            for name, samples in window.items()}

    directions = {name: spec.direction for name, spec in METRICS.items()}
    gates = Gates()
    policies: dict[str, Callable[[int], Any]] = {"one level": lambda look: gates}
    if hasattr(gates, "for_look"):  # a revision before it judged every look at one level
        policies["spent"] = gates.for_look
    cells: dict[str, dict[str, dict[str, int]]] = {}
    for scenario in SCENARIOS:
        counts = {policy: Counter[str]() for policy in policies}
        for t in range(trials):
            seed = zlib.crc32(f"{scenario}/{n}/{t}".encode())
            window = _window(np.random.default_rng(seed), n, scenario, METRICS, MetricSamples)
            for policy, gates_at in policies.items():
                verdicts = [judge(prefix(window, n * k // looks), gates_at(k), directions,
                                  seed=t).outcome.value for k in range(1, looks + 1)]
                _count_held(counts[policy], verdicts)
        cells[scenario] = {policy: {key: counted[key] for key in HELD}
                           for policy, counted in counts.items()}
    return cells


def _count_held(counts: Counter[str], verdicts: list[str]) -> None:
    moved = "PASS" in verdicts
    before_pass = verdicts[:verdicts.index("PASS")] if moved else verdicts
    counts["FAIL at any look"] += "FAIL" in verdicts
    counts["rolled back"] += "FAIL" in before_pass
    counts["moved on"] += moved and "FAIL" not in before_pass
    counts["held throughout"] += not moved and "FAIL" not in verdicts


def _spawn(stack: ExitStack, code: Path, sizes: list[int], trials: int,
           looks: int) -> subprocess.Popen[str]:
    """A judging worker on ``code``, stopped when ``stack`` closes (``_procs`` rule 3)."""
    argv = [sys.executable, __file__, "--worker", str(code), "--trials", str(trials),
            "--looks", str(looks), "--sizes", *map(str, sizes)]
    return popen(stack, argv, stdout=subprocess.PIPE, text=True)


def _collect(child: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"a judging process failed (exit {child.returncode})")
    result: dict[str, Any] = json.loads(out)
    return result


def _rate(counts: dict[str, int], *outcomes: str) -> str:
    total = sum(counts.values())
    return f"{sum(counts[o] for o in outcomes) / total:.0%}" if total else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 exchanges a side, 40 trials")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--looks", type=int, default=1,
                        help="also judge a held canary step this many times (rule 3)")
    parser.add_argument("--rev", help="judge the same trials with this git revision too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trials < 1 or min(args.sizes) < 2 or args.looks < 1:
        parser.error("--trials and --looks must be at least 1 and every size at least 2")
    if max(args.sizes) // args.looks < 2:
        parser.error("--looks: the first look needs at least 2 exchanges a side")
    if args.quick:
        args.sizes, args.trials = [300], 40
    if args.worker is not None:
        sys.path.insert(0, args.worker)
        held = (held_step_cells(max(args.sizes), args.trials, args.looks)
                if args.looks > 1 else {})
        print(json.dumps({"cells": judge_cells(args.sizes, args.trials), "held": held}))
        return 0
    revisions = {"this tree": code_revision(("evaluators",))}
    with tempfile.TemporaryDirectory(prefix="judge-calibration-") as tmp, ExitStack() as stack:
        children = {"this tree": _spawn(stack, REPO_ROOT, args.sizes, args.trials, args.looks)}
        if args.rev is not None:
            revisions[args.rev] = git_commit(args.rev)
            children[args.rev] = _spawn(stack, export_code(Path(tmp), args.rev), args.sizes,
                                        args.trials, args.looks)
        results = {label: _collect(child) for label, child in children.items()}
    header = ["scenario", "n a side"]
    for label in results:
        header += [f"{label}: PASS", "MARGINAL", "INCONCL.", "FAIL"]
    rows = []
    for scenario in SCENARIOS:
        for n in args.sizes:
            row = [scenario, str(n)]
            for result in results.values():
                counts = result["cells"][f"{scenario}|{n}"]
                row += [_rate(counts, o) for o in OUTCOMES]
            rows.append(row)
    print(render_table(f"The judge's verdicts over {args.trials} seeded trials a cell "
                       f"(default gates; {', '.join(f'{k}: {v}' for k, v in revisions.items())})",
                       header, rows))
    print("False alarms: FAIL under 'identical' and 'slightly slower'; misses: anything but "
          "FAIL under 'worse'.")
    if args.looks > 1:
        n = max(args.sizes)
        columns = [(label, policy) for label, result in results.items()
                   for policy in POLICIES if policy in result["held"][SCENARIOS[0]]]
        header = ["scenario"] + [f"{label}, {policy}: {HELD[0]}" if i == 0 else key
                                 for label, policy in columns for i, key in enumerate(HELD)]
        rows = [[scenario] + [f"{results[label]['held'][scenario][policy][key] / args.trials:.0%}"
                              for label, policy in columns for key in HELD]
                for scenario in SCENARIOS]
        print(render_table(f"A held canary step judged {args.looks} times on its growing "
                           f"window ({n // args.looks} to {n} a side), {args.trials} trials",
                           header, rows))
        print("A rollback is a FAIL before the first PASS (a PASS moves the canary on).")
    print(write_results(RESULTS, {"trials": args.trials, "sizes": args.sizes,
                                  "looks": args.looks, "revisions": revisions,
                                  "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
