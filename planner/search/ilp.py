"""The exact inner search: one mixed-integer program per outer candidate, built with PuLP, solved by CBC.

:func:`build_problem` states the maths (its docstring is the model); :func:`solve` (``planner.search.cbc``)
runs CBC with the limits of :class:`planner.search.config.SearchConfig` and reports status and proven gap
honestly;
:func:`extract_assignment` reads the chosen placement and options back as an
:class:`planner.search.tables.Assignment`.
"""

from __future__ import annotations

import math
from typing import Any

import pulp

from planner.search.cbc import Problem, SolveResult, solve  # noqa: F401 (re-exported)
from planner.search.ilp_cuts import add_block_cuts
from planner.search.ilp_terms import (
    COEF_MAX,
    COEF_MIN,
    ScalingError,
    at_least,
    check_scaling,
    concave_term,
    conjunction,
    indicator,
    linear,
)
from planner.search.tables import Assignment, Tables, moment_grads, pipeline_bytes, rank_moments, sweep_grad_bytes

OBJECTIVE_RESOLUTION = 1e4


def _fixed_cumulative(tables: Tables) -> tuple[dict, dict]:
    """(a') fixed chunk sizes: c[g,s] and st[g,s] are constants (layers dealt to chunks in model order)."""
    groups, sizes = tables.groups, tables.chunk_sizes or ()
    c: dict[tuple[int, int], int] = {}
    st: dict[tuple[int, int], int] = {}
    through = 0
    for s, size in enumerate(sizes):
        through += size
        start = 0
        for g, grp in enumerate(groups):
            c[g, s] = min(max(through - start, 0), grp.size)
            st[g, s] = int(through > start)
            start += grp.size
    return c, st


def _cumulative(prob: pulp.LpProblem, tables: Tables) -> tuple[dict, dict]:
    """(a) contiguity: cumulative counts c[g,s], 'started' st[g,s] and 'finished' f[g,s] flags; constants
    when the chunk sizes are fixed (a')."""
    if tables.chunk_sizes is not None:
        return _fixed_cumulative(tables)
    groups, chunks = tables.groups, tables.chunks
    keys = [(g, s) for g in range(len(groups)) for s in range(chunks)]
    c = prob.add_variable_dicts("c", keys, lowBound=0, cat="Integer")
    st = prob.add_variable_dicts("st", keys, cat="Binary")
    fin = prob.add_variable_dicts("f", keys, cat="Binary")
    for g, group in enumerate(groups):
        n = group.size
        prob += (c[g, chunks - 1] == n, f"a_all_placed[{g}]")
        for s in range(chunks):
            prob += (c[g, s] <= n * st[g, s], f"a_start_ub[{g},{s}]")
            prob += (c[g, s] >= st[g, s], f"a_start_lb[{g},{s}]")
            prob += (c[g, s] >= n * fin[g, s], f"a_finish[{g},{s}]")
            if s > 0:
                prob += (c[g, s] >= c[g, s - 1], f"a_monotone[{g},{s}]")
            if g + 1 < len(groups):
                prob += (st[g + 1, s] <= fin[g, s], f"a_order[{g},{s}]")
        for s in range(chunks):
            prev = c[g, s - 1] if s > 0 else 0
            prob += (c[g, s] - prev <= n, f"a_bound[{g},{s}]")
    for s in range(chunks):
        prob += (
            pulp.lpSum(c[g, s] - (c[g, s - 1] if s > 0 else 0) for g in range(len(groups))) >= 1,
            f"e_nonempty[{s}]",
        )
    return c, st


