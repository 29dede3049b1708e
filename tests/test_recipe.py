"""The training recipe (Goyal et al. 2017): the formula by hand, and the runtime applying it step by step."""

from __future__ import annotations

import argparse
import math

import pytest
import torch.distributed as dist

from planner.model import parse_model
from planner.plan import Plan, build_lr_schedule, lr_at_step, peak_lr


def test_linear_scaling_warmup_and_cosine_by_hand():
    # Goyal et al.: 0.1 per 256 images; batch 8192 -> k = 32 -> 3.2; warm-up from 0.1 over 4 steps
    s = build_lr_schedule(base_lr=0.1, reference_batch=256, total_steps=12, warmup_steps=4, min_lr=0.0)
    assert peak_lr(s, global_batch=8192) == pytest.approx(3.2)
    lrs = [lr_at_step(s, global_batch=8192, step=k) for k in range(14)]
    assert lrs[:5] == pytest.approx([0.1, 0.875, 1.65, 2.425, 3.2])
    # cosine over the 8 steps after warm-up: half-way (step 8) is the mean of peak and min
    assert lrs[8] == pytest.approx(1.6)
    assert lrs[12] == pytest.approx(0.0, abs=1e-12) and lrs[13] == 0.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_step_decay_multiplies_at_each_milestone():
    s = build_lr_schedule(
        base_lr=0.1, reference_batch=256, total_steps=100, warmup_steps=0, decay="step", step_milestones=(30, 60, 80)
    )
    got = [lr_at_step(s, global_batch=256, step=k) for k in (0, 29, 30, 59, 60, 80, 99)]
    assert got == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.0001, 0.0001])


def test_warmup_longer_than_the_run_is_rejected():
    with pytest.raises(ValueError, match="warmup_steps 20 exceeds total_steps 10"):
        build_lr_schedule(base_lr=0.1, reference_batch=256, total_steps=10, warmup_steps=20)


def _plan_with_schedule() -> Plan:
    from fixtures.plans import make_plan

    plan = make_plan(parse_model("gpt:tiny"), global_batch=8, seq_len=16)
    schedule = build_lr_schedule(base_lr=1e-3, reference_batch=4, total_steps=4, warmup_steps=2, min_lr=1e-4)
    return plan.model_copy(update={"training": plan.training.model_copy(update={"lr_schedule": schedule})})


@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_runtime_sets_the_formula_rate_every_step_and_matches_the_reference(one_rank, tmp_path):
    import torch

    from fixtures.reference import reference_losses
    from runtime.executor.metrics import read_metrics
    from runtime.executor.train import run_plan

    plan = _plan_with_schedule()
    args = argparse.Namespace(steps=5, data="synthetic", checkpoint_dir=None, checkpoint_every=0, resume=False)
    metrics = tmp_path / "m.jsonl"
    run_plan(plan, args, torch.device("cpu"), metrics_path=str(metrics))
    steps = [r for r in read_metrics(metrics) if r.get("event") == "step"]
    s = plan.training.lr_schedule
    expected = [lr_at_step(s, global_batch=8, step=k) for k in range(5)]
    assert [r["lr"] for r in steps] == pytest.approx(expected)
    # by hand: peak 1e-3 x 8/4 = 2e-3; warm-up 1e-3 -> 2e-3 over 2 steps; cosine to 1e-4 at step 4
    assert expected == pytest.approx([1e-3, 1.5e-3, 2e-3, 1e-4 + 1.9e-3 * 0.5 * (1 + math.cos(math.pi / 2)), 1e-4])
    assert [r["loss"] for r in steps] == pytest.approx(reference_losses(plan, 5), rel=1e-5)
