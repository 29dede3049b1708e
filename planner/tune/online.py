"""``stratagem tune run``: the trial loop on Stratagem's own runtime (issue 28).

Each round

1. calibrates the cluster on the trials measured so far (:func:`planner.tune.suggest.calibrate`: nothing with
   fewer than 2, then the bounded, cross-validated fit of ``planner.calibrate``);
2. re-plans on the calibrated cluster: the exact search's ``pool`` best plans, each the best plan of its outer
   choices (degrees, schedule, micro-batch, ZeRO; ``SearchConfig.exhaustive_top_k``), are the candidates;
3. ranks the unmeasured candidates as ``tune suggest`` does (expected gain over the measured best under the
   cross-validated uncertainty) and runs the first for ``steps`` optimizer steps through the ``runner`` (the CLI's
   runs ``stratagem launch`` in a subprocess with a wall-clock limit), or stops when none beats the measured
   best with probability ``STOP_PROBABILITY`` or more.

With 3 trials or more the last one launches the measured best again: the repeat's gap states the noise between
launches (one pair's standard deviation of a log), which the spread of steps inside one launch understates, and the
geometric mean of the two is the measurement (:func:`typical_of_launches`). The loop states the largest of that
gap, the trials' median step spread (:func:`planner.calibrate.step_stats`) and ``NOISE_FLOOR``.

A failed trial never stops the loop. Out of memory teaches the memory model: the search's memory limit drops
below that plan's predicted peak share (``OOM_SHARE``), so no plan predicted as full runs again. A timeout whose
run measured steps before it was stopped teaches the time model with them (the step time is what it was); one
that measured none is recorded and its configuration is not tried again; so is any other failure.

The runs are measured on ``runner``'s trainer; the configurations are priced the way ``stratagem calibrate``
prices a metrics run (``planner.calibrate.metrics_runs``): ``overlap_grad_reduce`` off on CPU ranks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from planner.calibrate import MeasuredRun, apply
from planner.core import StratagemError, is_gpu
from planner.cost import plan_config, with_gpus
from planner.model import ModelSpec
from planner.plan import Plan, TrainingSettings, TuneRecord, TuneTrial, fullest_share, plan_label
from planner.profile import ClusterProfile, ModelProfile
from planner.search import SearchConfig, candidate_plan, plan_search
from planner.tune.suggest import (
    NOISE_FLOOR,
    Scored,
    Target,
    TuneCalibration,
    calibrate,
    choose,
    config_key,
    fastest_of_repeats,
    label,
    price,
)

OOM_SHARE = 0.98  # after an out-of-memory trial, plans must be predicted below this share of its peak share
TrialStatus = Literal["ok", "oom", "timeout", "failed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialOutcome:
    """What the runner reports for one launched plan."""

    status: TrialStatus
    step_time_s: float | None = None  # measured seconds per step (ok, or a timeout that measured steps)
    detail: str = ""  # the launch's one-line error, or why the measurement is partial
    noise_rel: float | None = None  # relative spread of its steps (planner.calibrate.step_stats)


# runner(plan, number) -> outcome: launch ``plan`` as trial ``number`` (1, 2, ...)
TrialRunner = Callable[[Plan, int], TrialOutcome]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialRecord:
    number: int
    label: str
    status: TrialStatus
    measured_s: float | None
    predicted_s: float  # on the calibration of the round that chose it
    uncertainty_rel: float | None
    p_better: float | None
    predicted_peak_memory_bytes: float
    detail: str
    plan: Plan
    repeat_of: int | None = None  # the trial whose plan this one ran again (the confirmation of the measured best)


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneOutcome:
    trials: tuple[TrialRecord, ...]
    best: TrialRecord | None  # the measured best (None: no trial measured a step time)
    stop: bool  # True: the loop stopped itself; False: it ran out of trials
    reason: str
    calibration: TuneCalibration  # on every measured trial
    noise_rel: float  # the measurement noise the loop assumed: the trials' median step spread, at least NOISE_FLOOR


def is_cpu(cluster: ClusterProfile) -> bool:
    return not all(is_gpu(nt.device) for nt in cluster.node_types)


def candidate_pool(
    target: Target,
    spec: ModelSpec,
    profile: ModelProfile,
    cluster: ClusterProfile,
    training: TrainingSettings,
    search: SearchConfig,
    *,
    pool: int,
) -> list[tuple[MeasuredRun, Plan]]:
    """The ``pool`` best plans of the exact search on ``cluster`` (one per outer choice, proven the best ``pool``),
    each with its configuration as a run of ``target``."""
    config = replace(search, top_k=pool, exhaustive_top_k=True)
    result = plan_search(profile, cluster, gpus=target.gpus, global_batch=target.global_batch, config=config)
    overlap = not is_cpu(cluster)
    out = []
    for i, candidate in enumerate(result.ranked, start=1):
        plan = candidate_plan(candidate, model=spec, profile=profile, cluster=cluster, training=training)
        out.append((target.run(plan_config(plan, overlap_grad_reduce=overlap), i), plan))
    return out


def _refused(refuses: Callable[[Plan], str | None], plan: Plan, seen: set[str], report: Callable[[str], None]) -> bool:
    """Whether the trainer refuses ``plan``; its reason reported the first time it comes up."""
    reason = refuses(plan)
    if reason is not None and reason not in seen:
        seen.add(reason)
        report(f"not tried (the trainer refuses it): {plan_label(plan)}: {reason}")
    return reason is not None


def run_trials(
    target: Target,
    spec: ModelSpec,
    profile: ModelProfile,
    cluster: ClusterProfile,
    training: TrainingSettings,
    runner: TrialRunner,
    *,
    trials: int,
    search: SearchConfig,
    pool: int = 16,
    folds: int = 5,
    confirm: bool = True,
    report: Callable[[str], None] | None = None,
    on_trial: Callable[[tuple[TrialRecord, ...]], None] | None = None,
    refuses: Callable[[Plan], str | None] | None = None,
) -> TuneOutcome:
    """Run up to ``trials`` trials (module docstring); ``report`` gets a line per trial and its result, ``on_trial``
    every record so far after each trial (to keep a file of them current). ``refuses(plan)``: why the trainer would
    refuse the plan before running it (the CLI passes the runtime's launch checks), None when it runs; refused
    plans are never tried (each reason is reported once)."""
    report = report or (lambda _line: None)
    on_trial = on_trial or (lambda _records: None)
    cluster = with_gpus(cluster, target.gpus)
    records: list[TrialRecord] = []
    runs: list[MeasuredRun] = []  # measured trials, as calibration runs with the tuned profile
    tried: set[tuple] = set()
    refused: set[str] = set()  # reasons already reported
    spreads: list[float] = []
    memory_fraction = search.memory_fraction
    stop, reason = False, f"ran all {trials} trials"
    cal = calibrate(cluster, runs, folds=folds)
    noise = NOISE_FLOOR

    # the last trial confirms the measured best (with 3 trials or more): one repeat launch states the noise between
    # launches, which the spread of steps inside one launch understates (16-33 % against 5-9 % on 2 CPU ranks here)
    def explore() -> int:  # trials left to new plans: all of them until one has measured
        return trials - 1 if confirm and trials >= 3 and runs else trials

    while len(records) < explore():
        cal = calibrate(cluster, runs, folds=folds, noise_floor=noise)
        calibrated = apply(cluster, cal.values)
        try:
            pool_ = candidate_pool(
                target, spec, profile, calibrated, training, replace(search, memory_fraction=memory_fraction), pool=pool
            )
        except StratagemError as exc:
            if not records:
                raise
            stop, reason = True, f"no plan left to try: {exc}"
            break
        plans = {config_key(run.config): plan for run, plan in pool_}
        priced = price([run for run, _ in pool_], profile, calibrated, memory_fraction=memory_fraction)
        open_ = [s for s in priced if s.fits and config_key(s.run.config) not in tried]
        untried = len(open_)
        if refuses is not None:
            open_ = [s for s in open_ if not _refused(refuses, plans[config_key(s.run.config)], refused, report)]
        measured = fastest_of_repeats(runs)
        best = min(measured.values(), key=lambda r: r.step_time_s) if measured else None
        if not open_:
            refusals = f" ({untried} untried, refused by the trainer: {sorted(refused)[0]})" if untried else ""
            stop, reason = True, f"every plan of the search's {len(priced)} best has been tried{refusals}"
            break
        chosen, stop, reason = choose(
            open_, best, list(measured.values()), profile, cluster, cal, memory_fraction=memory_fraction, k=1
        )
        if stop:
            break
        pick: Scored = chosen[0]
        key = config_key(pick.run.config)
        plan = plans[key]
        number = len(records) + 1
        sigma = "" if pick.sigma is None else f" +- {pick.sigma:.1%}"
        report(f"trial {number}: {label(pick.run.config)}, predicted {pick.predicted_s:.4g} s{sigma} ({reason})")
        outcome = runner(plan, number)
        tried.add(key)
        records.append(
            TrialRecord(
                number=number,
                label=label(pick.run.config),
                status=outcome.status,
                measured_s=outcome.step_time_s,
                predicted_s=pick.predicted_s,
                uncertainty_rel=pick.sigma,
                p_better=pick.p_better,
                predicted_peak_memory_bytes=pick.peak_memory_bytes,
                detail=outcome.detail,
                plan=plan,
            )
        )
        if outcome.step_time_s is not None and outcome.step_time_s > 0 and math.isfinite(outcome.step_time_s):
            runs.append(replace(pick.run, row=number, step_time_s=outcome.step_time_s, profile=profile))
        if outcome.noise_rel is not None:
            spreads.append(outcome.noise_rel)
            noise = max(NOISE_FLOOR, statistics.median(spreads))
        if outcome.status == "oom":
            share = fullest_share(plan)
            memory_fraction = min(memory_fraction, OOM_SHARE * share)
            report(
                f"  out of memory: plans must now be predicted under {memory_fraction:.1%} of device memory "
                f"(this one was predicted at {share:.1%})"
            )
        on_trial(tuple(records))
        measured_s = "" if outcome.step_time_s is None else f" {outcome.step_time_s:.4g} s"
        report(f"  {outcome.status}{measured_s}{': ' + outcome.detail if outcome.detail else ''}")
    first = min((r for r in records if r.measured_s is not None), key=lambda r: r.measured_s or math.inf, default=None)
    if first is not None and len(records) < trials and explore() < trials:
        number = len(records) + 1
        report(f"trial {number}: {first.label} again, to confirm the measured best ({first.measured_s:.4g} s)")
        outcome = runner(first.plan, number)
        records.append(replace(first, number=number, status=outcome.status, measured_s=outcome.step_time_s,
                               detail=outcome.detail, repeat_of=first.number))  # fmt: skip
        on_trial(tuple(records))
        if outcome.step_time_s is not None and first.measured_s:
            gap = abs(math.log(outcome.step_time_s / first.measured_s)) / math.sqrt(2)  # one pair's sd of a log
            noise = max(noise, gap)
            run = next(r for r in runs if r.row == first.number)
            runs.append(replace(run, row=number, step_time_s=outcome.step_time_s))
            report(f"  {outcome.status} {outcome.step_time_s:.4g} s: launch-to-launch noise {gap:.1%}")
        else:
            report(f"  {outcome.status}{': ' + outcome.detail if outcome.detail else ''}")
    if runs:
        cal = calibrate(cluster, runs, folds=folds, noise_floor=noise)
    typical = typical_of_launches(records)
    best_record = min(typical, key=lambda r: r.measured_s or math.inf) if typical else None
    return TuneOutcome(
        trials=tuple(records), best=best_record, stop=stop, reason=reason, calibration=cal, noise_rel=noise
    )


def typical_of_launches(records: list[TrialRecord]) -> list[TrialRecord]:
    """One record per configuration that measured a step time: its first, with the geometric mean of its launches.

    The best is chosen on these, not on the fastest launch: a configuration launched twice (the confirmation)
    would otherwise get two draws at the lottery that a noisy machine runs (llama:tiny on 2 CPU ranks: a repeat
    measured 0.0496 s and then 0.0796 s, and its faster draw beat a configuration whose one launch took 0.0522 s;
    three more rounds in turn gave medians of 0.0801 s and 0.0599 s)."""
    by_trial: dict[int, list[TrialRecord]] = {}  # a repeat joins the trial it repeats (labels can coincide)
    for r in records:
        if r.measured_s is not None and math.isfinite(r.measured_s) and r.measured_s > 0:
            by_trial.setdefault(r.repeat_of or r.number, []).append(r)
    return [
        replace(group[0], measured_s=math.exp(statistics.fmean(math.log(r.measured_s or 1.0) for r in group)))
        if len(group) > 1
        else group[0]
        for group in by_trial.values()
    ]


def final_plan(outcome: TuneOutcome) -> Plan:
    """The measured best trial's plan with the tune record (every trial, the calibration) in it; an error when no
    trial measured a step time."""
    if outcome.best is None:
        failures = "; ".join(f"trial {r.number} {r.status}: {r.detail}"[:160] for r in outcome.trials[:3])
        raise StratagemError(
            f"no trial measured a step time ({failures or 'no trial ran'}); fix the cause named, or give the trials "
            f"more time with --trial-timeout-s"
        )
    cal = outcome.calibration
    record = TuneRecord(
        trials=[
            TuneTrial(
                number=r.number,
                summary=r.label,
                status=r.status,
                measured_step_time_s=r.measured_s,
                predicted_step_time_s=r.predicted_s,
                uncertainty_rel=r.uncertainty_rel,
                predicted_peak_memory_bytes=r.predicted_peak_memory_bytes,
                detail=r.detail,
                repeat_of=r.repeat_of,
            )
            for r in outcome.trials
        ],
        stopped=outcome.stop,
        reason=outcome.reason,
        calibration=dict(cal.values),
        calibration_note=cal.note,
        uncertainty_rel=cal.sigma,
        uncertainty_source=cal.sigma_source,
        measurement_noise_rel=outcome.noise_rel,
    )
    return outcome.best.plan.model_copy(update={"tune": record, "content_hash": None})
