"""``stratagem tune run``: measured trials on Stratagem's own runtime until the measured best is the answer.

Example (five trials of four steps each on this machine's two CPU ranks)::

    stratagem tune run --model gpt:small --model-profile profiles/models/gpt-small.json \\
        --cluster local-cpu-2core --gpus 2 --global-batch 16 --seq 64 --trials 5 --steps 4 --out tuned.json

Each trial is a plan of the exact search (re-planned on the cluster calibrated on the trials so far) launched with
``stratagem launch`` in a subprocess for ``--steps`` steps under ``--trial-timeout-s``; its plan, metrics and log
stay in ``--dir`` (default: ``<out>.trials/``) and ``trials.csv`` there lists every trial as it ends. A trial that
runs out of memory, times out or fails is recorded and the loop goes on (``planner/tune/online.py``). ``--out`` gets
the measured best trial's plan with every trial and the calibration in its ``tune`` record.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

from planner.core import DTYPES, StratagemError, atomic_write_text
from planner.profile import load_cluster_profile
from planner.search import SearchConfig

from .common import (
    DefaultsHelpFormatter,
    check_out_path,
    float_in,
    int_in,
    memory_fraction_of,
    nonempty_path,
    out_path,
    resolve_cluster_path,
)
from .cmd_tune_suggest import add_job_arguments
from .model_args import add_model_arguments, spec_from_args

LAUNCH_GRACE_S = 30.0  # launch stops itself at --timeout-s; this process stops it this much later
TRIAL_COLUMNS = (
    "trial",
    "repeat_of",
    "status",
    "configuration",
    "measured_step_time_s",
    "predicted_step_time_s",
    "uncertainty_rel",
    "p_better",
    "predicted_peak_memory_bytes",
    "plan",
    "detail",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch the most promising plans for a few steps each, calibrate, repeat; write the measured best",
        description="Model-guided trials on this machine's runtime: each round calibrates the cluster on the "
        "trials so far, re-plans (the search's best plans are the candidates), launches the one with the largest "
        "expected gain over the measured best for --steps steps, and stops when none is likely to beat it or the "
        "trials run out. Failed trials are recorded, never fatal.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument("--model-profile", type=nonempty_path, default=None, help="model profile JSON (default: analytic)")
    add_job_arguments(p)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the profile's, else bf16)")
    p.add_argument("--trials", type=int_in(1, 1000), default=5, help="most trials to run, count")
    p.add_argument(
        "--steps", type=int_in(2, 10**6), default=10, help="optimizer steps per trial (the first is warm-up)"
    )
    p.add_argument(
        "--trial-timeout-s",
        type=float_in(0, 7 * 86_400, low_open=True),
        default=600.0,
        help="wall-clock limit of one trial, seconds (a trial past it is stopped and recorded as a timeout)",
    )
    p.add_argument("--pool", type=int_in(2, 256), default=16, help="candidates: the search's best plans, count")
    p.add_argument(
        "--confirm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with 3 trials or more, the last launches the measured best again to state the noise between launches",
    )
    p.add_argument("--dir", type=Path, default=None, help="folder for the trials' plans, metrics and logs")
    p.add_argument("--out", required=True, type=out_path, help="the measured best plan (JSON), with the trials")
    p.add_argument("--time-limit", type=float_in(0, 3600, low_open=True), default=30.0, help="seconds per ILP solve")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="passed to each trial's launch (default: launch's: on with CUDA, off on CPU)",
    )
    p.set_defaults(func=run)


def _runtime_refuses(plan) -> str | None:
    """Why `stratagem launch` would refuse ``plan`` before starting a process (every check a trial's launch runs:
    ``runtime.launch.check_launch`` with its options), else None."""
    from runtime.launch import LaunchOptions, check_launch  # the CLI is the composition root

    try:
        check_launch(plan, LaunchOptions(plan_path=Path("trial.json"), steps=1))
    except StratagemError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    from planner.cli.cmd_plan import full_spec, model_profile
    from planner.plan import TrainingSettings, save_plan
    from planner.tune import Target
    from planner.tune import final_plan, run_trials

    cluster_path = resolve_cluster_path(args.cluster)
    check_out_path(args.out, inputs={"--cluster": cluster_path, "--model-profile": args.model_profile})
    folder = args.dir if args.dir is not None else args.out.with_name(args.out.name + ".trials")
    if folder.exists() and not folder.is_dir():
        raise StratagemError(f"--dir {folder} is a file, not a folder; give a folder path")
    spec = full_spec(spec_from_args(args))
    args.dtype = args.dtype or (None if args.model_profile is not None else "bf16")
    profile = model_profile(spec, args, args.seq)
    if args.dtype not in (None, profile.dtype):
        raise StratagemError(f"--dtype {args.dtype} differs from the profile's {profile.dtype}; drop --dtype")
    cluster = load_cluster_profile(cluster_path)
    if args.gpus > cluster.total_devices:
        raise StratagemError(
            f"--gpus {args.gpus} is more than cluster {cluster.name} has ({cluster.total_devices}); use at most that"
        )
    target = Target(
        model=args.model, spec=spec, seq=args.seq, gpus=args.gpus, global_batch=args.global_batch, dtype=profile.dtype
    )
    training = TrainingSettings(global_batch=args.global_batch, seq_len=profile.seq_len, dtype=profile.dtype)
    search = SearchConfig(memory_fraction=memory_fraction_of(args), time_limit_s=args.time_limit)
    folder.mkdir(parents=True, exist_ok=True)

    def runner(plan, number):
        return launch_trial(plan, number, folder=folder, args=args)

    def report(line: str) -> None:
        print(line, flush=True)

    def on_trial(records) -> None:
        atomic_write_text(folder / "trials.csv", trials_csv(records, folder))

    outcome = run_trials(
        target,
        spec,
        profile,
        cluster,
        training,
        runner,
        trials=args.trials,
        search=search,
        report=report,
        on_trial=on_trial,
        confirm=args.confirm,
        refuses=_runtime_refuses,
    )
    print(("stop: " if outcome.stop else "trials done: ") + outcome.reason)
    best = final_plan(outcome)
    save_plan(best, args.out)
    assert outcome.best is not None  # final_plan raised otherwise
    number = outcome.best.number
    launches = sum(1 for r in outcome.trials if (r.repeat_of or r.number) == number and r.measured_s is not None)
    mean = f", the geometric mean of {launches} launches" if launches > 1 else ""
    print(
        f"measured best: {outcome.best.measured_s:.4g} s per step, {outcome.best.label} (trial {outcome.best.number} "
        f"of {len(outcome.trials)}{mean}; measurement noise {outcome.noise_rel:.1%}); calibration: "
        f"{outcome.calibration.note}"
    )
    print(f"wrote {args.out} and {folder / 'trials.csv'}")
    return 0


def trial_stem(folder: Path, number: int) -> Path:
    """Trial ``number``'s files in ``folder``: ``<stem>.json`` (its plan), ``.metrics.jsonl``, ``.log``."""
    return folder / f"trial-{number:02d}"


