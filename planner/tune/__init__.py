"""Model-guided trials (``stratagem tune``): calibrate on the runs measured so far, re-price the candidates, and say
which to measure next or that the measured best is the answer (``suggest``); or run the trials on Stratagem's runtime
until then (``online``: ``run_trials``, ``stratagem tune run``)."""

from planner.plan import fullest_share  # the OOM lesson's measure, with the loop's names
from planner.tune.online import (
    OOM_SHARE,
    TrialOutcome,
    TrialRecord,
    TuneOutcome,
    candidate_pool,
    final_plan,
    run_trials,
)
from planner.tune.suggest import (
    STOP_PROBABILITY,
    Scored,
    Suggestion,
    Target,
    TuneCalibration,
    calibrate,
    config_key,
    label,
    score,
    suggest,
    uniform_candidates,
)

__all__ = [
    "OOM_SHARE",
    "TrialOutcome",
    "TrialRecord",
    "TuneOutcome",
    "candidate_pool",
    "final_plan",
    "fullest_share",
    "run_trials",
    "STOP_PROBABILITY",
    "Scored",
    "Suggestion",
    "Target",
    "TuneCalibration",
    "calibrate",
    "config_key",
    "label",
    "score",
    "suggest",
    "uniform_candidates",
]
