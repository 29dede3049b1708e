"""The CLI on 3D CNNs: `plan` writes a spatial plan and its per-layer table, `show` draws it, `estimate --sd` costs a
split, and bad splits (degree not dividing the volume, halo wider than the shard) are one line on stderr with exit
status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fixtures.spatial_plans import make_spatial_plan
from planner.plan import load_plan, save_plan

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def _one_line_error(proc: subprocess.CompletedProcess, text: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], proc.stderr


def test_plan_writes_a_spatial_plan_with_its_layer_table(tmp_path):
    out = tmp_path / "plan.json"
    proc = _cli(
        "plan", "--model", "unet3d:tiny", "--volume", "32", "--cluster", "aws-p3-16xlarge", "--gpus", "8",
        "--global-batch", "8", "--dtype", "fp16", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = load_plan(out)
    assert plan.mesh.axes == ["dp", "sd"] and plan.world_size == 8
    assert "blocks.0" in proc.stdout and "GiB/rank" in proc.stdout
    shown = _cli("show", str(out), "--png", str(tmp_path / "png"))
    assert shown.returncode == 0, shown.stderr
    assert (tmp_path / "png" / "layer_placement.png").stat().st_size > 0
    assert "sd " in shown.stdout  # the ranks line names the spatial axis
    _one_line_error(_cli("export", str(out), "--to", "megatron"), "megatron has no spatial parallelism")


def test_estimate_split_degree_not_dividing_the_volume():
    proc = _cli(
        "estimate", "--model", "unet3d:tiny", "--volume", "24", "--cluster", "aws-p3-16xlarge", "--sd", "16",
        "--gpus", "16", "--global-batch", "16", "--spatial-dims", "d", "--dtype", "fp16",
    )  # fmt: skip
    _one_line_error(proc, "spatial degree 16 along d does not divide its 24-voxel extent; choose a degree dividing 24")


def test_launch_refuses_a_halo_wider_than_the_shard(tmp_path):
    plan = make_spatial_plan(
        "cosmoflow:tiny", dp=1, sd=8, grids={"blocks.1": (8, 1, 1)}, global_batch=8, dims={"kernel": 5}
    )
    path = save_plan(plan, tmp_path / "bad.json")
    proc = _cli("launch", str(path), "--steps", "1")
    _one_line_error(proc, "halo of 2 voxels is wider than its 1-voxel shard along d")
