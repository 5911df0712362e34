"""``understudy demo``: the real-model story on one machine (see ``demo._run``)."""

from demo._cli import demo_command
from demo._run import DemoSpec, run_demo
from demo._scorecard import CandidateCard, Scorecard

__all__ = ["CandidateCard", "DemoSpec", "Scorecard", "demo_command", "run_demo"]
