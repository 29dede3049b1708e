"""Exports of searched plans (GPT-3 175B / 1,024 A100, Llama-2-70B / 256 H100, Llama-3 70B and 8B, a ZeRO-3 plan), checked by
each framework's own configuration code where it installs on CPU (the ``[export]`` extra); without it the
documented-schema checks of the round-trip tests still run. Bad input: one-line errors naming the flag/key."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from planner.cli.common import resolve_cluster_path
from planner.cli.main import main
from planner.core import StratagemError
from planner.export import export_plan
from planner.export import megatron as megatron_format
from planner.export import torchtitan as torchtitan_format
from planner.plan import load_plan, lr_at_step
from planner.profile import build_gpt_profile, load_cluster_profile

REPO = Path(__file__).resolve().parents[1]
PLANS = {  # name: stratagem plan arguments (each search takes 1-4 s here)
    "gpt3-175b-1024-a100": [
        "--model",
        "gpt:gpt3-175b",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "1024",
        "--global-batch",
        "1536",
        "--seq",
        "2048",
        "--lr",
        "6e-5",
        "--reference-batch",
        "512",
        "--warmup-steps",
        "100",
        "--train-steps",
        "1000",
        "--min-lr",
        "6e-6",
    ],
    "llama2-70b-256-h100": [
        "--model",
        "llama:llama2-70b",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "256",
        "--global-batch",
        "512",
        "--seq",
        "4096",
        "--lr",
        "1.5e-4",
        "--reference-batch",
        "256",
        "--warmup-steps",
        "20",
        "--train-steps",
        "200",
        "--lr-decay",
        "constant",
    ],
    "llama3-70b-256-h100": [
        *("--model", "llama:llama3-70b", "--cluster", "dgx-h100", "--gpus", "256", "--global-batch", "512"),
        *("--seq", "8192", "--lr", "1.5e-4", "--warmup-steps", "20", "--train-steps", "200"),
    ],
    "llama3-8b-64-h100": [
        *("--model", "llama:llama3-8b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "256"),
        *("--seq", "8192", "--lr", "3e-4", "--warmup-steps", "20", "--train-steps", "200"),
    ],
    "zero3-gpt3-175b-384": [
        "--model",
        "gpt:gpt3-175b",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "384",
        "--global-batch",
        "1536",
        "--seq",
        "2048",
        "--allow",
        "dp,zero,recompute",
        "--lr",
        "1e-4",
        "--reference-batch",
        "1536",
        "--warmup-steps",
        "10",
        "--train-steps",
        "100",
    ],
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for name, argv in PLANS.items():
        path = folder / f"{name}.json"
        # plans made to be run by these frameworks: priced as Megatron-LM holds memory (what most of them export to)
        assert main(["plan", *argv, "--for", "megatron", "--out", str(path)]) == 0
        out[name] = load_plan(path)
    assert out["zero3-gpt3-175b-384"].zero_stage == 3
    return out


def _export(plan, framework):
    profile = build_gpt_profile(plan.model, seq_len=plan.training.seq_len, dtype=plan.training.dtype)
    cluster = load_cluster_profile(resolve_cluster_path(plan.cluster_name))
    return export_plan(plan, framework, profile=profile, cluster=cluster)


@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_export_is_accepted_by_megatron_core(plans, name):
    plan = plans[name]
    export = _export(plan, "megatron")
    args = megatron_format.parse_args(export.text)  # every flag is one Megatron-LM's parser defines
    assert set(args) <= megatron_format.known_flags()
    assert int(args["--tensor-model-parallel-size"]) == plan.mesh.size("tp")
    assert int(args["--global-batch-size"]) == plan.training.global_batch
    assert export.exported_estimate.step_time_s >= export.plan_estimate.step_time_s * (1 - 1e-9) or export.changes
    core = pytest.importorskip("megatron.core")
    del core
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.transformer_config import TransformerConfig
    s = export.settings
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(s.dtype, torch.float32)
    TransformerConfig(  # its __post_init__ checks heads % tp, recompute method/granularity, pipeline dtype, ...
        num_layers=int(args["--num-layers"]),
        hidden_size=int(args["--hidden-size"]),
        num_attention_heads=int(args["--num-attention-heads"]),
        tensor_model_parallel_size=s.tp,
        pipeline_model_parallel_size=s.pp,
        sequence_parallel="--sequence-parallel" in args,
        recompute_granularity=args.get("--recompute-granularity"),
        recompute_method=args.get("--recompute-method"),
        recompute_num_layers=int(args["--recompute-num-layers"]) if "--recompute-num-layers" in args else None,
        num_query_groups=int(args["--num-query-groups"]) if "--num-query-groups" in args else None,
        ffn_hidden_size=int(args["--ffn-hidden-size"]) if "--ffn-hidden-size" in args else None,
        bf16=s.dtype == "bf16",
        fp16=s.dtype == "fp16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        virtual_pipeline_model_parallel_size=s.virtual_stages if s.virtual_stages > 1 else None,
    )
    DistributedDataParallelConfig(
        overlap_grad_reduce="--overlap-grad-reduce" in args,
        use_distributed_optimizer="--use-distributed-optimizer" in args,
        use_megatron_fsdp="--use-megatron-fsdp" in args,
        data_parallel_sharding_strategy=args.get("--data-parallel-sharding-strategy", "no_shard"),
    )
    # the learning rate Megatron-Core computes from the exported flags, step by step, is the plan's recipe
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    total = int(args["--lr-decay-iters"])
    sched = OptimizerParamScheduler(
        opt,
        init_lr=float(args.get("--lr-warmup-init", 0.0)),
        max_lr=float(args["--lr"]),
        min_lr=float(args.get("--min-lr", 0.0)),
        lr_warmup_steps=int(args.get("--lr-warmup-iters", 0)),
        lr_decay_steps=total,
        lr_decay_style=args["--lr-decay-style"],
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    got = []
    for _ in range(total + 3):
        got.append(opt.param_groups[0]["lr"])
        sched.step(1)
    want = [
        lr_at_step(plan.training.lr_schedule, global_batch=plan.training.global_batch, step=k) for k in range(total + 3)
    ]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("name", list(PLANS))
def test_deepspeed_export_is_accepted_by_deepspeed_config(plans, name, monkeypatch):
    plan = plans[name]
    export = _export(plan, "deepspeed")
    config = json.loads(export.text)
    assert config["train_batch_size"] == plan.training.global_batch
    ds = pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    class Mpu:  # DeepSpeed reads the data-parallel size from the model-parallel unit
        def get_data_parallel_world_size(self):
            return export.settings.dp

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    parsed = ds_config.DeepSpeedConfig(config, mpu=Mpu())  # checks batch = micro x accumulation x dp, ZeRO...
    assert parsed.train_batch_size == plan.training.global_batch
    assert parsed.zero_optimization_stage == export.settings.zero_stage
    assert parsed.scheduler_name == config["scheduler"]["type"]
    del ds
    if parsed.scheduler_name == "WarmupCosineLR":
        import torch

        peak = config["optimizer"]["params"]["lr"]
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        sched = WarmupCosineLR(opt, **parsed.scheduler_params)
        schedule = plan.training.lr_schedule
        # DeepSpeed's linear warm-up is the recipe's (its cosine starts one step later: not compared)
        for step in range(schedule.warmup_steps):
            sched.step(step)
            assert opt.param_groups[0]["lr"] == pytest.approx(
                lr_at_step(schedule, global_batch=plan.training.global_batch, step=step), rel=1e-9
            )


def test_deepspeed_top_level_keys_are_deepspeeds():
    pytest.importorskip("deepspeed")
    import deepspeed

    source = "\n".join(
        p.read_text(encoding="utf-8", errors="replace") for p in Path(deepspeed.__file__).parent.rglob("*.py")
    )
    import re  # a quoted key, or a field of DeepSpeed's pydantic config models

    from planner.export import TOP_LEVEL_KEYS, ZERO_KEYS

    missing = [
        k
        for k in sorted(TOP_LEVEL_KEYS | ZERO_KEYS)
        if f'"{k}"' not in source and f"'{k}'" not in source and not re.search(rf"^\s+{k}\s*:", source, flags=re.M)
    ]
    assert missing == []


TORCHTITAN_PLANS = ["llama3-70b-256-h100", "llama3-8b-64-h100"]  # torchtitan builds its registered flavors only


@pytest.mark.parametrize("name", TORCHTITAN_PLANS)
def test_torchtitan_export_builds_torchtitans_config_classes(plans, name):
    plan = plans[name]
    export = _export(plan, "torchtitan")
    sections, world = torchtitan_format._sections_from_python(export.text)
    assert world == plan.world_size
    pytest.importorskip("tyro")
    pytest.importorskip("torchtitan")
    try:
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        from torchtitan.config import ParallelismConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    except ImportError as exc:
        pytest.skip(f"torchtitan's config modules do not import here: {exc}")
    parallelism = ParallelismConfig(**sections["parallelism"])  # unknown field -> TypeError
    training = TrainingConfig(**sections["training"])
    LRSchedulersContainer.Config(**sections["lr_scheduler"])
    {"full": FullAC.Config, "selective": SelectiveAC.Config}.get(export.settings.recompute, lambda: None)()
    # Trainer.Config.__post_init__ (torchtitan/trainer.py): local batch divisible by the pipeline micro-batch
    if parallelism.pipeline_parallel_degree > 1:
        assert training.local_batch_size % parallelism.pipeline_parallel_microbatch_size == 0
    dp = parallelism.data_parallel_replicate_degree * parallelism.data_parallel_shard_degree
    model_parallel = parallelism.tensor_parallel_degree * parallelism.pipeline_parallel_degree
    assert dp * model_parallel * parallelism.context_parallel_degree == plan.world_size


def test_torchtitan_loads_the_exports_and_builds_the_planned_model(plans, tmp_path):
    """torchtitan's own code runs each export's config function and builds its model on the meta device
    (tools/check_torchtitan_export.py, in its own process): the model has the plan's parameters and the
    parallelism multiplies to the plan's GPUs."""
    pytest.importorskip("torchtitan")
    files = []
    for name in TORCHTITAN_PLANS:
        files.append(tmp_path / f"{name.replace('-', '_')}.py")
        files[-1].write_text(_export(plans[name], "torchtitan").text)
    cmd = [sys.executable, str(REPO / "tools" / "check_torchtitan_export.py"), *map(str, files)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(rows) == len(files), proc.stdout[-2000:] + proc.stderr[-2000:]
    for name, row in zip(TORCHTITAN_PLANS, rows):
        plan = plans[name]
        params = build_gpt_profile(plan.model, seq_len=plan.training.seq_len, dtype="bf16").total_params
        assert row["params"] == params, (name, row)
        dp, tp, pp, cp = row["dp_tp_pp_cp"]
        assert dp * tp * pp * cp == plan.world_size == row["world_size"], (name, row)


@pytest.mark.parametrize("name", ["gpt3-175b-1024-a100", "llama2-70b-256-h100"])
def test_torchtitan_export_refuses_a_model_torchtitan_does_not_register(plans, name):
    with pytest.raises(StratagemError, match="torchtitan") as err:
        _export(plans[name], "torchtitan")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["llama2-70b-256-h100", "zero3-gpt3-175b-384"])
