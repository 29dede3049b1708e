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

from planner.cost.collectives import collective_time
from planner.cost.compute import full_saved_bytes, layer_cost, layout_change_cost
from planner.cost.config import LayerCost, ParallelConfig
from planner.cost.estimate import dp_collective_time, estimate
from planner.cost.framework import chunk_overhead_s, dp_wrapper, layer_overhead_s, timings_scale
from planner.cost.memory import MemoryBreakdown, ModelStates, model_states_bytes
from planner.cost.pipeline import inflight_microbatches, pipeline_step_time
from planner.cost.placement import (
    ReplicaSet,
    assign_chunks,
    dp_group,
    proportional_shares,
    replica_sets,
    tp_group,
    with_gpus,
)
from planner.cost.records import ChunkEstimate, Estimate, RankEstimate, ReplicaTypeEstimate
from planner.cost.validate import replica_micro_batches

__all__ = [
    "ChunkEstimate",
    "Estimate",
    "LayerCost",
    "MemoryBreakdown",
    "ModelStates",
    "ParallelConfig",
    "RankEstimate",
    "ReplicaSet",
    "ReplicaTypeEstimate",
    "assign_chunks",
    "chunk_overhead_s",
    "collective_time",
    "dp_collective_time",
    "dp_group",
    "dp_wrapper",
    "estimate",
    "full_saved_bytes",
    "inflight_microbatches",
    "layer_cost",
    "layer_overhead_s",
    "layout_change_cost",
    "model_states_bytes",
    "pipeline_step_time",
    "proportional_shares",
    "replica_micro_batches",
    "replica_sets",
    "timings_scale",
    "tp_group",
    "with_gpus",
]
