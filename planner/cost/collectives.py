"""Time of one collective on a cluster, from the profile's alpha-beta fits, per algorithm.

A fit (:class:`planner.profile.load.CollectiveFit`) gives ``time = alpha + bus_factor(op, n) * bytes / bus_bw``
for the rank count it was measured or quoted with. This module turns it into a per-algorithm model:

- **ring** — Patarasuk & Yuan 2009 (bandwidth-optimal all-reduce): ``2(n-1)`` steps, each rank moves
  ``2(n-1)/n * S`` bytes; all-gather / reduce-scatter ``n-1`` steps and ``(n-1)/n * S``. Latency as in
  NCCL's own tuning model (``src/graph/tuning.cc``, ``ncclTopoTuneModel``): of the ring's steps, the
  ``steps(N nodes)`` that cross a node boundary pay the inter-node per-step latency and the rest the
  intra-node one; a fit's per-step latency is ``fit.alpha_s / steps(fit.n_ranks)``.
- **tree** — NCCL's double binary tree (Sanders, Speck & Träff 2009; NCCL 2.4 blog "Massively scale your
  deep learning training with NCCL 2.4"): ``2 ceil(log2 n)`` latency steps, each rank sends and receives
  ``S`` up and ``S`` down, i.e. ``2 S / bw`` — tree only wins on latency (small messages, many ranks).
- **hierarchical** — intra-node reduce-scatter, inter-node all-reduce of ``S/k`` per rank, intra-node
  all-gather (the seeds' multi-colour / PowerAI DDL all-reduce, Cho et al. 2017; Horovod hierarchical
  allreduce). Only for all-reduce across nodes with ``k >= 2`` ranks per node.
- **parameter_server** — one server rank receives every worker's gradient and sends the update back:
  ``2 n S / bw`` (the comparison point of FireCaffe, Iandola et al. 2016 §3, and Poseidon, Zhang et al.
  2017). For comparison only: ``auto`` never picks it.

Bandwidths. Intra-node: the node type's fit. Inter-node fits are **per node** (NCCL-tests bus bandwidth
with every GPU of each node in the collective, i.e. all NICs busy); a group with ``k`` of the node's
``d`` GPUs gets ``k/d`` of it (the other ``d/k`` groups, e.g. the other TP ranks' DP groups, run at the
same time, each on its own NICs). A flat algorithm across nodes runs at ``min(intra, inter share)``.
Point-to-point across nodes gets one NIC's share, ``inter / d``, per rank. A profile with a
:class:`~planner.profile.load.FabricLoad` scales every inter-node bandwidth by its fraction at the job's node
count (the cluster as resized to the job by ``planner.cost.placement.with_gpus``): a large job's flows share
the fabric's upper links.

A missing fit for an op falls back to the all-reduce fit of the same level (one bus bandwidth describes a
link whatever the op, per the bus-bandwidth convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from planner.core import StratagemError
from planner.profile import ClusterProfile, CollectiveFit, NodeType, bus_factor

if TYPE_CHECKING:
    from planner.cost.placement import GroupShape

Algorithm = Literal["auto", "ring", "tree", "hierarchical", "parameter_server"]
ALGORITHMS = ("ring", "tree", "hierarchical", "parameter_server")


def ring_steps(op: str, n_ranks: int) -> int:
    """Latency steps of the ring algorithm: 2(n-1) for all-reduce, n-1 for gathers/scatters, 1 for p2p."""
    if op == "send_recv":
        return 1
    return 2 * (n_ranks - 1) if op == "all_reduce" else n_ranks - 1


def _find_fit(fits: list[CollectiveFit], op: str, where: str) -> CollectiveFit:
    for fit in fits:
        if fit.op == op:
            return fit
    for fit in fits:
        if fit.op == "all_reduce":
            return fit
    raise StratagemError(
        f"{where} has no collective fit for {op} (nor all_reduce); profile the cluster "
        f"with `stratagem profile cluster` or add the fit to its profile"
    )


def inter_node_bw(cluster: ClusterProfile, fit: CollectiveFit) -> float:
    """Bus bandwidth of an inter-node fit at this job's size: the fit's, times the cluster's fabric-load share
    (:meth:`planner.profile.ClusterProfile.inter_node_fraction`; 1 without a
    :class:`~planner.profile.FabricLoad`)."""
    return fit.bus_bw_bytes_per_s * cluster.inter_node_fraction()


def _alpha_step(fit: CollectiveFit) -> float:
    return fit.alpha_s / ring_steps(fit.op, fit.n_ranks)


def _resolve_node(cluster: ClusterProfile, node_type: NodeType | str) -> NodeType:
    if isinstance(node_type, NodeType):
        return node_type
    try:
        return cluster.node_type(node_type)
    except KeyError:
        names = ", ".join(nt.name for nt in cluster.node_types)
        raise StratagemError(f"cluster {cluster.name} has no node type {node_type!r}; use one of {names}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Link:
    """Per-step latencies inside and across nodes, the group's bus bandwidth, and its node count."""

    intra_step_s: float
    inter_step_s: float
    bw: float
    nodes: int


