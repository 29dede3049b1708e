"""Mixture-of-Experts blocks in a measured model profile: shards without the routed experts, plus their shape.

The planner costs an MoE block in two parts (``planner.cost.moe``): the block's shards (attention, router,
shared experts, norms, the permutation around the experts) as measured, and the routed experts from their
shape (:class:`planner.profile.load.ExpertProfile`) per expert-parallel layout, since which experts a rank holds
and how many tokens reach them depend on ep and etp, not on the module alone. So a profiled MoE shard routes
its tokens as usual but its routed experts are removed: the exchange returns zero outputs (their weighted
sum, its backward and the saved combine inputs stay in the measurement).

``hf:`` MoE blocks (transformers' Mixtral / Qwen2-MoE / Qwen3-MoE decoder layers) hold their routed experts as
one fused module (``*Experts``: ``gate_up_proj`` ``E x 2f x h`` and ``down_proj`` ``E x h x f``, called with the
router's top-k indices and weights) beside a ``gate`` router with ``top_k``. They are profiled the same way:
the fused module is replaced by one that returns zeros, and the layer's :class:`ExpertProfile` is read off the
fused weights' shapes and the router, which are the config's ``moe`` dimensions (``runtime.models.hf_moe``;
tests/test_hf_moe_profile.py checks both against each other and Mixtral-8x7B against ``moe:mixtral-8x7b``).
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from torch import nn

from runtime.models.llama import FeedForward
from runtime.models.moe import MoE, moe_layers


def _no_routed_experts(rows: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict, slots: int = 0):  # noqa: ARG001 - Exchange API
    return rows.new_zeros(rows.shape)


class _NoHFExperts(nn.Module):
    """Stands in for a transformers fused experts module: no weights, zero output."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):  # noqa: ARG002 - HF API
        return hidden_states.new_zeros(hidden_states.shape)


def _is_hf_experts(module: nn.Module) -> bool:
    weights = dict(module.named_parameters(recurse=False))
    return (
        "gate_up_proj" in weights
        and "down_proj" in weights
        and weights["gate_up_proj"].dim() == 3
        and hasattr(module, "num_experts")
    )


def _hf_moe_blocks(module: nn.Module) -> list[nn.Module]:
    """transformers sparse-MoE blocks in ``module``: those with a fused ``experts`` child and a ``gate`` router."""
    return [
        m
        for m in module.modules()
        if isinstance(experts := getattr(m, "experts", None), nn.Module)
        and _is_hf_experts(experts)
        and hasattr(getattr(m, "gate", None), "top_k")
    ]


def without_routed_experts(module: nn.Module) -> nn.Module:
    """Remove the routed experts of every MoE layer in ``module`` (in place; zoo ``moe`` and ``hf:`` MoE
    blocks); returns ``module``."""
    for moe in moe_layers(module).values():
        moe.experts = nn.ModuleDict()
        moe.exchange = _no_routed_experts
    for block in _hf_moe_blocks(module):
        block.experts = _NoHFExperts()
    return module


def _hf_expert_profile(block: nn.Module, seq_len: int):
    """The :class:`ExpertProfile` of a transformers sparse-MoE block: E, h and f from the fused weights
    (``gate_up_proj`` is ``E x 2f x h``), top-k from its router; dropless (transformers drops no tokens); what its
    fused module saves per token and its backward's growth per weight byte, measured
    (:func:`fused_saved_bytes_per_token`, :func:`fused_backward_bytes_per_weight_byte`)."""
    from planner.profile import ExpertProfile

    experts = block.get_submodule("experts")
    n_experts, two_f, hidden = experts.get_parameter("gate_up_proj").shape
    top_k = int(block.get_submodule("gate").top_k)  # type: ignore[arg-type]  # a plain int attribute
    return ExpertProfile(
        experts=int(n_experts),
        top_k=top_k,
        hidden=int(hidden),
        expert_ffn=int(two_f) // 2,
        tokens_per_sample=seq_len,
        capacity_factor=None,
        wrapped_at_ep1=True,  # runtime.executor.moe: an hf: plan without an expert layout wraps them as dense
        fused_saved_bytes_per_token=fused_saved_bytes_per_token(experts, top_k),
        fused_backward_bytes_per_weight_byte=fused_backward_bytes_per_weight_byte(experts, top_k),
    )


# (h, f) of the three small copies fused_saved_bytes_per_token runs; tokens per copy: _TOKENS_PER_EXPERT x E
_FIT_WIDTHS = ((8, 8), (16, 8), (8, 16))
_TOKENS_PER_EXPERT = 4


