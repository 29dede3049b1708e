"""torchtitan configuration: a Python config function for torchtitan 0.3, read back from it or from TOML.

torchtitan 0.3 moved from TOML files to Python functions returning ``Trainer.Config``, selected with
``--module``/``--config`` (torchtitan/config/README.md, torchtitan/config/manager.py ``ConfigManager``).
Field names: torchtitan 0.3.0 ``torchtitan/config/configs.py`` (``ParallelismConfig``: ``data_parallel_
replicate_degree``, ``data_parallel_shard_degree``, ``fsdp_reshard_after_forward``, ``tensor_parallel_degree``,
``enable_sequence_parallel``, ``pipeline_parallel_degree``, ``pipeline_parallel_schedule``,
``pipeline_parallel_microbatch_size``, ``pipeline_parallel_layers_per_stage``, ``pipeline_parallel_first/
last_stage_less_layers``, ``context_parallel_degree``, ``expert_parallel_degree``; ``TrainingConfig``:
``local_batch_size``, ``global_batch_size``, ``seq_len``, ``steps``), ``components/optimizer/lr_scheduler.py``
(``warmup_steps``, ``total_steps``, ``decay_type``, ``min_lr_factor``; the warm-up starts from zero) and
``distributed/activation_checkpoint.py`` (``FullAC``, ``SelectiveAC``, ``None``). FSDP2 with
``reshard_after_forward="never"`` keeps gathered weights between forward and backward (ZeRO-2's memory);
``"always"`` is ZeRO-3; shard degree 1 with replicate degree dp is DDP.
The reader parses the file with ``ast`` (it never runs it) and also reads the TOML files of torchtitan <= 0.2
(same section and key names).
"""

from __future__ import annotations

import ast

from planner.core import ScheduleKind, StratagemError
from planner.export.settings import FrameworkSettings, check_settings
from planner.model import ModelSpec, ffn_width
from planner.plan import LRSchedule, peak_lr

SOURCE = "torchtitan config"
SCHEDULES: dict[ScheduleKind, str] = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
PARALLELISM_KEYS = frozenset(
    {
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "enable_fsdp_symm_mem",
        "tensor_parallel_degree",
        "enable_sequence_parallel",
        "spmd_backend",
        "pipeline_parallel_degree",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "context_parallel_degree",
        "context_parallel_load_balancer",
        "context_parallel_ptrr_mask_key",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "disable_loss_parallel",
    }
)
TRAINING_KEYS = frozenset(
    {
        "local_batch_size",
        "global_batch_size",
        "seq_len",
        "max_norm",
        "steps",
        "enable_cpu_offload",
        "disable_cuda_graphs",
        "dtype",
        "mixed_precision_param",
        "mixed_precision_reduce",
        "gc_freq",
        "gc_debug",
    }
)
LR_KEYS = frozenset({"warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"})
KEY_NAMES = {
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "micro_batch": "parallelism.pipeline_parallel_microbatch_size",
    "global_batch": "training.global_batch_size",
    "sequence_parallel": "parallelism.enable_sequence_parallel",
    "virtual_stages": "parallelism.pipeline_parallel_layers_per_stage",
    "cp": "parallelism.context_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
}


# torchtitan's Llama 3 flavors with a config function (torchtitan/models/llama3/config_registry.py; their dims in
# torchtitan/models/llama3/__init__.py ``llama3_configs``, the SwiGLU width from ``compute_ffn_hidden_dim``)
LLAMA3_FLAVORS = {
    "llama3_debugmodel": dict(hidden=256, layers=6, heads=16, kv_heads=16, ffn_hidden=768, vocab=2048),
    "llama3_8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256),
    "llama3_70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256),
    "llama3_405b": dict(hidden=16384, layers=126, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256),
}


