"""What every benchmark prints: figures as text, medians over rounds, tables, the results file.

Rules:
1. A figure that was not measured is ``None`` and prints as ``-``; a median or a ratio of
   figures some of which are missing is taken over those present (``None`` if none is).
2. Tables right-align every column; the plain form is the default (it is what the logs
   and the README show), ``rich=True`` draws it with rich where rich is installed.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "div", "load_figures", "loadavg", "median", "ms", "num",
           "render_table", "signed", "write_results"]

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def signed(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def load_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one load generator run (bench/_loadgen.py) that every report shows:
    counts, rates, and TTFT and end-to-end p50/p99 in ms."""
    ttft, e2e = result["ttft_s"], result["e2e_s"]
    return {
        "ok": result["ok"], "errors": result["errors"], "cut": result["cut_by_deadline"],
        "error_samples": result["error_samples"], "elapsed_s": result["elapsed_s"],
        "rps": result["rps"], "chunks_per_s": result["events_per_s"],
        "events": result["events"],
        "ttft_p50_ms": ms(ttft.get("p50")), "ttft_p99_ms": ms(ttft.get("p99")),
        "e2e_p50_ms": ms(e2e.get("p50")), "e2e_p99_ms": ms(e2e.get("p99")),
    }


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg has them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def render_table(title: str, header: list[str], rows: list[list[str]], *,
                 rich: bool = False) -> str:
    if rich:
        try:
            from rich.console import Console  # type: ignore[import-not-found,unused-ignore]
            from rich.table import Table  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            pass
        else:
            table = Table(title=title)
            for h in header:
                table.add_column(h, justify="right")
            for r in rows:
                table.add_row(*r)
            console = Console(width=260, record=True)
            with console.capture() as capture:
                console.print(table)
            return str(capture.get()).rstrip()
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def write_results(path: Path, document: dict[str, Any]) -> str:
    """Write a run's results as JSON; the line that says where (from the repository root
    when inside it), for the log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return f"results: {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}"
