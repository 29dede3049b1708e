"""DeepSpeed ``ds_config.json``: write it for a plan, read it back.

Keys and meanings: the DeepSpeed configuration reference (deepspeed.ai/docs/config-json) and DeepSpeed
0.19.8's ``deepspeed/runtime/config.py`` (``train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x data-parallel size``; the ``pipeline`` block read by ``get_pipeline_config``:
``stages``, ``partition``, ``activation_checkpoint_interval``), ``runtime/tensor_parallel/config.py``
(``tensor_parallel.autotp_size``, AutoTP training) and ``runtime/lr_schedules.py`` (``WarmupCosineLR``:
``warmup_min_ratio`` -> 1 over ``warmup_num_steps`` linearly with ``warmup_type: linear``, then cosine to
``cos_min_ratio`` at ``total_num_steps``, ratios of the optimizer's ``lr``; ``WarmupLR`` for a constant rate).
DeepSpeed's pipeline engine runs its own 1F1B-like schedule and allows ZeRO stage <= 1 with it.
"""

from __future__ import annotations

import json
from typing import overload

from planner.core import Recompute, StratagemError
from planner.export.settings import FrameworkSettings, check_settings
from planner.plan import LRSchedule, peak_lr

SOURCE = "DeepSpeed config"
# Top-level keys of the DeepSpeed config reference (each is checked against DeepSpeed's source in
# tests/test_export_frameworks.py when deepspeed is installed).
TOP_LEVEL_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "fp16",
        "bf16",
        "amp",
        "gradient_clipping",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "flops_profiler",
        "activation_checkpointing",
        "sparse_attention",
        "data_efficiency",
        "curriculum_learning",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "elasticity",
        "aio",
        "autotuning",
        "compression_training",
        "checkpoint",
        "data_types",
        "pipeline",
        "tensor_parallel",
        "sequence_parallel_size",
        "memory_breakdown",
        "comms_logger",
        "hybrid_engine",
        "compile",
        "timers",
        "weight_quantization",
        "dataloader_drop_last",
        "eigenvalue",
        "progressive_layer_drop",
        "gradient_accumulation_dtype",
        "torch_autocast",
        "disable_allgather",
        "nebula",
    }
)
ZERO_KEYS = frozenset(
    {
        "stage",
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "reduce_scatter",
        "reduce_bucket_size",
        "contiguous_gradients",
        "offload_param",
        "offload_optimizer",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "sub_group_size",
        "elastic_checkpoint",
        "round_robin_gradients",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_gradients",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "memory_efficient_linear",
        "cpu_offload",
        "load_from_fp32_weights",
        "ignore_unused_parameters",
        "legacy_stage1",
        "use_multi_rank_bucket_allreduce",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "module_granularity_threshold",
        "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
    }
)
FIELD_KEYS = {
    "tp": "tensor_parallel.autotp_size",
    "pp": "pipeline.stages",
    "micro_batch": "train_micro_batch_size_per_gpu",
    "global_batch": "train_batch_size",
    "sequence_parallel": "(no key)",
    "virtual_stages": "(no key)",
}


def to_items(s: FrameworkSettings) -> dict:
    """The config as a JSON object."""
    config: dict = {
        "train_batch_size": s.global_batch,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.num_micro_batches,
        "zero_optimization": {
            "stage": s.zero_stage,
            "overlap_comm": s.overlap_grad_reduce,
            "contiguous_gradients": True,
        },
    }
    if s.dtype in ("bf16", "fp16"):
        config[s.dtype] = {"enabled": True}
    if s.tp > 1:
        config["tensor_parallel"] = {"autotp_size": s.tp}
    if s.pp > 1:
        config["pipeline"] = {
            "stages": s.pp,
            "partition": "uniform",
            "activation_checkpoint_interval": 1 if s.recompute == "full" else 0,
        }
    if s.recompute == "full":
        layers = int(s.model.dim("layers")) if s.model is not None else None
        config["activation_checkpointing"] = {
            "partition_activations": s.tp > 1,
            "contiguous_memory_optimization": False,
            **({"number_checkpoints": layers} if layers else {}),
        }
    if s.lr_schedule is not None:
        config.update(_recipe(s.lr_schedule, s.global_batch, s.weight_decay))
    return config


def _recipe(schedule: LRSchedule, global_batch: int, weight_decay: float | None) -> dict:
    peak = peak_lr(schedule, global_batch=global_batch)
    params = {"lr": peak, **({"weight_decay": weight_decay} if weight_decay is not None else {})}
    warm = max(1, schedule.warmup_steps)
    if schedule.decay == "constant":
        sched = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": schedule.warmup_start_lr,
                "warmup_max_lr": peak,
                "warmup_num_steps": warm,
                "warmup_type": "linear",
            },
        }
    else:
        sched = {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": schedule.total_steps,
                "warmup_num_steps": warm,
                "warmup_min_ratio": schedule.warmup_start_lr / peak,
                "cos_min_ratio": schedule.min_lr / peak,
                "warmup_type": "linear",
            },
        }
    return {"optimizer": {"type": "AdamW", "params": params}, "scheduler": sched}


def render(s: FrameworkSettings, *, header: list[str]) -> str:
    """``ds_config.json`` text. JSON has no comments and DeepSpeed reads only its own keys, so ``header`` is
    not written; the CLI prints it on stderr."""
    return json.dumps(to_items(s), indent=2) + "\n"


