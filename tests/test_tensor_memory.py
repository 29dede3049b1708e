"""``runtime.executor.tensor_memory``: the live tensor bytes the runtime reports, checked against bytes counted
by hand on modules small enough to count."""

from __future__ import annotations

import pytest
import torch

from planner.plan import predicted_tensor_bytes
from runtime.executor.tensor_memory import TensorMemory, TensorPeak, steady_peak

F32 = 4


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256, bias=False), torch.nn.ReLU(), torch.nn.Linear(256, 8, bias=False)
    )


def test_weights_gradients_and_adamw_state_are_counted_by_kind():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = (64 * 256 + 256 * 8) * F32
    with TensorMemory([model], [opt]) as tracker:
        x = torch.ones(16, 64)
        model(x).sum().backward()
        opt.step()
        tracker.reset()
    after = tracker.peak().by_kind
    assert after["params"] == params and after["grads"] == params
    # AdamW: exp_avg and exp_avg_sq per weight, and a 0-d fp32 step count per parameter tensor
    assert after["optimizer"] == 2 * params + 2 * F32


def test_the_peak_is_where_activations_and_gradients_overlap():
    model = _mlp()
    params = (64 * 256 + 256 * 8) * F32
    with TensorMemory([model], []) as tracker:
        tracker.reset()
        x = torch.ones(16, 64)  # created inside: counted as an activation
        hidden = model[1](model[0](x))  # kept: x (first matmul), the ReLU's output; the matmul's output is freed
        out = model[2](hidden)
        forward = tracker.now().peak_bytes
        out.sum().backward()
    saved = 16 * 64 * F32 + 16 * 256 * F32
    assert forward == params + saved + 16 * 8 * F32  # and the output
    peak = tracker.peak()
    assert peak.peak_bytes >= forward and peak.by_kind["params"] == params
    assert tracker.now().by_kind["grads"] == params  # the gradients outlive the backward


def test_a_storage_is_counted_once_and_freed_when_dropped():
    model = _mlp()
    with TensorMemory([model], []) as tracker:
        tracker.reset()
        base = torch.zeros(1000)
        views = [base[:10], base.view(10, 100)]  # views share the storage
        assert tracker.now().by_kind["activations"] == 1000 * F32
        del base, views
        assert tracker.now().by_kind["activations"] == 0
    assert tracker.peak().peak_bytes == tracker.peak().by_kind["params"] + 1000 * F32


def test_the_steady_state_counts_the_optimizer_state_the_first_step_creates():
    passes = TensorPeak(peak_bytes=100, by_kind={"params": 10, "optimizer": 0, "activations": 90})
    opt_step = TensorPeak(peak_bytes=40, by_kind={"params": 10, "optimizer": 20, "grads": 10})
    assert steady_peak(passes, opt_step, opt_step).peak_bytes == 120
    resumed = TensorPeak(peak_bytes=120, by_kind={"params": 10, "optimizer": 20, "activations": 90})
    assert steady_peak(resumed, opt_step, opt_step).peak_bytes == 120  # state already there: nothing added
    big_step = TensorPeak(peak_bytes=500, by_kind={"params": 10, "optimizer": 20, "temporaries": 470})
    assert steady_peak(passes, big_step, big_step) == big_step


def test_the_prediction_compared_is_each_ranks_peak_without_its_reserve():
    from fixtures.plans import make_plan
    from planner.model import parse_model
    from planner.plan import Predictions, StagePrediction

    plan = make_plan(parse_model("gpt:tiny"), pp=2)
    stages = [
        StagePrediction(
            stage=i,
            time_breakdown_s={},
            memory_breakdown_bytes={"params": 50.0, "reserve": 10.0 * (i + 1)},
            peak_memory_bytes=100.0,
            memory_capacity_bytes=1e9,
        )
        for i in range(2)
    ]
    pred = Predictions(
        step_time_s=1.0,
        tokens_per_s=1.0,
        samples_per_s=1.0,
        model_tflops_per_gpu=0.0,
        hardware_tflops_per_gpu=0.0,
        mfu=0.0,
        peak_memory_bytes=100.0,
        breakdown_s={},
        stages=stages,
    )
    assert predicted_tensor_bytes(plan.model_copy(update={"predictions": pred})) == pytest.approx([90.0, 80.0])
    assert predicted_tensor_bytes(plan) is None
