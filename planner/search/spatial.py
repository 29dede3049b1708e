"""The exact search for hybrid data + spatial plans of 3D CNNs (unet3d, cosmoflow).

Outer loop: every spatial group size ``sd`` dividing the device count (``dp = gpus / sd`` dividing the global
batch) and every micro-batch size ``b`` dividing a replica's ``global_batch / dp`` samples, best-first by a
lower bound. Inner ILP (one per outer candidate), Whale's per-layer option set extended with spatial splits
(Jia et al., ATC'22 §4: each layer replicated or split, layout changes priced between them):

    index sets   L layers, O_l options of layer l (unsplit; each grid of s | sd shards over d / dh / dhw it can
                 run, ``planner.cost.spatial.layer_options``), E edges p -> c (consecutive layers, skips)
    variables    x[l,o] in {0,1}: layer l runs option o;  z[e,o] in [0,1]: both ends of edge e run option o
    minimise     m * (sum_l sum_o t[l,o] x[l,o]
                      + sum_e (sum_o g_e(o) x[p,o] + sum_o g_e(o) x[c,o] - sum_o 2 g_e(o) z[e,o])) + sync  (a)
    subject to   sum_o x[l,o] = 1                                   for every l                          (b)
                 z[e,o] <= x[p(e),o],  z[e,o] <= x[c(e),o]          for every e, o in O_p & O_c           (c)
                 sum_l sum_o a[l,o] x[l,o] <= activation budget of a rank (capacity, states, reserve)    (d)

A layout change costs ``g_e(o_p) + g_e(o_c)`` (the all-gathers over each side's sub-group, 0 unsplit) unless
both ends run the same option: (a) and (c) state exactly that, with ``z = min(x[p,o], x[c,o])`` at the optimum
(its coefficient is negative), in ``O(|O|)`` terms per edge instead of ``O(|O|^2)`` pairs.
``t``, ``g``, ``a``, ``sync`` and the budget come from ``planner.cost.spatial_plan.SpatialCosts``, the same
numbers :func:`planner.cost.spatial_plan.estimate_spatial` adds: every answer is re-scored by it and must
agree to 1e-9 relative. Pipeline and tensor parallelism are not combined with spatial plans (3D CNNs here are
small in weights and large in activations; the U-Net's skip connections would cross pipeline stages).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import pulp

from planner.core import StratagemError
from planner.cost import SpatialConfig, SpatialCosts, SpatialEstimate, SpatialOption, estimate_spatial, layer_options
from planner.profile import ClusterProfile, ModelProfile

SOLVER_REL_TOL = 1e-6  # CBC's objective at its solution vs estimate_spatial (the brute-force test checks 1e-9)
BYTES_UNIT = 2**30  # the memory row in GiB keeps its coefficients near 1


@dataclass(frozen=True, kw_only=True, slots=True)
class SpatialCandidate:
    config: SpatialConfig
    estimate: SpatialEstimate
    status: str  # CBC's: optimal


@dataclass(frozen=True, kw_only=True, slots=True)
class SpatialSearchResult:
    best: SpatialCandidate
    ranked: tuple[SpatialCandidate, ...]  # best first, one per outer candidate solved
    status: str  # optimal: every candidate solved or pruned by a proven bound
    wall_time_s: float
    candidates_total: int
    candidates_solved: int
    candidates_pruned: int
    candidates_infeasible: int
    notes: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _outer(gpus: int, global_batch: int, sd_degrees: tuple[int, ...] | None) -> list[tuple[int, int, int]]:
    """(sd, dp, micro_batch) of every outer candidate."""
    out: list[tuple[int, int, int]] = []
    for sd in _divisors(gpus):
        if sd_degrees is not None and sd not in sd_degrees:
            continue
        dp = gpus // sd
        if global_batch % dp:
            continue
        out.extend((sd, dp, b) for b in _divisors(global_batch // dp))
    return out


def activation_budget_bytes(costs: SpatialCosts, dp: int, memory_fraction: float = 1.0) -> float:
    """Most activation bytes a rank may save: peak(states + act) <= memory_fraction x capacity, with the
    linear reserve."""
    states = sum(costs.states_bytes(dp).values())
    intercept = costs.peak_bytes(0.0)
    slope = costs.peak_bytes(1.0) - intercept
    return (memory_fraction * costs.node.device_memory_bytes - intercept) / slope - states


def _bound_s(costs: SpatialCosts, options: dict[str, list[SpatialOption]], dp: int, m: int) -> float:
    return m * sum(min(costs.layer(p, o).time_s for o in opts) for p, opts in options.items()) + costs.grad_sync_s(dp)


def build_spatial_problem(
    costs: SpatialCosts, *, dp: int, m: int, memory_fraction: float = 1.0
) -> tuple[pulp.LpProblem, dict]:
    """The ILP of the module docstring for one outer candidate; returns (problem, x variables)."""
    prob = pulp.LpProblem("spatial", pulp.LpMinimize)
    options = {v.path: layer_options(v, costs.sd) for v in costs.table}
    x = prob.add_variable_dicts("x", [(p, i) for p, opts in options.items() for i in range(len(opts))], cat="Binary")
    objective = [m * costs.layer(p, o).time_s * x[p, i] for p, opts in options.items() for i, o in enumerate(opts)]
    for p, opts in options.items():
        prob += (pulp.lpSum(x[p, i] for i in range(len(opts))) == 1, f"b_one_option[{p}]")
    for k, (src, dst) in enumerate(costs.edges):
        for end in (src, dst):
            objective += [m * costs.relayout_part(src, o) * x[end, i] for i, o in enumerate(options[end])]
        for i, option in enumerate(options[src]):
            if option not in options[dst] or costs.relayout_part(src, option) == 0:
                continue
            z = prob.add_variable(f"z[{k},{i}]", lowBound=0, upBound=1)
            prob += (z <= x[src, i], f"c_same_producer[{src}->{dst},{i}]")
            prob += (z <= x[dst, options[dst].index(option)], f"c_same_consumer[{src}->{dst},{i}]")
            objective.append(-2 * m * costs.relayout_part(src, option) * z)
    prob += pulp.lpSum(objective) + costs.grad_sync_s(dp)
    budget = activation_budget_bytes(costs, dp, memory_fraction) / BYTES_UNIT
    act = [
        costs.layer(p, o).act_bytes / BYTES_UNIT * x[p, i] for p, opts in options.items() for i, o in enumerate(opts)
    ]
    prob += (pulp.lpSum(act) <= budget, "d_memory")
    return prob, {"x": x, "options": options}


def solve_spatial_problem(prob: pulp.LpProblem, *, time_limit_s: float) -> str:
    """Run CBC (serial, no gap tolerance); ``optimal``, ``infeasible`` or ``time_limit``.

    Constraints (b) and (c) always have a solution (z = 0), so only (d) can make the program infeasible; the
    caller checks the memory floor first, so an ``infeasible`` claim is a solver failure, not an answer."""
    with warnings.catch_warnings():  # PuLP 3.3 flags PULP_CBC_CMD for a 4.0 rename (as planner/search/cbc.py)
        warnings.simplefilter("ignore", DeprecationWarning)
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1.0, time_limit_s), gapRel=0.0, gapAbs=0.0)
    prob.solve(cmd)
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    return "infeasible" if prob.status == pulp.LpStatusInfeasible else "time_limit"


def _layout(variables: dict) -> dict[str, SpatialOption]:
    layout = {}
    for p, opts in variables["options"].items():
        chosen = [o for i, o in enumerate(opts) if (variables["x"][p, i].value() or 0) > 0.5]
        if len(chosen) != 1:
            raise RuntimeError(f"spatial ILP answer gives layer {p} {len(chosen)} options")
        if chosen[0].degree > 1:
            layout[p] = chosen[0]
    return layout


def _solve_outer(
    profile: ModelProfile,
    cluster: ClusterProfile,
    costs: SpatialCosts,
    *,
    dp: int,
    b: int,
    m: int,
    time_limit_s: float,
    memory_fraction: float,
) -> SpatialCandidate:
    prob, variables = build_spatial_problem(costs, dp=dp, m=m, memory_fraction=memory_fraction)
    status = solve_spatial_problem(prob, time_limit_s=time_limit_s)
    if status == "infeasible":
        raise RuntimeError(f"CBC calls the spatial ILP for sd={costs.sd}, micro-batch {b} infeasible below its floor")
    if status != "optimal":
        raise StratagemError(
            f"the spatial ILP for sd={costs.sd}, micro-batch {b} was not solved within its time limit; "
            f"raise --time-limit-s"
        )
    config = SpatialConfig(dp=dp, sd=costs.sd, micro_batch=b, num_micro_batches=m, layout=_layout(variables))
    est = estimate_spatial(profile, cluster, config)
    objective = pulp.value(prob.objective)
    fits = est.peak_memory_bytes <= memory_fraction * est.capacity_bytes * (1 + 1e-9)
    if abs(objective - est.step_time_s) > SOLVER_REL_TOL * est.step_time_s or not fits:
        raise RuntimeError(
            f"spatial ILP objective {objective} disagrees with estimate_spatial {est.step_time_s} (fits {fits})"
        )
    return SpatialCandidate(config=config, estimate=est, status="optimal")


def plan_spatial_search(
    profile: ModelProfile,
    cluster: ClusterProfile,
    *,
    gpus: int,
    global_batch: int,
    time_limit_s: float = 10.0,
    sd_degrees: tuple[int, ...] | None = None,
    keep: int = 5,
    memory_fraction: float = 1.0,
) -> SpatialSearchResult:
    """The fastest hybrid data + spatial plan that fits, proven optimal under the cost model (module docstring).

    ``memory_fraction``: share of each device's memory a plan may use (``stratagem plan --memory-fraction``).

    Raises a one-line :class:`StratagemError` when no candidate fits, naming the closest one's shortfall.
    """
    start = time.perf_counter()
    outers = _outer(gpus, global_batch, sd_degrees)
    if not outers:
        raise StratagemError(
            f"no data-parallel degree dividing global batch {global_batch} leaves a spatial group of {gpus} "
            f"devices; choose a global batch divisible by a divisor of {gpus}"
        )
    bounded = []
    infeasible, shortfall = 0, math.inf
    for sd, dp, b in outers:
        costs = SpatialCosts(profile, cluster, sd=sd, micro_batch=b)
        m = global_batch // (dp * b)
        options = {v.path: layer_options(v, sd) for v in costs.table}
        floor = sum(min(costs.layer(p, o).act_bytes for o in opts) for p, opts in options.items())
        budget = activation_budget_bytes(costs, dp, memory_fraction)
        if floor > budget:
            infeasible += 1
            shortfall = min(shortfall, floor - budget)
            continue
        bounded.append((_bound_s(costs, options, dp, m), sd, dp, b, m, costs))
    bounded.sort(key=lambda t: (t[0], t[1], t[3]))
    solved: list[SpatialCandidate] = []
    pruned = 0
    for bound, sd, dp, b, m, costs in bounded:
        if len(solved) >= keep and bound >= sorted(c.estimate.step_time_s for c in solved)[keep - 1]:
            pruned += 1
            continue
        remaining = max(1.0, time_limit_s - (time.perf_counter() - start))
        solved.append(
            _solve_outer(
                profile, cluster, costs, dp=dp, b=b, m=m, time_limit_s=remaining, memory_fraction=memory_fraction
            )
        )
    if not solved:
        gib = shortfall / 2**30
        raise StratagemError(
            f"no data + spatial plan of {profile.model.name} fits {gpus} devices of "
            f"{cluster.node_types[0].device_memory_bytes / 2**30:.0f} GiB (the closest needs {gib:.1f} GiB more "
            f"activations per rank); use more devices, a smaller volume or a smaller global batch"
        )
    ranked = tuple(sorted(solved, key=lambda c: (c.estimate.step_time_s, c.config.sd, c.config.micro_batch)))
    return SpatialSearchResult(
        best=ranked[0],
        ranked=ranked[:keep],
        status="optimal",
        wall_time_s=time.perf_counter() - start,
        candidates_total=len(outers),
        candidates_solved=len(solved),
        candidates_pruned=pruned,
        candidates_infeasible=infeasible,
        notes=f"spatial search: {len(outers)} (sd, micro-batch) candidates, {infeasible} cannot fit, "
        f"{pruned} pruned by their bound, {len(solved)} solved by CBC",
    )
