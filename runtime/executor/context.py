"""Context parallelism: attention over a sequence split across the ``cp`` ranks of the plan's mesh.

torch 2.13's ``torch.distributed.tensor.experimental.context_parallel`` does not run on CPU
(``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy) and takes over every SDPA call
in its context (a model-wide buffer sharding this runtime's per-module shards do not use), so the exchange is
written here with torch.distributed and each rank's local attention is the plan's kernel — fused SDPA with a
boolean visibility mask when ``flash_attention`` (on CUDA the memory-efficient kernel, which takes masks),
explicit math otherwise (Llama 3, Grattafiori
et al. 2024, arXiv:2407.21783, §3.3.2):

- **Layout** (Megatron-Core's causal load balancing): the ``s`` tokens are cut into ``2 cp`` chunks and cp rank
  ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (:meth:`ContextShard.shard`), so every rank has the same
  causal attention work. Inputs and targets are split the same way.
- **Positions**: each rank's tokens keep their global positions (:meth:`ContextShard.positions`): RoPE
  angles (llama), learned position embeddings (gpt) and the causal mask use them.
- **K/V exchange**: :meth:`ContextShard.gather` all-gathers K and V along the sequence over the cp group
  and puts the chunks back in sequence order; its backward reduce-scatters the gradients (each rank gets
  the sum over ranks of the gradient of its own chunks). GQA models gather their few K/V heads before
  repeating them for the query heads.
- **Ring** (the plan's ``context_parallel: ring``; Ring Attention, Liu et al. 2023, arXiv:2310.01889):
  instead of gathering, K/V chunk pairs travel ``cp - 1`` steps round the cp ring (point-to-point, each
  step's backward sends the gradient the other way) and each step's block of attention is merged into a
  running softmax (maximum, denominator, numerator: the blockwise form of Milakov & Gimelshein 2018),
  :meth:`ContextShard.attend`. Only the current K/V pair is needed per step (the autograd graph here still
  keeps every block for the backward; the saving is in the communication pattern, not the CPU memory).
- **Mask**: local queries at positions ``p_i`` see keys ``j <= p_i`` (:meth:`ContextShard.causal_bias`).
- **Loss**: each rank's loss is the mean over its ``s / cp`` tokens; every rank has as many tokens, so the
  gradient average over the ``dp x cp`` group (``apply_dp`` on the flattened mesh) is the gradient of the
  full-sequence mean, and the reported loss sums ``mean / (dp cp)`` over the ranks.

On CUDA the same code runs over NCCL (``all_gather_single`` / ``reduce_scatter_single``, ``isend`` / ``irecv``).
The ring form merges explicit-math blocks: SDPA returns no log-sum-exp to merge with. The CUDA path of context
parallelism has not been run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.plan import Plan

from runtime.models.attention import attend


@dataclass(frozen=True, kw_only=True)
class ContextShard:
    """What cp rank ``rank`` of ``cp`` holds of a ``seq_len``-token sequence, and its cp process group."""

    cp: int
    rank: int
    seq_len: int
    group: Any = None  # torch.distributed ProcessGroup of the cp axis
    mode: str = "allgather"  # the plan's context_parallel: "allgather" or "ring"

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    @property
    def chunks(self) -> tuple[int, int]:
        """The two chunk indices this rank holds: ``r`` and ``2 cp - 1 - r``."""
        return self.rank, 2 * self.cp - 1 - self.rank

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of this rank's ``s / cp`` tokens, in local order.

        >>> ContextShard(cp=2, rank=0, seq_len=8).positions().tolist()
        [0, 1, 6, 7]
        """
        c = self.chunk
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunks])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``x`` along ``dim`` (the sequence), concatenated."""
        parts = x.chunk(2 * self.cp, dim=dim)
        return torch.cat([parts[i] for i in self.chunks], dim=dim)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence of ``x`` (this rank's chunks along ``dim``) from every cp rank, in order;
        differentiable (the backward reduce-scatters the gradient)."""
        return _GatherSequence.apply(x, dim, self)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        fused: bool,
        scale: float,
        dropout_p: float = 0.0,
        training: bool = False,
        recompute_scores: bool = False,
    ) -> torch.Tensor:
        """Causal attention of this rank's queries ``q`` (b, heads, s/cp, d) over the whole sequence, whose K/V
        this rank holds a share of (``k``, ``v``: b, kv heads, s/cp, d; each kv head serves heads / kv heads
        query heads). The all-gather form runs :func:`runtime.models.attention.attend` on the gathered K/V with
        the rank's visibility mask — fused SDPA when ``fused`` (the plan's flash_attention) — and applies
        attention dropout; the ring form merges math blocks (no dropout: ``check_context_supported``).
        ``recompute_scores`` (selective recompute) re-runs the all-gather form's math core in backward; the ring
        form keeps its blocks."""
        if self.mode == "ring":
            return self._ring_attend(q, k, v, scale=scale, repeat=q.shape[1] // k.shape[1])
        k, v = self.gather(k, dim=2), self.gather(v, dim=2)  # the few K/V heads (Llama 3 §3.3.2)
        return attend(
            q,
            k,
            v,
            fused=fused,
            scale=scale,
            dropout_p=dropout_p,
            training=training,
            visible=self.visible(q.device),
            recompute_scores=recompute_scores,
        )

    def _ring_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, repeat: int):
        """Ring form of :meth:`attend`: step ``i`` holds the K/V of cp rank ``r - i``; blocks merge into a running
        softmax (a fully masked block contributes zero)."""
        q_pos = self.positions(q.device)[:, None]
        kv = torch.stack([k, v])
        best: torch.Tensor | None = None
        denominator: torch.Tensor | None = None
        numerator: torch.Tensor | None = None
        for step in range(self.cp):
            owner = replace(self, rank=(self.rank - step) % self.cp)
            k_s, v_s = kv[0], kv[1]
            if repeat > 1:
                k_s, v_s = k_s.repeat_interleave(repeat, dim=1), v_s.repeat_interleave(repeat, dim=1)
            scores = (q @ k_s.transpose(-2, -1)) * scale
            scores = scores.masked_fill(owner.positions(q.device)[None, :] > q_pos, float("-inf"))
            # any finite shift gives the same softmax: a detached one keeps the gradient exact
            shift = scores.detach().amax(-1, keepdim=True)
            shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
            weights = torch.exp(scores - shift)
            if best is None:
                best, denominator, numerator = shift, weights.sum(-1, keepdim=True), weights @ v_s
            else:
                assert denominator is not None and numerator is not None
                top = torch.maximum(best, shift)
                old, new = torch.exp(best - top), torch.exp(shift - top)
                denominator = denominator * old + weights.sum(-1, keepdim=True) * new
                numerator = numerator * old + (weights @ v_s) * new
                best = top
            if step < self.cp - 1:
                kv = _RingShift.apply(kv, self)
        assert numerator is not None and denominator is not None, "the ring runs at least one step (cp >= 1)"
        return numerator / denominator

    def visible(self, device: torch.device) -> torch.Tensor:
        """(s / cp, s) boolean mask: True where the key's position is at most the query's."""
        return torch.arange(self.seq_len, device=device)[None, :] <= self.positions(device)[:, None]

    def causal_bias(self, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(s / cp, s) additive mask: 0 where the key's position is at most the query's, -inf elsewhere."""
        return torch.zeros((), device=device, dtype=dtype).masked_fill(~self.visible(device), float("-inf"))


def _to_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """(cp * 2c, ...) in rank order (rank j: chunks j, 2cp-1-j) -> (2cp * c, ...) in sequence order."""
    per_rank = gathered.view(cp, 2, -1, *gathered.shape[1:])
    first, second = per_rank[:, 0], per_rank[:, 1].flip(0)  # chunks 0..cp-1, then cp..2cp-1
    return torch.cat([first, second]).reshape(-1, *gathered.shape[1:])


def _to_rank_order(full: torch.Tensor, cp: int) -> torch.Tensor:
    """Inverse of :func:`_to_sequence_order`."""
    chunks = full.view(2 * cp, -1, *full.shape[1:])
    per_rank = torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=1)
    return per_rank.reshape(-1, *full.shape[1:])


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, shard: ContextShard) -> torch.Tensor:
        ctx.dim, ctx.shard = dim, shard
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((shard.cp * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(out, local, group=shard.group)
        return _to_sequence_order(out, shard.cp).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard: ContextShard = ctx.shard
        full = _to_rank_order(grad.movedim(ctx.dim, 0).contiguous(), shard.cp).contiguous()
        mine = full.new_empty((full.shape[0] // shard.cp, *full.shape[1:]))
        dist.reduce_scatter_single(mine, full, op=dist.ReduceOp.SUM, group=shard.group)
        return mine.movedim(0, ctx.dim), None, None


def _shift(x: torch.Tensor, shard: ContextShard, step: int) -> torch.Tensor:
    """``x`` of cp rank ``r - step`` (this rank's goes to ``r + step``), point-to-point over the cp group."""
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x.contiguous(), group=shard.group, group_peer=(shard.rank + step) % shard.cp),
        dist.P2POp(dist.irecv, out, group=shard.group, group_peer=(shard.rank - step) % shard.cp),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


class _RingShift(torch.autograd.Function):
    """One ring step forward (from rank r-1); its backward sends the gradient back (from rank r+1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        ctx.shard = shard
        return _shift(x, shard, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.shard, -1), None


def build_context_shard(plan: Plan, mesh, coords: dict[str, int]) -> ContextShard | None:
    """This rank's :class:`ContextShard` (None without a cp axis > 1)."""
    cp = plan.mesh.size("cp")
    if cp == 1:
        return None
    return ContextShard(
        cp=cp,
        rank=coords["cp"],
        seq_len=plan.training.seq_len,
        group=mesh["cp"].get_group(),
        mode=plan.context_parallel or "allgather",
    )


def apply_cp(model: nn.Module, shard: ContextShard | None) -> list[str]:
    """Give every module that takes one (the zoo's attention and position embeddings) the rank's shard;
    returns their paths."""
    if shard is None:
        return []
    done = []
    for path, module in model.named_modules():
        if "context" in vars(module):  # the instance attribute the zoo's modules declare (not a wrapper's)
            module.context = shard
            done.append(path)
    return done


def data_parallel_mesh(mesh, cp: int):
    """The mesh gradients are averaged (and ZeRO-sharded) over: ``dp x cp`` flattened, or ``dp``."""
    return mesh["dp", "cp"]._flatten("dp_cp") if cp > 1 else mesh["dp"]