def base_config(model: ModelSpec | None) -> str:
    """torchtitan's config function whose model is the plan's model (same dimensions); a one-line error where
    torchtitan registers no such model (the export cannot carry other dimensions: torchtitan builds its model
    from a registered flavor)."""
    if model is None or model.family != "llama":
        family = "an unknown model" if model is None else f"a {model.family} model"
        raise StratagemError(
            f"torchtitan export: the plan is for {family}; torchtitan's Llama 3 config functions ("
            f"{', '.join(LLAMA3_FLAVORS)}) are the models it can start from; export to megatron or deepspeed instead"
        )
    dims = {k: int(model.dim(k)) for k in ("hidden", "layers", "heads", "vocab")}
    dims["ffn_hidden"] = ffn_width(model)
    dims["kv_heads"] = int(model.dim("kv_heads") or dims["heads"])
    for name, flavor in LLAMA3_FLAVORS.items():
        if flavor == dims:
            return name
    shown = ", ".join(f"{k} {v}" for k, v in dims.items())
    raise StratagemError(
        f"torchtitan export: torchtitan registers no Llama 3 flavor with {shown} (it has {', '.join(LLAMA3_FLAVORS)});"
        " register the model in torchtitan.models.llama3 first, or export to megatron or deepspeed"
    )


def to_items(s: FrameworkSettings) -> dict[str, dict]:
    """Section -> keyword arguments (what the config function sets)."""
    fsdp = s.zero_stage >= 2
    par: dict = {
        "data_parallel_replicate_degree": 1 if fsdp else s.dp,
        "data_parallel_shard_degree": s.dp if fsdp else 1,
    }
    if fsdp:
        par["fsdp_reshard_after_forward"] = "always" if s.zero_stage == 3 else "never"
    par.update(tensor_parallel_degree=s.tp, enable_sequence_parallel=s.sequence_parallel and s.tp > 1)
    if s.pp > 1:
        par.update(
            pipeline_parallel_degree=s.pp,
            pipeline_parallel_schedule=SCHEDULES[s.schedule],
            pipeline_parallel_microbatch_size=s.micro_batch,
            pipeline_parallel_first_stage_less_layers=0,
            pipeline_parallel_last_stage_less_layers=0,
        )
        if s.virtual_stages > 1 and s.model is not None:
            par["pipeline_parallel_layers_per_stage"] = int(s.model.dim("layers")) // (s.pp * s.virtual_stages)
    if s.cp > 1:
        par["context_parallel_degree"] = s.cp
    if s.ep > 1:
        par["expert_parallel_degree"] = s.ep
    local = s.micro_batch * s.num_micro_batches if s.pp > 1 else s.micro_batch
    training: dict = {"local_batch_size": local, "global_batch_size": s.global_batch}
    if s.seq_len:
        training["seq_len"] = s.seq_len
    out = {"parallelism": par, "training": training, "activation_checkpoint": {"mode": s.recompute}}
    if s.lr_schedule is not None:
        sched = s.lr_schedule
        peak = peak_lr(sched, global_batch=s.global_batch)
        training["steps"] = sched.total_steps
        out["optimizer"] = {"lr": peak, **({"weight_decay": s.weight_decay} if s.weight_decay is not None else {})}
        out["lr_scheduler"] = {
            "warmup_steps": sched.warmup_steps,
            "total_steps": sched.total_steps,
            "decay_type": "cosine",
            "min_lr_factor": sched.min_lr / peak,
        }
        if sched.decay == "constant":
            out["lr_scheduler"].update(decay_ratio=0.0, min_lr_factor=1.0)
    return out


def _call(name: str, kwargs: dict) -> str:
    inner = "".join(f"\n        {k}={v!r}," for k, v in kwargs.items())
    return f"{name}({inner}\n    )"


def render(s: FrameworkSettings, *, header: list[str]) -> str:
    """A Python module with ``stratagem_plan() -> Trainer.Config`` for ``--module``/``--config``."""
    items = to_items(s)
    base = base_config(s.model)
    doc = "\n".join(
        header
        + [
            "",
            f"Run: NGPU={s.world_size} MODULE=<this module> CONFIG=stratagem_plan "
            f"./run_train.sh  (world size {s.world_size} = dp {s.dp} x tp {s.tp} x pp {s.pp})",
            f"Model: torchtitan's {base}, the plan's model (same dimensions).",
        ]
    )
    ac = {"full": "FullAC.Config()", "selective": "SelectiveAC.Config()", "none": "None"}[s.recompute]
    lines = [
        f'"""{doc}\n"""',
        "",
        "from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw",
        "from torchtitan.config import ParallelismConfig, TrainingConfig",
        "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC",
        f"from torchtitan.models.llama3.config_registry import {base} as base_config",
        "from torchtitan.trainer import Trainer",
        "",
        f"WORLD_SIZE_GPUS = {s.world_size}",
        "",
        "",
        "def stratagem_plan() -> Trainer.Config:",
        "    config = base_config()",
        f"    config.parallelism = {_call('ParallelismConfig', items['parallelism'])}",
        f"    config.training = {_call('TrainingConfig', items['training'])}",
        f"    config.activation_checkpoint = {ac}",
    ]
    if "optimizer" in items:
        lines += [
            f"    config.optimizer = {_call('default_adamw', items['optimizer'])}",
            f"    config.lr_scheduler = {_call('LRSchedulersContainer.Config', items['lr_scheduler'])}",
        ]
    lines += ["    return config"]
    return "\n".join(lines) + "\n"


