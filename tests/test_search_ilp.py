"""The ILP on hand-made coefficient tables: hand-computed optima and brute force on random instances.

These tests need no cost model: they check the program's maths (contiguity, aggregation of identical
layers, options, layout changes, pipeline transfers, tails with min/max pieces, memory with working sets
and buffers, the pipeline objective) against exhaustive enumeration of :func:`tables.evaluate`.
"""

from __future__ import annotations

import math
import random

import pytest

from planner.search import (
    Concave,
    Group,
    Option,
    OptionCost,
    RankModel,
    SearchConfig,
    Tables,
    build_problem,
    evaluate,
    extract_assignment,
    lower_bound_s,
    solve,
)
from fixtures.search_brute import brute_force_tables

CFG = SearchConfig(time_limit_s=20, threads=1)
NONE_SPLIT = Option(recompute="none", style="split")
FULL_SPLIT = Option(recompute="full", style="split")


def _rank(cap: float = 1e9, **extra) -> RankModel:
    fields = dict(
        capacity_bytes=cap,
        state_bytes_per_param_dp=0.0,
        state_bytes_per_param_dpt=0.0,
        reserve_factor=1.0,
        reserve_const_bytes=0.0,
        ddp_buffer="never",
        ddp_buffer_cap_bytes=0.0,
        grad_bytes_per_param=0.0,
        zero3_buffer_layers=0,
        pp_buffers=False,
        sync_dp=Concave(),
        sync_dpt=Concave(),
        last_bucket_s=0.0,
        gather_dp=Concave(),
        gather_dpt=Concave(),
        optimizer_s_per_param_dp=0.0,
        optimizer_s_per_param_dpt=0.0,
    )
    return RankModel(**{**fields, **extra})


def _layer(path: str, time_s: float, act: float = 0.0, options=(NONE_SPLIT,), costs=None) -> Group:
    costs = costs or (OptionCost(time_s=time_s, act_bytes=act),)
    return Group(paths=(path,), options=options, costs={"A": costs}, boundary_s={("split", "A", "A"): 0.0})


def _tables(groups, *, pp=2, v=1, m=3, cap=1e9, inflight=None) -> Tables:
    return Tables(
        groups=tuple(groups),
        pp=pp,
        v=v,
        m=m,
        zero_stage=0,
        rank_node_types=("A",) * pp,
        inflight=inflight or (1.0,) * pp,
        ranks={"A": _rank(cap)},
        change_s={},
        tied_params={},
    )


def _solve(tables: Tables):
    problem = build_problem(tables)
    result = solve(problem, CFG)
    return result, (extract_assignment(problem) if result.objective_s is not None else None)


def test_pipeline_split_hand_computed():
    # Layers 1, 2, 3 s on 2 stages, m = 3: step = (m-1) max + sum; best split [1,2 | 3] -> 2*3 + 6 = 12.
    result, assignment = _solve(_tables([_layer("a", 1), _layer("b", 2), _layer("c", 3)]))
    assert result.status == "optimal" and result.gap == 0
    assert result.objective_s == pytest.approx(12.0, rel=1e-9)
    assert [sum(map(sum, chunk)) for chunk in assignment.counts] == [2, 1]


def test_cutoff_prunes_a_candidate_that_cannot_beat_the_incumbent():
    # The same program (optimum 12 s) with an incumbent of 11.9 s: nothing better exists -> cut_off with the
    # cutoff as its proven floor; with an incumbent of 12.5 s the optimum 12 s is still found and proven.
    tables = _tables([_layer("a", 1), _layer("b", 2), _layer("c", 3)])
    cut = solve(build_problem(tables), CFG, cutoff_s=11.9)
    assert cut.status == "cut_off" and cut.objective_s is None and cut.bound_s == 11.9
    kept = solve(build_problem(tables), CFG, cutoff_s=12.5)
    assert kept.status == "optimal" and kept.objective_s == pytest.approx(12.0, rel=1e-9)
    assert kept.bound_s == pytest.approx(12.0, rel=1e-9)


def test_memory_forces_recompute_hand_computed():
    # One stage, two layers; 'none' is 1 s with 10 bytes of activations, 'full' 1.5 s with 1 byte.
    costs = (OptionCost(time_s=1.0, act_bytes=10), OptionCost(time_s=1.5, act_bytes=1))
    layers = [_layer(p, 0, options=(NONE_SPLIT, FULL_SPLIT), costs=costs) for p in "ab"]
    # capacity 11: only one layer may keep its activations -> 1 + 1.5 = 2.5 s per micro-batch, m = 2.
    result, _ = _solve(_tables(layers, pp=1, m=2, cap=11))
    assert result.objective_s == pytest.approx(2 * 2.5, rel=1e-9)
    result, _ = _solve(_tables(layers, pp=1, m=2, cap=1))  # 2 bytes needed even with full recompute
    assert result.status == "infeasible"


def test_interleaved_objective_hand_computed():
    # 4 equal layers of 1 s, pp = 2, v = 2, m = 4: T_r = 2, step = (4 - 1/2)*2 + (1/2)*4 = 9.
    result, _ = _solve(_tables([_layer(str(i), 1) for i in range(4)], pp=2, v=2, m=4))
    assert result.objective_s == pytest.approx(9.0, rel=1e-9)


def _concave(rng: random.Random) -> Concave:
    return Concave(pieces=tuple((rng.uniform(0, 0.05), rng.uniform(0, 0.02)) for _ in range(rng.randint(0, 3))))


