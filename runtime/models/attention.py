"""Causal attention for the zoo and ``hf:`` models: fused SDPA or explicit math, chosen per plan.

- **fused** (the plan's ``flash_attention: true``): ``torch.nn.functional.scaled_dot_product_attention`` with
  ``is_causal`` (or a boolean mask where the visible keys are not a plain causal triangle: context-parallel
  shards, sliding windows) and ``enable_gqa`` for grouped-query attention. On CUDA torch picks its flash or
  memory-efficient kernel, on CPU ``_scaled_dot_product_flash_attention_for_cpu``; no (s x s) score tensor is
  kept for the backward (Dao et al. 2022, FlashAttention).
- **math** (``flash_attention: false``): QK^T * scale + additive causal mask, softmax, dropout, @V, which saves
  the tensors Korthikanti et al. 2022 (arXiv:2205.05198) §4.1 count; kept for exact parity tests.

FLOPs and saved bytes of either path come from the cost model's analytic formulas (``planner.cost``), never
from the kernel. Inputs are (batch, heads, seq, head_dim); key/value may have fewer heads (GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FUSED_ATTR = "fused_attention"  # instance attribute of every module whose attention the plan chooses
FUSED_MARK = "_stratagem_fused"  # the same choice on each submodule (the hf: attention function reads it)


def causal_bias(seq_len: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(s, s) additive mask: 0 on and below the diagonal, -inf above (a constant; autograd saves nothing)."""
    return torch.full((seq_len, seq_len), float("-inf"), device=device, dtype=dtype).triu(1)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout saving a 1-byte bool mask, as the fused CUDA kernel does; no-op when p == 0 or in eval mode.

    ``F.dropout`` on CPU and meta saves a mask in the input dtype instead; ``native_dropout`` keeps the
    memory accounting equal to GPU training (Korthikanti et al. 2022 §4.1 count masks as 1 byte).
    """
    return torch.native_dropout(x, p, True)[0] if p > 0 and training else x


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    fused: bool,
    scale: float,
    dropout_p: float = 0.0,
    training: bool = False,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale, causal) v over (b, heads, s_q, d) queries and (b, kv heads, s_k, d) keys/values.

    ``visible``: a boolean (s_q, s_k) mask of the keys each query sees; None = the causal triangle (s_q == s_k).
    Each key/value head serves ``heads / kv heads`` consecutive query heads (Ainslie et al. 2023, GQA).
    """
    p = dropout_p if training else 0.0
    if fused:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=visible,
            dropout_p=p,
            is_causal=visible is None,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if visible is None:
        bias = causal_bias(q.shape[-2], device=q.device, dtype=q.dtype)
    else:
        bias = torch.zeros((), device=q.device, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    probs = torch.softmax((q @ k.transpose(-2, -1)) * scale + bias, dim=-1)
    return dropout(probs, p, training) @ v


def apply_attention(model: nn.Module, *, fused: bool) -> list[str]:
    """Set every attention module of ``model`` to the fused (SDPA) or math path; returns their paths.

    The zoo's attention modules, and the ``hf:`` wrapper's blocks, declare the instance attribute
    ``fused_attention``; wrappers (checkpoint, FSDP, compile) do not, so each module is set once.
    """
    done = []
    for path, module in model.named_modules():
        if FUSED_ATTR in vars(module):
            setattr(module, FUSED_ATTR, fused)
            for sub in module.modules():
                object.__setattr__(sub, FUSED_MARK, fused)
            done.append(path)
    return done
