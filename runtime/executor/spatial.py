"""Spatial parallelism on torch.distributed: halo exchange, split Conv3d / GroupNorm, layout changes.

A spatial group is the ``sd`` ranks of one dp replica (mesh axes ``dp, sd``, ``sd`` fastest). A layer split
as ``grid = (g_d, g_h, g_w)`` holds on group rank ``i`` the shard at grid coordinates ``i`` row-major (``w``
fastest) of every ``(N, C, D, H, W)`` tensor. What each piece does, and its adjoint (backward):

- :class:`HaloExchange` (one spatial dim): forward sends the first/last ``halo`` slices to the previous/next
  rank along that dim and pads the shard with what it receives (zeros at the volume's edge: the convolution's
  own zero padding); backward sends the halo parts of the gradient back to their owners, which add them.
  Dims are exchanged one after another, so the second dim's faces carry the first's halos (edges, corners).
- :func:`split_conv`: a same-padded Conv3d on the padded shard with no padding along split dims equals the
  shard of the whole convolution (Oyama et al., TPDS 2021, §3.1).
- :func:`split_group_norm`: the sample's per-group mean, then variance, each a sum all-reduced over the group.
- :class:`Scatter` (unsplit -> split: keep my slice; backward all-gathers the gradient slices over the sub-group)
  and :class:`Gather` (split -> unsplit: all-gather over the sub-group; backward keeps my slice of the gradient,
  which every copy of a replicated consumer holds identically). Split -> another split: gather, then scatter.
  A layer split ``s < sd`` ways runs on each of the ``sd / s`` consecutive sub-groups of ``s`` ranks; every copy
  holds the true gradient of its shard (the convention the gather's backward relies on).

Point-to-point uses ``isend``/``irecv`` on the default group (gloo and NCCL), each wait bounded by the process
group's timeout and :data:`P2P_TIMEOUT`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

P2P_TIMEOUT = timedelta(seconds=120)
UNSPLIT = (1, 1, 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpatialGroup:
    """The ranks that hold one grid's shards together: their global ranks (in grid order), this rank's index in
    it, and which copy of the grid it is (a layer split ``s`` ways in a spatial group of ``sd`` ranks runs on
    ``sd / s`` consecutive sub-groups, copies computing the same thing)."""

    ranks: tuple[int, ...]
    index: int
    group: dist.ProcessGroup | None  # None for a group of one
    copy: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)


def grid_coords(index: int, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """Coordinates of group rank ``index`` in ``grid`` (row-major, w fastest)."""
    return (index // (grid[1] * grid[2]), (index // grid[2]) % grid[1], index % grid[2])


def _neighbour(sg: SpatialGroup, grid: tuple[int, int, int], dim: int, step: int) -> int | None:
    coords = list(grid_coords(sg.index, grid))
    coords[dim] += step
    if not 0 <= coords[dim] < grid[dim]:
        return None
    index = (coords[0] * grid[1] + coords[1]) * grid[2] + coords[2]
    return sg.ranks[index]


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    works = [dist.isend(t, peer) for t, peer in sends] + [dist.irecv(t, peer) for t, peer in recvs]
    for work in works:
        if work is None:
            raise RuntimeError("a point-to-point halo transfer returned no work handle (is this rank in the group?)")
        work.wait(P2P_TIMEOUT)


class HaloExchange(torch.autograd.Function):
    """Pad a shard along tensor dim ``dim`` with ``halo`` slices from each neighbour (module docstring)."""

    @staticmethod
    def forward(ctx, x, dim: int, halo: int, prev: int | None, nxt: int | None):
        ctx.meta = (dim, halo, prev, nxt)
        n = x.shape[dim]
        left = torch.zeros_like(x.narrow(dim, 0, halo))
        right = torch.zeros_like(left)
        sends, recvs = [], []
        if prev is not None:
            sends.append((x.narrow(dim, 0, halo).contiguous(), prev))
            recvs.append((left, prev))
        if nxt is not None:
            sends.append((x.narrow(dim, n - halo, halo).contiguous(), nxt))
            recvs.append((right, nxt))
        _exchange(sends, recvs)
        return torch.cat((left, x, right), dim)

    @staticmethod
    def backward(ctx, grad):
        dim, halo, prev, nxt = ctx.meta
        n = grad.shape[dim] - 2 * halo
        out = grad.narrow(dim, halo, n).clone()
        from_prev = torch.zeros_like(grad.narrow(dim, 0, halo))
        from_next = torch.zeros_like(from_prev)
        sends, recvs = [], []
        if prev is not None:
            sends.append((grad.narrow(dim, 0, halo).contiguous(), prev))
            recvs.append((from_prev, prev))
        if nxt is not None:
            sends.append((grad.narrow(dim, halo + n, halo).contiguous(), nxt))
            recvs.append((from_next, nxt))
        _exchange(sends, recvs)
        out.narrow(dim, 0, halo).add_(from_prev)
        out.narrow(dim, n - halo, halo).add_(from_next)
        return out, None, None, None, None


def exchange_halos(x: torch.Tensor, sg: SpatialGroup, grid: tuple[int, int, int], halo: int) -> torch.Tensor:
    """The shard padded by ``halo`` along every split dim (d, then h, then w)."""
    for dim in range(3):
        if grid[dim] > 1:
            x = HaloExchange.apply(x, 2 + dim, halo, _neighbour(sg, grid, dim, -1), _neighbour(sg, grid, dim, 1))
    return x


def split_conv(conv: nn.Conv3d, x: torch.Tensor, sg: SpatialGroup, grid: tuple[int, int, int]) -> torch.Tensor:
    """Shard of a stride-1 same-padded Conv3d's output from the shard of its input."""
    halo = conv.kernel_size[0] // 2
    if halo:
        x = exchange_halos(x, sg, grid, halo)
    padding = tuple(0 if g > 1 else halo for g in grid)
    return F.conv3d(x, conv.weight, conv.bias, padding=padding)


