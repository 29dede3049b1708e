"""The cost model: step time and per-rank memory of a parallel configuration.

Public API (stable; the search builds on it)::

    estimate(model, cluster, config, *, global_batch, dtype="bf16") -> Estimate
    layer_cost(layer, *, node, cluster, tp, style, recompute, sequence_parallel, micro_batch,
               flash_attention, dtype, tp_group_spans_nodes=False, use_timings=True, overlap_tp_comm=False,
               dp_wrapper="none", timings_scale=1.0, context=None, causal_skip=False) -> LayerCost
    layout_change_cost(prev, next, prev_style, next_style, *, node, cluster, tp, micro_batch, ...) -> float
    inflight_microbatches(schedule, pp, pp_rank, num_micro_batches, virtual_stages) -> float
    pipeline_step_time(rank_times_s, num_micro_batches, virtual_stages, schedule) -> float
    collective_time(cluster, op, bytes, n_ranks, *, node_type, spans_nodes, ranks_per_node,
                    algorithm="auto") -> float
    model_states_bytes(params_per_rank, zero_stage, dp, dtype) -> ModelStates
    proportional_shares(cluster, node_types, global_batch, micro_batch, *, dtype) -> tuple[int, ...]
    replica_micro_batches(config, global_batch) -> tuple[int, ...]
    replica_sets(cluster, config, micro_batches) -> list[ReplicaSet]

Rules a mirror of ``estimate`` (the ILP tables) must follow — each is documented where it is applied:

- compute: a shard with an op list (``ShardProfile.ops``) on a node type with a ``KernelModel`` is timed
  kernel by kernel (``kernels.py``: GEMM tile/wave quantization and roofline, memory-bound kernels, launch
  costs); measured timings on their own device take precedence; otherwise the layer-level roofline;
- overlapped communication costs ``max(c - (1 - k) w, k c)`` with ``k = kernels.contention(node)``: ZeRO-3
  (``zero3.py``), the DP gradient sync and the ZeRO-1/2 gathers (``estimate.py`` 3.);

- step time: formulae (P) and (S) in ``pipeline.py``; per-rank tail in ``estimate.py`` (3.); with
  ``ParallelConfig.replica_node_types``, formula (H) of ``estimate._estimate_replicas``;
- pipeline send/recv: every boundary costs BOTH adjacent chunks one one-way transfer per micro-batch;
- Whale ``replicate``: the full layer on the whole micro-batch on every TP rank (the runtime's
  behaviour), full weights, no TP collectives, gradients synced over the DP group only; a layout change
  costs one all-gather only with sequence parallelism or after a column-parallel (sharded-output) layer;
- a default recompute string applies to every layer except kinds in
  ``placement.NOT_RECOMPUTED_BY_DEFAULT`` (embedding, norm, head, pool, classifier);
- data-parallel collectives are bucketed (``ParallelConfig.grad_bucket_bytes``): linear in the bytes;
- ZeRO-3 (``zero3.py``): the mirror covers the default ``ParallelConfig.zero3_*`` fields (per-layer
  collectives, 2 gathers, overlap as ``overlap_grad_reduce``, gradient sync as the runtime does it: every
  micro-batch at pp = 1, once per step with unsharded weights + gradients held at pp > 1; the first
  layer's gather and reduce-scatter exposed); the other values model DeepSpeed's 2021 ZeRO-3 for
  published-run comparisons (``benchmarks/cost_accuracy.py``), not for the search;
- identical signatures give identical :class:`LayerCost` (``estimate`` computes each once);
- context parallelism (``ParallelConfig.cp > 1``, ``context.py``): ``estimate`` prices the folded configuration
  (``dp * cp`` replicas on ``context.context_view`` of the model, global batch ``B cp``, ``kv_exchange`` passed
  to ``layer_cost`` as ``context``); a mirror folds the same way (``planner.search.costs.CandidateCosts._folded``);
- ``ParallelConfig.causal_skip`` and ``flash_attention`` go to every ``layer_cost`` call as they are;
- measured runtime overheads (``framework.py``; only where ``use_timings``): pass
  ``dp_wrapper=dp_wrapper(dp, zero_stage)`` and ``timings_scale=timings_scale(model, node)`` to
  ``layer_cost``; add ``LayerCost.optimizer_s`` of every layer of rank ``r`` to its tail (per step), and
  ``sum(chunk_overhead_s(model, dp_wrapper(dp, zero), timings_scale(model, node)))`` once per chunk and
  micro-batch to ``T_r`` (a constant per chunk, 0 at dp 1).
"""

