"""``stratagem launch`` of an MoE plan: moe:tiny with ep=2 trains end to end on CPU/gloo with the single
process's losses, and bad expert layouts stop with one line and exit 2 before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.cli.main import main
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.metrics import final_step_losses, read_metrics

STEPS = 2


def _plan(tmp_path: Path, **cfg) -> tuple[Path, object]:
    plan = make_plan(parse_model("moe:tiny"), global_batch=8, seq_len=16, **cfg)
    return save_plan(plan, tmp_path / "plan.json"), plan


def _mutated(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    data["content_hash"] = None
    edit(data)
    out = path.with_name("bad.json")
    out.write_text(json.dumps(data))
    return out


@pytest.mark.slow
def test_launch_trains_moe_tiny_with_ep2_and_resumes_from_a_checkpoint(tmp_path, monkeypatch):
    """Two steps with a checkpoint after each (each rank saves its own experts), then a second launch resumes
    and trains step 3: every step's loss is the single process's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path, plan = _plan(tmp_path, dp=2, experts={"ep": 2})
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"
    common = ["launch", str(path), "--checkpoint-dir", str(ckpt), "--timeout-s", "120"]
    assert main([*common, "--steps", str(STEPS), "--checkpoint-every", "1", "--metrics", str(first)]) == 0
    assert main([*common, "--steps", str(STEPS + 1), "--resume", "--metrics", str(second)]) == 0
    resumed = final_step_losses(read_metrics(second))
    assert sorted(resumed) == [STEPS + 1]  # the second launch started from the step-2 checkpoint
    measured = {**final_step_losses(read_metrics(first)), **resumed}
    expected = reference_losses(plan, STEPS + 1)
    assert sorted(measured) == list(range(1, STEPS + 2))
    for step, ref in enumerate(expected, start=1):
        assert measured[step] == pytest.approx(ref, rel=1e-5), (step, measured, expected)


def _set_ep3(data: dict) -> None:
    data["experts"]["ep"] = 3


def _set_top_k5(data: dict) -> None:
    data["model"]["dims"]["top_k"] = 5


def _set_etp2_odd_ffn(data: dict) -> None:
    data["experts"]["etp"] = 2
    data["model"]["dims"]["expert_ffn"] = 63


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_set_ep3, "4 experts do not split over ep=3"),
        (_set_top_k5, "top_k 5 is more than its 4 experts"),
        (_set_etp2_odd_ffn, "etp=2 does not divide expert_ffn=63"),
    ],
)
def test_bad_expert_layouts_are_one_line_errors_and_nothing_runs(tmp_path, capsys, edit, needle):
    path, _ = _plan(tmp_path, dp=4, experts={"ep": 2})
    metrics = tmp_path / "run.jsonl"
    status = main(["launch", str(_mutated(path, edit)), "--steps", "1", "--metrics", str(metrics)])
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(lines) == 1 and needle in lines[0], err
    assert not metrics.exists()
