"""Time, cost and energy of a training run across GPU types and counts (``stratagem frontier``).

:mod:`economics` turns a plan's predicted step time into days, GPU-hours, dollars and megawatt-hours;
:mod:`pareto` marks the rows no other row beats in (time, cost) and (time, energy); :mod:`table` formats the rows
(CSV, a terminal table, the choice under a deadline or budget). The searches themselves are `stratagem plan`'s,
run by the CLI (``planner.cli.cmd_frontier``).
"""

from planner.frontier.economics import RunEconomics, gpu_counts, run_economics, utilisation
from planner.frontier.pareto import pareto_front
from planner.frontier.table import FrontierRow, choose_within, csv_text, mark_pareto, terminal_lines

__all__ = [
    "FrontierRow",
    "RunEconomics",
    "choose_within",
    "csv_text",
    "gpu_counts",
    "mark_pareto",
    "pareto_front",
    "run_economics",
    "terminal_lines",
    "utilisation",
]
