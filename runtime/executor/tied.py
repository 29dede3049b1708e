"""Tied LM head and token embedding (GPT-2, Megatron presets) under pipeline and tensor parallelism.

With pp = 1 the two modules share one Parameter; ``retie`` restores the sharing after ``apply_tp``,
which replaces each module's weight with its own DTensor. It requires both layers split or both
replicated, so their layouts (vocab rows sharded on dim 0) are the same. With pp > 1 the first stage
holds ``embed.tok.weight`` and the last holds ``head.weight``. The zoo's ``init_weights`` gives both
copies the same values. After every backward, :class:`TiedGradSync` all-reduces the two gradients
between the ranks holding them (same dp and tp coordinates), so the copies get the same update and stay
equal. This is Megatron-LM's embedding group (Shoeybi et al. 2019; ``_allreduce_word_embedding_grads``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from planner.core import ParallelDims
from planner.plan import Plan

from runtime.executor.checks import is_tied

EMBED, HEAD = "embed.tok.weight", "head.weight"


def tied_aliases(plan: Plan) -> dict[str, str]:
    """Checkpoint aliases of a tied model (``checkpoint.load_checkpoint``): the head's entries are the
    embedding's where a pp = 1 layout, whose AdamW state names the shared Parameter once, wrote them."""
    return {HEAD: EMBED} if is_tied(plan) else {}


def retie(model: nn.Module, plan: Plan) -> None:
    """Share the head's weight with the embedding again when this chunk holds both (after ``apply_tp``)."""
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    if is_tied(plan) and embed is not None and head is not None:
        head.weight = embed.tok.weight


@dataclass(kw_only=True)
class TiedGradSync:
    """All-reduces the gradient of this rank's copy of the tied weight with the other stage's copy."""

    group: object
    params: list[nn.Parameter] = field(default_factory=list)

    def sync(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                assert isinstance(p, DTensor), "a DTensor gradient belongs to a DTensor weight"
                # the embedding backward under TP leaves a Replicate gradient of a Shard(0) weight; match
                # the weight's layout so both copies' local gradients are the same vocab rows
                if tuple(p.grad.placements) != tuple(p.placements):
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                dist.all_reduce(p.grad.to_local(), group=self.group)
            else:
                dist.all_reduce(p.grad, group=self.group)


def build_tied_sync(
    plan: Plan, dims: ParallelDims, coords: dict[str, int], modules: list[nn.Module]
) -> TiedGradSync | None:
    """Collective (every rank creates every group): the sync for this rank, or None if it holds no copy."""
    if not is_tied(plan) or dims.pp == 1:
        return None
    mine = None
    for d in range(dims.dp):
        for c in range(dims.cp):  # context parallelism: one pair per cp rank too
            for t in range(dims.tp):
                ranks = [dims.rank_of(pp=0, dp=d, cp=c, tp=t), dims.rank_of(pp=dims.pp - 1, dp=d, cp=c, tp=t)]
                group = dist.new_group(ranks)
                if (coords["dp"], coords.get("cp", 0), coords["tp"]) == (d, c, t) and coords["pp"] in (0, dims.pp - 1):
                    mine = group
    if mine is None:
        return None
    params = []
    for module in modules:
        for name, p in module.named_parameters():
            if name.replace("_checkpoint_wrapped_module.", "") in (EMBED, HEAD):
                params.append(p)
    return TiedGradSync(group=mine, params=params)
