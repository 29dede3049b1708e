"""Token dispatch for expert parallelism: the all-to-all exchanges (with autograd) and TP token slices.

:class:`ExpertExchange` is what ``runtime.models.moe.MoE.exchange`` becomes under expert parallelism (ep) and
expert tensor parallelism (etp); :class:`TokenShard` decides which tokens a TP rank's expert layer computes.
The layout and the gradient rules are in :mod:`runtime.executor.moe`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.executor.etp_keys import mark_etp_slice
from runtime.models.llama import FeedForward
from runtime.models.moe import MoE, Routing, run_local_experts


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with explicit split sizes; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.group, ctx.in_splits, ctx.out_splits = group, in_splits, out_splits
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over the group (Megatron's
    ``copy_to_tensor_model_parallel_region``): each TP rank's gradient covers its token slice only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherRows(torch.autograd.Function):
    """All-gather equal row slices (dim 0); backward keeps this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group, size: int, index: int) -> torch.Tensor:
        ctx.index, ctx.rows = index, rows.shape[0]
        parts = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(parts, rows.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.index * ctx.rows : (ctx.index + 1) * ctx.rows], None, None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather sequence shards (b, s/n, h) -> (b, s, h); backward sums the gradients over the group and keeps
    this rank's shard (a reduce-scatter, written as all-reduce + slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, index: int) -> torch.Tensor:
        ctx.group, ctx.index, ctx.len = group, index, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.index * ctx.len : (ctx.index + 1) * ctx.len], None, None, None


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