def _options(prob: pulp.LpProblem, tables: Tables, c: dict) -> tuple[dict, dict, dict]:
    """(b) rank totals R[g,r] = sum of the rank's chunk counts (integer, so CBC branches on them) and
    options at rank level, sum_i n[r,g,i] = R[g,r] — a rank's cost depends only on its option totals;
    (c) one style per group through u[g,style]."""
    pp, chunks = tables.pp, tables.chunks
    keys = [(r, g, i) for r in range(pp) for g, grp in enumerate(tables.groups) for i in range(len(grp.options))]
    n = prob.add_variable_dicts("n", keys, lowBound=0, cat="Integer")
    rank_total = prob.add_variable_dicts(
        "R", [(g, r) for g in range(len(tables.groups)) for r in range(pp)], lowBound=0, cat="Integer"
    )
    u: dict[tuple[int, str], Any] = {}
    for g, group in enumerate(tables.groups):
        for r in range(pp):
            in_rank = pulp.lpSum(c[g, s] - (c[g, s - 1] if s > 0 else 0) for s in range(r, chunks, pp))
            prob += (rank_total[g, r] == in_rank, f"b_rank_total[{g},{r}]")
            prob += (
                pulp.lpSum(n[r, g, i] for i in range(len(group.options))) == rank_total[g, r],
                f"b_options[{r},{g}]",
            )
        styles = group.styles
        if len(styles) == 1:
            u[g, styles[0]] = 1
            continue
        ug = prob.add_variable_dicts(f"u{g}", list(styles), cat="Binary")
        prob += (pulp.lpSum(ug.values()) == 1, f"c_one_style[{g}]")
        for i, opt in enumerate(group.options):
            for r in range(pp):
                prob += (n[r, g, i] <= group.size * ug[opt.style], f"c_style[{r},{g},{i}]")
        u.update({(g, sty): var for sty, var in ug.items()})
    return n, u, rank_total


def _style(u: dict, g: int, style: str):
    return u.get((g, style), 0)


def _chunk_extras(prob: pulp.LpProblem, tables: Tables, st: dict, u: dict) -> list:
    """(d) per-chunk time terms besides the layers' own (those are summed per rank): layout change a->b at
    the start of group g+1
    (start[g+1,s] = st[g+1,s] - st[g+1,s-1]); the boundary after chunk s (it ends in g iff
    end[g,s] = st[g,s] - st[g+1,s] = 1), charged to chunks s and s+1."""
    groups, chunks = tables.groups, tables.chunks
    terms: list[list] = [[] for _ in range(chunks)]
    for s in range(chunks):
        nt = tables.node_type_of_chunk(s)
        for g in range(len(groups) - 1):
            start = st[g + 1, s] - (st[g + 1, s - 1] if s > 0 else 0)
            for a in groups[g].styles:
                for b in groups[g + 1].styles:
                    cost = tables.change_s.get((g, a, b, nt), 0.0)
                    if cost:
                        flag = conjunction(
                            prob, f"w[{s},{g},{a},{b}]", "d_change", [_style(u, g, a), _style(u, g + 1, b), start]
                        )
                        terms[s].append(cost * flag)
    if tables.pp > 1:
        for s in range(chunks - 1):
            key_nt = (tables.node_type_of_chunk(s), tables.node_type_of_chunk(s + 1))
            for g, grp in enumerate(groups):
                end = st[g, s] - (st[g + 1, s] if g + 1 < len(groups) else 0)
                for sty in grp.styles:
                    cost = grp.boundary_s[(sty, key_nt[0], key_nt[1])]
                    term = cost * conjunction(prob, f"e[{s},{g},{sty}]", "d_boundary", [_style(u, g, sty), end])
                    terms[s].append(term)  # sender and receiver each pay one transfer
                    terms[s + 1].append(term)
    return [pulp.lpSum(t) for t in terms]


def _presence(prob: pulp.LpProblem, tables: Tables, n: dict, r: int, g: int, i: int) -> Any:
    return indicator(prob, f"y[{r},{g},{i}]", "h_presence", n[r, g, i], tables.groups[g].size)


