"""Linearisation helpers for :mod:`planner.search.ilp`: indicators, products and concave (min-of-affine)
terms, each constraint named with its family tag."""

from __future__ import annotations

from typing import Any

import pulp

from planner.search.tables import Concave


def at_least(prob: pulp.LpProblem, name: str, tag: str, lower_bounds: list) -> Any:
    """A continuous y >= each expression in ``lower_bounds`` (and >= 0); minimisation makes it their max."""
    y = prob.add_variable(name, lowBound=0)
    for j, expr in enumerate(lower_bounds):
        prob += (y >= expr, f"{tag}[{name},{j}]")
    return y


def indicator(prob: pulp.LpProblem, name: str, tag: str, expr, upper: float) -> Any:
    """Binary e with expr <= upper * e, i.e. e = 1 whenever expr > 0 (expr >= 0, at most ``upper``)."""
    e = prob.add_variable(name, cat="Binary")
    prob += (expr <= upper * e, f"{tag}[{name}]")
    return e


def conjunction(prob: pulp.LpProblem, name: str, tag: str, factors: list) -> Any:
    """The product of 0/1 factors (constants, binaries, or 0/1-valued expressions such as st[g,s] -
    st[g,s-1]): w >= sum(factors) - (k - 1), w >= 0 over the k non-constant factors. Equal to the product
    wherever w is pushed down, i.e. where it only adds cost or memory."""
    if any(isinstance(f, (int, float)) and f == 0 for f in factors):
        return 0
    live = [f for f in factors if not isinstance(f, (int, float))]
    if len(live) <= 1:
        return live[0] if live else 1
    w = prob.add_variable(name, lowBound=0)
    prob += (w >= pulp.lpSum(live) - (len(live) - 1), f"{tag}[{name}]")
    return w


def concave_term(prob: pulp.LpProblem, name: str, tag: str, f: Concave, x, active, x_max: float) -> Any:
    """A continuous y with y >= f(x) achievable with equality, for f = min_k (alpha_k + beta_k x), x >= 0.

    ``active`` is 1 (or a binary) when x > 0 (f(0) = 0): y >= alpha_k active + beta_k x - M_k (1 - s_k),
    sum_k s_k = 1 with selector binaries s_k; M_k = alpha_k + beta_k x_max bounds the piece. Valid because
    y only ever appears on the larger side of >= constraints, so the solver picks the cheapest piece.
    """
    if not f.pieces:
        return 0
    if len(f.pieces) == 1:
        (a, b), = f.pieces
        return at_least(prob, name, tag, [a * active + b * x])
    sel = prob.add_variable_dicts(f"{name}_sel", list(range(len(f.pieces))), cat="Binary")
    prob += (pulp.lpSum(sel.values()) == 1, f"{tag}[{name},select]")
    bounds = [a * active + b * x - (a + b * x_max) * (1 - sel[k]) for k, (a, b) in enumerate(f.pieces)]
    return at_least(prob, name, tag, bounds)