@dataclass(frozen=True, kw_only=True)
class TokenShard:
    """Which tokens this TP rank's expert layer computes (the router always sees all of them).

    Without sequence parallelism the TP ranks hold the same (replicated) activation: each computes a
    contiguous ``1/tp`` of the flattened tokens, whose outputs are all-gathered; the input gradient is summed
    over the group (Megatron's ``copy_to_tensor_model_parallel_region``). With sequence parallelism each rank
    already holds a ``1/tp`` sequence shard (a ``Shard(1)`` DTensor from the sequence-parallel norm): it
    computes those tokens and returns its shard; only the router's input is all-gathered.
    """

    group: object
    size: int
    index: int
    sequence_parallel: bool = False

    def routing_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _GatherSequence.apply(_local(x), self.group, self.size, self.index)
        return _CopyToGroup.apply(x, self.group)

    def split(self, x: torch.Tensor, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
        if self.sequence_parallel:
            local = _local(x)
            b, s = local.shape[:2]
            rows = torch.arange(b * s * self.size, device=tokens.device).view(b, s * self.size)
            part = rows[:, self.index * s : (self.index + 1) * s].reshape(-1)
            mine = local.reshape(b * s, -1)
        else:
            n = tokens.shape[0] // self.size
            part = torch.arange(self.index * n, (self.index + 1) * n, device=tokens.device)
            mine = tokens[part]
        return mine, replace(
            routing, experts=routing.experts[part], weights=routing.weights[part], kept=routing.kept[part]
        )

    def output(self, out: torch.Tensor, b: int, s: int) -> torch.Tensor:
        if self.sequence_parallel:
            return out.view(b, s // self.size, -1)
        return _GatherRows.apply(out, self.group, self.size, self.index).view(b, s, -1)


@dataclass(frozen=True, kw_only=True)
class ExpertExchange:
    """``MoE.exchange`` under expert parallelism: rows sorted by global expert -> experts' outputs, same order.

    ``ep`` > 1: dispatch over the ep group (counts first, then rows), local experts, combine back; with a
    capacity factor, fixed-size zero-padded buffers instead (no count exchange).
    ``etp`` > 1: each expert's FFN is split over the etp group (Megatron-Core expert tensor parallelism):
    the etp peers' rows for the same experts are gathered, every peer runs its FFN slice on all of them, and
    each peer's rows get the sum of the partial outputs (a reduce-scatter), both written as uneven
    ``all_to_all_single`` exchanges so that autograd reverses them.
    """

    group: object | None
    ep: int
    etp_group: object | None = None
    etp: int = 1

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module, slots: int = 0) -> torch.Tensor:
        if self.ep == 1:
            return self._compute(rows, counts, experts)
        if slots:
            return self._fixed_capacity(rows, counts, experts, slots)
        local = counts.numel() // self.ep
        received = torch.empty_like(counts)  # (source rank, local expert) counts, source-major
        dist.all_to_all_single(received, counts, group=self.group)
        in_splits = counts.view(self.ep, local).sum(1).tolist()
        out_splits = received.view(self.ep, local).sum(1).tolist()
        inbound = AllToAll.apply(rows, out_splits, in_splits, self.group)
        order = _group_by_expert(received.view(self.ep, local))  # source-major -> expert-major (stable)
        grouped = self._compute(inbound[order], received.view(self.ep, local).sum(0), experts)
        outbound = torch.empty_like(grouped).index_copy(0, order, grouped)
        return AllToAll.apply(outbound, in_splits, out_splits, self.group)

    def _fixed_capacity(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module, slots: int):
        """GShard's fixed-capacity dispatch (Lepikhin et al. 2021 §3.2): every rank sends each expert a buffer
        of ``slots`` rows, zero-padded, so the all-to-all has equal splits and no counts are exchanged.
        Zero rows give zero SwiGLU outputs (no biases) and are dropped on the way back."""
        n_experts, h = counts.numel(), rows.shape[1]
        local = n_experts // self.ep
        start = torch.cumsum(counts, 0) - counts
        expert_of_row = torch.arange(n_experts, device=counts.device).repeat_interleave(counts)
        slot = expert_of_row * slots + torch.arange(rows.shape[0], device=counts.device) - start[expert_of_row]
        padded = rows.new_zeros(n_experts * slots, h).index_copy(0, slot, rows)
        splits = [local * slots] * self.ep
        inbound = AllToAll.apply(padded, splits, splits, self.group)  # (source, local expert, slot)
        grouped = inbound.view(self.ep, local, slots, h).transpose(0, 1).reshape(-1, h)  # expert-major
        per_expert = torch.full((local,), self.ep * slots, dtype=counts.dtype, device=counts.device)
        done = self._compute(grouped, per_expert, experts)
        outbound = done.view(local, self.ep, slots, h).transpose(0, 1).reshape(-1, h)
        return AllToAll.apply(outbound, splits, splits, self.group)[slot]

    def _compute(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """Rows grouped by local expert through the experts (their FFN slices, summed over etp)."""
        if self.etp == 1:
            return _run_experts(rows, counts, experts)
        peer_counts = [torch.empty_like(counts) for _ in range(self.etp)]
        dist.all_gather(peer_counts, counts, group=self.etp_group)
        by_peer = torch.stack(peer_counts)  # (etp peer, local expert)
        sizes, n = by_peer.sum(1).tolist(), rows.shape[0]
        gathered = AllToAll.apply(rows.repeat(self.etp, 1), sizes, [n] * self.etp, self.etp_group)
        order = _group_by_expert(by_peer)
        partial = _run_experts(gathered[order], by_peer.sum(0), experts)
        back = torch.empty_like(partial).index_copy(0, order, partial)  # peer-major again
        mine = AllToAll.apply(back, [n] * self.etp, sizes, self.etp_group)  # every peer's partial of my rows
        return mine.view(self.etp, n, -1).sum(0)


def _run_experts(rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """The zoo's ``nn.ModuleDict`` of experts, or a module running its experts itself (``run_grouped``: an hf:
    model's fused experts, ``runtime.executor.hf_moe.HFLocalExperts``)."""
    grouped = getattr(experts, "run_grouped", None)
    return grouped(rows, counts) if grouped is not None else run_local_experts(rows, counts, experts)  # type: ignore[arg-type]


def _group_by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Permutation taking rows laid out (source, expert) by ``counts`` (sources x experts) to expert-major
    order, sources in order within an expert (a stable sort)."""
    sources, local = counts.shape
    expert_of_row = torch.arange(local, device=counts.device).repeat(sources).repeat_interleave(counts.flatten())
    return torch.argsort(expert_of_row, stable=True)


def shard_expert_ffn(moe: MoE, etp: int, etp_index: int) -> None:
    """Keep this etp rank's slice of every local expert's FFN: rows of w1 and w3 (column-parallel), columns
    of w2 (row-parallel), Megatron-LM SC21 §2.3's MLP split applied inside each expert."""
    for module in moe.experts.values():
        expert = cast(FeedForward, module)  # MoE's routed experts are SwiGLU FeedForwards
        width = expert.w1.out_features // etp
        part = slice(etp_index * width, (etp_index + 1) * width)
        for name in ("w1", "w3"):
            linear = getattr(expert, name)
            linear.weight = nn.Parameter(linear.weight.detach()[part].clone())
            linear.out_features = width
        expert.w2.weight = nn.Parameter(expert.w2.weight.detach()[:, part].clone())
        expert.w2.in_features = width
        mark_etp_slice(expert, etp_index, etp)  # its own checkpoint keys (runtime.executor.etp_keys)
