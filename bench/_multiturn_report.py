"""Summaries and the printed report of bench/multiturn.py, built from its results JSON alone,
so that ``--from-json`` prints an earlier run's report without measuring anything."""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loadgen import percentile
from _multiturn_cluster import Reply
from _report import div, num, render_table

__all__ = [
    "BIDIR",
    "PREFIX",
    "RECOMPUTE",
    "TurnResult",
    "counts",
    "print_report",
    "summarise_depth",
]

# The systems of part 1: (a), (b), (c).
RECOMPUTE, BIDIR, PREFIX = "recompute", "bidir-kv", "prefix"

# History-length buckets (prompt tokens): [low, high) and a label.
BUCKETS = (
    (0, 500, "<0.5k"),
    (500, 1500, "~1k"),
    (1500, 2500, "~2k"),
    (2500, 3500, "~3k"),
    (3500, 4500, "~4k"),
    (4500, 1 << 30, ">4.5k"),
)
TARGET_BUCKET = "~4k"
TARGET_RATIO = 8.0


@dataclass(frozen=True, slots=True)
class TurnResult:
    system: str
    session: str
    turn: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    answer: str | None = None
    error: str | None = None

    @classmethod
    def of(cls, system: str, session: str, turn: int, reply: Reply) -> TurnResult:
        return cls(
            system,
            session,
            turn,
            reply.prompt_tokens,
            reply.cached_tokens,
            reply.ttft_s,
            reply.e2e_s,
            reply.text,
        )


def _bucket(tokens: int) -> str:
    return next(label for low, high, label in BUCKETS if low <= tokens < high)


