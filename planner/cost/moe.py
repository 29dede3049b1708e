"""Mixture-of-Experts blocks: the routed experts' compute, all-to-all, activations and states on one rank.

A block with an :class:`planner.profile.load.ExpertProfile` is costed in two parts: ``compute.layer_cost`` times
its shards (attention, router weights, shared experts: split over the attention tp) and
:func:`add_expert_costs` adds the routed experts, split over the expert layout of Megatron-Core MoE's
"parallel folding" (Liu et al. 2025, arXiv:2504.14960, §3): a stage's ``dp x tp`` ranks regrouped as
``(edp, ep, etp)``, etp fastest (``planner.plan.schema.ExpertLayout``).

Per rank and micro-batch, with ``b`` samples of ``s`` tokens, attention tp ``t``, top-k ``k``, ``E``
experts of width ``f``, model width ``h``, element size ``e`` and the busiest rank's load ``lam``
(``ParallelConfig.moe_load_imbalance``; the capacity factor when tokens are padded to capacity):

- **Tokens.** ``T = b s / t`` enter the MoE layer on each rank (sequence parallel; without it each TP rank
  takes its ``1/t`` slice and all-gathers the output, an extra all-gather each way). The rank sends ``k T``
  token copies to the ep group (GShard, Lepikhin et al. 2020 §2.2), receives ``lam k T`` for its ``E/ep``
  experts, and with ``etp > 1`` all-gathers its etp group's tokens (Megatron-Core's alltoall dispatcher:
  all-gather-v over etp after the all-to-all, reduce-scatter-v before the combine): ``R = lam k T etp`` rows.
- **Compute.** A grouped GEMM of ``E/ep`` problems of ``R / (E/ep)`` rows (MegaBlocks, Gale et al. 2022 §4:
  one kernel over every expert's problem), fc1 ``n = 2 f / etp`` (gate and up), fc2 ``k = f / etp``, through
  the shape-aware kernel model (``planner.cost.kernels``: tiles and waves over all problems at once), plus
  the router ``T x E x h`` and the permute / unpermute copies; backward two GEMMs per GEMM. Model FLOPs use
  the balanced load: ``3 (6 h f k T + 2 h E T)`` per micro-batch.
- **All-to-all.** Dispatch and combine forward, their mirrors backward: four all-to-alls of
  ``S = lam k T h e`` bytes per rank over the ep group, plus etp gathers and scatters of ``etp S``; full
  recompute (or ``moe_recompute``) repeats the forward ones. Not overlapped with compute (Megatron-Core's
  default; its ``--overlap-moe-expert-parallel-comm`` is not modelled). Two dispatchers
  (``ParallelConfig.moe_dispatcher``): ``"alltoall"``, NCCL's all-to-all, one copy per destination rank
  (:func:`all_to_all_s`; Megatron-Core's ``alltoall`` dispatcher), and ``"deepep"``, DeepEP's normal kernels
  (Megatron-Core's ``flex`` dispatcher with ``--moe-enable-deepep``): across nodes a token goes once to each
  destination node over RDMA and is forwarded inside it over NVLink (:func:`deepep_s`).
- **Activations saved** (none / selective recompute, without ``moe_recompute``): router logits and
  probabilities (fp32, ``8 T E``), top-k indices and weights (``12 k T``), the experts' input, fc1 output and fc2 input
  (``e R (h + 3 f / etp)``) and the combine's expert outputs (``e k T h``). Full recompute keeps only the
  block input and re-materialises these in the backward working set; ``moe_recompute`` (Megatron-Core's
  ``--recompute-modules moe``) does the same for the routed experts alone: their forward and dispatch are
  re-run in the backward and their activations are not kept. Dispatch buffers (send, receive and
  the etp-gathered copy, ``(2 + etp) S``) are transient working memory.
- **States.** ``E/ep`` experts of ``3 h f / etp`` parameters each; with ZeRO >= 1 their optimizer states
  (>= 2: gradients) are sharded over edp (Megatron-Core's distributed optimizer over the expert-data-parallel
  group); expert weights are never sharded over edp (ZeRO-3 shards the dense weights only).
- **Per step** (the rank's tail): the expert gradients' all-reduce (ZeRO >= 1: reduce-scatter) over edp in
  25 MiB buckets, the ZeRO >= 1 weight all-gather, and the AdamW step over the rank's expert shard. With
  ``overlap_grad_reduce`` (Megatron-LM ``--overlap-grad-reduce`` / ``--overlap-param-gather``) the two
  collectives run behind compute as the dense ones do: Megatron-Core's DistributedDataParallel keeps the
  expert parameters in buffers of their own whose bucket groups reduce over the expert-data-parallel group and
  fire from the same backward hooks (``megatron/core/distributed/distributed_data_parallel.py``,
  ``expert_parallel_buffers`` / ``expert_parallel_bucket_groups``, core_v0.12.0). Per layer, a collective of
  ``c`` s beside its block's compute window ``w`` (one micro-batch's backward and recompute for the gradient
  sync, its forward for the weight gather: the last micro-batch's, as for the dense sync in
  ``planner.cost.estimate``) costs ``max(c - (1 - k) w, k c)`` (``k = kernels.contention``). The window is the
  layer's own block: a bucket fired after layer ``l``'s backward runs beside the next layers' backward, of
  about the same length; the stage's last bucket, which nothing follows, and the dense sync sharing the
  window are not charged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from planner.core import (
    ParallelDims,
    DTYPE_BYTES,
    MEMORY_BW_EFFICIENCY,
    MOE_LOAD_IMBALANCE,
    MOE_ROUTER_IMBALANCE,
    OPTIMIZER_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    Recompute,
    StratagemError,
)
from planner.cost.collectives import group_collective_s, inter_node_bw
from planner.cost.config import LayerCost, MemorySemantics
from planner.cost.kernels import Device, PassTime, contention, gemm_s, optimizer_step_s
from planner.cost.memory import expert_runtime_states, model_states_bytes, precision_kind, runtime_states
from planner.cost.placement import GroupShape, dp_group, tp_group
from planner.profile import ClusterProfile, CollectiveFit, ExpertProfile, LayerProfile, NodeType

Dispatcher = Literal["alltoall", "deepep"]
DISPATCHERS: tuple[Dispatcher, ...] = ("alltoall", "deepep")
ROUTER_SAVED_BYTES_PER_TOKEN_EXPERT = 8  # fp32 logits + fp32 softmax output per (token, expert)
TOPK_SAVED_BYTES_PER_PAIR = 12  # int64 expert index + fp32 routing weight per (token, chosen expert)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertSplit:
    """How a rank runs the routed experts: the degrees around it and the micro-batch (ParallelConfig fields)."""

    tp: int
    dp: int
    ep: int
    etp: int
    zero_stage: int
    sequence_parallel: bool
    micro_batch: int
    load_imbalance: float
    grad_bucket_bytes: float | None
    dispatcher: Dispatcher = "alltoall"
    overlap_grad_reduce: bool = True
    memory_semantics: MemorySemantics = "fsdp2"  # ParallelConfig.memory_semantics

    @property
    def edp(self) -> int:
        return ParallelDims(dp=self.dp, tp=self.tp, ep=self.ep, etp=self.etp).edp


def ep_group(ep: int, etp: int, devices_per_node: int) -> GroupShape:
    """The ep group: ``ep`` ranks ``etp`` apart (the (edp, ep, etp) folding of a stage's ranks)."""
    return dp_group(ep, etp, devices_per_node)


def edp_group(split: ExpertSplit, devices_per_node: int) -> GroupShape:
    """The expert-data-parallel group: ``edp`` ranks ``ep * etp`` apart."""
    return dp_group(split.edp, split.ep * split.etp, devices_per_node)


def all_to_all_fit(fits: list[CollectiveFit], where: str, cluster: ClusterProfile) -> CollectiveFit:
    """The ``all_to_all`` fit of one link level; a profile without one gets a one-line error with the fix."""
    for fit in fits:
        if fit.op == "all_to_all":
            return fit
    raise StratagemError(
        f"cluster profile {cluster.name} has no all_to_all figure for {where}, which expert parallelism needs; "
        f"re-profile the cluster with `stratagem profile cluster` (it measures all_to_all) or add an all_to_all "
        f"fit to its profile"
    )


def require_all_to_all(cluster: ClusterProfile, node_types: list[str] | None = None) -> None:
    """Raise the one-line error of :func:`all_to_all_fit` unless every node type (and the network, when the
    cluster has more than one node) has an all_to_all fit."""
    for name in node_types or [nt.name for nt in cluster.node_types]:
        all_to_all_fit(cluster.node_type(name).intra_node, f"node type {name} (intra-node)", cluster)
    if sum(g.count for g in cluster.nodes) > 1:
        all_to_all_fit(cluster.inter_node, "the network (inter-node)", cluster)


def all_to_all_s(cluster: ClusterProfile, node: NodeType, message_bytes: float, group: GroupShape) -> float:
    """Seconds of one all-to-all in which each of the group's ranks sends ``message_bytes`` (its own share
    included) split evenly over the group.

    NCCL-tests' convention (doc/PERFORMANCE.md; NVIDIA/nccl-tests issue #130): ``busBw = algBw (n-1)/n``,
    ``1/n`` of the data stays local. Inside a node: ``alpha + (n-1)/n S / bw_intra``. Across nodes with ``g``
    of the group's ranks per node: ``(g-1)/n`` of S goes over NVLink and ``(n-g)/n`` over the network at one
    NIC's share per rank (the cluster's per-node fit / devices per node: an all-to-all does not aggregate
    NICs, nccl-tests issue #267), concurrently; the slower part sets the time (issue #130: on N nodes the
    bus bandwidth is N/(N-1) x the per-GPU network bandwidth).
    """
    n = group.n_ranks
    if n <= 1 or message_bytes <= 0:
        return 0.0
    intra = all_to_all_fit(node.intra_node, f"node type {node.name} (intra-node)", cluster)
    if not group.spans_nodes:
        return intra.alpha_s + (n - 1) / n * message_bytes / intra.bus_bw_bytes_per_s
    inter = all_to_all_fit(cluster.inter_node, "the network (inter-node)", cluster)
    g = group.ranks_per_node
    nvlink_s = (g - 1) / n * message_bytes / intra.bus_bw_bytes_per_s
    network_s = (n - g) / n * message_bytes / (inter_node_bw(cluster, inter) / node.devices_per_node)
    return inter.alpha_s + max(nvlink_s, network_s)


def remote_nodes_per_token(experts: int, top_k: int, nodes: int) -> float:
    """Expected number of other nodes a token's ``top_k`` distinct experts sit on, with ``experts`` spread
    evenly over ``nodes`` nodes of the ep group and each token's experts uniformly random (the mean that a
    load-balancing loss aims at): ``(nodes - 1) (1 - C(E - E/N, k) / C(E, k))``."""
    if nodes <= 1:
        return 0.0
    per_node = experts / nodes
    miss = 1.0
    for i in range(top_k):
        miss *= max(experts - per_node - i, 0.0) / (experts - i)
    return (nodes - 1) * (1.0 - miss)


def deepep_s(
    cluster: ClusterProfile, node: NodeType, message_bytes: float, top_k: int, experts: int, group: GroupShape
) -> float:
    """Seconds of one DeepEP dispatch (or combine) in which each rank holds ``message_bytes / top_k`` of tokens,
    ``message_bytes`` counting one copy per chosen expert.

    DeepEP's normal kernels (deepseek-ai/DeepEP README, "Normal kernels with NVLink and RDMA forwarding";
    the scheme of DeepSeek-V3's report, arXiv:2412.19437 §3.2.2): inside a node, an all-to-all over NVLink
    (:func:`all_to_all_s`). Across nodes, a token goes over RDMA once to each destination node that holds one
    of its experts (:func:`remote_nodes_per_token` of them), to the GPU of the same local index, which
    forwards it over NVLink to the GPUs holding its experts (``(g-1)/g`` of the copies); the two transfers are
    pipelined, the slower one sets the time. RDMA runs at one NIC per GPU: the README measures 43-58 GB/s of
    "bottleneck bandwidth" on 50 GB/s CX7 NICs (EP16-EP64, H800), the cluster's inter-node all_to_all fit
    per GPU (dgx-h100: 47 GB/s) is that figure.
    """
    n = group.n_ranks
    if n <= 1 or message_bytes <= 0:
        return 0.0
    if not group.spans_nodes:
        return all_to_all_s(cluster, node, message_bytes, group)
    intra = all_to_all_fit(node.intra_node, f"node type {node.name} (intra-node)", cluster)
    inter = all_to_all_fit(cluster.inter_node, "the network (inter-node)", cluster)
    g = group.ranks_per_node
    rdma_bytes = message_bytes / top_k * remote_nodes_per_token(experts, top_k, n // g)
    network_s = rdma_bytes / (inter_node_bw(cluster, inter) / node.devices_per_node)
    nvlink_s = (g - 1) / g * message_bytes / intra.bus_bw_bytes_per_s
    return inter.alpha_s + max(nvlink_s, network_s)


def dispatch_s(
    cluster: ClusterProfile, node: NodeType, message_bytes: float, ex: ExpertProfile, group: GroupShape, dispatcher: str
) -> float:
    """One dispatch or combine of the ep group with ``dispatcher`` (module docstring)."""
    if dispatcher == "alltoall":
        return all_to_all_s(cluster, node, message_bytes, group)
    if dispatcher == "deepep":
        return deepep_s(cluster, node, message_bytes, ex.top_k, ex.experts, group)
    raise StratagemError(f"unknown MoE dispatcher {dispatcher!r}; use one of {', '.join(DISPATCHERS)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Shape:
    """The routed experts' sizes on one rank for one micro-batch (module docstring)."""

    tokens: float  # T
    rows: float  # R = lam k T etp
    local_experts: int
    width: int  # f / etp
    send_bytes: float  # S
    e: int


def _shape(ex: ExpertProfile, split: ExpertSplit, dtype: str) -> _Shape:
    tokens = split.micro_batch * ex.tokens_per_sample / split.tp
    # dropless with every expert on the rank (ep = 1): the rank's rows are exactly k T, whatever the routing
    lam = ex.capacity_factor or (split.load_imbalance if split.ep > 1 else 1.0)
    e = DTYPE_BYTES[dtype]
    return _Shape(
        tokens=tokens,
        rows=lam * ex.top_k * tokens * split.etp,
        local_experts=ex.experts // split.ep,
        width=math.ceil(ex.expert_ffn / split.etp),
        send_bytes=lam * ex.top_k * tokens * ex.hidden * e,
        e=e,
    )


def _device(node: NodeType, dtype: str) -> Device | None:
    if node.kernel_model is None or not node.memory_bw_bytes_per_s:
        return None
    return Device(
        km=node.kernel_model,
        peak_flops_per_s=node.compute_for(dtype).peak_flops_per_s,
        memory_bw_bytes_per_s=node.memory_bw_bytes_per_s,
        elem_bytes=DTYPE_BYTES[dtype],
    )


def _compute_s(ex: ExpertProfile, sh: _Shape, node: NodeType, dtype: str) -> tuple[float, float]:
    """(forward_s, backward_s) of the router, permutes and grouped expert GEMMs on one rank."""
    h, n_e, f = ex.hidden, sh.local_experts, sh.width
    m = math.ceil(sh.rows / n_e)
    t = math.ceil(sh.tokens)
    copy_bytes = 2 * sh.e * sh.rows * h  # permute / unpermute: read and write every routed row
    router_bytes = ROUTER_SAVED_BYTES_PER_TOKEN_EXPERT * t * ex.experts
    fwd_bytes = 2 * copy_bytes + 3 * sh.e * sh.rows * f + router_bytes  # + SwiGLU reads 2 halves, writes 1
    bwd_bytes = 2 * copy_bytes + 5 * sh.e * sh.rows * f + 1.5 * router_bytes
    dev = _device(node, dtype)
    if dev is not None:
        gemms = [(m, 2 * f, h, n_e), (m, h, f, n_e), (t, ex.experts, h, 1)]  # fc1, fc2 (grouped), router
        fwd = PassTime(kernel_s=sum(gemm_s(a, b, c, g, dev) for a, b, c, g in gemms), kernels=3)
        bwd = PassTime(
            kernel_s=sum(gemm_s(a, c, b, g, dev) + gemm_s(c, b, a, g, dev, lead=(c, b)) for a, b, c, g in gemms),
            kernels=6,
        )
        fwd = fwd + PassTime(kernel_s=fwd_bytes / dev.stream_bytes_per_s, kernels=5)  # softmax, top-k, permutes, act
        bwd = bwd + PassTime(kernel_s=bwd_bytes / dev.stream_bytes_per_s, kernels=5)
        return fwd.wall_s(dev.km), bwd.wall_s(dev.km)
    flops = 2 * sh.rows * h * 3 * f + 2 * t * h * ex.experts
    rate = node.compute_for(dtype).achieved_flops_per_s
    traffic = 1 / (node.memory_bw_bytes_per_s * MEMORY_BW_EFFICIENCY) if node.memory_bw_bytes_per_s else 0.0
    return flops / rate + fwd_bytes * traffic, 2 * flops / rate + bwd_bytes * traffic


def _comm_s(
    cluster: ClusterProfile, node: NodeType, ex: ExpertProfile, sh: _Shape, split: ExpertSplit, full_bytes: float
) -> float:
    """One direction's (forward or backward) MoE communication per micro-batch (module docstring)."""
    dpn = node.devices_per_node
    t = 2 * dispatch_s(cluster, node, sh.send_bytes, ex, ep_group(split.ep, split.etp, dpn), split.dispatcher)
    if split.etp > 1:
        group = tp_group(split.etp, dpn)
        t += group_collective_s(cluster, node, "all_gather", split.etp * sh.send_bytes, group)
        t += group_collective_s(cluster, node, "reduce_scatter", split.etp * sh.send_bytes, group)
    if split.tp > 1 and not split.sequence_parallel:
        t += group_collective_s(cluster, node, "all_gather", full_bytes, tp_group(split.tp, dpn))
    return t


def _step_terms(
    cluster: ClusterProfile, node: NodeType, params: float, split: ExpertSplit, dtype: str
) -> tuple[float, float, float]:
    """Per optimizer step: (edp gradient sync s, ZeRO >= 1 weight gather s, AdamW s) over the rank's experts."""
    per = STATE_BYTES_PER_PARAM[precision_kind(dtype)]
    zero = split.zero_stage
    sync = gather = 0.0
    if split.edp > 1:
        group = edp_group(split, node.devices_per_node)
        bucket = split.grad_bucket_bytes

        def bucketed(op: str, nbytes: float) -> float:  # estimate.dp_collective_time: linear in the bytes
            if bucket is None:
                return group_collective_s(cluster, node, op, nbytes, group)
            return nbytes * group_collective_s(cluster, node, op, bucket, group) / bucket

        sync = bucketed("all_reduce" if zero == 0 else "reduce_scatter", params * per["grads"])
        if zero >= 1:
            gather = bucketed("all_gather", params * per["params"])
    shard = params / (split.edp if zero >= 1 else 1)
    return sync, gather, optimizer_step_s(node, dtype, OPTIMIZER_BYTES_PER_PARAM, shard)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertTime:
    """The routed experts' per-micro-batch terms on one rank (they do not depend on dp or ZeRO)."""

    forward_s: float
    backward_s: float
    comm_s: float  # one direction's all-to-alls and etp/tp gathers
    saved_bytes: float
    transient_bytes: float  # held during the pass beyond saved_bytes (_transient_bytes)
    flops: float  # balanced forward FLOPs


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertStates:
    """The routed experts' per-step terms on one rank (they do not depend on the micro-batch): the edp gradient
    sync and ZeRO weight gather before overlap (``overlap``: behind compute, with contention ``kappa``) and the
    optimizer step."""

    state_bytes: float
    grads_accumulating_bytes: float = 0.0  # held apart from state_bytes (memory_semantics "fsdp2")
    grads_end_bytes: float = 0.0
    unit_params: float = 0.0  # in the block's own data-parallel unit (LayerCost.expert_unit_params)
    unit_param_bytes: float = 0.0
    sync_s: float = 0.0
    gather_s: float = 0.0
    optimizer_s: float = 0.0
    overlap: bool = False
    kappa: float = 0.0

    @property
    def step_s(self) -> float:
        """The per-step terms with nothing overlapped."""
        return self.sync_s + self.gather_s + self.optimizer_s

    def exposed_s(self, backward_window_s: float, forward_window_s: float) -> float:
        """The per-step terms beside a block whose one micro-batch takes ``backward_window_s`` (backward and
        recompute) and ``forward_window_s`` (module docstring, "Per step")."""
        if not self.overlap:
            return self.step_s
        k = self.kappa
        sync = max(self.sync_s - (1 - k) * backward_window_s, k * self.sync_s)
        gather = max(self.gather_s - (1 - k) * forward_window_s, k * self.gather_s)
        return sync + gather + self.optimizer_s


def runs_fused(ex: ExpertProfile, split: ExpertSplit) -> bool:
    """True where the runtime runs the model's own fused experts module (an ``hf:`` block without an expert
    layout), not the runtime's expert exchange (``runtime.executor.hf_moe``, the zoo's MoE): where the profile
    measured that module (``ExpertProfile.fused_*``), those figures price it instead of the SwiGLU count."""
    return ex.wrapped_at_ep1 and split.ep * split.etp == 1


def _transient_bytes(ex: ExpertProfile, split: ExpertSplit, sh: _Shape, saved: float) -> float:
    """What the routed experts' pass holds beyond their ``saved`` activations: the exchange's send and receive
    buffers (at ep = etp = 1 the rows' and outputs' gradients of the same size), or, where transformers' fused
    module runs, the whole-weight gradients its loop's backward makes (measured per byte of its weights), less the
    one expert's share of the saved rows that loop has freed when they peak (traced on a tiny Mixtral: the sum of
    the whole-weight gradients is formed in the second expert's backward, benchmarks/memory_accuracy.py)."""
    ratio = ex.fused_backward_bytes_per_weight_byte
    if runs_fused(ex, split) and ratio is not None:
        return max(0.0, ratio * ex.params * sh.e - saved / ex.experts)
    return (2 + (split.etp if split.etp > 1 else 0)) * sh.send_bytes


def expert_time(
    layer: LayerProfile, *, node: NodeType, cluster: ClusterProfile, split: ExpertSplit, dtype: str
) -> ExpertTime:
    """Compute, communication and activation terms of ``layer``'s routed experts per micro-batch."""
    ex = layer.experts
    if ex is None:
        raise StratagemError(f"layer {layer.path} has no routed experts")
    sh = _shape(ex, split, dtype)
    fwd_s, bwd_s = _compute_s(ex, sh, node, dtype)
    full_bytes = layer.output_bytes_per_sample * split.micro_batch
    fused = ex.fused_saved_bytes_per_token
    if fused is not None and runs_fused(ex, split):  # transformers' fused module runs: what it saves, measured
        saved = fused * sh.tokens
    else:
        saved = (
            ROUTER_SAVED_BYTES_PER_TOKEN_EXPERT * sh.tokens * ex.experts
            + TOPK_SAVED_BYTES_PER_PAIR * ex.top_k * sh.tokens
            + sh.e * sh.rows * (ex.hidden + 3 * sh.width)
            + sh.e * ex.top_k * sh.tokens * ex.hidden
        )
        # the exchange's reorderings (runtime.executor.moe_dispatch) keep their sources for the backward: under
        # etp the peers' partial outputs of every gathered row, under ep this rank's expert outputs
        if split.etp > 1:
            saved += sh.e * sh.rows * ex.hidden
        if split.ep > 1:
            saved += sh.e * sh.rows / split.etp * ex.hidden
        if ex.wrapped_at_ep1 and split.ep * split.etp > 1:
            # an hf: block run through the exchange (runtime.executor.hf_moe) also saves its weighted slots, which
            # its profile's shard lacks (transformers combines inside the fused module the profile removed)
            saved += sh.e * ex.top_k * sh.tokens * ex.hidden
    return ExpertTime(
        forward_s=fwd_s,
        backward_s=bwd_s,
        comm_s=_comm_s(cluster, node, ex, sh, split, full_bytes),
        saved_bytes=saved,
        transient_bytes=_transient_bytes(ex, split, sh, saved),
        flops=6 * ex.hidden * ex.expert_ffn * ex.top_k * sh.tokens + 2 * ex.hidden * ex.experts * sh.tokens,
    )


def expert_states(
    layer: LayerProfile, *, node: NodeType, cluster: ClusterProfile, split: ExpertSplit, dtype: str
) -> ExpertStates:
    """Per-rank states and per-step sync/optimizer time of ``layer``'s routed experts."""
    ex = layer.experts
    if ex is None:
        raise StratagemError(f"layer {layer.path} has no routed experts")
    width = math.ceil(ex.expert_ffn / split.etp)
    params = ex.experts // split.ep * 3 * ex.hidden * width
    sync, gather, opt = _step_terms(cluster, node, params, split, dtype)
    unit_params = 0.0
    if split.memory_semantics == "fsdp2":  # as the runtime holds them: gradients by the peak's moment
        rs = expert_runtime_states(split.zero_stage, split.edp, dtype)
        if ex.wrapped_at_ep1 and split.ep * split.etp == 1:
            # in the block's data-parallel unit like its dense weights: at ZeRO-3 gathered with the block in its
            # forward and backward (the backward sweep's block unit), not from the forward to the step
            rs = runtime_states(split.zero_stage, split.dp, dtype)
            unit_params = float(params)
        state_bytes, grads_acc, grads_end = rs.always * params, rs.accumulating * params, rs.end * params
    else:
        state_bytes = model_states_bytes(params, min(split.zero_stage, 2), split.edp, dtype).total_bytes
        grads_acc = grads_end = 0.0
    return ExpertStates(
        state_bytes=state_bytes,
        grads_accumulating_bytes=grads_acc,
        grads_end_bytes=grads_end,
        unit_params=unit_params,
        unit_param_bytes=unit_params * STATE_BYTES_PER_PARAM[precision_kind(dtype)]["params"],
        sync_s=sync,
        gather_s=gather,
        optimizer_s=opt,
        overlap=split.overlap_grad_reduce,
        kappa=contention(node),
    )


def add_expert_costs(
    layer: LayerProfile,
    base: LayerCost,
    *,
    node: NodeType,
    cluster: ClusterProfile,
    split: ExpertSplit,
    recompute: Recompute,
    dtype: str,
    moe_recompute: bool = False,
) -> LayerCost:
    """``base`` (the block's attention, router weights and shared experts) plus its routed experts (module
    docstring); a dense layer is returned unchanged."""
    if layer.experts is None:
        return base
    t = expert_time(layer, node=node, cluster=cluster, split=split, dtype=dtype)
    st = expert_states(layer, node=node, cluster=cluster, split=split, dtype=dtype)
    return combine_expert_costs(base, t, st, recompute, moe_recompute=moe_recompute)


def combine_expert_costs(
    base: LayerCost, t: ExpertTime, st: ExpertStates, recompute: Recompute, *, moe_recompute: bool = False
) -> LayerCost:
    """The :class:`LayerCost` of a block: its shards' ``base`` plus the routed experts' terms; the routed
    experts are recomputed under full recompute or ``moe_recompute``."""
    full = recompute == "full" or moe_recompute
    forward_s = base.forward_s + t.forward_s
    backward_s = base.backward_s + t.backward_s
    recompute_s = base.recompute_s + (t.forward_s + t.comm_s if full else 0.0)
    return replace(
        base,
        forward_s=forward_s,
        backward_s=backward_s,
        recompute_s=recompute_s,
        ep_comm_s=2 * t.comm_s,
        act_bytes=base.act_bytes + (0.0 if full else t.saved_bytes),
        model_flops=base.model_flops + 3 * t.flops,
        hardware_flops=base.hardware_flops + (4 if full else 3) * t.flops,
        expert_state_bytes=st.state_bytes,
        expert_grads_accumulating_bytes=st.grads_accumulating_bytes,
        expert_grads_end_bytes=st.grads_end_bytes,
        expert_unit_params=st.unit_params,
        expert_unit_param_bytes=st.unit_param_bytes,
        expert_step_s=st.exposed_s(backward_s + recompute_s, forward_s),
        moe_ws_bytes=t.transient_bytes + (t.saved_bytes if full else 0.0),
    )


def expert_split(config, micro_batch: int | None = None) -> ExpertSplit:
    """The :class:`ExpertSplit` of a :class:`planner.cost.config.ParallelConfig`."""
    return ExpertSplit(
        tp=config.tp,
        dp=config.dp,
        ep=config.ep,
        etp=config.etp,
        zero_stage=config.zero_stage,
        sequence_parallel=config.sequence_parallel,
        micro_batch=micro_batch or config.micro_batch,
        load_imbalance=config.moe_load_imbalance,
        grad_bucket_bytes=config.grad_bucket_bytes,
        dispatcher=config.moe_dispatcher,
        overlap_grad_reduce=config.overlap_grad_reduce,
        memory_semantics=config.memory_semantics,
    )


def default_load_imbalance(model_name: str) -> tuple[float, str]:
    """(dropless load imbalance, where it comes from) for a model: its router's published fit
    (``MOE_ROUTER_IMBALANCE``, matched on the family in the model's name), else ``MOE_LOAD_IMBALANCE``."""
    name = model_name.lower()
    for family, (value, source) in MOE_ROUTER_IMBALANCE.items():
        if family in name:
            return value, f"the {family} router's fit on {source}"
    return MOE_LOAD_IMBALANCE, (
        f"no published forced/dropless pair for this router: the default {MOE_LOAD_IMBALANCE} "
        f"({MOE_ROUTER_IMBALANCE['qwen3'][1]})"
    )