def _first_gather(prob: pulp.LpProblem, tables: Tables, c: dict, u: dict, r: int, scale: float) -> Any:
    """ZeRO-3's first weight gather of rank r, never hidden: that of the first layer of chunk r. b[g]
    marks the first group present in the chunk (b <= present, b[g] + present[h] <= 1 for h < g). In
    objective units (seconds / ``scale``)."""
    groups, nt = tables.groups, tables.rank_node_types[r]
    pres, terms = [], []
    for g, grp in enumerate(groups):
        here = c[g, r] - (c[g, r - 1] if r > 0 else 0)  # layers of g in chunk r
        pres.append(indicator(prob, f"p[{r},{g}]", "g_first", here, grp.size))
        prob += (here >= pres[g], f"g_first_lb[{r},{g}]")
    b = prob.add_variable_dicts(f"b{r}", list(range(len(groups))), cat="Binary")
    prob += (pulp.lpSum(b.values()) == 1, f"g_first_one[{r}]")
    for g, grp in enumerate(groups):
        prob += (b[g] <= pres[g], f"g_first_present[{r},{g}]")
        for h in range(g):
            prob += (b[g] + pres[h] <= 1, f"g_first_earliest[{r},{g},{h}]")
        for sty in grp.styles:
            gather_s = next(k.z3_gather_s for o, k in zip(grp.options, grp.costs[nt]) if o.style == sty)
            if gather_s:
                flag = conjunction(prob, f"bq[{r},{g},{sty}]", "g_first", [b[g], _style(u, g, sty)])
                terms.append((gather_s / scale) * flag)
    return pulp.lpSum(terms)


def _rank_sums(tables: Tables, n: dict, u: dict, st: dict, r: int) -> dict[str, Any]:
    nt = tables.rank_node_types[r]
    items = [(n[r, g, i], grp.costs[nt][i]) for g, grp in enumerate(tables.groups) for i in range(len(grp.options))]
    sums = {
        key: linear((var, getattr(k, attr)) for var, k in items)
        for key, attr in (
            ("time", "time_s"),
            ("P", "params_dp"),
            ("Q", "params_dpt"),
            ("Wf", "fwd_s"),
            ("Wb", "bwd_s"),
            ("act", "act_bytes"),
            ("z3", "z3_mb_s"),
            ("opt", "opt_s"),
            ("st", "state_bytes"),
            ("lg", "logits_bytes"),
            ("ega", "expert_grads_accumulating_bytes"),
            ("ege", "expert_grads_end_bytes"),
            ("R", "root_params"),
            ("rg", "root_gathered_bytes"),
        )
    }
    if tables.chunk_unit_s:  # every chunk is non-empty: its root unit's host cost is a constant
        unit_f, unit_b = tables.chunk_unit_s[nt]
        sums["time"] += tables.v * (unit_f + unit_b)
        sums["Wf"] += tables.v * unit_f
        sums["Wb"] += tables.v * unit_b
    groups = tables.groups

    def boundary(s: int) -> Any:  # the activation crossing the boundary after chunk s: its last group's output
        return pulp.lpSum(
            (st[g, s] - (st[g + 1, s] if g + 1 < len(groups) else 0)) * grp.out_buffer_bytes
            for g, grp in enumerate(groups)
        )

    sums["out"] = pulp.lpSum(boundary(s) for s in range(r, tables.chunks - 1, tables.pp))
    sums["in"] = pulp.lpSum(boundary(s - 1) for s in range(r, tables.chunks, tables.pp) if s > 0)
    sums["last_out"] = groups[-1].out_buffer_bytes if (tables.chunks - 1) % tables.pp == r else 0.0
    if r == tables.pp - 1 and tables.pp > 1 and tables.tied_params:
        sums["P"] += pulp.lpSum(p * _style(u, tables.tied_group, sty) for sty, p in tables.tied_params.items())
    return sums


