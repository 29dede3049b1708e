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
    assert s["n_fully_stated"] >= 8 and s["n_validate"] >= 40  # SC21 Table 1 rows are fit rows (calib)
    assert s["mean_abs_error_fully_stated"] <= 0.10
    assert s["mean_abs_error_without_zero3"] <= 0.07
    groups = s["by_group"]
    for name in ("Korthikanti 2022", "SC21 Table 2, PTD-P", "Megatron README 2020", "Megatron README H100"):
        assert groups[name]["mean_abs_error"] <= 0.08, name
    small = [
        r
        for r in out["cases"]
        if r["cluster"] != "aws-p3-16xlarge"
        and r["role"] == "validate"
        and ("GPT-2" in r["label"] or r["label"].startswith(("GPT 1.7B", "GPT 7.1B")))
    ]
    assert len(small) >= 8 and max(abs(r["error"]) for r in small) <= 0.12
