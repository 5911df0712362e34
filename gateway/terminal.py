"""Tables for a person to read, printed whole: no cell is cut with an ellipsis.

On a terminal a column whose ``overflow`` is ``"fold"`` folds its cells onto more lines
where the width runs out; into a pipe or a file (where rich assumes 80 columns) the table
is as wide as it needs, up to ``MAX_TABLE_WIDTH``, so a row is a line a script can read.
``understudy candidates list`` and ``understudy load`` print this way.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

__all__ = ["MAX_TABLE_WIDTH", "print_table"]

MAX_TABLE_WIDTH = 1_000


def print_table(table: Table) -> None:
    console = Console()
    if not console.is_terminal:
        wide = console.options.update_width(MAX_TABLE_WIDTH)
        console = Console(width=max(console.width,
                                    Measurement.get(console, wide, table).maximum))
    console.print(table)
