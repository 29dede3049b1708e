"""Causal attention for the zoo and ``hf:`` models: fused SDPA or explicit math, chosen per plan.

- **fused** (the plan's ``flash_attention: true``): ``torch.nn.functional.scaled_dot_product_attention`` with
  ``is_causal`` (or a boolean mask where the visible keys are not a plain causal triangle: context-parallel
  shards, sliding windows) and ``enable_gqa`` for grouped-query attention. On CUDA torch picks its flash or
  memory-efficient kernel, on CPU ``_scaled_dot_product_flash_attention_for_cpu``; no (s x s) score tensor is
  kept for the backward (Dao et al. 2022, FlashAttention).
- **math** (``flash_attention: false``): QK^T * scale + additive causal mask, softmax, dropout, @V, which saves
  the tensors Korthikanti et al. 2022 (arXiv:2205.05198) §4.1 count; kept for exact parity tests. Grouped-query
  attention stacks each key/value head's query heads along the rows, so K and V are kept at their own width.
- **selective recompute** (``recompute: selective``, :func:`runtime.executor.recompute.apply_ac`): the math core
  (QK^T, softmax, dropout, @V) runs under ``torch.utils.checkpoint``, so only q, k and v are kept and the s x s
  tensors are rebuilt in backward — Megatron-LM's ``checkpoint_core_attention``, Korthikanti et al. §5. The fused
  path keeps no s x s tensor, so there is nothing to recompute and it runs as without recompute.

FLOPs and saved bytes of either path come from the cost model's analytic formulas (``planner.cost``), never
from the kernel. Inputs are (batch, heads, seq, head_dim); key/value may have fewer heads (GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.core import StratagemError

FUSED_ATTR = "fused_attention"  # instance attribute of every module whose attention the plan chooses
FUSED_MARK = "_stratagem_fused"  # the same choice on each submodule (the hf: attention function reads it)
RECOMPUTE_ATTR = "recompute_scores"  # instance attribute: selective recompute of the math core (apply_ac)
RECOMPUTE_MARK = "_stratagem_recompute_scores"  # the same choice on each submodule (the hf: attention function)


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
    recompute_scores: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale, causal) v over (b, heads, s_q, d) queries and (b, kv heads, s_k, d) keys/values.

    ``visible``: a boolean (s_q, s_k) mask of the keys each query sees; None = the causal triangle (s_q == s_k).
    Each key/value head serves ``heads / kv heads`` consecutive query heads (Ainslie et al. 2023, GQA).
    ``recompute_scores`` (math path only): keep q, k and v and rebuild the s x s tensors in backward.
    ``sinks``: one learned logit per query head (GPT-OSS's attention sinks) that joins every row's softmax as an
    extra key with no value, so the row's probabilities sum to less than one; it needs the explicit scores, so
    these heads always take the math path.
    """
    p = dropout_p if training else 0.0
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise StratagemError(
                f"attention sinks of shape {list(sinks.shape)} for {q.shape[1]} local query heads: sinks are not "
                f"sharded under tensor parallelism yet; plan this model with tp 1"
            )
        return _math_attention(q, k, v, scale, p, training, visible, sinks)
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
    if recompute_scores and torch.is_grad_enabled():
        # the same dropout mask in the recompute needs the RNG state; without dropout there is nothing to replay
        return checkpoint(
            _math_attention, q, k, v, scale, p, training, visible, use_reentrant=False, preserve_rng_state=p > 0
        )
    return _math_attention(q, k, v, scale, p, training, visible)


def _math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    p: float,
    training: bool,
    visible: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The math path of :func:`attend`. Query head ``j * groups + i`` uses key/value head ``j``, so the queries are
    viewed as (b, kv heads, groups * s_q, d): one batched product per key/value head, no repeated K/V copies."""
    b, heads, s_q, d = q.shape
    kv_heads, s_k = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    if visible is None:
        bias = causal_bias(s_q, device=q.device, dtype=q.dtype)
    else:
        bias = torch.zeros((), device=q.device, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    scores = (q.reshape(b, kv_heads, groups * s_q, d) @ k.transpose(-2, -1)).view(b, kv_heads, groups, s_q, s_k)
    logits = scores * scale + bias
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:  # one more column per row holding the head's sink logit, dropped after the softmax
        sink = sinks.to(logits.dtype).view(1, kv_heads, groups, 1, 1).expand(b, kv_heads, groups, s_q, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :s_k]
    out = dropout(probs, p, training).reshape(b, kv_heads, groups * s_q, s_k) @ v
    return out.view(b, heads, s_q, d)


def apply_attention(model: nn.Module, *, fused: bool) -> list[str]:
    """Set every attention module of ``model`` to the fused (SDPA) or math path; returns their paths.

    The zoo's attention modules, and the ``hf:`` wrapper's blocks, declare the instance attribute
    ``fused_attention``; wrappers (checkpoint, FSDP, compile) do not, so each module is set once.
    """
    return mark_attention(model, attr=FUSED_ATTR, mark=FUSED_MARK, value=fused)


def mark_attention(model: nn.Module, *, attr: str, mark: str, value: bool) -> list[str]:
    """Set ``attr`` on every module of ``model`` that declares it (the zoo's attention modules, the ``hf:``
    wrapper's blocks) and ``mark`` on each of their submodules (read by the ``hf:`` attention function);
    returns their paths."""
    done = []
    for path, module in model.named_modules():
        if FUSED_ATTR in vars(module):
            setattr(module, attr, value)
            for sub in module.modules():
                object.__setattr__(sub, mark, value)
            done.append(path)
    return done
