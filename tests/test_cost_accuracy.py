"""Regression guard on benchmarks/cost_accuracy.py: published Megatron runs stay within the target."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cost_accuracy  # noqa: E402


def test_published_cases_mean_error_within_target():
    if not cost_accuracy.DEFAULT_CSV.exists():
        import pytest
        pytest.skip("benchmarks/data/published_cases.csv not present")
    out = cost_accuracy.run(cost_accuracy.DEFAULT_CSV)
    s = out["summary"]
    assert s["n_fully_stated"] >= 15
    assert s["mean_abs_error_fully_stated"] <= 0.10
    groups = s["by_group"]
    for name in ("SC21 Table 1", "Korthikanti 2022", "SC21 Table 2, PTD-P"):
        assert groups[name]["mean_abs_error"] <= 0.10, name
