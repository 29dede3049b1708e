"""Fit a cluster's few free parameters to measured runs: bounded, regularised toward the prior, cross-validated.

Parameters (each physically bounded; :data:`PARAMETERS`): on a node type with a kernel model, the GEMM
ceiling, the memory-bound efficiency and the host cost per kernel; on one without (CPU profiles with
measured layer timings), the achieved matmul rate that scales those timings; and the bus bandwidth of the
intra-node and inter-node collective fits (one factor per link level). Fitted in log space with
Levenberg-Marquardt (Marquardt 1963) on the residuals ``log(predicted / measured) / MEASUREMENT_NOISE`` plus
a ridge term
``((log p - log p0) / PRIOR_WIDTH)^2`` per parameter — a Gaussian prior on the log (Tikhonov; Bishop, PRML
§3.3), so a handful of runs moves a parameter only as far as they agree. Parameters leave their bounds
never (projected steps).

How many: the Jacobian of the log step times w.r.t. the log parameters decides. Parameters are taken in
order of how much of the runs' variation they explain beyond the ones already taken (Gram-Schmidt); a
parameter whose remaining column is under ``MIN_NEW_DIRECTION`` of its own norm is collinear with them
(the runs cannot tell it apart) and is not fitted; at most ``runs - 1`` parameters (2 runs: the one that
moves the step times most, e.g. the GEMM ceiling as an overall compute scale). With 3 runs or more, the
number taken is then chosen by k-fold cross-validation on the runs themselves: the shortest prefix of that
order whose held-out error no longer prefix lowers by ``CV_MIN_GAIN``. The reported cross-validated error is
that prefix's (the same folds chose it, so it is slightly optimistic). The report says which were fitted.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from planner.calibrate.runs import MeasuredRun
from planner.core import StratagemError
from planner.cost import estimate, with_gpus
from planner.model import ModelSpec
from planner.profile import BlockingLatency, ClusterProfile, build_gpt_profile

PRIOR_WIDTH = 0.3  # prior standard deviation of log(parameter / datasheet value): ~ +-35 %
MEASUREMENT_NOISE = 0.03  # assumed relative noise of a measured step time (run-to-run spread of a few %)
MIN_NEW_DIRECTION = 0.15  # Gram-Schmidt remainder below which a parameter is collinear with the taken ones
CV_MIN_GAIN = 0.002  # a parameter more must lower the k-fold mean |error| by 0.2 points to be kept
# parameters of a cluster's network rather than of its GPUs and software stack (``transfer``)
LINK_PARAMETERS = frozenset({"intra_bw_scale", "inter_bw_scale", "intra_alpha_scale"})
# name -> (lower, upper) bounds of the absolute value (fractions of peak, seconds, bandwidth factors)
BOUNDS = {
    "gemm_ceiling": (0.2, 0.98),
    "memory_bw_efficiency": (0.2, 0.98),
    "host_op_s": (1e-6, 2e-4),
    "achieved_flops_scale": (0.1, 10.0),
    "intra_bw_scale": (0.2, 2.0),
    "inter_bw_scale": (0.2, 2.0),
    "intra_alpha_scale": (0.2, 20.0),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Parameter:
    name: str  # "<node type>.gemm_ceiling", "intra_bw_scale", "scale", ...
    prior: float
    lower: float
    upper: float


def _set_node(cluster: ClusterProfile, name: str, fn: Callable) -> ClusterProfile:
    return cluster.model_copy(update={"node_types": [fn(nt) if nt.name == name else nt for nt in cluster.node_types]})


def _scale_fits(fits, factor: float):
    return [f.model_copy(update={"bus_bw_bytes_per_s": f.bus_bw_bytes_per_s * factor}) for f in fits]


def _scale_latency(latency: BlockingLatency | None, factor: float) -> BlockingLatency | None:
    """The after-compute latency is a latency of the same links: ``intra_alpha_scale`` scales it too."""
    if latency is None:
        return None
    plain = None if latency.plain_collective_s is None else latency.plain_collective_s * factor
    return latency.model_copy(
        update={"functional_collective_s": latency.functional_collective_s * factor, "plain_collective_s": plain}
    )


def apply(cluster: ClusterProfile, values: dict[str, float]) -> ClusterProfile:
    """``cluster`` with fitted ``values`` (parameter name -> value) written into its node types and fits."""
    for key, v in values.items():
        node, _, what = key.rpartition(".")
        if what in ("gemm_ceiling", "memory_bw_efficiency", "host_op_s"):
            cluster = _set_node(
                cluster,
                node,
                lambda nt, w=what, v=v: nt.model_copy(
                    update={"kernel_model": nt.kernel_model.model_copy(update={w: v})}
                ),
            )
        elif what == "achieved_flops_scale":
            cluster = _set_node(
                cluster,
                node,
                lambda nt, v=v: nt.model_copy(
                    update={
                        "compute": [
                            c.model_copy(update={"achieved_flops_per_s": c.achieved_flops_per_s * v})
                            for c in nt.compute
                        ]
                    }
                ),
            )
        elif what == "intra_bw_scale":
            cluster = cluster.model_copy(
                update={
                    "node_types": [
                        nt.model_copy(update={"intra_node": _scale_fits(nt.intra_node, v)}) for nt in cluster.node_types
                    ]
                }
            )
        elif what == "intra_alpha_scale":
            cluster = cluster.model_copy(
                update={
                    "node_types": [
                        nt.model_copy(
                            update={
                                "intra_node": [f.model_copy(update={"alpha_s": f.alpha_s * v}) for f in nt.intra_node],
                                "blocking_latency": _scale_latency(nt.blocking_latency, v),
                            }
                        )
                        for nt in cluster.node_types
                    ]
                }
            )
        elif what == "inter_bw_scale":
            cluster = cluster.model_copy(update={"inter_node": _scale_fits(cluster.inter_node, v)})
        else:
            raise StratagemError(f"unknown calibration parameter {key!r}")
    return cluster


def candidate_parameters(cluster: ClusterProfile) -> list[Parameter]:
    """Every parameter the cluster offers, with its prior value and bounds."""
    out = []
    for nt in cluster.node_types:
        if nt.kernel_model is not None:
            for what in ("gemm_ceiling", "memory_bw_efficiency", "host_op_s"):
                out.append(
                    Parameter(
                        name=f"{nt.name}.{what}",
                        prior=getattr(nt.kernel_model, what),
                        lower=BOUNDS[what][0],
                        upper=BOUNDS[what][1],
                    )
                )
        else:
            out.append(Parameter(name=f"{nt.name}.achieved_flops_scale", prior=1.0, lower=0.1, upper=10.0))
    out.append(Parameter(name="intra_bw_scale", prior=1.0, lower=0.2, upper=2.0))
    out.append(Parameter(name="intra_alpha_scale", prior=1.0, lower=0.2, upper=20.0))
    if cluster.inter_node:
        out.append(Parameter(name="inter_bw_scale", prior=1.0, lower=0.2, upper=2.0))
    return out


class Predictor:
    """Predicted step times of runs on a cluster with parameter values; profiles built once per run."""

    def __init__(self, cluster: ClusterProfile, runs: list[MeasuredRun]):
        self.cluster, self.runs = cluster, runs
        self.models = []
        for r in runs:
            if r.profile is not None:
                self.models.append(r.profile)
                continue
            spec = ModelSpec(family=r.family or r.model.split(":")[0], dims=dict(r.dims))
            tps = [1, r.config.tp] if r.config.tp > 1 else [1]
            try:
                self.models.append(build_gpt_profile(spec, seq_len=r.seq, dtype=r.dtype, tp_degrees=tps))
            except StratagemError as exc:
                raise StratagemError(f"runs {r.label()}: {exc}") from None

    def predict(self, values: dict[str, float], runs: list[int] | None = None) -> np.ndarray:
        cluster = apply(self.cluster, values)
        out = []
        for i in runs if runs is not None else range(len(self.runs)):
            r = self.runs[i]
            try:
                est = estimate(
                    self.models[i], with_gpus(cluster, r.gpus), r.config, global_batch=r.global_batch, dtype=r.dtype
                )
            except StratagemError as exc:
                raise StratagemError(f"runs {r.label()}: the cost model rejects it ({exc})") from None
            out.append(est.step_time_s)
        return np.array(out)


@dataclass(kw_only=True)
class FitResult:
    values: dict[str, float]
    prior: dict[str, float]
    bounds: dict[str, tuple[float, float]]
    residuals: list[float]  # predicted / measured - 1 per run, after
    residuals_before: list[float]
    cv_errors: list[float] = field(default_factory=list)  # |held-out error| per run, k-fold
    note: str = ""


def _choose(params: list[Parameter], jac: np.ndarray, n_runs: int) -> tuple[list[int], str]:
    """Indices of the parameters to fit (module docstring) and the reason for leaving the rest out."""
    limit = max(1, n_runs - 1)
    taken: list[int] = []
    basis: list[np.ndarray] = []
    collinear = []
    order = sorted(range(len(params)), key=lambda j: -np.linalg.norm(jac[:, j]))
    for j in order:
        col = jac[:, j].copy()
        norm = np.linalg.norm(col)
        if norm < 1e-6:
            continue
        for b in basis:
            col -= (col @ b) * b
        if np.linalg.norm(col) < MIN_NEW_DIRECTION * norm:
            collinear.append(params[j].name)
            continue
        if len(taken) < limit:
            taken.append(j)
            basis.append(col / np.linalg.norm(col))
    left = [p.name for i, p in enumerate(params) if i not in taken]
    note = f"fitted {', '.join(params[j].name for j in taken)}"
    if left:
        note += f"; not fitted: {', '.join(left)}"
        if collinear:
            note += f" ({', '.join(collinear)} indistinguishable on these runs)"
        if len(taken) == limit:
            note += f" (at most runs - 1 = {limit} parameters)"
    return taken, note


def _solve(
    pred: Predictor, params: list[Parameter], measured: np.ndarray, runs: list[int], iterations: int = 12
) -> dict[str, float]:
    """Levenberg-Marquardt in log space with the ridge prior and projection onto the bounds."""
    x0 = np.log([p.prior for p in params])
    lo, hi = np.log([p.lower for p in params]), np.log([p.upper for p in params])
    x, lam = x0.copy(), 1e-2

    def resid(xv):
        vals = {p.name: math.exp(v) for p, v in zip(params, xv)}
        r = np.log(pred.predict(vals, runs) / measured) / MEASUREMENT_NOISE
        return np.concatenate([r, (xv - x0) / PRIOR_WIDTH])

    r = resid(x)
    for _ in range(iterations):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            step = np.zeros_like(x)
            step[j] = 1e-4
            jac[:, j] = (resid(x + step) - r) / 1e-4
        while True:
            a = jac.T @ jac + lam * np.eye(len(x))
            x_new = np.clip(x - np.linalg.solve(a, jac.T @ r), lo, hi)
            r_new = resid(x_new)
            if r_new @ r_new < r @ r:
                x, r, lam = x_new, r_new, lam / 3
                break
            lam *= 4
            if lam > 1e6:
                return {p.name: math.exp(v) for p, v in zip(params, x)}
    return {p.name: math.exp(v) for p, v in zip(params, x)}


def fit(cluster: ClusterProfile, runs: list[MeasuredRun], *, folds: int = 5, min_runs: int = 2) -> FitResult:
    """Fit the cluster's parameters to ``runs`` (module docstring) and cross-validate with ``folds`` folds
    (``folds=0``: no cross-validation). ``min_runs=1`` lets one run fit one parameter (``stratagem tune``: the
    overall scale, so that the next candidates are compared with the measured one on its footing)."""
    if len(runs) < max(1, min_runs):
        raise StratagemError(
            f"calibration needs at least 2 measured runs, got {len(runs)}; add runs of other "
            f"configurations (micro-batch, tp, model size) to the runs file"
        )
    pred = Predictor(cluster, runs)
    measured = np.array([r.step_time_s for r in runs])
    before = pred.predict({})
    params = candidate_parameters(cluster)
    base = np.log(before)
    jac = np.empty((len(runs), len(params)))
    for j, p in enumerate(params):
        jac[:, j] = (np.log(pred.predict({p.name: p.prior * math.exp(0.05)})) - base) / 0.05
    taken, note = _choose(params, jac, len(runs))
    ordered = [params[j] for j in taken]

    def cross_validate(chosen: list[Parameter]) -> list[float]:
        k = min(folds, len(runs))
        errors: list[float] = []
        for f in range(k):
            held = [i for i in range(len(runs)) if i % k == f]
            train = [i for i in range(len(runs)) if i % k != f]
            v = _solve(pred, chosen, measured[train], train)
            errors += list(np.abs(pred.predict(v, held) / measured[held] - 1))
        return errors

    params, cv = ordered, []
    if len(runs) >= 3 and folds >= 2:
        # how many of the ordered parameters: the prefix with the lowest k-fold error on these runs (model
        # selection by cross-validation, Hastie, Tibshirani & Friedman, ESL 2nd ed. §7.10); a longer prefix
        # must lower it by CV_MIN_GAIN to be taken, so ties keep the simpler model
        best: tuple[float, int, list[float]] | None = None
        for size in range(1, len(ordered) + 1):
            errors = cross_validate(ordered[:size])
            score = statistics.fmean(errors)
            if best is None or score < best[0] - CV_MIN_GAIN:
                best = (score, size, errors)
        assert best is not None
        params, cv = ordered[: best[1]], best[2]
        if best[1] < len(ordered):
            dropped = ", ".join(p.name for p in ordered[best[1] :])
            note += f"; cross-validation kept {best[1]} of {len(ordered)} (left out {dropped})"
    values = _solve(pred, params, measured, list(range(len(runs))))
    after = pred.predict(values)
    return FitResult(
        values=values,
        prior={p.name: p.prior for p in params},
        bounds={p.name: (p.lower, p.upper) for p in params},
        residuals=list(after / measured - 1),
        residuals_before=list(before / measured - 1),
        cv_errors=cv,
        note=note,
    )


def mean_abs(xs: list[float]) -> float:
    return statistics.fmean(abs(x) for x in xs) if xs else 0.0


def transfer(
    values: dict[str, float], prior: dict[str, float], cluster: ClusterProfile, *, links: bool = True
) -> dict[str, float]:
    """Fitted values carried to another cluster as ratios to their priors, per parameter kind (e.g. the
    fitted GEMM ceiling / the datasheet one), applied to every node type of ``cluster`` and clipped to bounds:
    what a software stack gains or loses on one GPU type it is assumed to gain or lose on another.
    ``links=False`` (the values were fitted on another cluster's network): the link parameters
    (:data:`LINK_PARAMETERS`) stay at ``cluster``'s own priors — a bandwidth or latency fitted on one
    network's switches and NICs says nothing about another's."""
    ratios = {k.rpartition(".")[2]: values[k] / prior[k] for k in values}
    out = {}
    for p in candidate_parameters(cluster):
        kind = p.name.rpartition(".")[2]
        if kind in ratios and (links or kind not in LINK_PARAMETERS):
            out[p.name] = min(max(p.prior * ratios[kind], p.lower), p.upper)
    return out