# -- import -----------------------------------------------------------------------------------------
_CALLS = {
    "ParallelismConfig": "parallelism",
    "TrainingConfig": "training",
    "default_adamw": "optimizer",
    "Config": "lr_scheduler",
}
_AC = {"FullAC": "full", "SelectiveAC": "selective"}


def _sections_from_python(text: str) -> tuple[dict[str, dict], int | None]:
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise StratagemError(f"the torchtitan config is not valid Python (line {exc.lineno}: {exc.msg})") from None
    sections: dict[str, dict] = {}
    world = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if any(isinstance(t, ast.Name) and t.id == "WORLD_SIZE_GPUS" for t in node.targets):
                constant = node.value.value
                if not isinstance(constant, (int, float, str)):
                    raise StratagemError(f"torchtitan config: WORLD_SIZE_GPUS = {constant!r}; write the GPU count")
                world = int(constant)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "activation_checkpoint" for t in node.targets
        ):
            value = node.value
            name = (
                value.func.value.id
                if isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and isinstance(value.func.value, ast.Name)
                else None
            )
            sections["activation_checkpoint"] = {"mode": _AC[name] if name in _AC else "none"}
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in _CALLS:
                try:
                    sections[_CALLS[name]] = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                except ValueError:
                    raise StratagemError(
                        f"torchtitan config: {name}(...) has a non-literal argument; write plain numbers and strings"
                    ) from None
    return sections, world


def _sections_from_toml(text: str) -> tuple[dict[str, dict], int | None]:
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise StratagemError(f"the torchtitan config is neither Python nor valid TOML ({exc})") from None
    return {k: v for k, v in data.items() if isinstance(v, dict)}, None


def _check_keys(sections: dict[str, dict]) -> None:
    for section, known in (("parallelism", PARALLELISM_KEYS), ("training", TRAINING_KEYS), ("lr_scheduler", LR_KEYS)):
        for key in sections.get(section, {}):
            if key not in known:
                raise StratagemError(
                    f"unknown torchtitan key {section}.{key}: not a field of torchtitan 0.3's "
                    f"config; check its spelling or remove it"
                )


def _degrees(par: dict, world: int | None, tp: int, pp: int, cp: int) -> tuple[int, int]:
    """(dp, zero stage) from the replicate and shard degrees (shard -1 = the rest of the world)."""
    replicate, shard = int(par.get("data_parallel_replicate_degree", 1)), int(par.get("data_parallel_shard_degree", -1))
    if shard == -1:
        if world is None:
            raise StratagemError(
                "torchtitan's data_parallel_shard_degree is -1 (the rest of the GPUs) and the GPU "
                "count is unknown; pass --gpus N"
            )
        if world % (replicate * tp * pp * cp):
            raise StratagemError(
                f"{world} GPUs do not divide into parallelism degrees replicate {replicate} x tp "
                f"{tp} x pp {pp} x cp {cp}; fix the config or --gpus"
            )
        shard = world // (replicate * tp * pp * cp)
    dp = replicate * shard
    if world is not None and dp * tp * pp * cp != world:
        raise StratagemError(
            f"torchtitan degrees give {dp * tp * pp * cp} GPUs (replicate {replicate} x shard {shard} "
            f"x tp {tp} x pp {pp} x cp {cp}) but the run has {world}; fix the degrees or --gpus"
        )
    if shard == 1 and "fsdp_reshard_after_forward" not in par:  # DDP (FSDP2 over one rank when it is set)
        return dp, 0
    return dp, 2 if par.get("fsdp_reshard_after_forward") == "never" else 3


