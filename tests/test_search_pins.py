"""`plan --tp/--pp/--dp/--ep/--zero/--micro-batch/--schedule/--recompute`: each pins that choice; the search proves
the best plan under the pins."""

from __future__ import annotations

import json

import pytest

from planner.cli.main import main
from planner.search import OuterChoice, apply_pins

GPT = ["--model", "gpt:gpt2-medium", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64", "--seq", "1024"]


def _plan(tmp_path, *extra) -> dict:
    out = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.json"
    assert main(["plan", *GPT, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _degree(plan: dict, axis: str) -> int:
    mesh = plan["mesh"]
    return mesh["sizes"][mesh["axes"].index(axis)] if axis in mesh["axes"] else 1


def test_pinned_tp_is_proven_best_under_the_pin_and_no_faster_than_the_free_optimum(tmp_path):
    free = _plan(tmp_path)
    pinned = _plan(tmp_path, "--tp", "8", "--micro-batch", "2")
    assert _degree(pinned, "tp") == 8 and pinned["schedule"]["micro_batch_size"] == 2
    assert pinned["search"]["status"] == "optimal"
    assert "pinned tp 8, micro batch 2: the proof holds under these pins" in pinned["search"]["notes"]
    assert pinned["predictions"]["step_time_s"] >= free["predictions"]["step_time_s"] * (1 - 1e-12)


def test_a_pin_no_candidate_can_take_is_one_line_naming_the_choices(tmp_path, capsys):
    assert main(["plan", *GPT, "--tp", "3", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: --tp 3 leaves no candidate (this model, cluster, device count and global batch allow --tp 1, 2, 4, "
        "8, 16); pick one of those or drop --tp"
    )
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_pinned_expert_parallelism_on_an_moe_model(tmp_path):
    out = tmp_path / "moe.json"
    argv = ["plan", "--model", "moe:mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64"]
    assert main([*argv, "--seq", "4096", "--ep", "2", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["experts"]["ep"] == 2 and plan["search"]["status"] == "optimal"
    assert "pinned ep 2" in plan["search"]["notes"]


def test_apply_pins_narrows_an_expert_family():
    base = dict(tp=2, pp=1, dp=4, schedule="1f1b", virtual_stages=1, micro_batch=1, num_micro_batches=8)
    family = OuterChoice(
        **base, zero_stage=0, sequence_parallel=False, rank_node_types=("h100",), expert_family=((1, 1), (2, 1), (4, 1))
    )
    (kept,) = apply_pins([family], {"ep": 2})
    assert kept.ep == 2 and kept.expert_family == ()
    assert apply_pins([family], {"ep": 8}) == []
    assert apply_pins([family], {"tp": 4}) == []


@pytest.mark.parametrize("mode", ["full", "none"])
def test_pinned_recompute_is_every_blocks_choice_and_proven_under_the_pin(tmp_path, mode):
    free = _plan(tmp_path)
    pinned = _plan(tmp_path, "--recompute", mode)
    chosen = {mode_ for st in pinned["stages"] for path, mode_ in st["recompute"].items() if path.startswith("blocks.")}
    assert chosen == {mode} or (mode == "none" and chosen == set())
    assert pinned["search"]["status"] == "optimal"
    assert f"pinned recompute {mode}: the proof holds under these pins" in pinned["search"]["notes"]
    assert pinned["predictions"]["step_time_s"] >= free["predictions"]["step_time_s"] * (1 - 1e-12)
