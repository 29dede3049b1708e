"""Hugging Face Accelerate launch config (``accelerate launch --config_file F``) for data-parallel plans.

Keys: Accelerate 1.15 ``accelerate/commands/config/config_args.py`` (``ClusterConfig``; unknown keys are
refused by ``from_yaml_file``) and ``commands/config/cluster.py`` (FSDP questions: ``fsdp_version`` 2,
``fsdp_reshard_after_forward`` true = ZeRO-3, false = ZeRO-2-like, ``fsdp_activation_checkpointing``).
``distributed_type: MULTI_GPU`` is DDP (ZeRO 0). The config has no batch or learning-rate keys: the micro-batch,
gradient accumulation and the recipe are written as comments for the training script.
"""

from __future__ import annotations

from planner.export.settings import FrameworkSettings
from planner.plan import peak_lr


def to_items(s: FrameworkSettings) -> dict:
    """The YAML mapping (nested dict for ``fsdp_config``)."""
    items: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if s.zero_stage >= 2 else "MULTI_GPU",
        "mixed_precision": s.dtype if s.dtype in ("bf16", "fp16") else "no",
        "num_machines": max(1, s.world_size // 8) if s.world_size % 8 == 0 else 1,
        "num_processes": s.world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if s.zero_stage >= 2:
        items["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": s.zero_stage == 3,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": s.recompute != "none",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": False,
        }
    return items


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def recipe_comments(s: FrameworkSettings) -> list[str]:
    """What the training script must set: batch split and learning rate (no Accelerate keys for them)."""
    lines = [
        f"training script: micro-batch {s.micro_batch} per process, gradient accumulation "
        f"{s.num_micro_batches} (global batch {s.global_batch})"
    ]
    sched = s.lr_schedule
    if sched is not None:
        peak = peak_lr(sched, global_batch=s.global_batch)
        lines.append(
            f"learning rate (Goyal et al. 2017): peak {peak:.6g} = {sched.base_lr:g} x {s.global_batch}/"
            f"{sched.reference_batch}, linear warm-up from {sched.warmup_start_lr:g} over "
            f"{sched.warmup_steps} steps, {sched.decay} decay over {sched.total_steps} steps"
            + (f" to {sched.min_lr:g}" if sched.decay == "cosine" else "")
        )
    return lines


def render(s: FrameworkSettings, *, header: list[str]) -> str:
    lines = [f"# {h}" for h in header + recipe_comments(s)]
    for key, value in to_items(s).items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {_yaml_value(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {_yaml_value(value)}")
    return "\n".join(lines) + "\n"