def _stats(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def summarise_depth(depth: dict[str, Any]) -> dict[str, Any]:
    turns = [TurnResult(**t) for t in depth["turns"]]
    ok = {(t.system, t.session, t.turn): t for t in turns if t.error is None}
    systems: list[str] = depth["systems"]

    def history(t: TurnResult) -> int:
        base = ok.get((RECOMPUTE, t.session, t.turn))
        return (base or t).prompt_tokens or 0

    buckets: dict[str, Any] = {}
    for _, _, label in BUCKETS:
        rows = {
            s: [t for t in ok.values() if t.system == s and _bucket(history(t)) == label]
            for s in systems
        }
        if not any(rows.values()):
            continue
        entry: dict[str, Any] = {s: _stats([t.ttft_s or 0.0 for t in rows[s]]) for s in systems}
        paired = [
            (ok[(RECOMPUTE, t.session, t.turn)].ttft_s or 0.0) / t.ttft_s
            for t in rows.get(BIDIR, [])
            if (RECOMPUTE, t.session, t.turn) in ok and t.ttft_s
        ]
        if RECOMPUTE in systems and BIDIR in systems:
            entry["ratio_p50"] = div(entry[RECOMPUTE]["p50"], entry[BIDIR]["p50"])
            entry["ratio_p99"] = div(entry[RECOMPUTE]["p99"], entry[BIDIR]["p99"])
            entry["ratio_paired_median"] = statistics.median(paired) if paired else None
        entry["history_tokens"] = sorted({history(t) for r in rows.values() for t in r})
        buckets[label] = entry
    both = [
        (ok[(RECOMPUTE, t.session, t.turn)].ttft_s or 0.0, t.ttft_s or 0.0)
        for t in ok.values()
        if t.system == BIDIR and (RECOMPUTE, t.session, t.turn) in ok
    ]
    saved = sum(a - b for a, b in both)
    pull_s = depth["pulls"]["pull_s"]
    agree = {
        s: [
            ok[(s, t.session, t.turn)].answer == t.answer
            for t in ok.values()
            if t.system == RECOMPUTE and (s, t.session, t.turn) in ok
        ]
        for s in systems
        if s != RECOMPUTE
    }
    target = buckets.get(TARGET_BUCKET, {}).get("ratio_p50")
    return {
        "buckets": buckets,
        "paired_turns": len(both),
        "sum_ttft_recompute_s": sum(a for a, _ in both),
        "sum_ttft_bidir_s": sum(b for _, b in both),
        "time_saved_s": saved,
        "pull_s": pull_s,
        "transfer_share": pull_s / saved if saved > 0 else None,
        "answers_equal": {s: [sum(v), len(v)] for s, v in agree.items()},
        "cached_tokens_bidir": sum(t.cached_tokens or 0 for t in ok.values() if t.system == BIDIR),
        "errors": [asdict(t) for t in turns if t.error is not None],
        "target": {
            "what": f"(a)/(b) p50 TTFT at {TARGET_BUCKET} >= {TARGET_RATIO:g}x",
            "value": target,
            "met": None if target is None else target >= TARGET_RATIO,
        },
    }


def summarise_policy(run: dict[str, Any]) -> dict[str, Any]:
    turns = [TurnResult(**t) for w in run.get("waves", []) for t in w]
    ok = [t for t in turns if t.error is None]
    heavy = [t for t in ok if t.session.startswith("H")]
    pulls = run.get("pulls", {})
    return {
        "all": _stats([t.ttft_s or 0.0 for t in ok]),
        "heavy": _stats([t.ttft_s or 0.0 for t in heavy]),
        "light": _stats([t.ttft_s or 0.0 for t in ok if not t.session.startswith("H")]),
        "waves_s": run.get("waves_s"),
        "errors": [asdict(t) for t in turns if t.error is not None]
        + [r for r in run.get("created", []) if r.get("error")],
        "routed": pulls.get("routed", {}),
        "readback": pulls.get("readback", {}),
        "nodes": pulls.get("nodes", {}),
        "answers": {t.session + f"#{t.turn}": t.answer for t in ok},
    }


# --- printing -----------------------------------------------------------------------------------


def counts(values: dict[str, float]) -> str:
    return " ".join(f"{k}:{v:.0f}" for k, v in sorted(values.items())) or "-"


def _complaints(where: str, by_deployment: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for children in by_deployment.values():
        for child, seen in children.items():
            lines.append(f"  {where}: {child} logged {seen['count']} warning/error line(s); last:")
            lines += [f"    {line[:300]}" for line in seen["last"]]
    return lines


def depth_report(depth: dict[str, Any], summary: dict[str, Any]) -> str:
    systems: list[str] = depth["systems"]
    header = ["history", "tokens"]
    for s in systems:
        header += [f"{s} n", "p50", "p99"]
    header += ["(a)/(b) p50", "p99", "paired"]
    rows = []
    for label, entry in summary["buckets"].items():
        tokens = entry["history_tokens"]
        row = [label, f"{tokens[0]}-{tokens[-1]}" if tokens else "-"]
        for s in systems:
            row += [str(entry[s]["n"]), num(entry[s]["p50"], 2), num(entry[s]["p99"], 2)]
        row += [
            num(entry.get("ratio_p50"), 1) + "x",
            num(entry.get("ratio_p99"), 1) + "x",
            num(entry.get("ratio_paired_median"), 1) + "x",
        ]
        rows.append(row)
    names = {
        RECOMPUTE: "(a) unified --no-prefix-caching",
        BIDIR: "(b) router + 1 prefill + 1 decode, bidirectional KV",
        PREFIX: "(c) unified, prefix caching",
    }
    lines = [
        render_table(
            "depth: TTFT in s per turn, by the history length (prompt tokens) of the turn; "
            "ratios of (a) over (b)",
            header,
            rows,
        ),
        "systems: " + "; ".join(f"{s} = {names[s]}" for s in systems),
    ]
    target = summary["target"]
    state = {True: "PASS", False: "MISS", None: "NOT MEASURED (no turn in that bucket)"}
    lines.append(
        f"target: {target['what']}: measured {num(target['value'], 1)}x  {state[target['met']]}"
    )
    pulls = depth["pulls"]
    share = summary["transfer_share"]
    lines.append(
        f"transfer: KV pull time {summary['pull_s']:.2f} s (prefill + decode nodes) over time "
        f"saved {summary['time_saved_s']:.1f} s (sum TTFT (a) {summary['sum_ttft_recompute_s']:.1f}"
        f" s - (b) {summary['sum_ttft_bidir_s']:.1f} s, {summary['paired_turns']} turns) = "
        + ("-" if share is None else f"{share * 100:.1f}% of the time saved")
    )
    for name, node in pulls["nodes"].items():
        lines.append(
            f"  {name}: {node['pulls_ok']:.0f} pulls ok, {node['pull_s']:.2f} s, "
            f"{node['blocks']:.0f} blocks, {node['bytes'] / 2**20:.1f} MiB; outcomes "
            f"{counts(node['outcomes'])}"
        )
    lines.append(
        f"  router read-back: {counts(pulls['readback'])}; (b) cached_tokens reported: "
        f"{summary['cached_tokens_bidir']}"
    )
    agree = "; ".join(f"{s} {v[0]}/{v[1]}" for s, v in summary["answers_equal"].items())
    lines.append(f"answers equal to (a)'s on the same turn (greedy): {agree}")
    machine = depth["machine"]
    lines.append(
        f"part 1 took {depth['elapsed_s']:.0f} s; machine busy {machine['machine_busy_pct']:.0f}%"
        f", of which other processes {machine['others_busy_pct']:.0f}%"
        + ("; CUT by the deadline" if depth["cut_by_deadline"] else "")
    )
    if depth["aborted"]:
        lines.append(f"ABORTED: {depth['aborted']}")
    lines += _complaints("part 1", depth.get("complaints", {}))
    for error in summary["errors"]:
        lines.append(
            f"ERROR {error['system']} {error['session']} turn {error['turn'] + 1}: {error['error']}"
        )
    return "\n".join(lines)


def policies_report(runs: dict[str, Any], plan: dict[str, Any]) -> str:
    summaries = {p: summarise_policy(r) for p, r in runs.items()}
    header = [
        "policy",
        "n",
        "TTFT p50",
        "p99",
        "heavy p50",
        "heavy p99",
        "light p50",
        "waves s",
        "prefill reqs",
        "prefill computed tok",
        "decode reqs",
        "read-back",
    ]
    rows = []
    for policy, s in summaries.items():
        rows.append(
            [
                policy,
                str(s["all"]["n"]),
                num(s["all"]["p50"], 2),
                num(s["all"]["p99"], 2),
                num(s["heavy"]["p50"], 2),
                num(s["heavy"]["p99"], 2),
                num(s["light"]["p50"], 2),
                num(s["waves_s"], 1),
                counts(s["routed"].get("prefill", {})),
                counts(
                    {
                        k.removeprefix("prefill"): v["computed_tokens"]
                        for k, v in s["nodes"].items()
                        if k.startswith("prefill") and "computed_tokens" in v
                    }
                ),
                counts(s["routed"].get("decode", {})),
                counts(s["readback"]),
            ]
        )
    title = (
        f"policies: {plan['prefill_nodes']} prefill + {plan['decode_nodes']} decode nodes, "
        f"sessions H L H L, {plan['waves']} waves of 4 turns at once; TTFT in s of the wave "
        "turns; per node (by index): requests and read-backs from the router, prompt tokens "
        "each prefill node computed (prefix-cache misses), waves only"
    )
    lines = [render_table(title, header, rows)]
    base = summaries.get("kv-aware")
    for policy, s in summaries.items():
        if base is None or policy == "kv-aware":
            continue
        lines.append(
            f"{policy} / kv-aware: TTFT p50 {num(div(s['all']['p50'], base['all']['p50']), 2)}x, "
            f"p99 {num(div(s['all']['p99'], base['all']['p99']), 2)}x, heavy p50 "
            f"{num(div(s['heavy']['p50'], base['heavy']['p50']), 2)}x, waves time "
            f"{num(div(s['waves_s'], base['waves_s']), 2)}x"
        )
    for policy, s in summaries.items():
        pulls = "; ".join(
            f"{name} {n['pulls_ok']:.0f} ok in {n['pull_s']:.2f} s"
            + (f" ({n['pull_s'] / n['pulls_ok']:.2f} s each)" if n["pulls_ok"] else "")
            + f" {n['bytes'] / 2**20:.0f} MiB"
            + (f" [{counts(n['outcomes'])}]" if n["outcomes"] else "")
            for name, n in s["nodes"].items()
        )
        machine = runs[policy].get("machine")
        busy = (
            ""
            if machine is None
            else f"; machine busy {machine['machine_busy_pct']:.0f}%, "
            f"others {machine['others_busy_pct']:.0f}%"
        )
        lines.append(f"  {policy} KV pulls: {pulls or '-'}{busy}")
        per_wave = runs[policy].get("computed_per_wave", [])
        if per_wave:
            lines.append(
                f"  {policy} prefill tokens computed per wave, by node: "
                + "; ".join(f"w{i + 1} {counts(w)}" for i, w in enumerate(per_wave))
            )
        for error in s["errors"]:
            lines.append(
                f"  ERROR {policy} {error['session']} turn {error['turn'] + 1}: {error['error']}"
            )
        lines += _complaints(policy, runs[policy].get("complaints", {}))
        if runs[policy].get("aborted"):
            lines.append(f"  ABORTED {policy}: {runs[policy]['aborted']}")
    answer_sets = {p: s["answers"] for p, s in summaries.items()}
    reference: dict[str, str | None] = next(iter(answer_sets.values()), {})
    same = [p for p, a in answer_sets.items() if a == reference]
    lines.append(f"answers identical across policies: {len(same)}/{len(answer_sets)} runs")
    return "\n".join(lines)


def print_report(saved: dict[str, Any]) -> None:
    if "depth" in saved:
        print(depth_report(saved["depth"], saved["depth_summary"]))
        print()
    if saved.get("policies"):
        print(policies_report(saved["policies"], saved["meta"]["plan"]))
        print()