def _tail(prob, tables: Tables, c: dict, u: dict, r: int, x: dict, limits: dict, scale: float) -> list:
    """(g) tail_r pieces in objective units (seconds / ``scale``): exposed sync max(S - Wb, min(S, last
    bucket)) with S = sync_dp(P) + sync_dpt(Q), plus ZeRO-1/2 max(gather - Wf, 0); or ZeRO-3
    m max(z3 - Wf - Wb, 0) + first gather; plus the optimizer (linear)."""
    rm = tables.ranks[tables.rank_node_types[r]]
    k = 1 / scale
    opt = (rm.optimizer_s_per_param_dp * k) * x["P"] + (rm.optimizer_s_per_param_dpt * k) * x["Q"] + k * x["opt"]
    kappa = rm.contention  # planner.cost.kernels.contention (0: hidden communication is free)
    if tables.zero_stage == 3:
        first = _first_gather(prob, tables, c, u, r, scale)
        return [
            (tables.m * k) * x["z3"] - (tables.m * k * (1 - kappa)) * (x["Wf"] + x["Wb"]) + first + opt,
            ((tables.m * k * kappa) * x["z3"] if kappa else 0) + first + opt,
        ]
    e_p = indicator(prob, f"eP[{r}]", "g_active", x["P"], limits["P"])
    e_q = indicator(prob, f"eQ[{r}]", "g_active", x["Q"], limits["Q"]) if limits["Q"] > 0 else 0
    sync = concave_term(prob, f"Sd[{r}]", "g_sync", rm.sync_dp, x["P"], e_p, limits["P"], scale) + concave_term(
        prob, f"Sq[{r}]", "g_sync", rm.sync_dpt, x["Q"], e_q, limits["Q"], scale
    )
    last = 0
    sync_max = (rm.sync_dp(limits["P"]) + rm.sync_dpt(limits["Q"])) * k
    if rm.last_bucket_s * k >= sync_max:  # min(S, last bucket) = S for every placement
        last = sync
    elif rm.last_bucket_s > 0:  # min via a selector; both pieces bounded by sync_max
        sel = prob.add_variable(f"last_sel[{r}]", cat="Binary")
        last = at_least(
            prob, f"L[{r}]", "g_last_bucket", [sync - sync_max * (1 - sel), (rm.last_bucket_s * k) * (1 - sel)]
        )
    zero = [0]
    if tables.zero_stage > 0:
        gather = concave_term(
            prob, f"Gd[{r}]", "g_gather", rm.gather_dp, x["P"], e_p, limits["P"], scale
        ) + concave_term(prob, f"Gq[{r}]", "g_gather", rm.gather_dpt, x["Q"], e_q, limits["Q"], scale)
        zero = [kappa * gather, gather - (k * (1 - kappa)) * x["Wf"]] if kappa else [0, gather - k * x["Wf"]]
    hidden_last = last + kappa * sync if kappa else last
    return [a + b + opt for a in (sync - (k * (1 - kappa)) * x["Wb"], hidden_last) for b in zero]


def _fraction(nbytes: float, cap: float) -> float:
    """``nbytes / cap``, raised to COEF_MIN where smaller (a few dozen bytes of an 80 GiB device): the ILP then
    counts at most COEF_MIN x cap more bytes than the cost model, never fewer, so what it calls feasible fits."""
    return max(nbytes / cap, COEF_MIN)


def _sweep_first(prob, name: str, grp, nt: str, rm, cap: float, present, g: int) -> Any:
    """The backward sweep's ``first`` (``planner.cost.memory.SweepRun``) of group g, in units of ``cap``: the
    largest (activations less gradients) of one layer among the options present, which is below 0 where a layer's
    gradients outweigh its activations (full recompute). y >= L + (v_i - L) present_i with L the least v_i (and at
    most 0): v_i where option i is present, the non-binding L where it is not."""
    values = [c.act_bytes - sweep_grad_bytes(rm, c, "none") for c in grp.costs[nt]]
    if not values:
        return 0
    least = min(0.0, min(values))
    y = prob.add_variable(name, lowBound=least / cap)
    for i, v in enumerate(values):
        prob += (y >= least / cap + _fraction(v - least, cap) * present(g, i), f"h_sweep_first[{name},{i}]")
    return y