class AllReduceSum(torch.autograd.Function):
    """Sum over the spatial group; its adjoint is the same sum of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def split_group_norm(norm: nn.GroupNorm, x: torch.Tensor, sg: SpatialGroup) -> torch.Tensor:
    """GroupNorm of the whole sample from its shard: mean, then variance, summed over the group."""
    n, c = x.shape[:2]
    xs = x.reshape(n, norm.num_groups, -1)
    total = xs.shape[-1] * sg.size
    mean = AllReduceSum.apply(xs.sum(-1), sg.group) / total
    centred = xs - mean.unsqueeze(-1)
    var = AllReduceSum.apply((centred * centred).sum(-1), sg.group) / total
    y = (centred / torch.sqrt(var + norm.eps).unsqueeze(-1)).reshape(x.shape)
    shape = (1, c, 1, 1, 1)
    return y * norm.weight.reshape(shape) + norm.bias.reshape(shape)


def shard_of(x: torch.Tensor, grid: tuple[int, int, int], index: int) -> torch.Tensor:
    """This rank's shard of a whole ``(N, C, D, H, W)`` tensor."""
    for dim, (g, c) in enumerate(zip(grid, grid_coords(index, grid))):
        if g > 1:
            size = x.shape[2 + dim] // g
            x = x.narrow(2 + dim, c * size, size)
    return x.contiguous()


def _assemble(x: torch.Tensor, sg: SpatialGroup, grid: tuple[int, int, int]) -> torch.Tensor:
    """The whole tensor from every rank's shard (all-gather, then placed by grid coordinates)."""
    parts = [torch.empty_like(x) for _ in range(sg.size)]
    dist.all_gather(parts, x.contiguous(), group=sg.group)
    shape = list(x.shape)
    for dim, g in enumerate(grid):
        shape[2 + dim] *= g
    out = x.new_empty(shape)
    for i, part in enumerate(parts):
        view = out
        for dim, (g, c) in enumerate(zip(grid, grid_coords(i, grid))):
            if g > 1:
                view = view.narrow(2 + dim, c * x.shape[2 + dim], x.shape[2 + dim])
        view.copy_(part)
    return out


class Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sg: SpatialGroup, grid):
        ctx.meta = (sg, grid)
        return shard_of(x, grid, sg.index)

    @staticmethod
    def backward(ctx, grad):
        sg, grid = ctx.meta
        return _assemble(grad, sg, grid), None, None


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sg: SpatialGroup, grid):
        ctx.meta = (sg, grid)
        return _assemble(x, sg, grid)

    @staticmethod
    def backward(ctx, grad):
        sg, grid = ctx.meta
        return shard_of(grad, grid, sg.index), None, None


def relayout(
    x: torch.Tensor, groups: dict[int, SpatialGroup], have: tuple[int, int, int], want: tuple[int, int, int]
) -> torch.Tensor:
    """``x`` laid out as ``have`` (a grid, or UNSPLIT) re-laid-out as ``want``; ``groups`` maps a degree to this
    rank's sub-group of that many ranks."""
    if have == want:
        return x
    if have != UNSPLIT:
        x = Gather.apply(x, groups[math.prod(have)], have)
    if want != UNSPLIT:
        x = Scatter.apply(x, groups[math.prod(want)], want)
    return x


def voxels(x: torch.Tensor) -> int:
    return math.prod(x.shape[2:])
