"""Regression guard on benchmarks/cost_accuracy.py: published Megatron runs stay within the target, and every
row keeps its role (issue 24 §1): a row that fitted a constant or chose a mechanism cannot become "validate"
(held out) after it helped; a new row must be given its role here."""

import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cost_accuracy  # noqa: E402

# rows of benchmarks/data/published_cases.csv by role (cost_accuracy.row_role); validate = held out
ROLES = {
    "calib": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 41, 46],  # SC21 Table 1 (A100), the H100 and V100 fitting rows
    "chose": [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # SC21 Table 2: ZeRO-3 switches, fabric load
    + [58, 59, 60, 61, 62, 63, 64, 65, 66]  # Korthikanti 2022: the fabric load's scope
    + [90, 91, 92, 93, 94],  # torchtitan FSDP2 A100: the overlap contention
    "validate": [27, 35, 36, 37, 38, 39, 40, 42, 43, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
    "reference": [95, 96],
}


def _out() -> dict:
    if not cost_accuracy.DEFAULT_CSV.exists():
        pytest.skip("benchmarks/data/published_cases.csv not present")
    return cost_accuracy.run(cost_accuracy.DEFAULT_CSV)


def test_every_row_keeps_its_role():
    roles: dict[str, list[int]] = {}
    for case in cost_accuracy.load_cases(cost_accuracy.DEFAULT_CSV):
        roles.setdefault(case.role, []).append(case.row)
        assert case.why, case.row
    assert roles == ROLES


def test_published_cases_mean_error_within_target():
    out = _out()
    s = out["summary"]
    assert s["n_validate"] == len(ROLES["validate"])
    assert s["mean_abs_error"] <= 0.07 and s["max_abs_error"] <= 0.15  # the held-out headline
    groups: dict[str, list[float]] = {}
    for r in out["cases"]:
        groups.setdefault(r["group"], []).append(abs(r["error"]))
    for name in ("Korthikanti 2022", "SC21 Table 2, PTD-P", "Megatron README 2020", "Megatron README H100"):
        assert statistics.fmean(groups[name]) <= 0.08, name
    small = [
        r
        for r in out["cases"]
        if r["cluster"] != "aws-p3-16xlarge"
        and r["role"] in ("validate", "chose")
        and ("GPT-2" in r["label"] or r["label"].startswith(("GPT 1.7B", "GPT 7.1B")))
    ]
    assert len(small) >= 8 and max(abs(r["error"]) for r in small) <= 0.12


def test_cpu_runtime_check_leads_with_the_rows_it_was_not_fitted_on(capsys):
    import runtime_vs_prediction as rvp

    rows = [("a", 0.9, "held out"), ("b", 1.3, "held out"), ("c", 1.0, "in-sample (a calibration run)")]
    rvp.print_headline(rows)
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("HELD OUT 2 rows: min/static 0.90-1.30") and "1/2 inside 0.8-1.25" in first
    assert second.startswith("in-sample, not a headline: 1 rows")