def test_accelerate_export_is_accepted_by_accelerate(plans, name, tmp_path):
    plan = plans[name]
    export = _export(plan, "accelerate")
    assert export.settings.tp == export.settings.pp == 1
    path = tmp_path / "accelerate.yaml"
    path.write_text(export.text)
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))  # refuses unknown keys
    assert config.num_processes == plan.world_size
    assert config.distributed_type == ("FSDP" if export.settings.zero_stage >= 2 else "MULTI_GPU")
    if export.settings.zero_stage >= 2:
        assert config.fsdp_config["fsdp_reshard_after_forward"] == (export.settings.zero_stage == 3)


def test_exact_plan_export_has_no_changes_and_the_same_estimate(plans):
    export = _export(plans["zero3-gpt3-175b-384"], "accelerate")
    if not export.changes:
        assert export.exported_estimate.step_time_s == pytest.approx(export.plan_estimate.step_time_s, rel=1e-12)
    else:  # only per-layer recompute and the recipe (no Accelerate key for it) may differ
        assert {c.what for c in export.changes} <= {
            "recompute",
            "recompute of non-block layers",
            "learning-rate recipe",
        }


# -- bad input: one line naming the flag or key, exit status 2 ----------------------------------------------
def _cli(*argv: str, capsys) -> subprocess.CompletedProcess:
    """The CLI in this process (as ``stratagem ...``): exit status and what it printed."""
    capsys.readouterr()
    status = main(list(argv))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(argv, status, printed.out, printed.err)