def _small_copy(experts: nn.Module, top_k: int, hidden: int, ffn: int, tokens_per_expert: int = _TOKENS_PER_EXPERT):
    """A shallow copy of ``experts`` (the same class and forward; its own parameter table, config and weights)
    holding small random ``hidden x ffn`` weights on the CPU, and a call's arguments in which every expert takes
    the same number of rows: ``(module, hidden_states, top_k_index, top_k_weights)``."""
    gate_up_proj = experts.get_parameter("gate_up_proj")
    n_experts = int(gate_up_proj.shape[0])
    dtype = gate_up_proj.dtype
    copy_ = copy.copy(experts)
    copy_._parameters = dict(experts._parameters)
    if hasattr(experts, "config"):  # run transformers' per-expert loop, as the runtime does (hf.use_loop_experts)
        copy_.config = copy.copy(experts.config)
        copy_.config._experts_implementation = "eager"  # type: ignore[union-attr]  # a transformers config
    gen = torch.Generator().manual_seed(0)
    copy_.gate_up_proj = nn.Parameter(torch.randn(n_experts, 2 * ffn, hidden, generator=gen).to(dtype))
    copy_.down_proj = nn.Parameter(torch.randn(n_experts, hidden, ffn, generator=gen).to(dtype))
    tokens = tokens_per_expert * n_experts
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    index = (torch.arange(tokens)[:, None] + torch.arange(top_k)[None]) % n_experts  # balanced, distinct choices
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype).requires_grad_()
    return copy_, x, index, weights


def _saved_by_small_copy(experts: nn.Module, top_k: int, hidden: int, ffn: int) -> float:
    """Bytes per token that ``experts``'s own forward saves for backward when its weights are ``hidden x ffn``
    (:func:`_small_copy`; the weights, the input and the routing weights are not counted: the memory model holds
    them apart)."""
    copy_, x, index, weights = _small_copy(experts, top_k, hidden, ffn)
    skip = {t.untyped_storage()._cdata for t in (copy_.gate_up_proj, copy_.down_proj, x, weights)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            saved[storage._cdata] = max(saved.get(storage._cdata, 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = copy_(x, index, weights)
    del out
    return sum(saved.values()) / x.shape[0]


def fused_backward_bytes_per_weight_byte(experts: nn.Module, top_k: int) -> float:
    """How far a backward of a transformers fused-experts module grows the live tensor bytes (its parameters'
    gradients left out), per byte of its weights: the eager loop takes each expert's slice of the fused
    ``E x ...`` weights, and each slice's backward makes a zero-filled gradient of the whole fused tensor that
    autograd sums (measured on a small CPU copy, :func:`_small_copy`, with few tokens, so the rows' own gradients
    hardly count; the second of two backwards, which adds into the gradients the first left, as every later
    micro-batch does)."""
    from runtime.executor.tensor_memory import TensorMemory

    copy_, x, index, weights = _small_copy(experts, top_k, hidden=32, ffn=32, tokens_per_expert=1)
    with TensorMemory([copy_], []) as tracker:
        for _ in range(2):
            out = copy_(x, index, weights)
            tracker.reset()
            start = tracker.now()
            out.backward(torch.ones_like(out))
            del out
        peak = tracker.peak()
    growth = peak.peak_bytes - start.peak_bytes - (peak.by_kind["grads"] - start.by_kind["grads"])
    weight_bytes = sum(p.numel() * p.element_size() for p in (copy_.gate_up_proj, copy_.down_proj))
    return max(0.0, growth / weight_bytes)


def fused_saved_bytes_per_token(experts: nn.Module, top_k: int) -> float:
    """Bytes a transformers fused-experts module saves for backward per token of its input (its ``top_k``
    rows: their inputs, the expert FFN's intermediates, indices), at its own hidden and FFN widths. The module
    cannot run on the meta device (its loop picks the experts that received tokens), so it runs on three small
    CPU copies and the bytes are taken as ``a h + b f + c`` through them (exact for a module whose saved tensors
    are rows of width h, f or 1; tests/test_hf_moe_profile.py checks a fourth width)."""
    (h0, f0), (h1, _), (_, f2) = _FIT_WIDTHS
    y0, y1, y2 = (_saved_by_small_copy(experts, top_k, h, f) for h, f in _FIT_WIDTHS)
    per_h, per_f = (y1 - y0) / (h1 - h0), (y2 - y0) / (f2 - f0)
    fixed = y0 - per_h * h0 - per_f * f0
    _, two_f, hidden = experts.get_parameter("gate_up_proj").shape
    return max(0.0, per_h * int(hidden) + per_f * (int(two_f) // 2) + fixed)


def expert_fields(module: nn.Module, seq_len: int) -> dict:
    """``{"experts": ExpertProfile}`` for a layer holding an MoE, ``{}`` otherwise (or when the profile schema
    has no expert field)."""
    from planner.profile import load as profiles

    if not hasattr(profiles, "ExpertProfile"):
        return {}
    hf_blocks = _hf_moe_blocks(module)
    if hf_blocks:
        return {"experts": _hf_expert_profile(hf_blocks[0], seq_len)}
    layers = list(moe_layers(module).values())
    if not layers:
        return {}
    moe: MoE = layers[0]
    first = cast(FeedForward, next(iter(moe.experts.values())))
    return {
        "experts": profiles.ExpertProfile(
            experts=moe.num_experts,
            top_k=moe.top_k,
            hidden=first.w1.in_features,
            expert_ffn=first.w1.out_features,
            tokens_per_sample=seq_len,
            capacity_factor=moe.capacity_factor if moe.capacity_factor > 0 else None,
        )
    }