from planner.cost.collectives import Algorithm, collective_time
from planner.cost.compute import (
    SYNC_PROBE_BYTES,
    batch_sliced,
    full_saved_bytes,
    LayerWork,
    layer_cost,
    layer_work,
    layout_change_cost,
    working_set_bytes,
)
from planner.cost.config import LayerCost, MemorySemantics, ParallelConfig
from planner.cost.context import (
    ContextParallelError,
    KVExchange,
    check_context,
    check_context_family,
    context_view,
    cp_degrees,
    fold,
    fold_parts,
    kv_bytes_per_sample,
    kv_exchange,
    unfold,
)
from planner.cost.estimate import dp_collective_time, estimate, timings_apply
from planner.cost.framework import chunk_overhead_s, dp_wrapper, layer_overhead_s, timings_scale
from planner.cost.kernels import Device, contention, gemm_s, layer_kernels, op_backward, optimizer_step_s
from planner.cost.memory import (
    MemoryBreakdown,
    ModelStates,
    SweepRun,
    backward_sweep,
    block_unit_bytes,
    model_states_bytes,
    optimizer_bytes_per_param,
    peak_moments,
    precision_kind,
    reserve_terms,
    runtime_states,
    state_dtype,
)
from planner.cost.moe import (
    ExpertStates,
    all_to_all_s,
    combine_expert_costs,
    deepep_s,
    default_load_imbalance,
    ep_group,
    expert_split,
    expert_states,
    expert_time,
    remote_nodes_per_token,
    require_all_to_all,
)
from planner.cost.pipeline import inflight_microbatches, pipeline_aliases_input, pipeline_step_time
from planner.cost.placement import (
    GroupShape,
    ReplicaSet,
    assign_chunks,
    block_count,
    dp_group,
    fill_stage_node_types,
    interleaved_chunk_sizes,
    proportional_shares,
    replica_sends_cross_nodes,
    replica_sets,
    tp_group,
    with_gpus,
)
from planner.cost.plan_config import plan_config
from planner.cost.records import ChunkEstimate, Estimate, RankEstimate, ReplicaTypeEstimate
from planner.cost.spatial import (
    UNSPLIT,
    SpatialOption,
    SpatialSplitError,
    check_split,
    crosses_nodes,
    halo_exchange,
    layer_options,
    split_grid,
)
from planner.cost.spatial_plan import SpatialConfig, SpatialCosts, SpatialEstimate, estimate_spatial
from planner.cost.validate import check_config, replica_micro_batches
from planner.cost.zero3 import (
    deepspeed_buckets,
    fsdp_call_latency_s,
    list_collective_s,
    parameter_tensors,
    root_unit_layers,
)

__all__ = [
    "fold_parts",
    "Algorithm",
    "ChunkEstimate",
    "ContextParallelError",
    "Device",
    "Estimate",
    "ExpertStates",
    "GroupShape",
    "KVExchange",
    "LayerCost",
    "MemoryBreakdown",
    "MemorySemantics",
    "ModelStates",
    "ParallelConfig",
    "RankEstimate",
    "ReplicaSet",
    "ReplicaTypeEstimate",
    "SYNC_PROBE_BYTES",
    "SpatialConfig",
    "SpatialCosts",
    "SpatialEstimate",
    "SpatialOption",
    "SpatialSplitError",
    "SweepRun",
    "UNSPLIT",
    "all_to_all_s",
    "assign_chunks",
    "backward_sweep",
    "block_count",
    "block_unit_bytes",
    "check_config",
    "check_context",
    "check_context_family",
    "check_split",
    "chunk_overhead_s",
    "collective_time",
    "combine_expert_costs",
    "contention",
    "context_view",
    "cp_degrees",
    "crosses_nodes",
    "deepep_s",
    "deepspeed_buckets",
    "default_load_imbalance",
    "dp_collective_time",
    "dp_group",
    "dp_wrapper",
    "ep_group",
    "estimate",
    "estimate_spatial",
    "expert_split",
    "expert_states",
    "expert_time",
    "fill_stage_node_types",
    "fold",
    "fsdp_call_latency_s",
    "full_saved_bytes",
    "gemm_s",
    "halo_exchange",
    "inflight_microbatches",
    "interleaved_chunk_sizes",
    "kv_bytes_per_sample",
    "kv_exchange",
    "layer_cost",
    "layer_work",
    "LayerWork",
    "layer_kernels",
    "layer_options",
    "layer_overhead_s",
    "layout_change_cost",
    "batch_sliced",
    "list_collective_s",
    "model_states_bytes",
    "op_backward",
    "optimizer_bytes_per_param",
    "optimizer_step_s",
    "parameter_tensors",
    "peak_moments",
    "pipeline_aliases_input",
    "pipeline_step_time",
    "plan_config",
    "precision_kind",
    "proportional_shares",
    "remote_nodes_per_token",
    "replica_micro_batches",
    "replica_sends_cross_nodes",
    "replica_sets",
    "require_all_to_all",
    "reserve_terms",
    "root_unit_layers",
    "runtime_states",
    "split_grid",
    "state_dtype",
    "timings_apply",
    "timings_scale",
    "tp_group",
    "unfold",
    "with_gpus",
    "working_set_bytes",
]
