"""The search: an exact ILP (PuLP + CBC) over layer placement and per-layer options, inside a best-first
branch-and-bound over the outer choices (degrees, schedule, micro-batching, ZeRO, sequence parallel, node
types), exact under ``planner.cost.estimate``.

Public API::

    plan_search(profile, cluster, *, gpus, global_batch, config, progress=None) -> SearchResult
    build_plan(result, *, model, profile, cluster, training) -> planner.plan.schema.Plan
    SearchConfig(time_limit_s=30, gap_rel=0, threads=1, top_k=5, allow=..., memory_fraction=0.9, ...)
    grid_search(profile, cluster, *, gpus, global_batch) -> GridResult   (Megatron-style baseline)

Modules: ``space`` (outer choices, lower bounds), ``costs`` (coefficients from the cost model),
``layer_options`` (each layer's option costs), ``tables`` (the coefficients and their closed-form evaluation),
``ilp`` / ``ilp_terms`` / ``ilp_cuts`` (the program), ``planner`` (the driver), ``plan_file`` (the Plan),
``grid`` (the Megatron-style grid baseline). The brute force the tests hold the ILP to is
``fixtures/search_brute.py``.
"""

from planner.search.cbc import Problem, SolveResult
from planner.search.config import ALL_DIMENSIONS, DEFAULT_DIMENSIONS, SearchConfig, parse_allow
from planner.search.context_table import best_per_cp, format_cp_table
from planner.search.costs import CandidateCosts
from planner.search.grid import grid_configs, grid_search
from planner.search.ilp import IncompleteAssignment, build_problem, check_complete, extract_assignment, solve
from planner.search.layer_options import LayerCostCache
from planner.search.ilp_terms import COEF_MAX, COEF_MIN, ScalingError, check_scaling
from planner.search.pins import PIN_FLAGS, apply_pins, pins_note
from planner.search.plan_file import build_plan, candidate_plan, stage_ranks
from planner.search.planner import SearchResult, check_exact, fallback_candidate, plan_search
from planner.search.space import (
    OuterChoice,
    devices_by_type,
    enumerate_outer,
    expand_experts,
    lower_bound_s,
    memory_shortfall_bytes,
    refined_lower_bound_s,
)
from planner.search.spatial import plan_spatial_search
from planner.search.spatial_plan_file import build_spatial_plan, check_spatial_plan, memory_table, spatial_config_of
from planner.search.tables import Assignment, Concave, Group, Option, OptionCost, RankModel, Tables, dominates, evaluate

__all__ = [
    "LayerCostCache",
    "ALL_DIMENSIONS",
    "Assignment",
    "COEF_MAX",
    "COEF_MIN",
    "CandidateCosts",
    "Concave",
    "DEFAULT_DIMENSIONS",
    "Group",
    "IncompleteAssignment",
    "Option",
    "OptionCost",
    "OuterChoice",
    "PIN_FLAGS",
    "Problem",
    "RankModel",
    "ScalingError",
    "SearchConfig",
    "SearchResult",
    "SolveResult",
    "Tables",
    "apply_pins",
    "best_per_cp",
    "build_plan",
    "candidate_plan",
    "build_problem",
    "build_spatial_plan",
    "check_complete",
    "check_exact",
    "check_scaling",
    "check_spatial_plan",
    "devices_by_type",
    "dominates",
    "enumerate_outer",
    "evaluate",
    "expand_experts",
    "extract_assignment",
    "fallback_candidate",
    "format_cp_table",
    "grid_configs",
    "grid_search",
    "lower_bound_s",
    "memory_shortfall_bytes",
    "memory_table",
    "parse_allow",
    "pins_note",
    "plan_search",
    "plan_spatial_search",
    "refined_lower_bound_s",
    "solve",
    "spatial_config_of",
    "stage_ranks",
]