def _check_keys(config: dict) -> None:
    for key in config:
        if key not in TOP_LEVEL_KEYS:
            raise StratagemError(
                f"unknown DeepSpeed config key {key!r}: not in the DeepSpeed config reference; "
                f"check its spelling or remove it"
            )
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise StratagemError("DeepSpeed key 'zero_optimization' must be an object, e.g. {\"stage\": 1}")
    for key in zero:
        if key not in ZERO_KEYS:
            raise StratagemError(
                f"unknown DeepSpeed config key 'zero_optimization.{key}'; check its spelling or remove it"
            )


@overload
def _int(config: dict, key: str, default: int) -> int: ...
@overload
def _int(config: dict, key: str, default: None = None) -> int | None: ...
def _int(config: dict, key: str, default: int | None = None) -> int | None:
    value = config.get(key, default)
    if value is None or value == "auto":
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise StratagemError(f"DeepSpeed key {key!r} needs an integer, got {value!r}")
    return value


def _schedule(config: dict, global_batch: int) -> LRSchedule | None:
    sched, opt = config.get("scheduler") or {}, (config.get("optimizer") or {}).get("params") or {}
    params = sched.get("params") or {}
    kind, lr = sched.get("type"), opt.get("lr")
    if kind == "WarmupCosineLR" and isinstance(lr, (int, float)):
        return LRSchedule(
            base_lr=lr,
            reference_batch=global_batch,
            decay="cosine",
            warmup_steps=int(params.get("warmup_num_steps", 1000)),
            warmup_start_lr=lr * float(params.get("warmup_min_ratio", 0.0)),
            total_steps=int(params["total_num_steps"]),
            min_lr=lr * float(params.get("cos_min_ratio", 0.0001)),
        )
    if kind == "WarmupLR" and "warmup_max_lr" in params:
        warm = int(params.get("warmup_num_steps", 1000))
        return LRSchedule(
            base_lr=float(params["warmup_max_lr"]),
            reference_batch=global_batch,
            decay="constant",
            warmup_steps=warm,
            warmup_start_lr=float(params.get("warmup_min_lr", 0.0)),
            total_steps=max(warm, 1),
        )
    return None


def parse(text: str, *, world_size: int | None = None) -> FrameworkSettings:
    """Settings from ``ds_config.json`` text; ``world_size`` (GPUs) gives dp = world / (tp x pp)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StratagemError(f"the DeepSpeed config is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(config, dict):
        raise StratagemError("the DeepSpeed config must be a JSON object")
    _check_keys(config)
    tp = _int(config.get("tensor_parallel") or {}, "autotp_size", 1) or 1
    pp = _int(config.get("pipeline") or {}, "stages", 1) if "pipeline" in config else 1
    mb, gas, gb = (
        _int(config, k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    )
    if world_size is not None:
        if world_size % (tp * pp):
            raise StratagemError(
                f"{world_size} GPUs do not divide into tensor_parallel.autotp_size {tp} x "
                f"pipeline.stages {pp}; fix the config or --gpus"
            )
        dp = world_size // (tp * pp)
    elif gb and mb and gas:
        dp = gb // (mb * gas)
    else:
        raise StratagemError(
            "the DeepSpeed config does not fix the data-parallel size (give train_batch_size, "
            "train_micro_batch_size_per_gpu and gradient_accumulation_steps) and no --gpus was given"
        )
    mb = mb or (gb // (dp * (gas or 1)) if gb else None)
    if mb is None:
        raise StratagemError("the DeepSpeed config needs train_micro_batch_size_per_gpu or train_batch_size")
    gas = gas or (gb // (dp * mb) if gb else 1)
    if gb is not None and gb != mb * gas * dp:
        raise StratagemError(
            f"DeepSpeed keys contradict: train_batch_size {gb} != train_micro_batch_size_per_gpu "
            f"{mb} x gradient_accumulation_steps {gas} x data-parallel size {dp}; fix one of them"
        )
    gb = gb or mb * gas * dp
    pipe = config.get("pipeline") or {}
    recompute: Recompute = (
        "full" if config.get("activation_checkpointing") or _int(pipe, "activation_checkpoint_interval", 0) else "none"
    )
    zero = config.get("zero_optimization") or {}
    dtype = (
        "bf16"
        if (config.get("bf16") or {}).get("enabled")
        else "fp16"
        if (config.get("fp16") or {}).get("enabled")
        else "fp32"
    )
    settings = FrameworkSettings(
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=mb,
        global_batch=gb,
        zero_stage=_int(zero, "stage", 0),
        recompute=recompute,
        overlap_grad_reduce=bool(zero.get("overlap_comm", False)),
        dtype=dtype,
        lr_schedule=_schedule(config, gb),
        weight_decay=((config.get("optimizer") or {}).get("params") or {}).get("weight_decay"),
    )
    check_settings(settings, source=SOURCE, names=FIELD_KEYS)
    if settings.zero_stage > 1 and pp > 1:
        raise StratagemError(
            f"DeepSpeed keys contradict: zero_optimization.stage {settings.zero_stage} with "
            f"pipeline.stages {pp} (DeepSpeed's pipeline engine allows ZeRO stage <= 1)"
        )
    return settings
