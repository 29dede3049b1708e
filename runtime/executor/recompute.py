"""Activation recompute per module path: ``apply_ac``. The three modes mean what the cost model charges
(``planner.cost.compute.layer_cost``; ``tests/test_saved_bytes.py`` holds the two to the same bytes):

- ``none``: autograd keeps everything the block's backward needs (Korthikanti et al. 2022, arXiv:2205.05198,
  §4.1: ``34 sbh + 5 as^2b`` bytes per GPT block in 16 bits with dropout).
- ``full``: the whole module is checkpointed; only its input is kept and its forward is re-run during
  backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
- ``selective``: only the attention core — QK^T, softmax, dropout, @V — is checkpointed: q, k and v are kept and
  the ``as^2b`` score tensors are rebuilt in backward (Korthikanti et al. §5; Megatron-LM's
  ``checkpoint_core_attention``). Fused (flash) attention keeps no score tensor, so there selective recompute
  frees nothing and costs nothing, and the block runs as with ``none``; so does a block without attention.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from planner.core import StratagemError
from runtime.executor.stage import replace_module
from runtime.models.attention import RECOMPUTE_ATTR, RECOMPUTE_MARK, mark_attention


def apply_selective_recompute(module: nn.Module) -> list[str]:
    """Make every attention of ``module`` recompute its math core in backward; returns their paths (relative).

    The zoo's attention modules and the ``hf:`` wrapper's blocks declare ``recompute_scores`` (read by
    :func:`runtime.models.attention.attend`); the ``hf:`` attention function reads the mark on its submodule.
    """
    return mark_attention(module, attr=RECOMPUTE_ATTR, mark=RECOMPUTE_MARK, value=True)


def apply_ac(model: nn.Module, recompute: Mapping[str, str]) -> list[str]:
    """Apply each module's recompute (path -> ``none``/``selective``/``full``) in place; returns the paths
    recomputed (``full``: wrapped in a checkpoint; ``selective``: holding an attention whose core is recomputed).

    Paths absent from ``model`` (held by another stage) are skipped. The wrapper keeps parameter names in state
    dicts (torch strips its ``_checkpoint_wrapped_module``).
    """
    done = []
    for path, mode in recompute.items():
        if mode not in ("none", "selective", "full"):
            raise StratagemError(f"recompute mode {mode!r} of {path}: use none, selective or full")
        if mode == "none":
            continue
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if module is None:
            continue
        if mode == "full":
            replace_module(model, path, checkpoint_wrapper(module, preserve_rng_state=True))
            done.append(path)
        elif apply_selective_recompute(module):
            done.append(path)
    return done
