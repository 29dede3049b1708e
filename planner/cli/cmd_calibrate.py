"""``stratagem calibrate``: fit a cluster profile's free parameters to measured runs, write the calibrated profile.

Example::

    stratagem calibrate --cluster dgx-a100-80g --runs runs.csv --out profiles/hardware/my-a100.json --png fit.png

The runs file's columns are described under ``--help`` (``planner/calibrate/runs.py``). Nothing is written
when the input is bad (one ``error:`` line naming the row and column, exit status 2).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from planner.calibrate import (
    DIMS,
    OPTIONAL,
    REQUIRED,
    MeasuredRun,
    calibrated_profile,
    fit,
    load_runs_csv,
    load_runs_jsonl,
    save_png,
    table_lines,
)
from planner.profile import load_cluster_profile, save_profile

from .common import (
    DefaultsHelpFormatter,
    check_out_path,
    int_in,
    nonempty_path,
    out_path,
    resolve_cluster_path,
    utc_now,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit a cluster profile's few free parameters to measured runs",
        description="Fit the cluster's GEMM ceiling, memory-bound efficiency, per-kernel cost and collective "
        "bandwidth (bounded, regularised toward the profile's values) to measured step times; "
        "prints prior/fitted/bounds, residuals and the k-fold cross-validated error. Runs CSV "
        f"columns: required {', '.join(REQUIRED)}; model dims {', '.join(DIMS)}; optional "
        + ", ".join(f"{k} ({v})" for k, v in OPTIONAL.items())
        + ".",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--cluster", required=True, help="shipped cluster name or a cluster profile path")
    p.add_argument(
        "--runs",
        required=True,
        nargs="+",
        type=nonempty_path,
        help="measured runs: CSV (one run per row) and/or `stratagem launch --metrics` JSONL files",
    )
    p.add_argument("--out", required=True, type=out_path, help="calibrated cluster profile to write (JSON)")
    p.add_argument(
        "--plan",
        type=nonempty_path,
        default=None,
        help="the plan a metrics JSONL run launched (default: the plan_path its start line names)",
    )
    p.add_argument("--png", type=out_path, default=None, help="also draw predicted vs measured, before and after")
    p.add_argument("--folds", type=int_in(2, 1000), default=5, help="k of the k-fold cross-validation, count")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster_path = resolve_cluster_path(args.cluster)
    inputs = {"--cluster": cluster_path, "--plan": args.plan} | {f"--runs {p}": p for p in args.runs}
    check_out_path(args.out, inputs=inputs)
    if args.png is not None:
        check_out_path(args.png, flag="--png", inputs=inputs | {"--out": args.out})
    runs: list[MeasuredRun] = []
    for path in args.runs:
        if path.suffix == ".jsonl":
            runs.append(load_runs_jsonl(path, plan_path=args.plan, row=len(runs) + 1))
        else:
            runs += [replace(r, row=len(runs) + r.row) for r in load_runs_csv(path)]
    cluster = load_cluster_profile(cluster_path)
    result = fit(cluster, runs, folds=args.folds)
    for line in table_lines(runs, result):
        print(line)
    profile = calibrated_profile(cluster, runs, result, created_utc=utc_now())
    if args.png:
        save_png(runs, result, args.png)
    print(f"wrote {save_profile(profile, args.out)}")
    return 0
