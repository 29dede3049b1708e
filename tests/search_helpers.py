"""Shared by the exactness tests: the ILP's answer checked against brute force under ``estimate``."""

from __future__ import annotations

import math

from planner.search import build_problem, check_exact, extract_assignment, solve


def check_ilp_against_brute(costs, outer, tables, best: float | None, *, cuts: bool = False):
    """Solve the ILP of ``outer``: infeasible exactly when brute force found no fitting assignment (``best``
    None), else proven optimal, its objective equal to ``estimate`` of its assignment (``check_exact``) and to
    the brute-force best, to 1e-9 relative. Returns that estimate, or None when infeasible."""
    problem = build_problem(tables, cuts=cuts)
    result = solve(problem, costs.search)
    if best is None:
        assert result.status == "infeasible", outer.summary()
        return None
    assert result.status == "optimal", outer.summary()
    assignment = extract_assignment(problem)
    est = costs.estimate(costs.parallel_config(outer, tables, assignment))
    step_s = check_exact(tables, assignment, est, outer, result.objective_s)
    assert math.isclose(step_s, best, rel_tol=1e-9), (outer.summary(), step_s, best)
    return est
