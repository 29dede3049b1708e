"""Regression guard on benchmarks/moe_validation.py: published MoE training runs against the cost model."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe_validation  # noqa: E402

from planner.cost.constants import MOE_LOAD_IMBALANCE  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return moe_validation.load_rows()


def test_load_imbalance_default_is_the_calib_fit(rows):
    # the constant is what the calib row (dropless vs its forced-balance twin) fits, not a free choice
    assert moe_validation.fit_imbalance(rows) == pytest.approx(MOE_LOAD_IMBALANCE, abs=0.01)


def test_counted_rows_within_tolerance(rows):
    out = moe_validation.table(rows, MOE_LOAD_IMBALANCE)
    counted = [(r["run"], err) for r, _, _, err in out if r["status"] == "validate"]
    assert len(counted) >= 6
    within = [run for run, err in counted if abs(err) <= moe_validation.TOLERANCE]
    # today 3 of 6 (DeepEP cross-node -8 %, Megatron-FSDP +13 %, 16k forced balance +8 %); the others are printed
    assert len(within) >= 3, counted
    assert sum(abs(err) for _, err in counted) / len(counted) <= 0.25, counted
    # DeepEP priced by what it sends: the cross-node row was +61 % with NCCL's all-to-all
    cross = next(err for run, err in counted if run == "qwen3-235b-deepep-crossnode-256xh100")
    assert abs(cross) <= moe_validation.TOLERANCE


def test_tflops_rows_use_the_megatron_flop_count(rows):
    # the Qwen3-235B all-to-all row publishes both: 24.2 s and 200 TFLOP/s/GPU on 256 GPUs
    row = next(r for r in rows if r["run"] == "qwen3-235b-a2a-256xh100")
    assert moe_validation.megatron_flops(row) / 256 / 24.2 / 1e12 == pytest.approx(200, rel=0.01)
