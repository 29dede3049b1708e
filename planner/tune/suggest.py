"""``stratagem tune suggest``: which configurations to measure next, or that the measured best is the answer.

One step of the model-guided trial loop (issue 28). From the runs measured so far it

1. calibrates the cluster on them (``planner.calibrate.fit``: bounded, regularised, cross-validated; one run
   fits one parameter, the one that moves it most, so later candidates are compared with it on its footing);
2. prices every candidate configuration on the calibrated cluster (the user's ``--candidates``, or every
   uniform configuration a trainer can state: the Megatron-style grid of ``planner.search.grid`` with ZeRO 0/1
   and sequence parallelism), dropping those predicted not to fit in memory;
3. gives each prediction an uncertainty (relative, the standard deviation of ``log(measured / predicted)``) of
   two parts: the calibration's cross-validated error on these runs (k-fold with 3 runs or more, leave-one-out
   of a one-factor scale with 2, with one run the prior width ``PRIOR_WIDTH`` and no stop; never below the
   run-to-run noise floor), and, for every parameter the runs did
   not fit, its prior width (``PRIOR_WIDTH``) times the candidate's sensitivity to it (``d log t / d log p``)
   beyond the measured best's -- a candidate unlike the measured runs (another mix of compute and links) is as
   uncertain as the profile's own figures -- and, for a parallel layout no run used (its degrees above 1:
   :func:`family`), ``FAMILY_WIDTH`` more: the model's error on a mechanism no run exercised is not in the
   cross-validated residuals. With no run of the job yet, the fastest predictions come first;
4. ranks the unmeasured candidates by the expected gain over the measured best (lognormal step time:
   ``E[max(best - T, 0)] = best Phi(d) - t exp(s^2/2) Phi(d - s)``, ``d = ln(best/t)/s``), a plausible layout no
   run used first (:func:`choose`), and stops when none beats the measured best with probability
   ``STOP_PROBABILITY`` or more.

The runs may include other models or GPU counts on the same cluster: all of them calibrate; only those of the
target (model, sequence, GPUs, global batch, dtype) are measured candidates.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from planner.calibrate import PRIOR_WIDTH, MeasuredRun, Predictor, apply, candidate_parameters, fit
from planner.core import StratagemError
from planner.cost import ParallelConfig, estimate, with_gpus
from planner.model import ModelSpec, parse_model
from planner.profile import ClusterProfile, ModelProfile, build_gpt_profile
from planner.search import grid_configs

STOP_PROBABILITY = 0.05  # stop when no unmeasured candidate beats the measured best with at least this chance
# the floor of the uncertainty: run-to-run noise of a measured step time (the calibration's own assumption)
NOISE_FLOOR = 0.03
TUNABLE_FAMILIES = ("gpt", "llama", "moe")  # the families the runs file and the calibration price


@dataclass(frozen=True, kw_only=True, slots=True)
class Scored:
    """One candidate configuration priced on the calibrated cluster."""

    run: MeasuredRun  # the configuration; step_time_s is NaN unless it was measured
    predicted_s: float
    peak_memory_bytes: float
    fits: bool
    sigma: float | None = None  # relative uncertainty of predicted_s (std of log measured/predicted)
    p_better: float | None = None  # chance it beats the measured best
    expected_gain_s: float | None = None  # E[max(best - T, 0)], seconds per step


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneCalibration:
    values: dict[str, float]  # fitted parameters (empty: the profile as it is)
    note: str
    sigma: float | None
    sigma_source: str
    runs: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Suggestion:
    next: tuple[Scored, ...]  # best first; empty when stop
    stop: bool
    reason: str
    best: MeasuredRun | None  # the measured best of the target
    calibration: TuneCalibration
    candidates: int  # priced
    unfit: int  # predicted not to fit in memory
    measured: int  # candidates already measured


def config_key(config: ParallelConfig) -> tuple:
    """What identifies a uniform configuration (the runs file's columns)."""
    return (
        config.tp,
        config.pp,
        config.dp,
        config.micro_batch,
        config.schedule,
        config.virtual_stages,
        config.zero_stage,
        config.recompute if isinstance(config.recompute, str) else tuple(sorted(config.recompute.items())),
        config.sequence_parallel,
    )


def label(config: ParallelConfig) -> str:
    """``tp2 pp4 dp8 mb1 1f1b z1 full sp``: a uniform configuration in one word per choice."""
    parts = [f"tp{config.tp}", f"pp{config.pp}", f"dp{config.dp}", f"mb{config.micro_batch}", config.schedule]
    if config.virtual_stages > 1:
        parts[-1] += f"(v={config.virtual_stages})"
    parts.append(f"z{config.zero_stage}")
    modes = {config.recompute} if isinstance(config.recompute, str) else set(config.recompute.values()) or {"none"}
    parts.append(modes.pop() if len(modes) == 1 else "per-layer")
    if config.sequence_parallel:
        parts.append("sp")
    return " ".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """The training job being tuned."""

    model: str  # as the user wrote it (the runs file's ``model`` column)
    spec: ModelSpec
    seq: int
    gpus: int
    global_batch: int
    dtype: str

    def matches(self, run: MeasuredRun) -> bool:
        return (
            dict(run.dims) == dict(self.spec.dims)
            and (run.family or run.model.split(":")[0]) == self.spec.family
            and (run.seq, run.gpus, run.global_batch, run.dtype) == (self.seq, self.gpus, self.global_batch, self.dtype)
        )

    def run(self, config: ParallelConfig, row: int) -> MeasuredRun:
        return MeasuredRun(
            row=row,
            model=self.model,
            dims=tuple(sorted(self.spec.dims.items())),
            seq=self.seq,
            gpus=self.gpus,
            global_batch=self.global_batch,
            config=config,
            dtype=self.dtype,
            step_time_s=math.nan,
        )


def check_target(target: Target) -> None:
    if target.spec.family not in TUNABLE_FAMILIES:
        raise StratagemError(
            f"tune prices {', '.join(TUNABLE_FAMILIES)} models (the runs file's families); "
            f"{target.model} is {target.spec.family}: plan it with `stratagem plan` instead"
        )
    stated = {k: target.spec.dims[k] for k in ("layers", "hidden", "heads", "vocab") if k in target.spec.dims}
    as_runs = parse_model(target.model, **stated, max_seq=target.seq)
    extra = sorted(k for k in target.spec.dims if as_runs.dims.get(k) != target.spec.dims[k])
    if extra:
        raise StratagemError(
            f"the runs file states a model by model, layers, hidden, heads, vocab and seq; {', '.join(extra)} "
            f"cannot be stated there, so measured runs could not be matched to this job; tune without those "
            f"overrides (or a preset that has them)"
        )


def target_profile(target: Target) -> ModelProfile:
    return build_gpt_profile(target.spec, seq_len=target.seq, dtype=target.dtype)


def uniform_candidates(target: Target, profile: ModelProfile) -> list[MeasuredRun]:
    """Every uniform configuration a trainer can state for the target: the grid's (tp inside a node, every pp, dp
    and micro-batch split, 1F1B or interleaved, recompute none or full) with ZeRO 0 or 1 and, at tp > 1,
    sequence parallelism off or on."""
    out: list[MeasuredRun] = []
    for config in grid_configs(profile, target.gpus, target.global_batch):
        for zero in (0, 1):
            for sp in (False, True) if config.tp > 1 else (False,):
                out.append(target.run(replace(config, zero_stage=zero, sequence_parallel=sp), len(out) + 1))
    return out


def calibrate(
    cluster: ClusterProfile, runs: list[MeasuredRun], *, folds: int = 5, noise_floor: float = NOISE_FLOOR
) -> TuneCalibration:
    """Fit the cluster to ``runs`` and state how far its predictions are to be trusted (module docstring); the
    uncertainty is at least ``noise_floor``, the run-to-run noise of a measurement."""
    if not runs:
        return TuneCalibration(
            values={},
            note="no runs yet: nothing fitted",
            sigma=None,
            sigma_source="no runs yet: no cross-validated error; the fastest predictions are measured first",
            runs=0,
        )
    result = fit(cluster, runs, folds=folds if len(runs) >= 3 else 0, min_runs=1)
    if result.cv_errors:
        # |held-out error| e is |pred / meas - 1|; its log is log(1 + e) over, -log(1 - e) under: take the larger
        logs = [-math.log(1 - min(e, 0.99)) for e in result.cv_errors]
        sigma = math.sqrt(statistics.fmean(x * x for x in logs))
        source = f"{min(folds, len(runs))}-fold cross-validated error of the calibration on {len(runs)} runs"
    elif len(runs) == 1:  # nothing held out yet: as uncertain as the profile's own figures, and no stop
        sigma = PRIOR_WIDTH
        source = (
            f"one run: no held-out error yet, so the prior width of the profile's figures ({PRIOR_WIDTH:.0%}); "
            f"no stop before a second run"
        )
    else:  # leave-one-out of a one-factor scale: each run predicted from the mean log ratio of the others
        ratios = [math.log(r.step_time_s) - math.log(p) for r, p in zip(runs, Predictor(cluster, runs).predict({}))]
        n = len(ratios)
        held = [x - (sum(ratios) - x) / (n - 1) for x in ratios]
        sigma = math.sqrt(statistics.fmean(x * x for x in held))
        source = f"leave-one-out error of a one-factor scale on {n} runs"
    floored = max(sigma, noise_floor)
    if floored > sigma:
        source += f" ({sigma:.1%}, raised to the {noise_floor:.1%} run-to-run noise floor)"
    return TuneCalibration(values=result.values, note=result.note, sigma=floored, sigma_source=source, runs=len(runs))


CONTRADICTION = 1.5  # repeats of one configuration further apart than this factor are refused


def fastest_of_repeats(runs: list[MeasuredRun]) -> dict[tuple, MeasuredRun]:
    """One measurement per configuration: the fastest of its repeats. Repeats more than ``CONTRADICTION`` apart
    are a contradiction (a different setup, or a disturbed run) and are refused with the rows named."""
    groups: dict[tuple, list[MeasuredRun]] = {}
    for run in runs:
        groups.setdefault(config_key(run.config), []).append(run)
    out = {}
    for key, repeats in groups.items():
        fast = min(repeats, key=lambda r: r.step_time_s)
        slow = max(repeats, key=lambda r: r.step_time_s)
        if slow.step_time_s > CONTRADICTION * fast.step_time_s:
            raise StratagemError(
                f"runs rows {fast.row} and {slow.row} measure the same configuration ({label(fast.config)}) "
                f"{slow.step_time_s / fast.step_time_s:.1f}x apart; remeasure it, or drop the row that ran on "
                f"another setup"
            )
        out[key] = fast
    return out


SENSITIVITY_STEP = 0.05  # log step of the finite difference d log t / d log p
# the uncertainty a candidate carries for a parallel layout no measured run used (module docstring, item 3)
FAMILY_WIDTH = PRIOR_WIDTH


def family(config: ParallelConfig) -> tuple[str, ...]:
    """The parallel mechanisms a configuration exercises: the degrees above 1 (``("pp",)``, ``("dp", "tp")``, ...).

    >>> family(ParallelConfig(tp=2, dp=4))
    ('dp', 'tp')
    """
    degrees = {"dp": config.dp, "tp": config.tp, "pp": config.pp, "cp": config.cp, "ep": config.ep}
    return tuple(name for name, degree in sorted(degrees.items()) if degree > 1)


def uncertainties(
    scored: list[Scored],
    best: MeasuredRun,
    measured: list[MeasuredRun],
    profile: ModelProfile,
    cluster: ClusterProfile,
    cal: TuneCalibration,
    *,
    memory_fraction: float,
) -> list[float]:
    """Each candidate's relative uncertainty against the measured ``best``: the calibration's cross-validated error
    and, in quadrature, the prior width of every parameter the runs did not fit times the candidate's sensitivity
    to it beyond the measured best's (an error both share moves both alike; module docstring), and ``FAMILY_WIDTH``
    for a candidate whose parallel layout (:func:`family`) none of ``measured`` used."""
    base = cal.sigma if cal.sigma is not None else NOISE_FLOOR
    seen = {family(run.config) for run in measured}
    var = [base * base + (0.0 if family(s.run.config) in seen else FAMILY_WIDTH**2) for s in scored]
    runs = [s.run for s in scored] + [best]
    now = scored + price([best], profile, apply(cluster, cal.values), memory_fraction=memory_fraction, strict=True)
    for param in candidate_parameters(cluster):
        if param.name in cal.values:
            continue
        moved = apply(cluster, {**cal.values, param.name: param.prior * math.exp(SENSITIVITY_STEP)})
        again = price(runs, profile, moved, memory_fraction=memory_fraction, strict=True)
        slopes = [(math.log(m.predicted_s) - math.log(s.predicted_s)) / SENSITIVITY_STEP for s, m in zip(now, again)]
        for i in range(len(scored)):
            var[i] += ((slopes[i] - slopes[-1]) * PRIOR_WIDTH) ** 2
    return [math.sqrt(v) for v in var]


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def score(predicted_s: float, best_s: float, sigma: float) -> tuple[float, float]:
    """(P(T < best), E[max(best - T, 0)]) for a lognormal step time T with median ``predicted_s``.

    >>> p, gain = score(1.0, 1.0, 0.1)
    >>> round(p, 3), round(gain, 4)
    (0.5, 0.0375)
    """
    d = math.log(best_s / predicted_s) / sigma
    p = _normal_cdf(d)
    gain = best_s * p - predicted_s * math.exp(sigma * sigma / 2) * _normal_cdf(d - sigma)
    return p, max(gain, 0.0)


def price(
    candidates: list[MeasuredRun],
    profile: ModelProfile,
    cluster: ClusterProfile,
    *,
    memory_fraction: float,
    strict: bool = True,
) -> list[Scored]:
    """Each candidate's predicted step time and peak memory on ``cluster`` (already calibrated). A candidate the
    cost model rejects is an error when ``strict`` (the user's own list), else left out (the generated grid)."""
    out = []
    sized = with_gpus(cluster, max((run.gpus for run in candidates), default=1))
    for run in candidates:
        try:
            est = estimate(profile, sized, run.config, global_batch=run.global_batch, dtype=run.dtype)
        except StratagemError as exc:
            if not strict:
                continue
            raise StratagemError(
                f"candidate {run.row} ({label(run.config)}): the cost model rejects it ({exc})"
            ) from None
        fits = all(rk.memory.peak_bytes <= memory_fraction * rk.memory.capacity for rk in est.per_rank)
        out.append(Scored(run=run, predicted_s=est.step_time_s, peak_memory_bytes=est.peak_memory_bytes, fits=fits))
    return out


def suggest(
    target: Target,
    cluster: ClusterProfile,
    runs: list[MeasuredRun],
    *,
    candidates: list[MeasuredRun] | None = None,
    k: int = 2,
    memory_fraction: float = 0.9,
    folds: int = 5,
) -> Suggestion:
    """The ``k`` configurations most worth measuring next, or stop (module docstring)."""
    check_target(target)
    profile = target_profile(target)
    generated = candidates is None
    if candidates is None:
        candidates = uniform_candidates(target, profile)
    stray = [c for c in candidates if not target.matches(c)]
    if stray:
        raise StratagemError(
            f"candidate row {stray[0].row} is for another job ({stray[0].model}, {stray[0].gpus} GPUs, batch "
            f"{stray[0].global_batch}) than the one tuned; give candidates of {target.model} on {target.gpus} GPUs "
            f"at batch {target.global_batch}, seq {target.seq}, {target.dtype}"
        )
    too_big = [c for c in candidates if c.gpus > cluster.total_devices]
    if too_big:
        raise StratagemError(
            f"candidate row {too_big[0].row} needs {too_big[0].gpus} GPUs but cluster {cluster.name} has "
            f"{cluster.total_devices}; use --gpus {cluster.total_devices} or fewer"
        )
    measured = fastest_of_repeats([r for r in runs if target.matches(r)])
    cal = calibrate(cluster, runs, folds=folds)
    calibrated = apply(cluster, cal.values)
    priced = price(candidates, profile, calibrated, memory_fraction=memory_fraction, strict=not generated)
    best = min(measured.values(), key=lambda r: r.step_time_s) if measured else None
    open_ = [s for s in priced if s.fits and config_key(s.run.config) not in measured]
    unfit = sum(1 for s in priced if not s.fits)

    def answer(chosen: list[Scored], stop: bool, reason: str) -> Suggestion:
        return Suggestion(
            next=tuple(chosen),
            stop=stop,
            reason=reason,
            best=best,
            calibration=cal,
            candidates=len(priced),
            unfit=unfit,
            measured=len(measured),
        )

    if priced and unfit == len(priced):
        raise StratagemError(
            f"none of the {len(priced)} candidates is predicted to fit in {memory_fraction:.0%} of device memory; "
            f"use more GPUs, a larger --memory-fraction, or candidates with recompute or ZeRO"
        )
    if not open_:
        why = "every candidate that fits has been measured" if priced else "there are no candidates"
        return answer([], True, why)
    chosen, stop, reason = choose(
        open_, best, list(measured.values()), profile, cluster, cal, memory_fraction=memory_fraction, k=k
    )
    return answer(chosen, stop, reason)


def choose(
    open_: list[Scored],
    best: MeasuredRun | None,
    measured: list[MeasuredRun],
    profile: ModelProfile,
    cluster: ClusterProfile,
    cal: TuneCalibration,
    *,
    memory_fraction: float,
    k: int,
) -> tuple[list[Scored], bool, str]:
    """(the ``k`` unmeasured candidates most worth measuring, stop, why): the fastest predictions while nothing is
    measured, else the largest expected gains over the measured ``best``; stop when none beats it with probability
    ``STOP_PROBABILITY`` or more (module docstring). ``measured``: the target's measured runs. ``cluster`` is
    uncalibrated; ``cal`` says how it was fitted.

    Layouts first: while a parallel layout (:func:`family`) that no run used has a candidate that beats the
    measured best with probability ``STOP_PROBABILITY`` or more, the most promising such layout's best candidate
    comes first. A calibration fitted on one layout's runs cannot tell how far off the model is on another
    (gpt:small on 2 CPU ranks: pipeline runs measured 3.7x their prediction, data-parallel ones 2.1x, so scaling
    by the first ranked the faster data-parallel layout last)."""
    if best is None:
        return (
            sorted(open_, key=lambda s: s.predicted_s)[:k],
            False,
            "no measured run of this job yet: the fastest predictions",
        )
    sigmas = uncertainties(open_, best, measured, profile, cluster, cal, memory_fraction=memory_fraction)
    scored = []
    for s, sigma in zip(open_, sigmas):
        p, gain = score(s.predicted_s, best.step_time_s, sigma)
        scored.append(replace(s, sigma=sigma, p_better=p, expected_gain_s=gain))
    scored.sort(key=lambda s: (-(s.expected_gain_s or 0.0), s.predicted_s))
    likeliest = max(scored, key=lambda s: s.p_better or 0.0)
    if (likeliest.p_better or 0.0) < STOP_PROBABILITY and cal.runs >= 2:  # a stop needs a held-out error
        reason = (
            f"no unmeasured candidate beats the measured best ({best.step_time_s:.4g} s, {label(best.config)}) with "
            f"probability {STOP_PROBABILITY:.0%} or more: the likeliest, {label(likeliest.run.config)}, is predicted "
            f"{likeliest.predicted_s:.4g} s +- {likeliest.sigma:.1%} (P = {likeliest.p_better:.1%}; uncertainty: "
            f"{cal.sigma_source} and the unfitted parameters' prior widths)"
        )
        return [], True, reason
    plausible = [s for s in scored if (s.p_better or 0.0) >= STOP_PROBABILITY]
    seen = {family(run.config) for run in measured}
    new_layouts: dict[tuple[str, ...], Scored] = {}
    for s in plausible:  # best first: each unmeasured layout's most promising candidate
        new_layouts.setdefault(family(s.run.config), s)
    first = [s for layout, s in new_layouts.items() if layout not in seen]
    chosen = (first + [s for s in plausible if s not in first])[:k] or scored[:k]
    if first:
        layout = " x ".join(family(chosen[0].run.config)) or "one device"
        return chosen, False, f"a layout no run has used yet ({layout}), largest expected gain among its candidates"
    return chosen, False, "largest expected gain over the measured best"
