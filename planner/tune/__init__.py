"""Model-guided trials (``stratagem tune``): calibrate on the runs measured so far, re-price the candidates, and say
which to measure next or that the measured best is the answer (``suggest``)."""

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