@pytest.mark.parametrize(
    "framework, source, needle",
    [
        (
            "megatron",
            "--tensor-model-parallel-size 8 --pipline-model-parallel-size 2 --micro-batch-size 1",
            "--pipline-model-parallel-size",
        ),
        (
            "megatron",
            "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --micro-batch-size 1 "
            "--num-layers 96 --hidden-size 12288 --num-attention-heads 96",
            "--pipeline-model-parallel-size 16",
        ),
        (
            "megatron",
            "--tensor-model-parallel-size 8 --micro-batch-size 2 --global-batch-size 100 --num-layers 4 "
            "--hidden-size 64 --num-attention-heads 8",
            "--global-batch-size 100",
        ),
        (
            "megatron",
            "--tensor-model-parallel-size 3 --micro-batch-size 1 --num-layers 4 --hidden-size 64 "
            "--num-attention-heads 8",
            "--tensor-model-parallel-size 3",
        ),
    ],
)
def test_bad_megatron_arguments_are_one_line_errors(framework, source, needle, capsys):
    run = _cli("estimate", "--from", framework, source, "--cluster", "dgx-a100-80g", "--gpus", "1000", capsys=capsys)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], run.stderr


def test_bad_deepspeed_and_torchtitan_configs_are_one_line_errors(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(
        json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 3}})
    )
    run = _cli(
        "estimate",
        "--from",
        "deepspeed",
        str(ds),
        "--model",
        "gpt:gpt2",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "8",
        capsys=capsys,
    )
    assert run.returncode == 2 and "'zero_optimisation'" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 1},
            }
        )
    )
    run = _cli(
        "estimate",
        "--from",
        "deepspeed",
        str(ds),
        "--model",
        "gpt:gpt2",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "8",
        capsys=capsys,
    )
    assert (
        run.returncode == 2
        and "train_batch_size 64 != train_micro_batch_size_per_gpu 2 x "
        "gradient_accumulation_steps 2 x data-parallel size 8"
        in run.stderr
    )
    ds.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 1, "overlap_com": True}}))
    run = _cli(
        "estimate", "--from", "deepspeed", str(ds), "--model", "gpt:gpt2", "--cluster", "dgx-a100-80g", capsys=capsys
    )
    assert run.returncode == 2 and "zero_optimization.overlap_com" in run.stderr
    tt = tmp_path / "titan.py"
    tt.write_text(
        "from torchtitan.config import ParallelismConfig\n"
        "def cfg():\n    c.parallelism = ParallelismConfig(tensor_paralel_degree=2)\n"
    )
    run = _cli(
        "estimate",
        "--from",
        "torchtitan",
        str(tt),
        "--model",
        "gpt:gpt2",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "8",
        capsys=capsys,
    )
    assert run.returncode == 2 and "parallelism.tensor_paralel_degree" in run.stderr


