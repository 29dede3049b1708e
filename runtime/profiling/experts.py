"""Mixture-of-Experts blocks in a measured model profile: shards without the routed experts, plus their shape.

The planner costs an MoE block in two parts (``planner.cost.moe``): the block's shards (attention, router,
shared experts, norms, the permutation around the experts) as measured, and the routed experts from their
shape (:class:`planner.profiles.ExpertProfile`) per expert-parallel layout, since which experts a rank holds
and how many tokens reach them depend on ep and etp, not on the module alone. So a profiled MoE shard routes
its tokens as usual but its routed experts are removed: the exchange returns zero outputs (their weighted
sum, its backward and the saved combine inputs stay in the measurement).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.models.moe import MoE, moe_layers


def _no_routed_experts(rows: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict, slots: int = 0):  # noqa: ARG001 - Exchange API
    return rows.new_zeros(rows.shape)


def without_routed_experts(module: nn.Module) -> nn.Module:
    """Remove the routed experts of every MoE layer in ``module`` (in place); returns ``module``."""
    for moe in moe_layers(module).values():
        moe.experts = nn.ModuleDict()
        moe.exchange = _no_routed_experts
    return module


def expert_fields(module: nn.Module, seq_len: int) -> dict:
    """``{"experts": ExpertProfile}`` for a layer holding an MoE, ``{}`` otherwise (or when the profile schema
    has no expert field)."""
    from planner import profiles

    layers = list(moe_layers(module).values())
    if not layers or not hasattr(profiles, "ExpertProfile"):
        return {}
    moe: MoE = layers[0]
    first = next(iter(moe.experts.values()))
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
