"""Step time and memory of a hybrid data + spatial plan of a 3D CNN (Oyama et al., TPDS 2021, §3).

``dp x sd`` ranks (mesh axes ``dp, sd``, ``sd`` fastest: a spatial group is ``sd`` consecutive ranks, inside
one node when ``sd`` <= devices per node). Each dp replica trains ``global_batch / dp`` samples per step in
``num_micro_batches`` micro-batches of ``micro_batch`` samples (gradient accumulation); the ``sd`` ranks of a
group share every sample, each layer split as its :class:`SpatialOption` says (unsplit: replicated in the
group; split ``s < sd`` ways: on each of ``sd / s`` sub-groups). Per step::

    step = m * (sum_l t_l(o_l) + sum_(p->c) relayout(o_p, o_c)) + allreduce(grad bytes, dp * sd ranks)

with the per-layer and layout-change terms of ``planner/cost/spatial.py`` (edges p->c: consecutive layers and
U-Net skip connections), and the gradient all-reduce not overlapped with backward (an upper bound; the
gradients of a 3D CNN are small next to its activations). Peak memory per rank::

    (1 + fragmentation) * (16 P + sum_l act_l(o_l)) + CUDA context

(weights, gradients and AdamW states of mixed precision: ZeRO paper §5.1, 16 bytes per parameter; one
micro-batch's activations live at a time; reserve as ``planner.cost.memory.reserve_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from planner.core import DTYPE_BYTES, StratagemError, is_gpu
from planner.cost.collectives import collective_time
from planner.cost.memory import model_states_bytes, reserve_bytes
from planner.cost.spatial import UNSPLIT, SpatialLayerCost, SpatialOption, spatial_layer_cost
from planner.model import VolumeLayer, volume_layers
from planner.profile import ClusterProfile, ModelProfile, NodeType


@dataclass(frozen=True, kw_only=True, slots=True)
class SpatialConfig:
    """One hybrid data + spatial configuration; ``layout`` per module path (absent = unsplit)."""

    dp: int
    sd: int
    micro_batch: int
    num_micro_batches: int
    layout: Mapping[str, SpatialOption]

    def option(self, path: str) -> SpatialOption:
        return self.layout.get(path, UNSPLIT)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerRow:
    """One layer of an estimate: its option, time per micro-batch and saved bytes per rank."""

    path: str
    option: str
    time_s: float
    halo_s: float
    act_bytes: float
    act_bytes_unsplit: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SpatialEstimate:
    step_time_s: float
    breakdown_s: dict[str, float]
    per_micro_batch_s: dict[str, float]  # forward, backward (each with its halo/norm traffic), and the traffic alone
    memory_bytes: dict[str, float]  # params, grads, optimizer, activations, reserve
    peak_memory_bytes: float
    capacity_bytes: float
    layers: tuple[LayerRow, ...]

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes


class SpatialCosts:
    """Per-layer, per-option costs and edge costs of one model, cluster, ``sd`` and micro-batch (shared by
    :func:`estimate_spatial` and the ILP of ``planner/search/spatial.py``, so both add the same numbers)."""

    def __init__(self, profile: ModelProfile, cluster: ClusterProfile, *, sd: int, micro_batch: int) -> None:
        if profile.model.family not in ("unet3d", "cosmoflow"):
            raise StratagemError(
                f"{profile.model.name} is not a 3D CNN; spatial parallelism plans unet3d and cosmoflow models"
            )
        self.profile, self.cluster, self.sd, self.micro_batch = profile, cluster, sd, micro_batch
        self.node: NodeType = cluster.node_types[0]
        self.dtype = profile.dtype
        self.table: list[VolumeLayer] = volume_layers(profile.model)
        paths = [layer.path for layer in profile.layers]
        if paths != [layer.path for layer in self.table]:
            raise StratagemError(
                f"model profile {profile.name} has layers {paths[:3]}..., not those of {profile.model.name}; "
                f"re-profile the model"
            )
        self._layer_costs: dict[tuple[str, SpatialOption], SpatialLayerCost] = {}

    def layer(self, path: str, option: SpatialOption) -> SpatialLayerCost:
        key = (path, option)
        if key not in self._layer_costs:
            vl = next(v for v in self.table if v.path == path)
            self._layer_costs[key] = spatial_layer_cost(
                self.profile.layer(path), vl, option, micro_batch=self.micro_batch,
                dtype=self.dtype, node=self.node, cluster=self.cluster,
            )  # fmt: skip
        return self._layer_costs[key]

    @cached_property
    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) of every activation that crosses layers: consecutive layers, skip connections."""
        out = [(a.path, b.path) for a, b in zip(self.table, self.table[1:])]
        out += [(v.skip_from, v.path) for v in self.table if v.skip_from]
        return out

    def edge(self, producer: str, before: SpatialOption, after: SpatialOption) -> float:
        """Seconds per micro-batch (forward + backward) to re-lay-out ``producer``'s output (spatial.py)."""
        if before == after:
            return 0.0
        return self.relayout_part(producer, before) + self.relayout_part(producer, after)

    def relayout_part(self, producer: str, option: SpatialOption) -> float:
        """One side's share of a layout change of ``producer``'s output: the all-gather over that side's
        sub-group of ``option.degree`` ranks (0 unsplit)."""
        nbytes = self.profile.layer(producer).output_bytes_per_sample * self.micro_batch
        return self._gather_s(nbytes, option.degree)

    def _gather_s(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        dpn = self.node.devices_per_node
        return collective_time(
            self.cluster, "all_gather", nbytes, ranks, node_type=self.node, spans_nodes=ranks > dpn,
            ranks_per_node=min(ranks, dpn),
        )  # fmt: skip

    def grad_sync_s(self, dp: int) -> float:
        world = dp * self.sd
        dpn = self.node.devices_per_node
        nbytes = self.profile.total_params * DTYPE_BYTES[self.dtype]
        return collective_time(
            self.cluster, "all_reduce", nbytes, world, node_type=self.node, spans_nodes=world > dpn,
            ranks_per_node=min(world, dpn),
        )  # fmt: skip

    def states_bytes(self, dp: int) -> dict[str, float]:
        states = model_states_bytes(self.profile.total_params, 0, dp * self.sd, self.dtype)
        return {"params": states.params_bytes, "grads": states.grads_bytes, "optimizer": states.optimizer_bytes}

    def peak_bytes(self, allocated: float) -> float:
        return allocated + reserve_bytes(allocated, is_gpu=is_gpu(self.node.device))


def estimate_spatial(
    profile: ModelProfile, cluster: ClusterProfile, config: SpatialConfig, *, costs: SpatialCosts | None = None
) -> SpatialEstimate:
    """Predicted step time and per-rank memory of ``config`` (module docstring). Bad splits raise one line.

    ``costs``: per-layer costs already built for this profile, cluster, ``sd`` and micro-batch (a cache for
    callers that estimate many layouts of one candidate)."""
    if costs is None or (costs.sd, costs.micro_batch) != (config.sd, config.micro_batch):
        costs = SpatialCosts(profile, cluster, sd=config.sd, micro_batch=config.micro_batch)
    unknown = sorted(set(config.layout) - {v.path for v in costs.table})
    if unknown:
        raise StratagemError(f"spatial layout names layers {unknown} that {profile.model.name} does not have")
    for path, option in config.layout.items():
        if config.sd % option.degree:
            raise StratagemError(
                f"layer {path} is split {option.degree} ways, which does not divide the spatial group's "
                f"sd={config.sd} ranks; choose a degree dividing {config.sd}"
            )
    m = config.num_micro_batches
    rows = []
    compute = halo = norm = forward = 0.0
    for vl in costs.table:
        option = config.option(vl.path)
        c = costs.layer(vl.path, option)
        compute, halo, norm = compute + c.compute_s, halo + c.halo_s, norm + c.norm_s
        forward += c.forward_s
        unsplit = costs.layer(vl.path, UNSPLIT).act_bytes
        rows.append(
            LayerRow(path=vl.path, option=option.label, time_s=c.time_s, halo_s=c.halo_s, act_bytes=c.act_bytes,
                     act_bytes_unsplit=unsplit)
        )  # fmt: skip
    relayout = sum(costs.edge(p, config.option(p), config.option(c)) for p, c in costs.edges)
    sync = costs.grad_sync_s(config.dp)
    breakdown = {
        "compute": m * compute,
        "halo_exchange": m * halo,
        "norm_allreduce": m * norm,
        "layout_change": m * relayout,
        "dp_grad_sync": sync,
    }
    memory = costs.states_bytes(config.dp)
    memory["activations"] = sum(r.act_bytes for r in rows)
    allocated = sum(memory.values())
    peak = costs.peak_bytes(allocated)
    memory["reserve"] = peak - allocated
    # per micro-batch, for the plan's stage record: halo and norm traffic is half forward, half backward
    per_micro = {
        "forward": forward + (halo + norm) / 2,
        "backward": compute - forward + (halo + norm) / 2,
        "halo_exchange": halo,
        "norm_allreduce": norm,
        "layout_change": relayout,
    }
    return SpatialEstimate(
        step_time_s=sum(breakdown.values()),
        per_micro_batch_s=per_micro,
        breakdown_s=breakdown,
        memory_bytes=memory,
        peak_memory_bytes=peak,
        capacity_bytes=float(costs.node.device_memory_bytes),
        layers=tuple(rows),
    )