def parse(text: str, *, world_size: int | None = None, layers: int | None = None) -> FrameworkSettings:
    """Settings from a torchtitan 0.3 Python config (or a <= 0.2 TOML file); ``layers``: the model's
    transformer layers (torchtitan keeps them in the model config, not here)."""
    looks_python = "def " in text or "import " in text
    sections, stated = (_sections_from_python if looks_python else _sections_from_toml)(text)
    _check_keys(sections)
    par, training = sections.get("parallelism", {}), sections.get("training", {})
    world = world_size or stated
    tp, pp = int(par.get("tensor_parallel_degree", 1)), int(par.get("pipeline_parallel_degree", 1))
    cp = int(par.get("context_parallel_degree", 1))
    dp, zero = _degrees(par, world, tp, pp, cp)
    local = int(training.get("local_batch_size", 8))
    mb = int(par.get("pipeline_parallel_microbatch_size", 1)) if pp > 1 else local
    gb = int(training.get("global_batch_size", -1))
    gb = local * dp if gb == -1 else gb
    names = {v: k for k, v in SCHEDULES.items()}
    kind = par.get("pipeline_parallel_schedule", "1F1B") if pp > 1 else "1F1B"
    if kind not in names:
        raise StratagemError(
            f"torchtitan parallelism.pipeline_parallel_schedule {kind!r}: Stratagem estimates "
            f"{', '.join(names)}; pick one of them"
        )
    v = 1
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    if per_stage and pp > 1:
        if layers is None:
            raise StratagemError(
                "torchtitan parallelism.pipeline_parallel_layers_per_stage needs the model's layer "
                "count to give virtual stages; pass --model"
            )
        if layers % (pp * int(per_stage)):
            raise StratagemError(
                f"torchtitan parallelism.pipeline_parallel_layers_per_stage {per_stage} does not "
                f"divide {layers} layers over pipeline_parallel_degree {pp}; fix one of them"
            )
        v = layers // (pp * int(per_stage))
    if names[kind] == "interleaved_1f1b" and v < 2:
        raise StratagemError(
            "torchtitan parallelism.pipeline_parallel_schedule Interleaved1F1B: set "
            "parallelism.pipeline_parallel_layers_per_stage so that each rank holds >= 2 stages"
        )
    mode = sections.get("activation_checkpoint", {}).get("mode", "selective")
    settings = FrameworkSettings(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        context_parallel="allgather" if cp > 1 else None,  # torch's context_parallel rotates K/V by all-gather
        ep=int(par.get("expert_parallel_degree", 1)),
        micro_batch=mb,
        global_batch=gb,
        schedule=names[kind] if pp > 1 else "1f1b",
        virtual_stages=v if names[kind] == "interleaved_1f1b" else 1,
        zero_stage=zero,
        sequence_parallel=bool(par.get("enable_sequence_parallel", True)) and tp > 1,
        recompute=mode if mode in ("none", "selective", "full") else "full",
        seq_len=training.get("seq_len"),
        lr_schedule=_schedule(sections, gb),
        weight_decay=sections.get("optimizer", {}).get("weight_decay"),
    )
    check_settings(settings, source=SOURCE, names=KEY_NAMES)
    return settings


def _schedule(sections: dict[str, dict], global_batch: int) -> LRSchedule | None:
    opt, sched = sections.get("optimizer", {}), sections.get("lr_scheduler")
    if sched is None or "lr" not in opt:
        return None
    lr = float(opt["lr"])
    total = int(sched.get("total_steps") or sections.get("training", {}).get("steps", 10000))
    constant = sched.get("decay_ratio") == 0.0
    if not constant and sched.get("decay_type", "linear") != "cosine":
        return None
    return LRSchedule(
        base_lr=lr,
        reference_batch=global_batch,
        warmup_steps=int(sched.get("warmup_steps", 200)),
        warmup_start_lr=0.0,
        decay="constant" if constant else "cosine",
        total_steps=total,
        min_lr=0.0 if constant else lr * float(sched.get("min_lr_factor", 0.0)),
    )
