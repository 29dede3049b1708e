"""plan --compare-to and show --compare-to: the plan against the user's config, stored and shown."""

from __future__ import annotations

import json

from planner.cli.main import main
from planner.plan import load_plan

MEGATRON = (
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 2304 "
    "--num-attention-heads 24 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 "
    "--global-batch-size 512 --fp16 --recompute-granularity full --recompute-method uniform"
)
PLAN = [
    "plan",
    "--model",
    "gpt:megatron-1.7b",
    "--cluster",
    "dgx-a100-80g",
    "--gpus",
    "32",
    "--global-batch",
    "512",
    "--seq",
    "2048",
    "--dtype",
    "fp16",
]


def test_plan_compare_to_megatron_stores_speedup_and_flag_changes(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--compare-to", "megatron", MEGATRON, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = load_plan(out)
    c = plan.comparison
    assert c is not None and c.framework == "megatron"
    assert c.current_summary.startswith("tp2 pp2 dp8 1f1b mb4x16 zero0")
    assert c.speedup == c.current_step_time_s / c.exported_step_time_s
    assert c.plan_step_time_s <= c.current_step_time_s  # the search is optimal under the same model
    assert (
        any(line.startswith("--tensor-model-parallel-size 2 -> ") for line in c.flag_changes)
        or plan.mesh.size("tp") == 2
    )
    assert "predicted speed-up" in printed and "what to change in your megatron config" in printed
    assert main(["show", str(out)]) == 0
    assert "predicted speed-up" in capsys.readouterr().out


def test_show_compares_with_a_deepspeed_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--out", str(out)]) == 0
    ds = tmp_path / "ds_config.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 512,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 4,
                "zero_optimization": {"stage": 3},
                "fp16": {"enabled": True},
            }
        )
    )
    capsys.readouterr()
    assert main(["show", str(out), "--compare-to", "deepspeed", str(ds)]) == 0
    printed = capsys.readouterr().out
    assert "against your deepspeed config" in printed and "yours: tp1 pp1 dp32 1f1b mb4x4 zero3" in printed


def test_compare_to_a_config_of_another_batch_is_refused(tmp_path, capsys):
    bad = MEGATRON.replace("--global-batch-size 512", "--global-batch-size 256")
    assert main([*PLAN, "--compare-to", "megatron", bad, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "256 samples per step but the plan 512" in err[0]
    assert not (tmp_path / "p.json").exists()
