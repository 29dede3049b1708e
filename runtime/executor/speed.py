"""How a chunk is made fast: the precision scheme, the optimizer's kernel and ``torch.compile`` per block.

**Precision** (the plan's ``training.dtype``), per layout, as torchtitan does it where torch allows:

- fp32 / tf32 plans -> ``fp32``: fp32 weights and compute (tf32: TF32 matmuls on CUDA).
- bf16, ZeRO 1-3 over dp x cp > 1, dense models -> ``fsdp-bf16``: FSDP2
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. FSDP2 casts each unit's sharded fp32 weights to
  bf16 once per all-gather; compute, activations and saved tensors are bf16; gradients are reduced and kept in
  fp32 next to the fp32 master weights and AdamW state (torchtitan's default).
- bf16 on one rank, dense models -> ``bf16-master``: the model's weights, activations and gradients are bf16 and
  the optimizer (:class:`runtime.executor.master_adamw.MasterAdamW`) keeps fp32 master weights next to AdamW's
  fp32 moments, updating both and writing the bf16 weights back in one fused kernel per parameter on CUDA:
  no cast kernel in the step (Megatron-LM's mixed-precision layout). Measured on one H200 against autocast:
  ``benchmarks/data/h200`` (``benchmarks/gpu_speed.py``).
- bf16 on TP / PP without ZeRO, ZeRO 0 over dp > 1, or an MoE -> ``autocast``: ``torch.autocast(bf16)`` over fp32
  weights. Nothing else in torch keeps fp32 master weights there: an FSDP2 policy needs a ``fully_shard`` unit,
  ``replicate`` keeps the module's dtype, and an MoE's experts stay outside the FSDP units (their own group).
  torchtitan too falls back to autocast when FSDP is off. Compiled blocks fuse autocast's activation casts; the
  per-step weight and gradient casts stay (4-7 % of device time on one H200, ``benchmarks/data/h200``).

**Optimizer**: AdamW with ``fused=True`` on CUDA (one kernel for all parameters, Apex/torchtitan's choice) and
``foreach=True`` elsewhere; a chunk mixing DTensor and plain parameters gets one parameter group of each (the
multi-tensor kernels take one kind per list).

**Compile**: each transformer block is compiled in place (``nn.Module.compile``, so parameter names and DCP keys
do not change) after TP and activation checkpointing and before FSDP — torchtitan's order
(``apply_tp -> apply_ac -> apply_compile -> apply_fsdp``). Default on for CUDA, off for CPU (``launch --compile``);
on one rank the compiled blocks also replay as CUDA graphs (:func:`compile_mode`);
torch's dynamo falls back to eager for a block it cannot compile (``suppress_errors``) and
:func:`report_compile` turns that into one warning naming the fallback.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from planner.core import StratagemError
from planner.plan import Plan
from runtime.executor.checks import expert_layout, is_moe

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", "on", "off")


def precision_scheme(plan: Plan) -> str:
    """The scheme ``plan`` trains with (module docstring): ``fp32``, ``fsdp-bf16``, ``bf16-master``
    or ``autocast``."""
    if plan.training.dtype != "bf16":
        return "fp32"
    shards = plan.mesh.size("dp") * plan.mesh.size("cp") > 1 and plan.zero_stage >= 1
    lay = expert_layout(plan)
    experts_apart = is_moe(plan) or lay.ep > 1 or lay.etp > 1  # experts outside the FSDP units (their own group)
    if shards and not experts_apart:
        return "fsdp-bf16"
    if plan.world_size == 1 and not experts_apart:
        return "bf16-master"
    return "autocast"


def autocast_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype the step runs under ``torch.autocast`` (None: no autocast)."""
    return torch.bfloat16 if precision_scheme(plan) == "autocast" else None


def fsdp_mp_policy(plan: Plan):
    """FSDP2's mixed-precision policy for ``plan`` (None: FSDP2's default, the weights' own dtype)."""
    if precision_scheme(plan) != "fsdp-bf16":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def weight_dtype(plan: Plan) -> torch.dtype:
    """The dtype the model's parameters are kept in (bf16 only under ``bf16-master``)."""
    return torch.bfloat16 if precision_scheme(plan) == "bf16-master" else torch.float32


