"""``stratagem calibrate``: learn a cluster's few free parameters from the user's measured runs.

``runs.load_runs_csv`` reads the runs; ``fit.fit`` fits and cross-validates; ``report`` writes the
calibrated cluster profile (with its ``calibration`` section) and the predicted-vs-measured picture.
"""

from planner.calibrate.fit import FitResult, apply, fit
from planner.calibrate.runs import MeasuredRun, load_runs_csv, runs_hash

__all__ = ["FitResult", "MeasuredRun", "apply", "fit", "load_runs_csv", "runs_hash"]