def _memory(prob, tables: Tables, n: dict, r: int, x: dict, limits: dict) -> None:
    """(h) memory of rank r: reserve * (states + act * inflight + working set + buffers) + const <= cap,
    every term in units of the rank's capacity (so coefficients are fractions of the device)."""
    nt = tables.rank_node_types[r]
    rm = tables.ranks[nt]
    cap = rm.capacity_bytes
    k = 1 / cap
    parts = [
        (rm.state_bytes_per_param_dp * k) * x["P"],
        (rm.state_bytes_per_param_dpt * k) * x["Q"],
        k * x["st"],
    ]
    groups = tables.groups
    flags: dict[tuple[int, int], Any] = {}

    def present(g: int, i: int) -> Any:
        if (g, i) not in flags:
            flags[g, i] = _presence(prob, tables, n, r, g, i)
        return flags[g, i]

    if rm.backward_sweep:
        _memory_sweep(prob, tables, n, r, x, parts, present)
        return
    ws = [
        _fraction(c.ws_bytes, cap) * present(g, i)
        for g, grp in enumerate(groups)
        for i, c in enumerate(grp.costs[nt])
        if c.ws_bytes > 0
    ]
    if ws:
        parts.append(at_least(prob, f"WS[{r}]", "h_working_set", ws))
    if rm.zero3_buffer_layers:
        mx = [
            _fraction(c.param_bytes, cap) * present(g, i)
            for g, grp in enumerate(groups)
            for i, c in enumerate(grp.costs[nt])
            if c.param_bytes > 0
        ]
        if mx:
            parts.append(rm.zero3_buffer_layers * at_least(prob, f"MX[{r}]", "h_zero3_buffer", mx))
    if rm.ddp_buffer != "never":  # min(cap, gradient bytes), only with replicated layers when dp = 1
        grads = (rm.grad_bytes_per_param * k) * (x["P"] + x["Q"])
        big = limits["grad_bytes"] * k
        off = 0
        if rm.ddp_buffer == "if_replicated":
            off = big * (1 - indicator(prob, f"eQm[{r}]", "h_ddp", x["Q"], max(limits["Q"], 1.0)))
        if math.isinf(rm.ddp_buffer_cap_bytes) or rm.ddp_buffer_cap_bytes >= limits["grad_bytes"]:
            parts.append(at_least(prob, f"DDP[{r}]", "h_ddp", [grads - off]))
        else:
            bucket = rm.ddp_buffer_cap_bytes * k
            sel = prob.add_variable(f"ddp_sel[{r}]", cat="Binary")
            parts.append(
                at_least(prob, f"DDP[{r}]", "h_ddp", [bucket * (1 - sel) - off, grads - big * (1 - sel) - off])
            )
    buffers, held = pipeline_bytes(tables, rm, x)
    if rm.pp_buffers:
        parts.append(k * buffers)
    # the peak is the largest of the rank's moments (activations in flight, gradients alive): each must fit
    for j, (inflight, mode) in enumerate(rank_moments(tables, r)):
        moment = [(inflight * k) * (x["act"] + held), k * moment_grads(rm, mode, x)]
        name = f"h_mem[{r}]" if j == 0 else f"h_mem[{r},{j}]"
        prob += (pulp.lpSum(parts + moment) * rm.reserve_factor <= 1 - rm.reserve_const_bytes * k, name)


def _memory_sweep(prob, tables: Tables, n: dict, r: int, x: dict, parts: list, present) -> None:
    """(h) memory of rank r as the runtime holds it (``tables.rank_memory_bytes`` with ``backward_sweep``): for
    each moment, states + buffers + the moment's gradients + its backward sweep <= cap, the sweep one row per
    group and point (``tables.backward_sweep_bytes``; with several chunks per rank, all activations and the
    largest working set). Units of the rank's capacity."""
    nt = tables.rank_node_types[r]
    rm = tables.ranks[nt]
    cap = rm.capacity_bytes
    k = 1 / cap
    groups = tables.groups
    parts = parts + [k * x["rg"]]
    buffers, held = pipeline_bytes(tables, rm, x)
    if rm.pp_buffers:
        parts.append(k * buffers)
    widest = {}  # per group: its largest present working set (with the block unit), a variable

    def ws_of(g: int) -> Any:
        if g not in widest:
            terms = [
                _fraction(c.ws_bytes, cap) * present(g, i) for i, c in enumerate(groups[g].costs[nt]) if c.ws_bytes > 0
            ]
            widest[g] = at_least(prob, f"SW[{r},{g}]", "h_sweep_ws", terms) if terms else 0
        return widest[g]

    def sweep_rows(mode: str) -> list:
        if tables.v > 1:  # every activation with the largest working set
            return [k * x["act"] + at_least(prob, f"WS[{r}]", "h_working_set", [ws_of(g) for g in range(len(groups))])]
        acts = [linear((n[r, g, i], c.act_bytes) for i, c in enumerate(grp.costs[nt])) for g, grp in enumerate(groups)]
        grads = [
            linear((n[r, g, i], sweep_grad_bytes(rm, c, mode)) for i, c in enumerate(grp.costs[nt]))
            for g, grp in enumerate(groups)
        ]
        rows = []
        for g, grp in enumerate(groups):
            before = k * pulp.lpSum(acts[:g])
            after = k * pulp.lpSum(grads[g + 1 :])
            rows.append(before + k * acts[g] + ws_of(g) + after)
            if mode == "none":
                rows.append(
                    before
                    + _sweep_first(prob, f"SD[{r},{g}]", grp, nt, rm, cap, present, g)
                    + ws_of(g)
                    + after
                    + k * grads[g]
                )
        return rows

    rows_of = {}
    for j, (inflight, mode) in enumerate(rank_moments(tables, r)):
        grads = k * moment_grads(rm, mode, x)
        if mode == "end":
            rows = [0]
        else:
            key = mode if tables.v == 1 else "whole"  # several chunks: one row for both modes
            if key not in rows_of:
                rows_of[key] = sweep_rows(mode)
            rows = [(inflight * k) * held + ((inflight - 1) * k) * x["act"] + row for row in rows_of[key]]
        for q, row in enumerate(rows):
            name = f"h_mem[{r},{j},{q}]"
            prob += (pulp.lpSum(parts + [grads, row]) * rm.reserve_factor <= 1 - rm.reserve_const_bytes * k, name)


