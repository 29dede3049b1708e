"""``stratagem calibrate``: learn a cluster's few free parameters from the user's measured runs.

``runs.load_runs_csv`` reads the runs; ``fit.fit`` fits and cross-validates; ``report`` writes the
calibrated cluster profile (with its ``calibration`` section) and the predicted-vs-measured picture.
"""

from planner.calibrate.fit import (
    PRIOR_WIDTH,
    FitResult,
    Predictor,
    apply,
    candidate_parameters,
    fit,
    mean_abs,
    transfer,
)
from planner.calibrate.metrics_runs import StepStats, load_runs_jsonl, runtime_precision, step_stats
from planner.calibrate.report import calibrated_profile, save_png, table_lines
from planner.calibrate.runs import (
    CANDIDATE_COLUMNS,
    DIMS,
    OPTIONAL,
    REQUIRED,
    MeasuredRun,
    load_candidates_csv,
    load_runs_csv,
    run_columns,
    runs_hash,
)

__all__ = [
    "PRIOR_WIDTH",
    "candidate_parameters",
    "CANDIDATE_COLUMNS",
    "load_candidates_csv",
    "run_columns",
    "DIMS",
    "FitResult",
    "MeasuredRun",
    "OPTIONAL",
    "Predictor",
    "REQUIRED",
    "apply",
    "calibrated_profile",
    "fit",
    "load_runs_csv",
    "load_runs_jsonl",
    "mean_abs",
    "runs_hash",
    "runtime_precision",
    "step_stats",
    "StepStats",
    "save_png",
    "table_lines",
    "transfer",
]