def _random_tables(rng: random.Random) -> Tables:
    pp, v = rng.choice([1, 2, 3]), rng.choice([1, 1, 2])
    n_layers = rng.randint(pp * v, min(6, pp * v + 3))
    types = ["A", "B"] if rng.random() < 0.5 else ["A"]
    zero = rng.choice([0, 1, 2, 3])
    groups, left, k = [], n_layers, 0
    while left:
        size = rng.randint(1, min(3, left))
        left -= size
        styles = ["replicate", "split"] if rng.random() < 0.4 else ["split"]
        modes = rng.sample(["none", "selective", "full"], rng.randint(1, 3))
        opts = tuple(Option(recompute=r, style=s) for s in styles for r in modes)
        gather = {s: rng.uniform(0, 0.05) for s in styles}  # a weight gather depends on the layout only
        costs = {
            t: tuple(
                OptionCost(
                    time_s=(1 + 0.7 * (t == "B")) * rng.uniform(0.1, 1),
                    fwd_s=rng.uniform(0, 0.2),
                    bwd_s=rng.uniform(0, 0.3),
                    act_bytes=rng.uniform(0, 10),
                    params_dp=rng.uniform(0, 3),
                    params_dpt=rng.uniform(0, 1) * (o.style == "replicate"),
                    param_bytes=rng.uniform(0, 2),
                    ws_bytes=rng.uniform(0, 4) * (o.recompute == "full"),
                    z3_mb_s=rng.uniform(0, 0.4),
                    z3_gather_s=gather[o.style],
                )
                for o in opts
            )
            for t in types
        }
        groups.append(
            Group(
                paths=tuple(f"l{k + j}" for j in range(size)),
                options=opts,
                costs=costs,
                boundary_s={(sty, a, b): rng.uniform(0, 0.1) for sty in styles for a in types for b in types},
                out_buffer_bytes=rng.uniform(0, 1),
            )
        )
        k += size
    change = {
        (g, a, b, t): rng.uniform(0, 0.3)
        for g in range(len(groups) - 1)
        for a in groups[g].styles
        for b in groups[g + 1].styles
        for t in types
        if a != b
    }
    ranks = {
        t: _rank(
            rng.uniform(15, 50),
            state_bytes_per_param_dp=rng.uniform(0, 2),
            state_bytes_per_param_dpt=rng.uniform(0, 1),
            reserve_factor=rng.choice([1.0, 1.1]),
            reserve_const_bytes=rng.uniform(0, 2),
            ddp_buffer=rng.choice(["never", "always"]),
            ddp_buffer_cap_bytes=rng.choice([math.inf, rng.uniform(0, 3)]),
            grad_bytes_per_param=1.0,
            zero3_buffer_layers=2 if zero == 3 else 0,
            pp_buffers=pp > 1,
            sync_dp=_concave(rng),
            sync_dpt=_concave(rng),
            last_bucket_s=rng.choice([0.0, rng.uniform(0, 0.05)]),
            gather_dp=_concave(rng),
            gather_dpt=_concave(rng),
            optimizer_s_per_param_dp=rng.uniform(0, 0.01),
            optimizer_s_per_param_dpt=rng.uniform(0, 0.01),
        )
        for t in types
    }
    tied = {sty: rng.uniform(0, 2) for sty in groups[0].styles} if rng.random() < 0.3 else {}
    return Tables(
        groups=tuple(groups),
        pp=pp,
        v=v,
        m=rng.randint(1, 4),
        zero_stage=zero,
        rank_node_types=tuple(rng.choice(types) for _ in range(pp)),
        inflight=tuple(float(rng.randint(1, 3)) for _ in range(pp)),
        ranks=ranks,
        change_s=change,
        tied_params=tied,
    )


def test_ilp_equals_brute_force_on_random_tables():
    rng = random.Random(20261121)
    feasible = infeasible = 0
    for _ in range(60):
        tables = _random_tables(rng)
        brute = brute_force_tables(tables)
        problem = build_problem(tables, cuts=rng.random() < 0.5)
        result = solve(problem, CFG)
        assignment = extract_assignment(problem) if result.objective_s is not None else None
        if brute is None:
            assert result.status == "infeasible"
            infeasible += 1
            continue
        feasible += 1
        ev = evaluate(tables, assignment)
        assert ev.fits
        assert math.isclose(ev.step_s, brute[0].step_s, rel_tol=1e-9)
        assert math.isclose(result.objective_s, ev.step_s, rel_tol=1e-6)
        assert lower_bound_s(tables) <= ev.step_s * (1 + 1e-12)
    assert feasible >= 40 and infeasible >= 1  # the memory limits bind in some instances


def test_linear_builds_what_lpsum_of_products_builds():
    """ilp_terms.linear, the build's fast path, makes the expression pulp.lpSum(var * coef ...) makes: zero
    coefficients left out, a repeated variable's coefficients added in order, int coefficients kept, NaN refused."""
    import pulp

    from planner.search.ilp_terms import linear

    prob = pulp.LpProblem("linear")
    x, y, z = (prob.add_variable(n) for n in "xyz")
    pairs = [(x, 0.5), (y, 0.0), (z, 3), (x, 1e-3), (y, -0.0), (z, 2.25)]
    mine, theirs = linear(pairs), pulp.lpSum(v * c for v, c in pairs)
    assert list(mine.items()) == list(theirs.items())
    assert [type(c) for c in mine.values()] == [type(c) for c in theirs.values()]
    assert mine.constant == theirs.constant == 0
    assert list(linear([(x, 2)]).items()) == [(x, 2)] and type(linear([(x, 2)])[x]) is int
    with pytest.raises(pulp.PulpError):
        linear([(x, float("nan"))])
    with pytest.raises(pulp.PulpError):
        pulp.lpSum(v * c for v, c in [(x, float("nan"))])
