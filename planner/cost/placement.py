"""Where a configuration puts things: layers into chunks, pp ranks onto node types, groups onto nodes.

Rank layout follows the plan file (``planner.plan.schema``): mesh axes ``(pp, dp, tp)``, tp fastest, so a TP
group is ``tp`` consecutive ranks and a stage's ``dp * tp`` ranks are consecutive. With ``d`` devices per
node (and groups aligned to node boundaries), a TP group spans nodes iff ``tp > d``; a DP group has
``min(dp, d // tp)`` ranks per node and spans nodes iff ``dp * tp > d``; consecutive pipeline ranks sit on
different nodes iff ``dp * tp >= d`` or their node types differ.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from planner.core import Recompute, StratagemError, TPStyle
from planner.cost.config import ParallelConfig
from planner.profile import ClusterProfile, LayerProfile, ModelProfile, NodeGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupShape:
    """One communication group: its size, ranks per node, and whether it crosses nodes."""

    n_ranks: int
    ranks_per_node: int
    spans_nodes: bool


def tp_group(tp: int, devices_per_node: int) -> GroupShape:
    spans = tp > devices_per_node
    return GroupShape(n_ranks=tp, ranks_per_node=min(tp, devices_per_node), spans_nodes=spans)


def dp_group(dp: int, tp: int, devices_per_node: int, *, include_tp: bool = False) -> GroupShape:
    """The DP group of one rank: ``dp`` ranks ``tp`` apart (``include_tp``: the whole ``tp * dp`` block of
    a stage, over which replicated layers under ``tp > 1`` — batch-split inside the TP group, Whale — sync)."""
    if include_tp:
        n = dp * tp
        return GroupShape(n_ranks=n, ranks_per_node=min(n, devices_per_node), spans_nodes=n > devices_per_node)
    per_node = max(1, min(dp, devices_per_node // tp)) if tp <= devices_per_node else 1
    return GroupShape(n_ranks=dp, ranks_per_node=per_node, spans_nodes=dp * tp > devices_per_node)


def with_gpus(cluster: ClusterProfile, gpus: int) -> ClusterProfile:
    """``cluster`` resized to hold ``gpus`` devices: a single-type cluster gets ``ceil(gpus / d)`` nodes
    (the shipped profiles describe a node type and its network; the node count is the user's choice).
    A mixed cluster is returned unchanged and must already hold ``gpus`` devices."""
    if gpus < 1:
        raise StratagemError(f"--gpus must be >= 1, got {gpus}")
    if cluster.is_inventory and gpus > cluster.total_devices:
        raise StratagemError(
            f"cluster {cluster.name} is a measured inventory of {cluster.total_devices} devices, "
            f"not {gpus}; use --gpus <= {cluster.total_devices}, or profile the larger cluster "
            f"(stratagem profile cluster --nnodes ...)"
        )
    if not cluster.is_mixed and not cluster.is_inventory and gpus > cluster.total_devices:
        log.warning(
            "cluster %s lists %d devices; planning for %d of its node type (a datasheet template, resized)",
            cluster.name,
            cluster.total_devices,
            gpus,
        )
    if cluster.is_mixed:
        if gpus > cluster.total_devices:
            raise StratagemError(
                f"mixed cluster {cluster.name} has {cluster.total_devices} devices, not "
                f"{gpus}; use --gpus <= {cluster.total_devices} or edit its node groups"
            )
        return cluster
    node_type = cluster.nodes[0].node_type
    per_node = cluster.node_type(node_type).devices_per_node
    nodes = [NodeGroup(node_type=node_type, count=math.ceil(gpus / per_node))]
    return cluster.model_copy(update={"nodes": nodes, "content_hash": None})


def default_style(layer: LayerProfile, tp: int) -> TPStyle:
    """Split TP-capable layers when tp > 1, replicate the rest (ParallelConfig.layout's default)."""
    return "split" if tp > 1 and layer.tp_style != "none" else "replicate"


def layer_style(config: ParallelConfig, layer: LayerProfile) -> TPStyle:
    return config.layout.get(layer.path, default_style(layer, config.tp))


# Layer kinds a *default* recompute mode (``recompute="full"``) leaves alone: Megatron-LM recomputes
# transformer layers only (``--recompute-granularity``), and SC21 eq. 3 counts no recompute of the head.
NOT_RECOMPUTED_BY_DEFAULT = frozenset({"embedding", "head", "norm", "pool", "classifier"})


def layer_recompute(config: ParallelConfig, layer: LayerProfile) -> Recompute:
    """The layer's recompute mode: from the per-path mapping (absent = none), or the default mode for
    every layer whose kind is not in ``NOT_RECOMPUTED_BY_DEFAULT``."""
    if isinstance(config.recompute, str):
        return "none" if layer.kind in NOT_RECOMPUTED_BY_DEFAULT else config.recompute
    return config.recompute.get(layer.path, "none")


def block_count(model: ModelProfile) -> int:
    """The model's repeated blocks (layers of kind ``block``; every layer when it has none)."""
    return sum(1 for layer in model.layers if layer.kind == "block") or len(model.layers)


def interleaved_chunk_sizes(model: ModelProfile, config: ParallelConfig) -> tuple[int, ...] | None:
    """Layers per chunk of an interleaved schedule (None for one chunk per rank).

    Interleaved 1F1B runs equal chunks: each holds ``blocks / (pp * v)`` blocks, the layers before the
    first block join the first chunk and those after the last block the last (Megatron-LM's
    ``--num-layers-per-virtual-pipeline-stage``; the bubble (p - 1) / v of Narayanan et al. SC21 §2.2.2
    assumes equal chunks, which the cost model's formula (P) does too). So the chunk sizes are fixed.
    """
    if config.virtual_stages < 2:
        return None
    return tuple(len(chunk) for chunk in assign_chunks(model, replace(config, stage_layers=None)))


def assign_chunks(model: ModelProfile, config: ParallelConfig) -> list[list[LayerProfile]]:
    """Layers of each chunk (``pp * v`` chunks in model order; chunk ``i`` runs on pp rank ``i % pp``).

    Without ``stage_layers``: blocks split as evenly as possible, earlier chunks taking the remainder
    (Megatron requires equal counts; the ILP may choose any boundaries); the layers before the first
    block join the first chunk, the layers after the last block join the last.
    """
    n_chunks = config.pp * config.virtual_stages
    by_path = {layer.path: layer for layer in model.layers}
    if config.stage_layers is not None:
        return _explicit_chunks(model, config, by_path, n_chunks)
    blocks = [i for i, layer in enumerate(model.layers) if layer.kind == "block"]
    if not blocks:
        blocks = list(range(len(model.layers)))
    if len(blocks) < n_chunks:
        raise StratagemError(
            f"the model has {len(blocks)} blocks but pp={config.pp} x virtual stages="
            f"{config.virtual_stages} needs {n_chunks} chunks; reduce --pp or --virtual-stages"
        )
    base, extra = divmod(len(blocks), n_chunks)
    chunks: list[list[LayerProfile]] = []
    start = 0
    for c in range(n_chunks):
        size = base + (1 if c < extra else 0)
        chunks.append([model.layers[i] for i in blocks[start : start + size]])
        start += size
    chunks[0] = model.layers[: blocks[0]] + chunks[0]
    chunks[-1] = chunks[-1] + model.layers[blocks[-1] + 1 :]
    return chunks


def _explicit_chunks(
    model: ModelProfile, config: ParallelConfig, by_path: dict[str, LayerProfile], n_chunks: int
) -> list[list[LayerProfile]]:
    stage_layers = config.stage_layers or ()
    if len(stage_layers) != n_chunks:
        raise StratagemError(
            f"stage_layers lists {len(stage_layers)} chunks but pp={config.pp} x virtual "
            f"stages={config.virtual_stages} = {n_chunks}; give one entry per chunk"
        )
    flat = [p for chunk in stage_layers for p in chunk]
    if flat != [layer.path for layer in model.layers]:
        unknown = sorted(set(flat) - set(by_path))
        missing = sorted(set(by_path) - set(flat))
        raise StratagemError(
            f"stage_layers must list every layer once, in model order (unknown {unknown[:3]}, "
            f"missing {missing[:3]}); fix the stage boundaries"
        )
    if any(not chunk for chunk in stage_layers):
        raise StratagemError("a pipeline chunk in stage_layers is empty; give every chunk at least one layer")
    return [[by_path[p] for p in chunk] for chunk in stage_layers]


def rank_node_types(cluster: ClusterProfile, config: ParallelConfig) -> list[str]:
    """Node type of each pp rank; checks that every type has the devices its stages need."""
    names = [nt.name for nt in cluster.node_types]
    types = list(config.stage_node_types) if config.stage_node_types else [cluster.nodes[0].node_type] * config.pp
    if len(types) != config.pp:
        raise StratagemError(
            f"stage_node_types names {len(types)} node types for pp={config.pp}; give one per pipeline rank"
        )
    for t in types:
        if t not in names:
            raise StratagemError(f"stage node type {t!r} is not in cluster {cluster.name} ({', '.join(names)})")
    for name in set(types):
        need = types.count(name) * config.dp * config.tp
        have = sum(g.count for g in cluster.nodes if g.node_type == name) * cluster.node_type(name).devices_per_node
        if need > have:
            raise StratagemError(
                f"the stages placed on {name} need {need} devices but the cluster has {have}; "
                f"move stages to another node type or use a larger cluster"
            )
    return types


def fill_stage_node_types(cluster: ClusterProfile, config: ParallelConfig) -> ParallelConfig:
    """``config`` with pp ranks placed on node types in cluster order, each taking ``dp * tp`` devices
    from the first type with room (the default placement on a mixed cluster)."""
    free: dict[str, int] = {}
    for group in cluster.nodes:
        free[group.node_type] = (
            free.get(group.node_type, 0) + group.count * cluster.node_type(group.node_type).devices_per_node
        )
    need = config.dp * config.tp
    types = []
    for r in range(config.pp):
        name = next((t for t, n in free.items() if n >= need), None)
        if name is None:
            raise StratagemError(
                f"pipeline rank {r} needs {need} devices of one node type but none is left in "
                f"{cluster.name}; reduce dp*tp or pp"
            )
        free[name] -= need
        types.append(name)
    return replace(config, stage_node_types=tuple(types))


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSet:
    """The dp replicas of one node type (``ParallelConfig.replica_node_types``) and the groups they sync over.

    ``micro_batches`` is ``m_t``, the most any of these replicas runs; ``dp_group``/``dp_tp_group`` are the
    shapes of the data-parallel groups (which span every replica, of every type) and ``sync_node_types`` the
    node types those groups touch: a collective over them runs at the slowest (see :func:`replica_sets`).
    """

    node_type: str
    replicas: tuple[int, ...]
    micro_batches: int
    batch_share_total: float
    dp_group: GroupShape
    dp_tp_group: GroupShape
    sync_node_types: tuple[str, ...]


def _mixed_dp_groups(cluster: ClusterProfile, config: ParallelConfig) -> tuple[GroupShape, GroupShape]:
    """DP group shapes when the replicas sit on several node types (so on different nodes).

    Rank layout of such plans (``planner.search.plan_file``): mesh axes ``dp, pp, tp``, so replica ``j`` is
    the ``j``-th block of ``pp * tp`` ranks and the members of a DP group are ``pp * tp`` ranks apart. A
    type-``t`` node (``d_t`` devices) holds ``k_t = d_t // (pp * tp)`` whole replicas (one part of one when
    ``pp * tp > d_t``), so its share of the DP group has ``min(count_t, max(k_t, 1))`` ranks per node and
    of the ``dp x tp`` group ``min(count_t, k_t) * tp`` (``min(tp, d_t)`` when a replica spans nodes).
    The group crosses nodes and is given the smallest of those per-node counts: fewer ranks per node
    means a smaller share of the node's NICs in ``collectives._flat_link``, so the time is an upper bound
    for the other types' nodes.
    """
    types = config.replica_node_types or ()
    tp, block = config.tp, config.pp * config.tp
    per_dp, per_dpt = [], []
    for name in dict.fromkeys(types):
        d, count = cluster.node_type(name).devices_per_node, types.count(name)
        whole = d // block
        per_dp.append(min(count, max(whole, 1)))
        per_dpt.append(min(count, whole) * tp if whole >= 1 else min(tp, d))
    return (
        GroupShape(n_ranks=config.dp, ranks_per_node=min(per_dp), spans_nodes=True),
        GroupShape(n_ranks=config.dp * tp, ranks_per_node=min(per_dpt), spans_nodes=True),
    )


def replica_sends_cross_nodes(config: ParallelConfig, devices_per_node: int) -> bool:
    """Whether pipeline sends inside a replica are charged inter-node in the ``dp, pp, tp`` layout of plans
    with replicas on several node types: consecutive stages are ``tp`` ranks apart, so they stay inside a
    node unless the replica's ``pp * tp`` ranks span nodes; then every send is charged inter-node (an upper
    bound: only the sends at node boundaries cross)."""
    return config.pp * config.tp > devices_per_node


def replica_sets(cluster: ClusterProfile, config: ParallelConfig, micro_batches: tuple[int, ...]) -> list[ReplicaSet]:
    """One :class:`ReplicaSet` per distinct node type of ``config.replica_node_types`` (in order of first use).

    ``micro_batches``: per replica (``validate.replica_micro_batches``). With a single type the groups are
    exactly :func:`dp_group`'s, so the estimate equals the one without ``replica_node_types``.
    """
    types = config.replica_node_types or ()
    shares = config.batch_shares or (1.0 / config.dp,) * config.dp
    distinct = tuple(dict.fromkeys(types))
    if len(distinct) == 1:
        d = cluster.node_type(distinct[0]).devices_per_node
        groups = (dp_group(config.dp, config.tp, d), dp_group(config.dp, config.tp, d, include_tp=True))
    else:
        groups = _mixed_dp_groups(cluster, config)
    out = []
    for name in distinct:
        mine = tuple(j for j, t in enumerate(types) if t == name)
        out.append(
            ReplicaSet(
                node_type=name,
                replicas=mine,
                micro_batches=max(micro_batches[j] for j in mine),
                batch_share_total=sum(shares[j] for j in mine),
                dp_group=groups[0],
                dp_tp_group=groups[1],
                sync_node_types=distinct,
            )
        )
    return out


def proportional_shares(
    cluster: ClusterProfile, node_types: list[str] | tuple[str, ...], global_batch: int, micro_batch: int, *, dtype: str
) -> tuple[int, ...]:
    """Micro-batches per dp replica proportional to its node type's achieved FLOP/s of ``dtype``.

    Whale's hardware-aware balancing (Jia et al. ATC'22 §4: batch per replica proportional to device
    speed). ``M = global_batch / micro_batch`` is split by largest remainders (Hamilton's method), every
    replica getting at least one; ``batch_shares = counts[j] * micro_batch / global_batch``.

    >>> # A100 (230.88 TFLOP/s fp16) x2 + V100 (95) x2, M = 64: ideal 22.67, 22.67, 9.33, 9.33
    >>> # proportional_shares(mixed_a100_v100, ["dgx-a100-80g"] * 2 + ["p3.16xlarge"] * 2, 64, 1, dtype="fp16")
    >>> # (23, 23, 9, 9)
    """
    if micro_batch < 1 or global_batch % micro_batch:
        raise StratagemError(
            f"global batch {global_batch} is not a multiple of micro-batch {micro_batch}; "
            f"change --global-batch or --micro-batch"
        )
    total = global_batch // micro_batch
    if not node_types or total < len(node_types):
        raise StratagemError(
            f"{total} micro-batches cannot give each of {len(node_types)} replicas at least one; "
            f"use fewer replicas or a larger global batch"
        )
    speeds = []
    for name in node_types:
        try:
            speeds.append(cluster.node_type(name).compute_for(dtype).achieved_flops_per_s)
        except KeyError:
            raise StratagemError(
                f"node type {name!r} of cluster {cluster.name} has no {dtype} compute figure; "
                f"use a known node type and a dtype it lists"
            ) from None
    ideal = [total * s / sum(speeds) for s in speeds]
    counts = [max(1, math.floor(q)) for q in ideal]
    while sum(counts) < total:  # the largest remainder first, ties to the lower index
        j = max(range(len(counts)), key=lambda j: (ideal[j] - counts[j], -j))
        counts[j] += 1
    while sum(counts) > total:  # only when the floor of 1 lifted a slow replica: take from the most over
        j = min((j for j in range(len(counts)) if counts[j] > 1), key=lambda j: (ideal[j] - counts[j], j))
        counts[j] -= 1
    return tuple(counts)