def test_export_cli_writes_the_file_and_prints_the_price(tmp_path, plans, capsys):
    from planner.plan import save_plan

    plan_path = save_plan(plans["llama2-70b-256-h100"], tmp_path / "plan.json")
    out = tmp_path / "args.sh"
    run = _cli("export", str(plan_path), "--to", "megatron", "--out", str(out), capsys=capsys)
    assert run.returncode == 0, run.stderr
    assert "plan (cost model): step" in run.stderr and "this megatron config (cost model): step" in run.stderr
    text = out.read_text()
    assert "--tensor-model-parallel-size 2" in text and "--lr-decay-style constant" in text
    assert megatron_format.parse(text).dp == 128


def test_megatron_exports_carry_what_megatrons_validate_args_demands(tmp_path):
    """Megatron-LM's validate_args (read from its source; tools/check_megatron_export.py runs it): Megatron-FSDP
    requires --ckpt-format fsdp_dtensor, and TP or CP without FSDP requires CUDA_DEVICE_MAX_CONNECTIONS=1 on GPUs
    before Blackwell (FSDP requires it unset or > 1). Every kind in tools/megatron_export_cases.py is written."""
    import subprocess
    import sys

    from planner.export import megatron

    proc = subprocess.run(
        [sys.executable, "tools/megatron_export_cases.py", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(tmp_path.glob("*.sh"))
    assert len(files) == 10
    for f in files:
        text = f.read_text()
        fsdp = "--use-megatron-fsdp" in text
        assert ("--ckpt-format fsdp_dtensor" in text) == fsdp, f.name
        parallel = any(f"--{k}-parallel-size" in text and f"--{k}-parallel-size 1\n" not in text
                       for k in ("tensor-model", "context"))  # fmt: skip
        assert ("export CUDA_DEVICE_MAX_CONNECTIONS=1" in text) == (parallel and not fsdp), f.name
        megatron.parse(text)  # the importer reads its own exports back