def trials_csv(records, folder: Path) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(TRIAL_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow(
            {
                "trial": r.number,
                "repeat_of": "" if r.repeat_of is None else r.repeat_of,
                "status": r.status,
                "configuration": r.label,
                "measured_step_time_s": "" if r.measured_s is None else f"{r.measured_s:.6g}",
                "predicted_step_time_s": f"{r.predicted_s:.6g}",
                "uncertainty_rel": "" if r.uncertainty_rel is None else f"{r.uncertainty_rel:.4f}",
                "p_better": "" if r.p_better is None else f"{r.p_better:.4f}",
                "predicted_peak_memory_bytes": f"{r.predicted_peak_memory_bytes:.0f}",
                "plan": str(trial_stem(folder, r.number).with_suffix(".json")),
                "detail": r.detail,
            }
        )
    return buf.getvalue()


def launch_trial(plan, number: int, *, folder: Path, args: argparse.Namespace):
    """Launch ``plan`` as trial ``number`` (``stratagem launch`` in its own process group) and classify the result:
    ok, oom (launch's out-of-memory error), timeout (launch's own limit, or this process's after a grace), failed."""
    from planner.calibrate import step_stats
    from planner.plan import save_plan
    from planner.tune import TrialOutcome
    from runtime.launch import stop_process_group

    stem = trial_stem(folder, number)
    plan_path = save_plan(plan, stem.with_suffix(".json"))
    metrics = stem.with_suffix(".metrics.jsonl")
    log_path = stem.with_suffix(".log")
    for stale in (metrics, log_path):
        stale.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "planner.cli.main", "launch", str(plan_path), "--steps", str(args.steps)]
    cmd += ["--metrics", str(metrics), "--timeout-s", f"{args.trial_timeout_s:g}"]
    if args.compile is not None:
        cmd.append("--compile" if args.compile else "--no-compile")
    killed = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.trial_timeout_s + LAUNCH_GRACE_S)
        except subprocess.TimeoutExpired:
            killed = True
            stop_process_group(proc)
            rc = proc.returncode
    stop_leftovers(plan_path)
    stats = step_stats(metrics)
    step_s, noise = stats.step_time_s, stats.noise_rel
    text = log_path.read_text(encoding="utf-8", errors="replace")
    error = next((ln for ln in reversed(text.splitlines()) if ln.startswith("error:")), "")
    if killed or "ran past --timeout-s" in error:
        why = f"stopped after --trial-timeout-s {args.trial_timeout_s:g} s"
        partial = "; the steps it finished measured" if step_s is not None else "; no step finished"
        return TrialOutcome(status="timeout", step_time_s=step_s, detail=why + partial, noise_rel=noise)
    if rc == 0 and step_s is not None:
        return TrialOutcome(status="ok", step_time_s=step_s, noise_rel=noise)
    if step_s is not None and stats.summarised:  # every step ran and was summarised; the exit failed after
        detail = f"every step ran; the launch then exited with status {rc} ({error.removeprefix('error: ')})"
        return TrialOutcome(status="ok", step_time_s=step_s, noise_rel=noise, detail=detail[:300])
    if "ran out of memory" in error or "OutOfMemoryError" in text:
        return TrialOutcome(status="oom", detail=(error or "out of memory").removeprefix("error: ")[:300])
    detail = (error or f"launch exited with status {rc}; see {log_path}").removeprefix("error: ")
    return TrialOutcome(status="failed", detail=detail[:300])


def _has_summary(metrics: Path) -> bool:
    """Whether rank 0 wrote the run's summary line (it does after the last step)."""
    from planner.calibrate import step_stats

    return step_stats(metrics).summarised


def stop_leftovers(plan_path: Path) -> list[int]:
    """SIGKILL every process still running with ``plan_path`` on its command line (a trial's ranks that outlived
    their launcher, e.g. stuck in a collective when the launch was stopped); the pids killed. Linux /proc only."""
    killed = []
    needle = str(plan_path).encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "cmdline").read_bytes() and int(entry.name) != os.getpid():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return killed
