"""Linearisation helpers for :mod:`planner.search.ilp`: indicators, products and concave (min-of-affine)
terms, each constraint named with its family tag."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pulp

from planner.search.tables import Concave

# What build_problem guarantees CBC: every non-zero coefficient a and right-hand side b of every row and of
# the objective with COEF_MIN <= |a| <= COEF_MAX and |b| <= COEF_MAX. CBC's feasibility and integrality
# tolerances are ~1e-7 to 1e-6 absolute; a row with a 1e9 coefficient turns them into whole layers (seen:
# feasible programs "proven infeasible" by preprocessing, and an "optimal" empty assignment).
COEF_MIN, COEF_MAX = 1e-9, 1e6
RESIDUE_REL = 1e-12  # coefficients this small against their row's largest are float residue of cancelling terms


class ScalingError(RuntimeError):
    """A built program has coefficients outside the bounds CBC handles reliably (a bug in the builder).
    ``largest``/``smallest``: the offending row's largest and smallest |coefficient|."""

    def __init__(self, message: str, *, largest: float, smallest: float):
        super().__init__(message)
        self.largest, self.smallest = largest, smallest


def linear(pairs: Iterable[tuple[Any, float]]) -> pulp.LpAffineExpression:
    """The sum of coefficient x variable over ``pairs`` (variable, coefficient): the expression
    ``pulp.lpSum(var * coef for var, coef in pairs)`` builds (a zero coefficient left out, a repeated variable's
    added, a NaN or infinite one an error), without an expression per term, where the build spends its time."""
    out = pulp.LpAffineExpression()
    for var, coef in pairs:
        if not math.isfinite(coef):
            raise pulp.PulpError("Cannot multiply variables with NaN/inf values")
        if coef != 0:
            out.addterm(var, coef)
    return out


def at_least(prob: pulp.LpProblem, name: str, tag: str, lower_bounds: list) -> Any:
    """A continuous y >= each expression in ``lower_bounds`` (and >= 0); minimisation makes it their max."""
    y = prob.add_variable(name, lowBound=0)
    for j, expr in enumerate(lower_bounds):
        prob += (y >= expr, f"{tag}[{name},{j}]")
    return y


def indicator(prob: pulp.LpProblem, name: str, tag: str, expr, upper: float) -> Any:
    """Binary e with expr / upper <= e, i.e. e = 1 whenever expr > 0 (expr >= 0, at most ``upper``).

    The row is divided by ``upper`` (the tightest big-M the instance allows) so that its coefficients are
    at most 1 whatever the units of ``expr``: a row "1.6e8 n <= 3.6e9 e" in parameters made CBC's
    preprocessing call feasible programs infeasible."""
    e = prob.add_variable(name, cat="Binary")
    prob += (expr * (1 / upper) <= e, f"{tag}[{name}]")
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


def concave_term(
    prob: pulp.LpProblem, name: str, tag: str, f: Concave, x, active, x_max: float, unit: float = 1.0
) -> Any:
    """A continuous y with y >= f(x) / unit achievable with equality, for f = min_k (alpha_k + beta_k x),
    x >= 0 (``unit``: the time unit y is measured in, so its row has coefficients near 1).

    ``active`` is 1 (or a binary) when x > 0 (f(0) = 0): y >= alpha_k active + beta_k x - M_k (1 - s_k),
    sum_k s_k = 1 with selector binaries s_k; M_k = alpha_k + beta_k x_max bounds the piece (the tightest
    bound the instance allows: x_max is the most x can be). Valid because y only ever appears on the
    larger side of >= constraints, so the solver picks the cheapest piece.
    """
    if not f.pieces:
        return 0
    k = 1 / unit
    if len(f.pieces) == 1:
        ((a, b),) = f.pieces
        return at_least(prob, name, tag, [(a * k) * active + (b * k) * x])
    sel = prob.add_variable_dicts(f"{name}_sel", list(range(len(f.pieces))), cat="Binary")
    prob += (pulp.lpSum(sel.values()) == 1, f"{tag}[{name},select]")
    bounds = [
        (a * k) * active + (b * k) * x - ((a + b * x_max) * k) * (1 - sel[j]) for j, (a, b) in enumerate(f.pieces)
    ]
    return at_least(prob, name, tag, bounds)


def check_scaling(prob: pulp.LpProblem) -> tuple[float, float]:
    """Drop float residue (|a| < RESIDUE_REL x the row's largest, e.g. two equal boundary costs computed
    along different paths, 5e-16 apart) and check every row against COEF_MIN / COEF_MAX.

    Returns (smallest, largest) |coefficient|. Raises :class:`ScalingError` naming the row otherwise.
    """
    lo, hi = math.inf, 0.0
    rows = [(con.name, con.expr, con.constant) for con in prob.constraints()]
    rows.append(("objective", prob.objective, 0.0))
    for name, expr, constant in rows:
        if not expr:
            continue
        top = max(abs(a) for a in expr.values())
        for var in [v for v, a in expr.items() if abs(a) < RESIDUE_REL * top]:
            del expr[var]
        small = min((abs(a) for a in expr.values() if a), default=math.inf)
        if top > COEF_MAX or small < COEF_MIN or abs(constant) > COEF_MAX:
            raise ScalingError(
                f"ILP row {name} has coefficients in [{small:.3g}, {top:.3g}] and right-hand side "
                f"{-constant:.3g}, outside [{COEF_MIN:g}, {COEF_MAX:g}]: rescale its units",
                largest=max(top, abs(constant)),
                smallest=small,
            )
        lo, hi = min(lo, small), max(hi, top)
    return lo, hi