def _flat_link(
    cluster: ClusterProfile, node: NodeType, op: str, n_ranks: int, spans_nodes: bool, ranks_per_node: int
) -> _Link:
    """Latencies and bandwidth of a flat ring or tree over this group."""
    intra = (
        _find_fit(node.intra_node, op, f"node type {node.name} (intra-node)")
        if (ranks_per_node > 1 or not spans_nodes)
        else None
    )
    if not spans_nodes:
        assert intra is not None  # looked up above whenever the group stays inside a node
        step = _alpha_step(intra)
        return _Link(intra_step_s=step, inter_step_s=step, bw=intra.bus_bw_bytes_per_s, nodes=1)
    inter = _find_fit(cluster.inter_node, op, f"cluster {cluster.name} (inter-node)")
    share = min(1.0, ranks_per_node / node.devices_per_node)
    if op == "send_recv":
        share = 1.0 / node.devices_per_node
    bw = inter_node_bw(cluster, inter) * share
    if intra is not None:
        bw = min(bw, intra.bus_bw_bytes_per_s)
    inter_step = _alpha_step(inter)
    return _Link(
        intra_step_s=_alpha_step(intra) if intra is not None else inter_step,
        inter_step_s=inter_step,
        bw=bw,
        nodes=max(2, math.ceil(n_ranks / ranks_per_node)),
    )


def _ring_s(op: str, message_bytes: float, n: int, link: _Link) -> float:
    inter_steps = ring_steps(op, link.nodes) if link.nodes > 1 else 0
    latency = (ring_steps(op, n) - inter_steps) * link.intra_step_s + inter_steps * link.inter_step_s
    return latency + bus_factor(op, n) * message_bytes / link.bw


def _tree_s(message_bytes: float, n: int, link: _Link) -> float:
    """NCCL tree latency: 2 ((ppn - 1) intra + log2(nodes) inter) steps (tuning.cc); bandwidth 2 S / bw."""
    ppn = max(1, n // link.nodes)
    latency = 2 * ((ppn - 1) * link.intra_step_s + math.ceil(math.log2(max(2, link.nodes))) * link.inter_step_s)
    if link.nodes == 1:
        latency = 2 * math.ceil(math.log2(n)) * link.intra_step_s
    return latency + 2 * message_bytes / link.bw


def _hierarchical_s(
    cluster: ClusterProfile, node: NodeType, message_bytes: float, n: int, ranks_per_node: int
) -> float:
    k = ranks_per_node
    nodes = max(2, math.ceil(n / k))
    intra = _find_fit(node.intra_node, "reduce_scatter", f"node type {node.name} (intra-node)")
    inter = _find_fit(cluster.inter_node, "all_reduce", f"cluster {cluster.name} (inter-node)")
    step = _alpha_step(intra)
    scatter_s = _ring_s(
        "reduce_scatter",
        message_bytes,
        k,
        _Link(intra_step_s=step, inter_step_s=step, bw=intra.bus_bw_bytes_per_s, nodes=1),
    )
    group_bw = inter_node_bw(cluster, inter) * min(1.0, k / node.devices_per_node)
    # k concurrent inter-node all-reduces of S/k, sharing the group's NIC bandwidth: each gets group_bw/k.
    step = _alpha_step(inter)
    inter_s = _ring_s(
        "all_reduce",
        message_bytes / k,
        nodes,
        _Link(intra_step_s=step, inter_step_s=step, bw=group_bw / k, nodes=nodes),
    )
    return 2 * scatter_s + inter_s  # the all-gather mirrors the reduce-scatter


def _parameter_server_s(message_bytes: float, n: int, link: _Link) -> float:
    return 2 * link.inter_step_s + 2 * n * message_bytes / link.bw


def collective_time(
    cluster: ClusterProfile,
    op: str,
    message_bytes: float,
    n_ranks: int,
    *,
    node_type: NodeType | str,
    spans_nodes: bool,
    ranks_per_node: int,
    algorithm: Algorithm = "auto",
) -> float:
    """Seconds for one ``op`` of ``message_bytes`` (the full tensor) over ``n_ranks`` ranks.

    ``ranks_per_node``: ranks of this group inside each node (= n_ranks when it does not span nodes).
    ``algorithm="auto"`` returns the cheapest applicable of ring, tree and hierarchical; asking for an
    algorithm that does not apply (tree for all-gather, hierarchical inside a node) is an error.

    >>> # 1 GB all-reduce over 8 GPUs at 200 GB/s bus bandwidth: 2*7/8 * 1e9 / 2e11 = 8.75 ms + latency
    """
    if n_ranks <= 1 or message_bytes <= 0:
        return 0.0
    node = _resolve_node(cluster, node_type)
    ranks_per_node = max(1, min(ranks_per_node, n_ranks))
    link = _flat_link(cluster, node, op, n_ranks, spans_nodes, ranks_per_node)
    options: dict[str, float] = {"ring": _ring_s(op, message_bytes, n_ranks, link)}
    if op == "all_reduce":
        options["tree"] = _tree_s(message_bytes, n_ranks, link)
        options["parameter_server"] = _parameter_server_s(message_bytes, n_ranks, link)
        if spans_nodes and ranks_per_node >= 2:
            options["hierarchical"] = _hierarchical_s(cluster, node, message_bytes, n_ranks, ranks_per_node)
    if algorithm == "auto":
        return min(t for name, t in options.items() if name != "parameter_server")
    if algorithm not in options:
        raise StratagemError(
            f"algorithm {algorithm!r} does not apply to {op} over {n_ranks} ranks "
            f"(spans_nodes={spans_nodes}); use one of {', '.join(options)} or auto"
        )
    return options[algorithm]


def group_collective_s(cluster: ClusterProfile, node: NodeType, op: str, nbytes: float, group: GroupShape) -> float:
    """:func:`collective_time` of ``op`` on ``nbytes`` over a rank group laid out as ``group``
    (``planner.cost.placement.GroupShape``: its size, whether it spans nodes, its ranks per node)."""
    return collective_time(
        cluster,
        op,
        nbytes,
        group.n_ranks,
        node_type=node,
        spans_nodes=group.spans_nodes,
        ranks_per_node=group.ranks_per_node,
    )
