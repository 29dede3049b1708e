"""Megatron-LM command-line arguments: write them for a plan, read them back from a user's command.

Flag names and meanings: NVIDIA/Megatron-LM ``megatron/training/arguments.py`` and the config dataclasses
it builds flags from (``megatron/training/config/training_config.py``: ``--lr-warmup-init``,
``--lr-decay-style {constant,linear,cosine,inverse-square-root,WSD}``; ``megatron/core``'s
``ModelParallelConfig`` / ``TransformerConfig``: ``--recompute-granularity {full,selective}``,
``--recompute-method {uniform,block}``, ``--recompute-num-layers``) at commit d98e8a64ddf3 (2026-08-22).
Megatron derives the data-parallel size as ``world / (tp x pp x cp)``, so the world size travels beside the
arguments (``WORLD_SIZE_GPUS`` in the fragment, torchrun's ``--nnodes x --nproc-per-node`` in a command, or
the caller's ``--gpus``). The learning rate is Megatron-Core's ``OptimizerParamScheduler`` (warm-up from
``--lr-warmup-init`` to ``--lr``, then cosine to ``--min-lr`` at ``--lr-decay-iters``), the same formulas
as ``planner/plan/recipe.py``.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import overload

from planner.core import StratagemError
from planner.export.settings import FrameworkSettings, check_settings
from planner.model import ModelSpec, parse_model
from planner.plan import LRSchedule, peak_lr

SOURCE = "megatron"
FLAGS_FILE = Path(__file__).with_name("data") / "megatron_flags.txt"
ZERO_FLAGS = {
    1: ["--use-distributed-optimizer"],
    # Megatron-FSDP checkpoints only in its DTensor format (validate_args: "Megatron-FSDP requires the
    # `fsdp_dtensor` checkpointing format")
    2: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--ckpt-format", "fsdp_dtensor"],
    3: [
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--ckpt-format",
        "fsdp_dtensor",
    ],
}
SHARDING_ZERO = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
FLAG_NAMES = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "micro_batch": "--micro-batch-size",
    "global_batch": "--global-batch-size",
    "sequence_parallel": "--sequence-parallel",
    "virtual_stages": "--num-layers-per-virtual-pipeline-stage",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
}
# launcher options whose value is the next token (torchrun / python -m torch.distributed.run)
_LAUNCHER_NODES = ("--nnodes",)
_LAUNCHER_PER_NODE = ("--nproc-per-node", "--nproc_per_node")


@lru_cache(maxsize=1)
def known_flags() -> frozenset[str]:
    """Every flag Megatron-LM's parser accepts (planner/export/data/megatron_flags.txt, tools/megatron_flags.py)."""
    lines = FLAGS_FILE.read_text(encoding="utf-8").splitlines()
    return frozenset(line.strip() for line in lines if line.startswith("--"))


