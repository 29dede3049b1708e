"""Models from outside the zoo trained by `launch`'s runtime (one torchrun job for all plans, 2 ranks):

- an HF Llama-architecture config under DP2, FSDP2 (ZeRO-3), TP2 and PP2 (1F1B);
- the user-defined example model (examples/custom_model.py) under TP2 (its tp_plan) and PP2 (1F1B);

each gives the single-process losses (fp32, 3 AdamW steps), and each axis is really applied (layout reports)."""

from __future__ import annotations

import json

import pytest
from hf_helpers import write_config
from runtime_helpers import REPO, tail, torchrun

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.metrics import final_step_losses, read_metrics

pytestmark = pytest.mark.slow
STEPS = 3
TOL = 1e-5  # fp32, relative and absolute
ALL_SPLIT = ["embed", "blocks.0", "blocks.1", "head"]
PLANS = {
    "dp2": dict(dp=2),
    "fsdp2_zero3": dict(dp=2, zero_stage=3),
    "tp2": dict(tp=2, split=ALL_SPLIT),
    "pp2_1f1b": dict(pp=2, schedule="1f1b", num_micro_batches=4),
    "custom_tp2": dict(tp=2, split=[f"blocks.{i}" for i in range(6)], custom=True),
    "custom_pp2_1f1b": dict(pp=2, schedule="1f1b", num_micro_batches=4, custom=True),
}
CUSTOM = f"py:{REPO / 'examples' / 'custom_model.py'}:build"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_parity")
    hf, custom = parse_model("hf:" + str(write_config(root / "llama"))), parse_model(CUSTOM)
    args, out = ["--steps", str(STEPS), "--timeout-s", "60"], {}
    for name, cfg in PLANS.items():
        cfg = dict(cfg)
        spec = custom if cfg.pop("custom", False) else hf
        plan = make_plan(spec, global_batch=8, seq_len=16 if spec is hf else 1, **cfg)
        path = save_plan(plan, root / f"{name}.json")
        args += ["--plan", str(path), "--metrics", str(root / f"{name}.jsonl"), "--layout-report", str(root / name)]
        out[name] = (plan, root / f"{name}.jsonl", root / name)
    proc = torchrun(2, args, timeout_s=240)
    assert proc.returncode == 0, tail(proc)
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_matches_single_process(job, name):
    plan, metrics, _ = job[name]
    measured = final_step_losses(read_metrics(metrics))
    expected = reference_losses(plan, STEPS)
    assert sorted(measured) == list(range(1, STEPS + 1))
    diffs = [abs(measured[s] - ref) for s, ref in enumerate(expected, start=1)]
    print(f"{name}: max |loss diff| {max(diffs):.2e}")
    assert max(diffs) <= TOL * max(1.0, max(expected)), (measured, expected)
    assert expected[0] != expected[-1]  # it trained


def _params(job, name, rank):
    return json.loads((job[name][2] / f"rank{rank}.json").read_text())["chunks"][0]["params"]


def test_each_axis_is_applied(job):
    q = "blocks.0.layer.self_attn.q_proj.weight"  # (4 heads x 16, 64)
    tp = _params(job, "tp2", 1)
    assert tp[q]["placements"] == ["S(0)"] and tp[q]["local_shape"] == [32, 64]
    assert tp["blocks.0.layer.self_attn.o_proj.weight"]["placements"] == ["S(1)"]
    assert tp["embed.tok.weight"]["placements"] == ["S(0)"] and tp["head.weight"]["placements"] == ["S(0)"]
    assert _params(job, "custom_tp2", 0)["blocks.0.fc1.weight"]["placements"] == ["S(0)"]
    assert _params(job, "fsdp2_zero3", 0)[q]["local_shape"] == [32, 64]
    stage0, stage1 = _params(job, "pp2_1f1b", 0), _params(job, "pp2_1f1b", 1)
    assert "embed.tok.weight" in stage0 and "head.weight" not in stage0
    assert "head.weight" in stage1 and "embed.tok.weight" not in stage1