def _limits(tables: Tables) -> dict[str, float]:
    """Big-M bounds: the most parameters (and gradient bytes) one rank can hold."""
    p_max = q_max = 0.0
    for grp in tables.groups:
        p_max += grp.size * max(k.params_dp for ks in grp.costs.values() for k in ks)
        q_max += grp.size * max(k.params_dpt for ks in grp.costs.values() for k in ks)
    p_max += max(tables.tied_params.values(), default=0.0)
    grad = max(rm.grad_bytes_per_param for rm in tables.ranks.values())
    return {"P": max(p_max, 1.0), "Q": q_max, "grad_bytes": grad * (p_max + q_max) + 1.0}


def _time_unit_s(tables: Tables) -> float:
    """The objective's unit: a power of 2 (so dividing by it is exact) near 1/OBJECTIVE_RESOLUTION of the
    step's magnitude, so the objective is ~1e4 units (differences of 1e-5 relative are far above CBC's
    absolute tolerances) and per-layer coefficients stay near 1 (``ilp_terms.COEF_MAX``).

    Magnitude: the larger of a floor of the pipeline time (m micro-batches over pp ranks of the layers'
    least total time, or of their ZeRO-3 communication) and of the gradient sync a rank's even share of the
    parameters would expose (the step of a communication-bound candidate is mostly that). Not a bound: only
    its order matters.
    """
    magnitude = 0.0
    for lane in tables.lanes:
        for nt in set(lane.rank_node_types):
            rm = lane.ranks[nt]
            least = sum(min(k.time_s for k in grp.costs[nt]) * grp.size for grp in lane.groups)
            if lane.zero_stage == 3:  # ZeRO-3's per-micro-batch gathers may dwarf the compute
                least = max(least, sum(min(k.z3_mb_s for k in grp.costs[nt]) * grp.size for grp in lane.groups))
            p_share = sum(grp.size * min(k.params_dp for k in grp.costs[nt]) for grp in lane.groups) / lane.pp
            q_share = sum(grp.size * min(k.params_dpt for k in grp.costs[nt]) for grp in lane.groups) / lane.pp
            sync = min(rm.sync_dp(p_share) + rm.sync_dpt(q_share), rm.last_bucket_s or math.inf)
            magnitude = max(magnitude, least * lane.m / lane.pp, sync if math.isfinite(sync) else 0.0)
    return 2.0 ** round(math.log2((magnitude or 1.0) / OBJECTIVE_RESOLUTION))


