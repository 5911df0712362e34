"""``understudy demo``: the command line of ``run_demo``.

SIGINT, SIGTERM and SIGHUP end a demo the way Ctrl-C does (``demo.processes`` rule 4):
``run_demo`` unwinds and stops every process it started (seven engines and the gateway),
and the exit status is 128 + the signal's number, whatever exception carried it up (rule 6).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from demo._spec import DemoSpec

__all__ = ["demo_command"]

_DEFAULTS = DemoSpec()


class _NumberRange(click.FloatRange):
    """``FloatRange`` that refuses NaN: it compares false with both bounds, so click lets it
    through, and the demo would start its engines to fail minutes later."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number.", param, ctx)
        return number


@click.command("demo")
@click.option("--sessions", type=click.IntRange(1, 1000), default=_DEFAULTS.sessions,
              show_default=True, help="Agentic sessions to drive through the gateway.")
@click.option("--turns", type=click.IntRange(1, 16), default=_DEFAULTS.turns,
              show_default=True, help="Turns per session, at most.")
@click.option("--minutes", type=_NumberRange(0.1, 120), default=_DEFAULTS.minutes,
              show_default=True, help="No session starts after this (in-flight ones finish).")
@click.option("--rate", type=_NumberRange(0.01, 100), default=_DEFAULTS.rate,
              show_default=True, help="Session arrivals per second (Poisson).")
@click.option("--min-samples", type=click.IntRange(10, 10_000),
              default=_DEFAULTS.min_samples, show_default=True,
              help="The gates' samples per metric below which a verdict is INCONCLUSIVE.")
@click.option("--primary-vllm", is_flag=True,
              help="The primary and its replica are the real vLLM built by "
                   "scripts/setup-vllm.sh, not the reference engine.")
@click.option("--no-promote", is_flag=True, help="Show what would be promoted; change nothing.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where logs, config, store and scorecard.json go (default: a new "
                   "temporary folder).")
def demo_command(sessions: int, turns: int, minutes: float, rate: float, min_samples: int,
                 primary_vllm: bool, no_promote: bool, workdir: Path | None) -> None:
    """Run the real-model demo: a primary, its replica and three candidates behind the
    gateway, agentic traffic, the scorecard, and a promotion."""
    from demo._run import run_demo  # the gateway, the store, the workload: not for --help
    from demo.processes import ended_by_signals

    try:
        with ended_by_signals("the demo"):  # its status: 128 + a stop signal's number
            run_demo(DemoSpec(sessions=sessions, turns=turns, minutes=minutes, rate=rate,
                              min_samples=min_samples, primary_vllm=primary_vllm,
                              promote=not no_promote, workdir=workdir))
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