def build_optimizer(
    module: nn.Module, *, lr: float, weight_decay: float, device: torch.device, master_weights: bool = False
):
    """AdamW over ``module``'s parameters: fused kernel on CUDA, multi-tensor (foreach) elsewhere;
    ``master_weights`` (``bf16-master``): :class:`~runtime.executor.master_adamw.MasterAdamW`."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if p.requires_grad]
    if master_weights:
        from runtime.executor.master_adamw import MasterAdamW

        return MasterAdamW(params, lr=lr, weight_decay=weight_decay)
    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (dtensors, plain) if g] if dtensors and plain else params
    kernel: dict[str, Any] = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, **kernel)


def check_attention_kernel(plan: Plan, device: torch.device) -> str | None:
    """A warning line when the plan asks for fused attention that this torch build cannot give on ``device``
    (CUDA without the flash kernel: SDPA then picks its memory-efficient or math kernel)."""
    if not plan.flash_attention or device.type != "cuda":
        return None
    if torch.backends.cuda.is_flash_attention_available():
        return None
    msg = (
        "flash_attention: this torch build has no CUDA flash-attention kernel; SDPA runs its memory-efficient or "
        "math kernel (slower, and the math kernel keeps the s x s scores the plan did not price)"
    )
    log.warning(msg)
    return msg


def resolve_compile(choice: str, device: torch.device) -> bool:
    """``auto`` -> on for CUDA, off for CPU. ``on`` on a CPU without a C++ compiler (inductor needs one) warns
    once and runs uncompiled."""
    if choice == "off" or (choice == "auto" and device.type != "cuda"):
        return False
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        log.warning("--compile: no C++ compiler on this machine (torch inductor needs one); running uncompiled")
        return False
    return True


COMPILE_MODE_ENV = "STRATAGEM_COMPILE_MODE"  # overrides torch.compile's mode for the blocks
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode(plan: Plan, device: torch.device) -> str | None:
    """``torch.compile``'s ``mode`` for compiled blocks: ``reduce-overhead`` (each compiled block replays as a CUDA
    graph) for a one-rank plan with one micro-batch per step on CUDA, torch's default elsewhere;
    ``$STRATAGEM_COMPILE_MODE`` overrides.

    Why there: the step is one forward and one backward through the blocks, and measured host-bound without
    graphs: gpt2-large at micro-batch 4 on one H200 kept its GPU busy 50 ms of a 96 ms step
    (the launches of 36 blocks' kernels), and 53 ms with graphs (``benchmarks/data/h200``). With FSDP, TP or
    pipeline stages, collectives and hooks sit between and inside the blocks, which CUDA graphs do not take; with
    several micro-batches the gradients of one accumulate while the graphs of the next replay, which no GPU run
    here has checked (one try on an H200 failed, its error unseen), so those keep torch's default."""
    mode = os.environ.get(COMPILE_MODE_ENV) or None
    if mode is not None and mode not in COMPILE_MODES:
        raise StratagemError(f"{COMPILE_MODE_ENV}={mode!r}: use one of {', '.join(COMPILE_MODES)}, or unset it")
    if mode is None and device.type == "cuda" and plan.world_size == 1 and plan.schedule.max_micro_batches == 1:
        return "reduce-overhead"
    return None if mode == "default" else mode


def _configure_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a block dynamo cannot take runs eagerly (report_compile warns)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


def apply_compile(model: nn.Module, block_paths: Iterable[str], mode: str | None = None) -> list[str]:
    """Compile each block of ``block_paths`` present in ``model`` in place with torch.compile's ``mode``
    (:func:`compile_mode`); returns the paths compiled."""
    _configure_dynamo()
    done = []
    for path in block_paths:
        try:
            block = model.get_submodule(path)
        except AttributeError:
            continue
        block.compile(mode=mode)
        done.append(path)
    return done


def compile_loss(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """``loss`` compiled (when blocks are compiled and the logits are plain tensors): inductor reads the bf16
    logits and computes the fp32 log-softmax in one kernel, where eager first writes an fp32 copy of the logits
    (4.5 ms of a Llama-3-8B-shaped step at sequence 8,192 on one H200, ``benchmarks/data/h200``)."""
    _configure_dynamo()
    return torch.compile(loss, dynamic=False)


def report_compile(compiled: list[str]) -> str | None:
    """After the first step: one warning line when dynamo ran any compiled block's frames eagerly."""
    if not compiled:
        return None
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    total, ok = frames.get("total", 0), frames.get("ok", 0)
    if total and ok < total:
        msg = (
            f"torch.compile compiled {ok} of {total} frames of {len(compiled)} blocks; the rest run uncompiled "
            "(graph breaks or a compiler error: TORCH_LOGS=graph_breaks shows why; --no-compile silences this)"
        )
        log.warning(msg)
        return msg
    return None
