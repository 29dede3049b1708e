"""The search: an exact ILP (PuLP + CBC) over layer placement and per-layer options, inside a best-first
branch-and-bound over the outer choices (degrees, schedule, micro-batching, ZeRO, sequence parallel, node
types), exact under ``planner.cost.estimate``.

Public API::

    plan_search(profile, cluster, *, n_devices, global_batch, config, progress=None) -> SearchResult
    build_plan(result, *, model, profile, cluster, training) -> planner.plan.Plan
    SearchConfig(time_limit_s=30, gap_rel=0, threads=1, top_k=5, allow=..., memory_fraction=0.9, ...)
    grid_search(profile, cluster, *, n_devices, global_batch) -> GridResult   (Megatron-style baseline)

Modules: ``space`` (outer choices, lower bounds), ``costs`` (coefficients from the cost model), ``tables``
(the coefficients and their closed-form evaluation), ``ilp`` / ``ilp_terms`` / ``ilp_cuts`` (the program),
``brute`` (enumeration for tests), ``planner`` (the driver), ``plan_file`` (the Plan), ``grid``.
"""

from planner.search.config import SearchConfig
from planner.search.grid import grid_search
from planner.search.plan_file import build_plan
from planner.search.planner import SearchResult, plan_search

__all__ = ["SearchConfig", "SearchResult", "build_plan", "grid_search", "plan_search"]