# -- export -----------------------------------------------------------------------------------------
def to_items(s: FrameworkSettings) -> dict[str, str | None]:
    """Flag -> value (``None`` for a switch), in the order they are written."""
    items: dict[str, str | None] = {
        "--tensor-model-parallel-size": str(s.tp),
        "--pipeline-model-parallel-size": str(s.pp),
    }
    layers = int(s.model.dim("layers")) if s.model is not None else None
    if s.virtual_stages > 1:
        if layers is not None and layers % (s.pp * s.virtual_stages) == 0:
            items["--num-layers-per-virtual-pipeline-stage"] = str(layers // (s.pp * s.virtual_stages))
        else:
            items["--num-virtual-stages-per-pipeline-rank"] = str(s.virtual_stages)
    if s.first_chunk_blocks is not None:
        items["--decoder-first-pipeline-num-layers"] = str(s.first_chunk_blocks)
    if s.last_chunk_blocks is not None:
        items["--decoder-last-pipeline-num-layers"] = str(s.last_chunk_blocks)
    items.update(_context_and_expert_items(s))
    if s.sequence_parallel:
        items["--sequence-parallel"] = None
    if s.recompute != "none":
        items["--recompute-granularity"] = s.recompute
    if s.recompute == "full":
        block = s.recompute_blocks_per_chunk is not None
        items["--recompute-method"] = "block" if block else "uniform"
        items["--recompute-num-layers"] = str(s.recompute_blocks_per_chunk if block else 1)
    flags = ZERO_FLAGS.get(s.zero_stage, [])
    for i, flag in enumerate(flags):
        if flag.startswith("--"):
            items[flag] = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
    if s.overlap_grad_reduce:
        items["--overlap-grad-reduce"] = None
    items["--micro-batch-size"] = str(s.micro_batch)
    items["--global-batch-size"] = str(s.global_batch)
    items.update(_model_items(s.model, s.seq_len))
    if s.dtype in ("bf16", "fp16"):
        items[f"--{s.dtype}"] = None
    items.update(_recipe_items(s.lr_schedule, s.global_batch, s.weight_decay))
    return items


def _context_and_expert_items(s: FrameworkSettings) -> dict[str, str | None]:
    """Context-parallel, flash-attention and expert-parallel flags (each only where it applies)."""
    items: dict[str, str | None] = {}
    if s.cp > 1:
        items["--context-parallel-size"] = str(s.cp)
        items["--cp-comm-type"] = CP_COMM_TYPES[s.context_parallel or "ring"]
    if s.flash_attention:
        items["--use-flash-attn"] = None
    if s.ep > 1:
        items["--expert-model-parallel-size"] = str(s.ep)
    if s.model is not None and s.model.is_moe:  # Megatron's default expert TP is the attention's tp
        items["--expert-tensor-parallel-size"] = str(s.etp)
    return items


def _moe_items(model: ModelSpec) -> dict[str, str | None]:
    """Megatron-Core MoE flags of an ``moe`` model (megatron/core/transformer/moe/README.md argument table):
    experts, top-k, expert width, shared experts, the leading dense layers as ``--moe-layer-freq``, the
    load-balancing loss, the capacity factor (none = dropless), grouped GEMM and the all-to-all dispatcher."""
    dim = model.dim
    items: dict[str, str | None] = {
        "--num-experts": str(dim("experts")),
        "--moe-router-topk": str(dim("top_k")),
        "--moe-ffn-hidden-size": str(dim("expert_ffn")),
        "--moe-router-load-balancing-type": "aux_loss",
        "--moe-aux-loss-coeff": f"{float(dim('aux_loss_coef')):g}",
        "--moe-grouped-gemm": None,
        "--moe-token-dispatcher-type": "alltoall",
    }
    if int(dim("shared_experts")):
        items["--moe-shared-expert-intermediate-size"] = str(int(dim("shared_experts")) * int(dim("expert_ffn")))
    dense, layers = int(dim("dense_layers")), int(dim("layers"))
    if dense:
        items["--moe-layer-freq"] = f"([0]*{dense}+[1]*{layers - dense})"
    if float(dim("capacity_factor")) > 0:
        items["--moe-expert-capacity-factor"] = f"{float(dim('capacity_factor')):g}"
    return items


def _model_items(model: ModelSpec | None, seq_len: int | None) -> dict[str, str | None]:
    if model is None:
        return {}
    dim = model.dim
    items: dict[str, str | None] = {
        "--num-layers": str(dim("layers")),
        "--hidden-size": str(dim("hidden")),
        "--num-attention-heads": str(dim("heads")),
    }
    if dim("ffn_hidden"):
        items["--ffn-hidden-size"] = str(dim("ffn_hidden"))
    if model.family in ("llama", "moe"):
        if dim("kv_heads") and dim("kv_heads") != dim("heads"):
            items.update({"--group-query-attention": None, "--num-query-groups": str(dim("kv_heads"))})
        items.update(
            {
                "--swiglu": None,
                "--normalization": "RMSNorm",
                "--position-embedding-type": "rope",
                "--disable-bias-linear": None,
            }
        )
    if model.is_moe:
        items.update(_moe_items(model))
    if not dim("tie_embeddings"):
        items["--untie-embeddings-and-output-weights"] = None
    items["--seq-length"] = str(seq_len or dim("max_seq"))
    items["--max-position-embeddings"] = str(max(int(seq_len or 0), int(dim("max_seq"))))
    items["--vocab-size"] = str(dim("vocab"))
    return items


def _recipe_items(schedule: LRSchedule | None, global_batch: int, weight_decay: float | None) -> dict[str, str | None]:
    items: dict[str, str | None] = {}
    if weight_decay is not None:
        items["--weight-decay"] = f"{weight_decay:g}"
    if schedule is None:
        return items
    items.update(
        {
            "--lr": f"{peak_lr(schedule, global_batch=global_batch):.10g}",
            "--lr-decay-style": schedule.decay,
            "--train-iters": str(schedule.total_steps),
            "--lr-decay-iters": str(schedule.total_steps),
        }
    )
    if schedule.decay == "cosine":
        items["--min-lr"] = f"{schedule.min_lr:.10g}"
    if schedule.warmup_steps:
        items["--lr-warmup-iters"] = str(schedule.warmup_steps)
        items["--lr-warmup-init"] = f"{schedule.warmup_start_lr:.10g}"
    return items


def render(s: FrameworkSettings, *, header: list[str]) -> str:
    """A shell fragment: ``WORLD_SIZE_GPUS`` and ``MEGATRON_ARGS`` for ``pretrain_gpt.py``."""
    lines = [f"# {h}" for h in header]
    nodes = (
        f"--nnodes {s.world_size // 8} --nproc-per-node 8"
        if s.world_size % 8 == 0
        else f"--nproc-per-node {s.world_size}"
    )
    lines += [
        f"# world size {s.world_size} = tp {s.tp} x pp {s.pp} x dp {s.dp}"
        + (f" x cp {s.cp}" if s.cp > 1 else "")
        + " (Megatron derives dp from the world size)",
        f"# run: torchrun {nodes} pretrain_gpt.py $MEGATRON_ARGS <data, tokenizer and checkpoint flags>",
    ]
    if (s.tp > 1 or s.cp > 1) and s.zero_stage < 2:
        # validate_args on GPUs before Blackwell: TP or CP needs one CUDA connection (kernel order for the overlap
        # of TP/CP communication); Megatron-FSDP (ZeRO 2/3 here) needs more than one, so it is left unset there
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1")
    lines += [
        f"WORLD_SIZE_GPUS={s.world_size}",
        'MEGATRON_ARGS="',
    ]
    for flag, value in to_items(s).items():
        lines.append(f"  {flag}" + ("" if value is None else f" {value}"))
    lines.append('"')
    return "\n".join(lines) + "\n"


# -- import -----------------------------------------------------------------------------------------
def _tokens(text: str) -> tuple[list[str], int | None]:
    """Argument tokens and the world size the text states (fragment variable or torchrun options)."""
    world = None
    match = re.search(r"^\s*WORLD_SIZE_GPUS=(\d+)\s*$", text, flags=re.M)
    if match:
        world = int(match.group(1))
    body = re.search(r'MEGATRON_ARGS="(.*?)"', text, flags=re.S)
    text = body.group(1) if body else text
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise StratagemError(f"cannot split the Megatron command into arguments ({exc}); check its quotes") from None
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    if script is not None:
        launcher, tokens = tokens[:script], tokens[script + 1 :]
        nodes, per_node = _launcher_value(launcher, _LAUNCHER_NODES), _launcher_value(launcher, _LAUNCHER_PER_NODE)
        if per_node:
            world = int(nodes or 1) * int(per_node)
    return tokens, world


def _launcher_value(tokens: list[str], names: tuple[str, ...]) -> str | None:
    """The value of a torchrun option (``--name V`` or ``--name=V``; for ``--nnodes MIN:MAX`` the MAX)."""
    for i, t in enumerate(tokens):
        for name in names:
            if t == name and i + 1 < len(tokens):
                return tokens[i + 1].split(":")[-1]
            if t.startswith(name + "="):
                return t.split("=", 1)[1].split(":")[-1]
    return None


def parse_args(text: str) -> dict[str, str | None]:
    """``{flag: value or None}`` of a Megatron argument string; an unknown flag is an error naming it."""
    tokens, _ = _tokens(text)
    return _parse_tokens(tokens)


def _parse_tokens(tokens: list[str]) -> dict[str, str | None]:
    known, i = known_flags(), 0
    out: dict[str, str | None] = {}
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise StratagemError(
                f"Megatron argument {token!r} is not a flag (expected --name [value]); check the quoting of the command"
            )
        flag, _, inline = token.partition("=")
        if flag not in known:
            raise StratagemError(
                f"unknown Megatron-LM flag {flag}: not an argument of megatron/training/arguments.py "
                f"(Megatron-LM d98e8a64); check its spelling or remove it"
            )
        if inline:
            out[flag] = inline
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[flag] = tokens[i + 1]
            i += 1
        else:
            out[flag] = None
        i += 1
    return out


@overload
def _int(args: dict[str, str | None], flag: str, default: int) -> int: ...
@overload
def _int(args: dict[str, str | None], flag: str, default: None = None) -> int | None: ...
def _int(args: dict[str, str | None], flag: str, default: int | None = None) -> int | None:
    if flag not in args:
        return default
    value = args[flag]
    if value is not None:
        try:
            return int(value)
        except ValueError:
            pass
    raise StratagemError(f"Megatron flag {flag} needs an integer, got {value!r}")


@overload
def _float(args: dict[str, str | None], flag: str, default: float) -> float: ...
@overload
def _float(args: dict[str, str | None], flag: str, default: None = None) -> float | None: ...
def _float(args: dict[str, str | None], flag: str, default: float | None = None) -> float | None:
    if flag not in args:
        return default
    value = args[flag]
    if value is not None:
        try:
            return float(value)
        except ValueError:
            pass
    raise StratagemError(f"Megatron flag {flag} needs a number, got {value!r}")


def _model(args: dict[str, str | None]) -> ModelSpec | None:
    if "--num-layers" not in args or "--hidden-size" not in args or "--num-attention-heads" not in args:
        return None
    llama = (
        "--swiglu" in args
        or args.get("--normalization") == "RMSNorm"
        or args.get("--position-embedding-type") == "rope"
    )
    moe = _int(args, "--num-experts") is not None
    family = "moe" if moe else "llama" if llama else "gpt"
    seq = _int(args, "--seq-length") or _int(args, "--max-position-embeddings")
    dims = dict(
        layers=_int(args, "--num-layers"),
        hidden=_int(args, "--hidden-size"),
        heads=_int(args, "--num-attention-heads"),
        ffn_hidden=_int(args, "--ffn-hidden-size"),
        vocab=_int(args, "--vocab-size", 32000 if llama else 51200),
        max_seq=seq,
        tie_embeddings="--untie-embeddings-and-output-weights" not in args,
    )
    if llama or moe:
        dims["kv_heads"] = _int(args, "--num-query-groups") if "--group-query-attention" in args else None
    if moe:
        dims.update(_moe_dims(args, dims))
    return parse_model(family, **dims)


def _moe_dims(args: dict[str, str | None], dims: dict) -> dict:
    """The ``moe`` dimensions of Megatron-Core MoE flags (the inverse of :func:`_moe_items`)."""
    expert_ffn = _int(args, "--moe-ffn-hidden-size", dims.get("ffn_hidden") or 4 * int(dims["hidden"]))
    shared = _int(args, "--moe-shared-expert-intermediate-size", 0)
    if shared % expert_ffn:
        raise StratagemError(
            f"--moe-shared-expert-intermediate-size {shared} is not a whole number of experts of "
            f"--moe-ffn-hidden-size {expert_ffn}; the moe family states shared experts of the routed width"
        )
    freq = (args.get("--moe-layer-freq") or "").replace(" ", "")
    dense = 0
    if freq and freq != "1":
        match = re.fullmatch(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?", freq)
        if match is None:
            raise StratagemError(
                f"--moe-layer-freq {freq!r}: the moe family states leading dense layers only, as ([0]*N+[1]*M)"
            )
        dense = int(match.group(1))
    out: dict = dict(
        experts=_int(args, "--num-experts"),
        top_k=_int(args, "--moe-router-topk", 2),
        expert_ffn=expert_ffn,
        shared_experts=shared // expert_ffn,
        dense_layers=dense,
        aux_loss_coef=_float(args, "--moe-aux-loss-coeff", 0.0),
    )
    capacity = _float(args, "--moe-expert-capacity-factor")
    if capacity is not None:
        out["capacity_factor"] = capacity
    return out


def _zero(args: dict[str, str | None]) -> int:
    if "--use-megatron-fsdp" in args or "--use-torch-fsdp2" in args:
        strategy = args.get("--data-parallel-sharding-strategy") or "optim_grads_params"
        if strategy not in SHARDING_ZERO:
            raise StratagemError(
                f"Megatron flag --data-parallel-sharding-strategy {strategy!r}: expected one of "
                f"{', '.join(SHARDING_ZERO)}"
            )
        return SHARDING_ZERO[strategy]
    return 1 if "--use-distributed-optimizer" in args else 0


def _recompute(args: dict[str, str | None], layers_per_chunk: int | None) -> dict:
    granularity = args.get("--recompute-granularity") or ("selective" if "--recompute-activations" in args else None)
    if granularity is None:
        return {}
    if granularity not in ("full", "selective"):
        raise StratagemError(f"Megatron flag --recompute-granularity {granularity!r}: expected full or selective")
    if granularity == "selective":
        return {"recompute": "selective"}
    method = args.get("--recompute-method") or "uniform"
    if method not in ("uniform", "block"):
        raise StratagemError(f"Megatron flag --recompute-method {method!r}: expected uniform or block")
    count = _int(args, "--recompute-num-layers", 1)
    if method == "block" and (layers_per_chunk is None or count < layers_per_chunk):
        return {"recompute": "full", "recompute_blocks_per_chunk": count}
    return {"recompute": "full"}


def _schedule(args: dict[str, str | None], s_global: int) -> LRSchedule | None:
    """The recipe the flags state (iterations, or samples / global batch as Megatron converts them)."""
    if "--lr" not in args:
        return None
    style = args.get("--lr-decay-style") or "linear"
    if style not in ("cosine", "constant"):
        return None  # linear / inverse-square-root / WSD: not part of the recipe; the estimate does not need it

    def steps(iters_flag: str, samples_flag: str) -> int | None:
        if iters_flag in args:
            return _int(args, iters_flag)
        samples = _int(args, samples_flag)
        return samples // s_global if samples is not None else None

    total = steps("--lr-decay-iters", "--lr-decay-samples") or steps("--train-iters", "--train-samples")
    if total is None:
        return None
    return LRSchedule(
        base_lr=_float(args, "--lr"),
        reference_batch=s_global,
        decay=style,
        warmup_steps=steps("--lr-warmup-iters", "--lr-warmup-samples") or 0,
        total_steps=total,
        warmup_start_lr=_float(args, "--lr-warmup-init", 0.0),
        min_lr=_float(args, "--min-lr", 0.0),
    )


# Megatron-Core's --cp-comm-type (context parallelism user guide): p2p = ring point-to-point overlapped with
# blockwise attention, all_gather = all-gather K/V (Llama 3's); its a2a / a2a+p2p are priced as the ring here.
CP_COMM_TYPES = {"ring": "p2p", "allgather": "all_gather"}


def _cp_mode(args: dict) -> str:
    return "allgather" if args.get("--cp-comm-type") == "all_gather" else "ring"  # Megatron's default: p2p


def parse(text: str, *, world_size: int | None = None) -> FrameworkSettings:
    """Settings from a Megatron command, argument string or exported fragment (``world_size``: GPUs)."""
    tokens, stated_world = _tokens(text)
    args = _parse_tokens(tokens)
    world = world_size or stated_world
    tp, pp = _int(args, "--tensor-model-parallel-size", 1), _int(args, "--pipeline-model-parallel-size", 1)
    cp = _int(args, "--context-parallel-size", 1)
    if world is None:
        raise StratagemError(
            "the Megatron arguments do not state the GPU count (Megatron derives the data-parallel "
            "size from it); pass --gpus N"
        )
    if world % (tp * pp * cp):
        raise StratagemError(
            f"{world} GPUs do not divide into --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}; fix the degrees "
            f"or --gpus"
        )
    dp = world // (tp * pp * cp)
    model = _model(args)
    mb = _int(args, "--micro-batch-size")
    if mb is None:
        raise StratagemError("the Megatron arguments lack --micro-batch-size; add it")
    gb = _int(args, "--global-batch-size", mb * dp)
    layers = int(model.dim("layers")) if model is not None else None
    v = _int(args, "--num-virtual-stages-per-pipeline-rank", 1)
    per = _int(args, "--num-layers-per-virtual-pipeline-stage")
    if per is not None:
        if layers is None or per < 1 or layers % (pp * per):
            raise StratagemError(
                f"--num-layers-per-virtual-pipeline-stage {per} does not divide --num-layers "
                f"{layers} over --pipeline-model-parallel-size {pp}; fix one of them"
            )
        v = layers // (pp * per)
    chunk = layers // (pp * v) if layers is not None and layers % (pp * v) == 0 else None
    dtype = "bf16" if "--bf16" in args else "fp16" if "--fp16" in args else "fp32"
    settings = FrameworkSettings(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=_int(args, "--expert-model-parallel-size", 1),
        etp=_int(args, "--expert-tensor-parallel-size", tp) if model is not None and model.is_moe else 1,
        micro_batch=mb,
        global_batch=gb,
        schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v,
        first_chunk_blocks=_int(args, "--decoder-first-pipeline-num-layers"),
        last_chunk_blocks=_int(args, "--decoder-last-pipeline-num-layers"),
        zero_stage=_zero(args),
        sequence_parallel="--sequence-parallel" in args,
        **_recompute(args, chunk),
        overlap_grad_reduce="--overlap-grad-reduce" in args,
        seq_len=_int(args, "--seq-length"),
        dtype=dtype,
        model=model,
        lr_schedule=_schedule(args, gb),
        weight_decay=_float(args, "--weight-decay"),
        context_parallel=_cp_mode(args) if cp > 1 else None,
        flash_attention="--use-flash-attn" in args or args.get("--attention-backend") == "flash",
    )
    check_settings(settings, source="Megatron arguments", names=FLAG_NAMES)
    return settings