def build_problem(tables: Tables, *, cuts: bool = True) -> Problem:
    """Build the program for one outer candidate.

    Index sets: groups g of identical consecutive layers (size N_g); options i of a group (recompute x
    style); chunks s = 0..S-1, S = pp*v, in model order; pp ranks r (chunk s on rank s mod pp).

    Variables: c[g,s] in 0..N_g layers of g in chunks <= s; st[g,s], f[g,s] binary (g started / finished
    by chunk s); R[g,r] integer layers of g on pp rank r; n[r,g,i] integer layers of g on rank r with
    option i; u[g,style] binary; T (slowest rank per micro-batch), Z (slowest tail); auxiliaries of the
    linearisations (ilp_terms).

    Objective (seconds / scale): minimise (m - 1/v) T + (1/v) sum_r T_r + Z — the cost model's formula
    for every schedule: GPipe and 1F1B have v = 1 ((m-1) max + sum, fill and drain); interleaved 1F1B has
    v chunks per rank (bubble (p-1)/v).

    (a) contiguity: c[g,S-1] = N_g; st <= c <= N_g st; c >= N_g f; c monotone in s; st[g+1,s] <= f[g,s]
        (a later group starts only after the earlier one is complete) => chunks are contiguous ranges.
    (b) rank totals R[g,r] = sum_{s on r} (c[g,s] - c[g,s-1]); options sum_i n[r,g,i] = R[g,r].
    (c) one style per group: sum_style u[g,style] = 1; n[r,g,i] <= N_g u[g, style(i)].
    (d) rank time: sum n*time over the rank's options + per chunk: layout changes at group starts + the
        one-way transfer of every
        boundary, charged to both of its chunks; products of binaries linearised.
    (a') interleaved schedules: fixed chunk sizes (equal chunks, planner.cost.placement.
        interleaved_chunk_sizes), so c[g,s] and st[g,s] are constants and (a), (e) drop out.
    (e) non-empty chunks: sum_g (c[g,s] - c[g,s-1]) >= 1.
    (f) slowest rank: T >= T_r = sum of its chunks' times.
    (g) slowest tail: Z >= tail_r for every combination of the max() pieces of tail_r (exposed sync,
        ZeRO communication) in the rank's parameters P_r, Q_r and forward/backward windows; min() terms
        (last bucket, unbucketed collectives' best algorithm) via selector binaries.
    (h) memory per rank: reserve * (states(P, Q) + expert states + inflight_r * act_r + working set + buffers) + context
        <= capacity (scaled to 1); working set / ZeRO-3 buffers are maxima over present layers (presence
        binaries), the DDP bucket buffer a min(cap, gradient bytes) via a selector.
    Scaling (checked by ``ilp_terms.check_scaling``): times in units of 1e-4 of the pipeline-time floor,
    memory in units of the rank's capacity, big-M rows divided by their bound, so every coefficient and
    right-hand side lies within ``SCALING_BOUNDS``.
    (j) dp replicas on several node types (``tables.lanes``): (d)-(h) once per lane t (its node type on
        every rank, its m_t and in-flight counts; names prefixed L<t>_), W >= (m_t - 1/v) T_t + (1/v)
        sum_r T_{t,r}, and the objective is W + Z (formula (H) of planner.cost.estimate).
    """
    scale = _time_unit_s(tables)
    try:
        return _build(tables, cuts=cuts, scale=scale)
    except ScalingError as exc:
        if exc.largest <= COEF_MAX:
            raise
        # an option far slower than the step's magnitude (a layer split over a slow cross-node group):
        # a larger time unit brings it under COEF_MAX / 100; the check still guards the smallest terms
        return _build(tables, cuts=cuts, scale=scale * 2.0 ** math.ceil(math.log2(100 * exc.largest / COEF_MAX)))


def _build(tables: Tables, *, cuts: bool, scale: float) -> Problem:
    prob = pulp.LpProblem("stratagem_plan", pulp.LpMinimize)
    c, st = _cumulative(prob, tables)
    n, u, rank_total = _options(prob, tables, c)
    limits = _limits(tables)
    if cuts:
        add_block_cuts(prob, tables, n, rank_total, scale)
    z_max = prob.add_variable("Z", lowBound=0)
    pipelines = [
        _lane(prob if k == 0 else _Prefixed(prob, f"L{k}_"), lane, c, st, n, u, z_max, scale, limits)
        for k, lane in enumerate(tables.lanes)
    ]
    if len(pipelines) == 1:
        prob += pipelines[0] + z_max
    else:  # (j) replica types: the slowest type's pipeline, W >= pipeline_t
        w_max = prob.add_variable("W", lowBound=0)
        for k, pipe in enumerate(pipelines):
            prob += (w_max >= pipe, f"j_slowest_type[{k}]")
        prob += w_max + z_max
    check_scaling(prob)
    return Problem(prob=prob, tables=tables, count=n, cumulative=c, objective_scale_s=scale)


