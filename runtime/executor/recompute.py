"""Activation recompute per module path: ``apply_ac``.

- ``full``: the whole module is checkpointed; only its input is kept and its forward is re-run during
  backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
- ``selective``: torch's selective activation checkpointing keeps the outputs of the matmul and
  attention kernels and recomputes the cheap element-wise/normalisation ops around them — the op-level
  variant torchtitan ships (``_save_list`` in torchtitan/models/llama3/infra/parallelize.py); it is in
  the spirit of Korthikanti et al. 2022 (arXiv:2205.05198) §4.1 (recompute what is cheap per byte saved).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from runtime.executor.stage import replace_module

# Ops whose outputs selective recompute keeps (the expensive ones); everything else is recomputed.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ARG001 - torch policy API
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_ac(model: nn.Module, recompute: Mapping[str, str]) -> list[str]:
    """Wrap each module named in ``recompute`` (path -> ``none``/``selective``/``full``) in place.

    Paths absent from ``model`` (held by another stage) are skipped. Returns the paths wrapped.
    The wrapper keeps parameter names in state dicts (torch strips its ``_checkpoint_wrapped_module``).
    """
    wrapped = []
    for path, mode in recompute.items():
        if mode == "none":
            continue
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if module is None:
            continue
        if mode == "full":
            new = checkpoint_wrapper(module, preserve_rng_state=True)
        else:
            new = checkpoint_wrapper(module, context_fn=_selective_context, preserve_rng_state=True)
        replace_module(model, path, new)
        wrapped.append(path)
    return wrapped
