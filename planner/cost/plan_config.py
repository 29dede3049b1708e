"""The one converter from a plan file to what the cost model prices: :func:`plan_config`. Every place that prices
a plan (``export``, ``show``, ``calibrate``, the benchmarks, the runtime's OOM fallback) goes through it, so a
plan is priced the same everywhere."""

from __future__ import annotations

from planner.core import MOE_LOAD_IMBALANCE
from planner.cost.config import ParallelConfig
from planner.cost.context import plan_context_fields
from planner.plan import Plan


def plan_config(plan: Plan, *, overlap_grad_reduce: bool = True) -> ParallelConfig:
    """The cost model's :class:`ParallelConfig` of ``plan``: mesh, schedule, stages and their node types, per-layer
    layout and recompute, ZeRO, batch shares and replica node types, context parallelism, the expert layout and
    the routing load it was priced at.

    At ``pp = 1`` one micro-batch is in flight whatever the plan calls its schedule: every trainer (the runtime's
    ``LocalRunner``, Megatron-LM's ``forward_backward_no_pipelining``) runs each micro-batch's forward and
    backward before the next one's forward, so it is priced as "1f1b" (the search writes that already).
    ``overlap_grad_reduce``: False for CPU ranks, where FSDP2's gloo collectives block the rank."""
    stages = sorted(plan.stages, key=lambda s: s.index)
    pp = plan.mesh.size("pp")
    node_types = (
        None
        if plan.replica_node_types
        else tuple(next(s.node_type for s in stages if s.pp_rank == r) for r in range(pp))
    )
    return ParallelConfig(
        **plan.parallel_dims.degrees(),
        micro_batch=plan.schedule.micro_batch_size,
        num_micro_batches=plan.schedule.max_micro_batches,
        schedule=plan.schedule.kind if pp > 1 else "1f1b",
        virtual_stages=plan.schedule.virtual_stages,
        zero_stage=plan.zero_stage,
        sequence_parallel=any(lay.sequence_parallel for lay in plan.layout.values()),
        recompute={p: m for s in stages for p, m in s.recompute.items()},
        stage_layers=tuple(tuple(s.module_paths) for s in stages),
        layout={p: lay.style for p, lay in plan.layout.items()},
        stage_node_types=node_types,
        batch_shares=tuple(plan.batch_shares) if plan.batch_shares else None,
        replica_node_types=tuple(plan.replica_node_types) if plan.replica_node_types else None,
        overlap_grad_reduce=overlap_grad_reduce,
        moe_load_imbalance=plan.experts.load_imbalance if plan.experts else MOE_LOAD_IMBALANCE,
        **plan_context_fields(plan),
    )
