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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pulp

from planner.search.config import SearchConfig
from planner.search.tables import Tables

log = logging.getLogger(__name__)
_WARNINGS_LOCK = threading.Lock()  # warnings.catch_warnings is process-global; solves may run in threads


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A built program and the variables needed to read its answer back."""

    prob: pulp.LpProblem
    tables: Tables
    count: dict[tuple[int, int, int], Any]  # (pp rank r, group g, option i) -> integer variable
    cumulative: dict[tuple[int, int], Any]  # (group g, chunk s) -> layers of g in chunks <= s
    objective_scale_s: float  # the objective is in units of this many seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveResult:
    """Outcome of one CBC run.

    ``status``: optimal | within_gap | feasible | time_limit | infeasible | cut_off. ``within_gap``: CBC stopped at
    the configured relative gap (``plan --gap``) with its bound short of the answer. ``cut_off``: CBC proved that no
    solution is better than the cutoff it was given (the candidate's optimum is >= ``bound_s``).
    ``bound_s``: the proven lower bound on the candidate's optimum in seconds (the objective when optimal,
    the cutoff when cut off, -inf when nothing is known). ``warnings``: numerical warnings from CBC's log
    (each one triggered a confirming re-solve); ``confirmed``: an infeasible / cut-off claim was made (or
    checked) by a solve without CBC's preprocessing.
    """

    status: str
    objective_s: float | None
    gap: float
    wall_time_s: float
    bound_s: float = -math.inf
    warnings: tuple[str, ...] = ()
    confirmed: bool = False


_BOUND = re.compile(r"^(?:Lower bound|best possible)\s*:?\s*(-?[\d.eE+-]+)", re.MULTILINE)
_BEST_POSSIBLE = re.compile(r"best possible (-?[\d.eE+-]+)")
# CBC log lines that mean its answer may rest on a tolerance decision rather than on the program (seen here
# on badly scaled programs: an "optimal" empty assignment), and claims of its integer preprocessing (seen
# calling feasible programs infeasible); each triggers a confirming re-solve
TOLERANCE_WARNINGS = ("possible tolerance issue", "Postprocessed model is infeasible")
PREPROCESSING_CLAIMS = ("Pre-processing says infeasible", "Cut generators found to be infeasible")
# the confirming solve: no integer preprocessing (where the false claims came from), no LP presolve
SAFE_OPTIONS = ("preprocess off", "presolve off")


def _log_bound(log_text: str) -> float | None:
    """CBC's best bound from its log, in CBC's units (the LP file drops the objective's constant)."""
    found = _BOUND.findall(log_text) or _BEST_POSSIBLE.findall(log_text)
    return float(found[-1]) if found else None


OPTIMAL_GAP = 1e-9  # a proven relative gap at most this is optimality (CBC's own integrality tolerance is 1e-7)


def _relative_gap(objective: float, bound: float) -> float:
    return max(0.0, (objective - bound) / abs(objective)) if objective else 0.0


def log_warnings(log_text: str) -> tuple[str, ...]:
    """The :data:`TOLERANCE_WARNINGS` that CBC's log contains, in that order."""
    return tuple(w for w in TOLERANCE_WARNINGS if w in log_text)


def _refuted(first: SolveResult, second: SolveResult, cutoff_s: float | None) -> tuple[str, ...]:
    """A note when the confirming solve disagrees with a no-solution claim of the first: it found a
    solution (under the cutoff by more than CBC's tolerance, for a cut-off claim)."""
    if first.status not in ("infeasible", "cut_off") or second.objective_s is None:
        return ()
    if first.status == "cut_off" and cutoff_s is not None and second.objective_s >= cutoff_s * (1 - 1e-9):
        return ()
    return (f"CBC claimed {first.status} but a solve without preprocessing found a solution",)


def solve(
    problem: Problem, config: SearchConfig, *, cutoff_s: float | None = None, max_nodes: int | None = None
) -> SolveResult:
    """Run CBC with the config's time limit, relative gap and threads; confirm what it cannot be trusted on.

    ``max_nodes``: stop after this many branch-and-bound nodes (a limit that, unlike time, gives the same
    answer on every run and machine; stopped answers are ``feasible`` with their gap).
    ``cutoff_s``: only solutions strictly better than this step time are of interest (CBC ``-cutoff``):
    branches whose bound reaches it are pruned, and if none is left the result is ``cut_off``.
    Status: ``optimal`` (proven within ``gap_rel``), ``time_limit`` (stopped with a feasible answer, or
    stopped before confirming a claim; its proven gap and bound are reported), ``feasible`` (a solution
    without a stated bound), ``infeasible`` (nothing fits), ``cut_off`` (nothing better than the cutoff).
    A stopped search is never reported as optimal.

    Checked, never trusted: an ``infeasible`` or ``cut_off`` claim, and any answer whose log carries a
    :data:`TOLERANCE_WARNINGS` line, is re-solved without preprocessing (:data:`SAFE_OPTIONS`); the second
    answer stands (a solution it finds refutes the claim). With a finite cutoff the solve without
    preprocessing is the only one (the first run's claim could only be replaced by its answer). Tolerance
    warnings and refuted claims are reported in ``warnings``.
    """
    nodes = () if max_nodes is None else (f"maxNodes {max_nodes}",)
    if cutoff_s is not None and math.isfinite(cutoff_s):
        # with a cutoff, most solves of a search end in a cut-off claim, which only a solve without
        # preprocessing may make: run that solve first (the same answer as a claim and its confirmation,
        # one CBC run instead of two)
        safe, safe_log = _run(problem, config, cutoff_s, SAFE_OPTIONS + nodes)
        found = log_warnings(safe_log)
        if found:
            log.warning(
                "CBC (without preprocessing): %s; %s %s (cutoff %s)",
                "; ".join(found),
                safe.status,
                safe.objective_s,
                cutoff_s,
            )
        return replace(safe, warnings=found, confirmed=safe.status in ("infeasible", "cut_off"))
    first, log_text = _run(problem, config, cutoff_s, nodes)
    found = log_warnings(log_text)
    if first.status not in ("infeasible", "cut_off") and not found:
        return first
    second, second_log = _run(problem, config, cutoff_s, SAFE_OPTIONS + nodes)
    wall_s = first.wall_time_s + second.wall_time_s
    found = tuple(dict.fromkeys(found + log_warnings(second_log) + _refuted(first, second, cutoff_s)))
    if found:
        log.warning(
            "CBC: %s; re-solved without preprocessing: %s %s (cutoff %s)",
            "; ".join(found),
            second.status,
            second.objective_s,
            cutoff_s,
        )
    return replace(
        second,
        wall_time_s=wall_s,
        warnings=found,
        confirmed=second.status in ("infeasible", "cut_off") and first.status == second.status,
    )


def _run(
    problem: Problem, config: SearchConfig, cutoff_s: float | None, extra: tuple[str, ...]
) -> tuple[SolveResult, str]:
    """One CBC process on ``problem``: (result, CBC's log)."""
    fd, log_path = tempfile.mkstemp(prefix="stratagem-cbc-", suffix=".log")
    os.close(fd)
    constant = problem.prob.objective.constant if problem.prob.objective is not None else 0.0
    scale = problem.objective_scale_s
    options = list(extra)
    limit = cutoff_s if cutoff_s is not None and math.isfinite(cutoff_s) else None
    if limit is not None:
        options.append(f"cutoff {limit / scale - constant!r}")
    # One thread = CBC's serial code (no "-threads"): "-threads 1" starts CBC's parallel branch-and-bound
    # with one worker, whose start-up sometimes stalls for exactly 10 s here (log: "Thread 0 used 0 times,
    # waiting to start 10.000131"; measured 1 run in 15 on a 0.02 s program).
    threads = config.threads if config.threads > 1 else None
    with _WARNINGS_LOCK, warnings.catch_warnings():  # PuLP 3.3 flags PULP_CBC_CMD for a 4.0 rename; current API
        warnings.simplefilter("ignore", DeprecationWarning)
        cmd = pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=config.time_limit_s,
            gapRel=config.gap_rel,
            gapAbs=0.0,
            threads=threads,
            logPath=log_path,
            options=options,
        )
    start = time.perf_counter()
    try:
        problem.prob.solve(cmd)
        log_text = Path(log_path).read_text(errors="replace")
    finally:
        Path(log_path).unlink(missing_ok=True)
    wall_s = time.perf_counter() - start
    sol = problem.prob.sol_status
    stopped = "Stopped on" in log_text
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if stopped:
            # CBC's bound covers the solutions better than the cutoff: the candidate's floor is the smaller
            bound = _log_bound(log_text)
            floor_s = -math.inf if bound is None else (bound + constant) * scale
            return SolveResult(
                status="time_limit",
                objective_s=None,
                gap=math.inf,
                wall_time_s=wall_s,
                bound_s=floor_s if limit is None else min(floor_s, limit),
            ), log_text
        if limit is not None:
            return SolveResult(
                status="cut_off", objective_s=None, gap=math.inf, wall_time_s=wall_s, bound_s=limit
            ), log_text
        return SolveResult(
            status="infeasible", objective_s=None, gap=math.inf, wall_time_s=wall_s, bound_s=math.inf
        ), log_text
    scaled = pulp.value(problem.prob.objective)
    objective_s = scaled * scale
    bound = _log_bound(log_text)
    bound = None if bound is None else bound + constant
    if sol == pulp.LpSolutionOptimal and not stopped:
        if config.gap_rel <= 0:
            return SolveResult(
                status="optimal", objective_s=objective_s, gap=0.0, wall_time_s=wall_s, bound_s=objective_s
            ), log_text
        # CBC stopped at --gap: its answer is optimal only if the proven bound reaches it; else it is within the
        # proven gap (at most gap_rel: CBC's stopping rule), and the plan says so (status "within_gap")
        gap = min(_relative_gap(scaled, bound), config.gap_rel) if bound is not None else config.gap_rel
        return SolveResult(
            status="optimal" if gap <= OPTIMAL_GAP else "within_gap",
            objective_s=objective_s,
            gap=gap if gap > OPTIMAL_GAP else 0.0,
            wall_time_s=wall_s,
            bound_s=objective_s * (1 - gap) if gap > OPTIMAL_GAP else objective_s,
        ), log_text
    status = "time_limit" if "Stopped on time" in log_text else "feasible"
    gap = _relative_gap(scaled, bound) if bound is not None else math.inf
    log.info("CBC stopped before proving optimality (%s, gap %s)", status, gap)
    return SolveResult(
        status=status,
        objective_s=objective_s,
        gap=gap,
        wall_time_s=wall_s,
        bound_s=min(bound * scale, objective_s) if bound is not None else -math.inf,
    ), log_text
