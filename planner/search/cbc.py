"""Running CBC on a built program: :func:`solve` with a time limit, a cutoff, and an honest status and gap.

Split from ``planner.search.ilp`` (which builds the program): :class:`Problem` is what ``build_problem``
returns; :class:`SolveResult` is what CBC proved about it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulp

from planner.search.config import SearchConfig
from planner.search.tables import Tables

log = logging.getLogger(__name__)
_WARNINGS_LOCK = threading.Lock()   # warnings.catch_warnings is process-global; solves may run in threads


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A built program and the variables needed to read its answer back."""

    prob: pulp.LpProblem
    tables: Tables
    count: dict[tuple[int, int, int], Any]   # (pp rank r, group g, option i) -> integer variable
    cumulative: dict[tuple[int, int], Any]   # (group g, chunk s) -> layers of g in chunks <= s
    objective_scale_s: float                 # the objective is in units of this many seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveResult:
    """Outcome of one CBC run.

    ``status``: optimal | feasible | time_limit | infeasible | cut_off. ``cut_off``: CBC proved that no
    solution is better than the cutoff it was given (the candidate's optimum is >= ``bound_s``).
    ``bound_s``: the proven lower bound on the candidate's optimum in seconds (the objective when optimal,
    the cutoff when cut off, -inf when nothing is known).
    """

    status: str
    objective_s: float | None
    gap: float
    wall_time_s: float
    bound_s: float = -math.inf


_BOUND = re.compile(r"^(?:Lower bound|best possible)\s*:?\s*(-?[\d.eE+-]+)", re.MULTILINE)
_BEST_POSSIBLE = re.compile(r"best possible (-?[\d.eE+-]+)")


def _log_bound(log_text: str) -> float | None:
    """CBC's best bound from its log, in CBC's units (the LP file drops the objective's constant)."""
    found = _BOUND.findall(log_text) or _BEST_POSSIBLE.findall(log_text)
    return float(found[-1]) if found else None


def _relative_gap(objective: float, bound: float) -> float:
    return max(0.0, (objective - bound) / abs(objective)) if objective else 0.0


def solve(problem: Problem, config: SearchConfig, *, cutoff_s: float | None = None) -> SolveResult:
    """Run CBC with the config's time limit, relative gap and threads.

    ``cutoff_s``: only solutions strictly better than this step time are of interest (CBC ``-cutoff``):
    branches whose bound reaches it are pruned, and if none is left the result is ``cut_off``.
    Status: ``optimal`` (proven within ``gap_rel``), ``time_limit`` (stopped with a feasible answer; its
    proven gap and bound are reported), ``feasible`` (a solution without a stated bound), ``infeasible``
    (nothing fits), ``cut_off`` (nothing better than the cutoff). A stopped search is never reported as
    optimal.
    """
    fd, log_path = tempfile.mkstemp(prefix="stratagem-cbc-", suffix=".log")
    os.close(fd)
    constant = problem.prob.objective.constant if problem.prob.objective is not None else 0.0
    scale = problem.objective_scale_s
    options = []
    if cutoff_s is not None and math.isfinite(cutoff_s):
        options.append(f"cutoff {cutoff_s / scale - constant!r}")
    # One thread = CBC's serial code (no "-threads"): "-threads 1" starts CBC's parallel branch-and-bound
    # with one worker, whose start-up sometimes stalls for exactly 10 s here (log: "Thread 0 used 0 times,
    # waiting to start 10.000131"; measured 1 run in 15 on a 0.02 s program).
    threads = config.threads if config.threads > 1 else None
    with _WARNINGS_LOCK, warnings.catch_warnings():   # PuLP 3.3 flags PULP_CBC_CMD for a 4.0 rename; current API
        warnings.simplefilter("ignore", DeprecationWarning)
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=config.time_limit_s, gapRel=config.gap_rel, gapAbs=0.0,
                                threads=threads, logPath=log_path, options=options)
    start = time.perf_counter()
    try:
        problem.prob.solve(cmd)
        log_text = Path(log_path).read_text(errors="replace")
    finally:
        Path(log_path).unlink(missing_ok=True)
    wall_s = time.perf_counter() - start
    sol = problem.prob.sol_status
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if options and "Stopped on" not in log_text:
            return SolveResult(status="cut_off", objective_s=None, gap=math.inf, wall_time_s=wall_s,
                               bound_s=cutoff_s)
        status = "infeasible" if "Stopped on" not in log_text else "time_limit"
        return SolveResult(status=status, objective_s=None, gap=math.inf, wall_time_s=wall_s)
    scaled = pulp.value(problem.prob.objective)
    objective_s = scaled * scale
    bound = _log_bound(log_text)
    bound = None if bound is None else bound + constant
    if sol == pulp.LpSolutionOptimal and "Stopped on" not in log_text:
        return SolveResult(status="optimal", objective_s=objective_s,
                           gap=min(_relative_gap(scaled, bound), config.gap_rel) if bound is not None else 0.0,
                           wall_time_s=wall_s, bound_s=objective_s * (1 - config.gap_rel))
    status = "time_limit" if "Stopped on time" in log_text else "feasible"
    gap = _relative_gap(scaled, bound) if bound is not None else math.inf
    log.info("CBC stopped before proving optimality (%s, gap %s)", status, gap)
    return SolveResult(status=status, objective_s=objective_s, gap=gap, wall_time_s=wall_s,
                       bound_s=min(bound * scale, objective_s) if bound is not None else -math.inf)