class _Prefixed:
    """``prob`` with every new variable and constraint name prefixed (the second and later lanes)."""

    def __init__(self, prob: pulp.LpProblem, prefix: str):
        self.prob, self.prefix = prob, prefix

    def add_variable(self, name: str, *args, **kwargs):
        return self.prob.add_variable(self.prefix + name, *args, **kwargs)

    def add_variable_dicts(self, name: str, *args, **kwargs):
        return self.prob.add_variable_dicts(self.prefix + name, *args, **kwargs)

    def __iadd__(self, item):
        expr, name = item
        self.prob += (expr, self.prefix + name)
        return self


def _lane(prob, lane: Tables, c: dict, st: dict, n: dict, u: dict, z_max, scale: float, limits: dict):
    """Families (d)-(h) of one lane (its rank node types, m and in-flight micro-batches); returns its
    pipeline term (m - 1/v) T + (1/v) sum_r T_r in objective units."""
    chunk_extra = _chunk_extras(prob, lane, st, u)
    t_max = prob.add_variable("T", lowBound=0)
    rank_time = []
    for r in range(lane.pp):
        x = _rank_sums(lane, n, u, st, r)
        rank_time.append((x["time"] + pulp.lpSum(chunk_extra[s] for s in range(r, lane.chunks, lane.pp))) * (1 / scale))
        prob += (t_max >= rank_time[r], f"f_slowest[{r}]")
        for j, piece in enumerate(_tail(prob, lane, c, u, r, x, limits, scale)):
            prob += (z_max >= piece, f"g_tail[{r},{j}]")
        _memory(prob, lane, n, r, x, limits)
    return (lane.m - 1 / lane.v) * t_max + (1 / lane.v) * pulp.lpSum(rank_time)


def extract_assignment(problem: Problem) -> Assignment:
    """Chunk x group x option counts: chunk sizes from c[g,s], each rank's option totals dealt over its
    chunks in order (any dealing costs the same). Values are rounded to the integers CBC found."""
    t = problem.tables

    def val(var) -> int:
        return int(round(var if isinstance(var, (int, float)) else (var.value() or 0.0)))

    counts = [[[0] * len(grp.options) for grp in t.groups] for _ in range(t.chunks)]
    for g, grp in enumerate(t.groups):
        for r in range(t.pp):
            left = [val(problem.count[r, g, i]) for i in range(len(grp.options))]
            for s in range(r, t.chunks, t.pp):
                size = val(problem.cumulative[g, s]) - (val(problem.cumulative[g, s - 1]) if s > 0 else 0)
                for i in range(len(grp.options)):
                    take = min(size, left[i])
                    counts[s][g][i] += take
                    left[i] -= take
                    size -= take
    assignment = Assignment(counts=tuple(tuple(tuple(row) for row in chunk) for chunk in counts))
    check_complete(t, assignment)
    return assignment


class IncompleteAssignment(RuntimeError):
    """CBC's answer does not place every layer exactly once in non-empty chunks (a solver fault: seen as
    an "optimal" objective 0 with nothing assigned, after "Postprocessed model is infeasible")."""


def check_complete(tables: Tables, assignment: Assignment) -> None:
    """Every group's layers placed exactly once (all options counted), every chunk non-empty, one style
    per group; raises :class:`IncompleteAssignment` naming what is wrong."""
    for g, grp in enumerate(tables.groups):
        placed = sum(sum(chunk[g]) for chunk in assignment.counts)
        if placed != grp.size:
            raise IncompleteAssignment(
                f"solver answer places {placed} of the {grp.size} layers of group {g} ({grp.paths[0]}...)"
            )
        styles = {grp.options[i].style for chunk in assignment.counts for i, k in enumerate(chunk[g]) if k}
        if len(styles) != 1:
            raise IncompleteAssignment(f"solver answer gives group {g} ({grp.paths[0]}...) styles {sorted(styles)}")
    for s, chunk in enumerate(assignment.counts):
        if not any(sum(row) for row in chunk):
            raise IncompleteAssignment(f"solver answer leaves chunk {s} empty")
