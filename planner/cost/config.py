"""Inputs and outputs of the cost model: a parallel configuration in, an estimate out.

This file is the contract between the cost model (``planner.cost``) and the search (``planner.search``):
the ILP optimises exactly the step time :func:`planner.cost.estimate` computes, assembled from the
per-layer, per-option pieces of :class:`LayerCost` with sums and maxima only (see ``planner.cost.pipeline``
for the exact formula per schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping

from planner.core import (
    DDP_BUCKET_BYTES,
    MOE_LOAD_IMBALANCE,
    ContextMode,
    ParallelDims,
    Recompute,
    ScheduleKind,
    TPStyle,
)

__all__ = ["ContextMode", "LayerCost", "MemorySemantics", "ParallelConfig", "Recompute", "ScheduleKind", "TPStyle"]

if TYPE_CHECKING:
    from planner.cost.context import KVExchange

# how a trainer holds memory (ParallelConfig.memory_semantics)
MemorySemantics = Literal["fsdp2", "textbook"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """One fully specified way to run a model on a cluster.

    Degrees: ``tp * pp * dp * cp`` devices. ``stage_layers`` lists, per pipeline chunk (``pp * virtual_stages``
    chunks in model order; chunk ``i`` runs on pp rank ``i % pp``), its top-level module paths; ``None``
    means the cost model splits the repeated blocks as evenly as possible (Megatron style; non-block layers
    go with the first/last chunk). ``recompute`` is a per-path mapping (absent = none) or a default mode for
    every layer but embeddings, norms and heads (Megatron recomputes transformer layers only; see
    ``planner.cost.placement.NOT_RECOMPUTED_BY_DEFAULT``).
    ``layout`` gives Whale's replicate-or-split per module path; layers absent from it are split when they
    are tensor-parallel capable and ``tp > 1`` (blocks) and replicated otherwise.
    ``stage_node_types`` names the node type of each pp rank (mixed clusters; ``None`` = the cluster's
    first node type everywhere). ``batch_shares`` is the fraction of the global batch per dp replica
    (``None`` = equal).
    ``replica_node_types`` names the node type of each dp replica instead (all of a replica's pp and tp
    ranks on that type; Whale's hardware-aware data parallelism, Jia et al. ATC'22 §4): replica ``j`` then
    runs ``m_j = batch_shares[j] * global_batch / micro_batch`` micro-batches (``num_micro_batches`` is
    not used) and ``stage_node_types`` may name at most one type (it is then ignored).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    # whose memory the estimate prices (planner.cost.memory): "fsdp2", what `stratagem launch` and torchtitan
    # hold (FSDP2's gathered weights, gradients as they exist at the peak); "textbook", what Megatron-LM and
    # DeepSpeed hold (ZeRO's model states with gradients through the step, DDP gradient buckets). The search
    # plans with the default; exports and --compare-to price a framework's config with its own.
    memory_semantics: MemorySemantics = "fsdp2"
    # Context parallelism (``planner.cost.context``): the sequence split over ``cp`` ranks, K/V exchanged by
    # all-gather or ring (None when cp == 1). ``kv_exchange`` is set only on the folded configuration
    # ``context.fold`` builds (dp * cp ranks on the per-rank view of the model); leave it None.
    cp: int = 1
    context_parallel: ContextMode | None = None
    kv_exchange: KVExchange | None = None
    micro_batch: int = 1
    num_micro_batches: int = 1
    schedule: ScheduleKind = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: Recompute | Mapping[str, Recompute] = "none"
    stage_layers: tuple[tuple[str, ...], ...] | None = None
    layout: Mapping[str, TPStyle] = field(default_factory=dict)
    stage_node_types: tuple[str, ...] | None = None
    batch_shares: tuple[float, ...] | None = None
    replica_node_types: tuple[str, ...] | None = None
    flash_attention: bool = False
    # A causal flash kernel skips the blocks above the diagonal (FlashAttention-2 §3.1.1): it is timed on
    # ``constants.CAUSAL_FLASH_WORK_FRACTION`` of the score FLOPs. Off by default: the published short-sequence
    # rows of benchmarks/cost_accuracy.py agree better without it (validation mean |error| 6.2 % vs 7.4 %),
    # a sign that the flash efficiencies of planner/profile/hardware_catalog.py absorb it there; at 32k-128k tokens the
    # s^2 terms dominate and it must be on (the long-context search and benchmarks set it).
    causal_skip: bool = False
    overlap_grad_reduce: bool = True
    # Hide TP collectives behind the layer's GEMMs (Megatron-Core/Transformer Engine --tp-comm-overlap).
    overlap_tp_comm: bool = False
    # Data-parallel gradient bucket (bytes): torch DDP's default 25 MiB; None = one collective for all
    # gradients (Megatron-LM's 2021 "local" DDP, a contiguous buffer).
    grad_bucket_bytes: float | None = DDP_BUCKET_BYTES
    # How ZeRO-3 communicates (``planner.cost.zero3``). The defaults are FSDP-like: one all-gather per layer
    # for the forward and one for the backward, one reduce-scatter per layer, hidden behind compute when
    # ``overlap_grad_reduce``. DeepSpeed's 2021 ZeRO-3 (Narayanan et al. SC21 Table 2) is
    # zero3_overlap=False, zero3_param_gathers=3, zero3_granularity="tensor", zero3_list_collectives=True,
    # zero3_grad_reduce="all_reduce".
    # None = follow overlap_grad_reduce; False = every gather and reduce-scatter waits for compute and vice versa.
    zero3_overlap: bool | None = None
    # All-gathers of each weight per micro-batch: 2 = forward + backward (the recompute reuses the backward's).
    zero3_param_gathers: int = 2
    # "layer": one collective per layer's weights; "tensor": one per parameter tensor, tensors under
    # DeepSpeed's 1e5-element persistence threshold stay replicated (not gathered, gradients still reduced).
    zero3_granularity: Literal["layer", "tensor"] = "layer"
    # torch < 1.9 list-based all_gather / reduce_scatter: per-rank views and copies on the host (O(ranks)).
    zero3_list_collectives: bool = False
    # How the gradients are reduced: "reduce_scatter" (per layer, or per tensor at granularity "tensor");
    # "all_reduce" = DeepSpeed ZeRO-3 before July 2021 with its default contiguous_gradients=False: the
    # gradients are flattened into reduce_bucket_size buckets and all-reduced (``planner.cost.zero3``).
    zero3_grad_reduce: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    # When ZeRO-3 reduce-scatters gradients under accumulation (num_micro_batches > 1). "micro_batch": after
    # every micro-batch's backward (FSDP2's default); "step": only after the last one, keeping the weights
    # unsharded from one micro-batch's backward to the next one's forward and holding unsharded gradients
    # (torch.distributed.pipelining's stages: set_requires_gradient_sync / set_reshard_after_backward
    # False but on the last). None = as Stratagem's runtime runs the plan: "micro_batch" when pp == 1
    # (runtime/executor/schedule.py LocalRunner, sync_every_micro_batch), "step" when pp > 1.
    zero3_grad_sync: Literal["micro_batch", "step"] | None = None
    # Mixture-of-Experts (``planner.cost.moe``): expert-parallel degree, tensor parallel inside an expert,
    # and the busiest ep rank's tokens over the mean (dropless routing; a capacity factor replaces it).
    # A stage's dp x tp ranks are folded as (edp, ep, etp) for the expert layers (``planner.plan.schema.ExpertLayout``).
    ep: int = 1
    etp: int = 1
    moe_load_imbalance: float = MOE_LOAD_IMBALANCE
    # How tokens reach their experts (``planner.cost.moe``): "alltoall" (NCCL all-to-all, one copy per
    # destination rank) or "deepep" (DeepEP: one copy per destination node over RDMA, then NVLink).
    moe_dispatcher: Literal["alltoall", "deepep"] = "alltoall"
    # Megatron-Core's ``--recompute-modules moe``: the routed experts' forward and dispatch re-run in the
    # backward, their activations not kept (the rest of the layer follows ``recompute``).
    moe_recompute: bool = False

    @property
    def zero3_grad_sync_mode(self) -> Literal["micro_batch", "step"]:
        """``zero3_grad_sync``, with None resolved as the runtime runs the plan (see the field)."""
        if self.zero3_grad_sync is not None:
            return self.zero3_grad_sync
        return "micro_batch" if self.pp == 1 else "step"

    @property
    def world_size(self) -> int:
        """``tp x pp x dp x cp`` ranks (read before the layout is validated, so no :attr:`parallel_dims`)."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def parallel_dims(self) -> ParallelDims:
        """The configuration's degrees as the one layout record (:class:`planner.core.ParallelDims`)."""
        return ParallelDims.with_axes(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep, etp=self.etp)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """Cost of one layer under one option, per micro-batch, on one rank.

    Times in seconds per micro-batch; bytes per rank. ``act_bytes`` is what this layer keeps alive for
    backward per in-flight micro-batch (after recompute and sequence parallel); ``param_bytes`` are the
    rank's share of the weights (before ZeRO sharding, which the stage-level model applies).
    """

    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: float
    act_bytes: float
    param_bytes: float
    params: float
    output_bytes: float
    model_flops: float
    hardware_flops: float
    # Per optimizer step (not per micro-batch): the measured AdamW host time over this layer's parameters
    # (``planner.cost.framework``); 0 without a measured runtime overhead. Added to the rank's tail.
    optimizer_s: float = 0.0
    # Exposed K/V exchange of context parallelism (``planner.cost.context``), already inside forward_s and
    # backward_s (full recompute repeats the forward's); kept apart so that callers can see it.
    cp_comm_s: float = 0.0
    # Mixture-of-Experts blocks (``planner.cost.moe``; 0 for dense layers). ``ep_comm_s``: the dispatch and
    # combine all-to-alls (and expert-TP gathers) per micro-batch, forward and backward. ``expert_state_bytes``:
    # the rank's routed-expert weights, gradients and optimizer states (sharded over ep, etp and, with ZeRO,
    # edp). ``expert_step_s``: per optimizer step, the expert gradients' edp sync, ZeRO weight gather and
    # AdamW step (added to the rank's tail; under overlap_grad_reduce only what the block's compute does not
    # hide, planner.cost.moe). ``moe_ws_bytes``: the routed experts' transient bytes (the exchange's buffers, or
    # transformers' fused module's whole-weight gradients) and the expert activations a full recompute
    # re-materialises, part of the backward working set.
    ep_comm_s: float = 0.0
    expert_state_bytes: float = 0.0
    # the routed experts' gradients while micro-batches accumulate and as the last backward ends (memory
    # semantics "fsdp2", ``planner.cost.memory.expert_runtime_states``; "textbook" counts them in the states)
    expert_grads_accumulating_bytes: float = 0.0
    expert_grads_end_bytes: float = 0.0
    # routed experts held in the block's own data-parallel unit (an hf: block without an expert layout, memory
    # semantics "fsdp2"): their parameters and weight bytes, gathered and reduce-scattered with the block's
    # (``planner.cost.memory.block_unit_bytes``); 0 where the experts are their own units or plain parameters
    expert_unit_params: float = 0.0
    expert_unit_param_bytes: float = 0.0
    expert_step_s: float = 0.0
    moe_ws_bytes: float = 0.0
    # the transient gradients of the layer's backward beyond what it saved (``ShardProfile.backward_ws_bytes``
    # per sample x the micro-batch; 0 where the profile predates it)
    backward_ws_bytes: float = 0.0
    # the model's last layer: its output before the loss per micro-batch (``ShardProfile.logits_bytes``), which
    # a pipeline's last stage keeps per micro-batch in flight; 0 for other layers
    logits_bytes: float = 0.0
