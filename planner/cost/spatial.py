"""Spatial parallelism for 3D CNNs: one layer's volume split over the ``sd`` ranks of a spatial group.

A *spatial split* of a layer cuts its input volume into a grid of ``g_d x g_h x g_w`` shards, ``degree = g_d g_h
g_w`` dividing the group size ``sd``: the group's ranks form ``sd / degree`` consecutive sub-groups of ``degree``
ranks, each holding the whole grid (row-major rank order, ``w`` fastest), the copies computing the same thing. A
layer left unsplit (degree 1) runs on the whole sample on every rank of the group (data parallel across ``dp``
only). The formulas follow
Oyama et al., "The case for strong scaling in deep learning: training large 3D CNNs with hybrid parallelism"
(IEEE TPDS 2021, arXiv:2007.12856, §3 spatial parallelism) and Dryden et al., "Improving strong-scaling of CNN
training by exploiting finer-grained parallelism" (IPDPS 2019, §III-IV: a layer's distribution over the
sample/spatial dims, halo exchange as point-to-point messages, shuffles where neighbouring layers' distributions
differ):

- **compute**: forward and backward time of the whole layer / ``degree`` (every shard computes the same
  fraction of the output voxels; the per-voxel work does not change).
- **halo exchange** (convolutions with kernel k > 1, stride 1, same padding): halo ``h = (k - 1) / 2`` voxels per
  side. Along every split dim ``j`` each rank exchanges a face of ``h x c_in x (the other two local extents,
  each grown by the halos already exchanged)`` elements per sample with each of its neighbours (dims are
  exchanged one after another so that edges and corners arrive too). A rank in the middle of a row has 2
  neighbours, a row of 2 ranks 1; the messages to them go one after the other (alpha-beta ``send_recv`` fit of
  the link the pair crosses, intra- or inter-node by the rank placement). Backward sends the same bytes back
  (the gradient of the halo, added by its owner): the same time again.
- **pooling / up-convolution** (kernel = stride): windows never cross a shard boundary when the stride divides
  the local extent, so no halo; the local extent divides (pooling) or multiplies (up-convolution) by the
  stride. 1x1x1 convolutions: no halo.
- **GroupNorm**: the sample's per-group mean, then its variance, each a sum all-reduced over the group
  (two-pass, as the runtime computes it), and the two gradient sums backward: 4 all-reduces of one fp32
  value per group and sample.
- **layout change** at a boundary tensor of ``B`` bytes where producer and consumer split differently
  (also along a U-Net skip connection): the producer's shards are all-gathered over its sub-group forward
  (nothing backward: every copy holds the same gradient and keeps its slice) and the consumer's slice is taken
  (forward free, its gradient all-gathered over the consumer's sub-group backward): ``all_gather(B, s_p) +
  all_gather(B, s_c)``, a term 0 on an unsplit side (``runtime/executor/spatial.py``; an all-to-all would move
  ``B / sd`` per rank instead of ``B``).
- **memory**: a split layer's saved activations / ``degree``, plus its halo-padded input copy; weights,
  gradients and AdamW states in full on every rank (ZeRO paper §5.1 stage 0).
- **gradients**: all-reduced over all ``dp x sd`` ranks (``planner/cost/spatial_plan.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from planner.core import DTYPE_BYTES, StratagemError
from planner.cost.collectives import collective_time
from planner.cost.compute import layer_cost
from planner.model import VolumeLayer, norm_groups
from planner.profile import ClusterProfile, LayerProfile, NodeType

SPATIAL_DIMS = ("d", "h", "w")
NORM_STAT_BYTES = 4  # one fp32 sum per group and sample per all-reduce
DIM_CHOICES = (("d",), ("d", "h"), ("d", "h", "w"))  # cubic volumes: other orders give the same costs


class SpatialSplitError(StratagemError):
    """A spatial split that cannot run: degree not dividing the volume, halo wider than the shard."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpatialOption:
    """How one layer runs in its spatial group: ``grid`` shards per (d, h, w); (1, 1, 1) = unsplit."""

    grid: tuple[int, int, int] = (1, 1, 1)

    @property
    def degree(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(d for d, g in zip(SPATIAL_DIMS, self.grid) if g > 1)

    @property
    def label(self) -> str:
        """``"dp"`` unsplit, else e.g. ``"sd8 d4xh2"``."""
        if self.degree == 1:
            return "dp"
        return f"sd{self.degree} " + "x".join(f"{d}{g}" for d, g in zip(SPATIAL_DIMS, self.grid) if g > 1)


UNSPLIT = SpatialOption()


def split_grid(degree: int, dims: tuple[str, ...]) -> tuple[int, int, int]:
    """The most balanced grid of ``degree`` shards over ``dims`` (prime factors dealt largest first).

    >>> split_grid(8, ("d", "h")), split_grid(8, ("d", "h", "w")), split_grid(6, ("h",))
    ((4, 2, 1), (2, 2, 2), (1, 6, 1))
    """
    if degree < 1 or not dims or any(d not in SPATIAL_DIMS for d in dims) or len(set(dims)) != len(dims):
        raise SpatialSplitError(
            f"spatial split of degree {degree} over dims {list(dims)}: "
            f"use a degree >= 1 and distinct dims among d, h, w"
        )
    sizes = {d: 1 for d in dims}
    factors, n, p = [], degree, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    for f in sorted(factors, reverse=True):
        smallest = min(dims, key=lambda d: (sizes[d], dims.index(d)))
        sizes[smallest] *= f
    return tuple(sizes.get(d, 1) for d in SPATIAL_DIMS)  # type: ignore[return-value]


def check_split(layer: VolumeLayer, option: SpatialOption) -> None:
    """Raise a one-line :class:`SpatialSplitError` unless ``layer`` can run split as ``option``."""
    if option.degree == 1:
        return
    if not layer.splittable:
        raise SpatialSplitError(
            f"layer {layer.path} is dense ({layer.c_in} -> {layer.c_out} features) and has no volume to split; "
            f"leave it unsplit (spatial degree 1)"
        )
    for dim, g in zip(SPATIAL_DIMS, option.grid):
        if g == 1:
            continue
        if layer.in_extent % g:
            raise SpatialSplitError(
                f"layer {layer.path}: spatial degree {g} along {dim} does not divide its {layer.in_extent}-voxel "
                f"extent; choose a degree dividing {layer.in_extent}"
            )
        local = layer.in_extent // g
        if layer.halo > local:
            raise SpatialSplitError(
                f"layer {layer.path}: halo of {layer.halo} voxels is wider than its {local}-voxel shard along {dim} "
                f"({layer.in_extent} / {g}); use a spatial degree <= {layer.in_extent // layer.halo} along {dim}"
            )
        stride = layer.stride * layer.pool
        if layer.op in ("pool", "conv") and local % stride:
            raise SpatialSplitError(
                f"layer {layer.path}: its {stride}x pooling does not divide the {local}-voxel shard along {dim}; "
                f"use a spatial degree dividing {layer.in_extent // stride} along {dim}"
            )


def layer_options(layer: VolumeLayer, sd: int) -> list[SpatialOption]:
    """Unsplit, and each distinct grid of ``s`` shards over d / dh / dhw, for every degree ``s > 1`` dividing
    ``sd``, that the layer can run (largest degree first).

    >>> from planner.model.cnn3d import volume_layers
    >>> from planner.model.spec import parse_model
    >>> conv = volume_layers(parse_model("unet3d:tiny"))[1]
    >>> [o.label for o in layer_options(conv, 4)]
    ['dp', 'sd4 d4', 'sd4 d2xh2', 'sd2 d2']
    """
    options = [UNSPLIT]
    if not layer.splittable:
        return options
    for degree in sorted((s for s in range(2, sd + 1) if sd % s == 0), reverse=True):
        for dims in DIM_CHOICES:
            option = SpatialOption(grid=split_grid(degree, dims))
            if option in options:
                continue
            try:
                check_split(layer, option)
            except SpatialSplitError:
                continue
            options.append(option)
    return options


@lru_cache(maxsize=4096)
def crosses_nodes(grid: tuple[int, int, int], dim: int, devices_per_node: int) -> bool:
    """True when some pair of neighbours along grid dim ``dim`` sits on two nodes (ranks row-major, w fastest)."""
    stride = math.prod(grid[dim + 1 :])
    n = math.prod(grid)
    return any(
        r // devices_per_node != (r + stride) // devices_per_node
        for r in range(n)
        if (r // stride) % grid[dim] != grid[dim] - 1
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class SpatialLayerCost:
    """One layer at one option, per micro-batch on one rank: seconds and saved bytes."""

    compute_s: float  # forward + backward
    forward_s: float  # the forward part of compute_s
    halo_s: float  # halo exchanges, forward + backward
    norm_s: float  # GroupNorm statistics all-reduces, forward + backward
    act_bytes: float
    halo_bytes: float  # per rank and micro-batch, forward (backward sends as many)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.halo_s + self.norm_s


def halo_exchange(
    layer: VolumeLayer, option: SpatialOption, *, samples: int, dtype: str, node: NodeType, cluster: ClusterProfile
) -> tuple[float, float]:
    """(seconds, bytes) of one forward halo exchange of ``layer``'s input (module docstring)."""
    if option.degree == 1 or layer.halo == 0:
        return 0.0, 0.0
    local = [layer.in_extent // g for g in option.grid]
    seconds = nbytes = 0.0
    for j, g in enumerate(option.grid):
        if g == 1:
            continue
        others = [local[i] for i in range(3) if i != j]
        face = layer.halo * layer.c_in * others[0] * others[1] * samples * DTYPE_BYTES[dtype]
        spans = crosses_nodes(option.grid, j, node.devices_per_node)
        one = collective_time(
            cluster, "send_recv", face, 2, node_type=node, spans_nodes=spans, ranks_per_node=1 if spans else 2
        )
        messages = min(2, g - 1)
        seconds += messages * one
        nbytes += messages * face
        local[j] += 2 * layer.halo  # the next dim's faces include this dim's halos (edges, corners)
    return seconds, nbytes


def spatial_layer_cost(
    profile: LayerProfile,
    layer: VolumeLayer,
    option: SpatialOption,
    *,
    micro_batch: int,
    dtype: str,
    node: NodeType,
    cluster: ClusterProfile,
) -> SpatialLayerCost:
    """Cost of ``layer`` under ``option`` on one rank of its spatial group (module docstring)."""
    check_split(layer, option)
    full = layer_cost(
        profile,
        node=node,
        cluster=cluster,
        tp=1,
        style="replicate",
        recompute="none",
        sequence_parallel=False,
        micro_batch=micro_batch,
        flash_attention=False,
        dtype=dtype,
    )
    s = option.degree
    halo_s, halo_bytes = halo_exchange(layer, option, samples=micro_batch, dtype=dtype, node=node, cluster=cluster)
    norm_s = 0.0
    if layer.norm and s > 1:
        spans = s > node.devices_per_node
        stats = NORM_STAT_BYTES * norm_groups(layer.c_out) * micro_batch
        per_node = min(s, node.devices_per_node)
        norm_s = 4 * collective_time(
            cluster, "all_reduce", stats, s, node_type=node, spans_nodes=spans, ranks_per_node=per_node
        )
    padded = 1.0
    if layer.halo and s > 1:
        local = [layer.in_extent // g for g in option.grid]
        padded = math.prod(n + 2 * layer.halo * (g > 1) for n, g in zip(local, option.grid)) / math.prod(local)
    input_saved = min(full.act_bytes, profile.input_bytes_per_sample * micro_batch)
    act = full.act_bytes / s + (padded - 1.0) * input_saved / s
    return SpatialLayerCost(
        compute_s=(full.forward_s + full.backward_s) / s,
        forward_s=full.forward_s / s,
        halo_s=2 * halo_s,
        norm_s=norm_s,
        act_bytes=act,
        halo_bytes=halo_bytes,
    )
