"""What ``stratagem estimate`` prints and writes: the terminal table and the ``--json`` document (shared with
``estimate --from``, :mod:`planner.cli.compare_cli`)."""

from __future__ import annotations

from planner.cli.common import (
    no_ellipsis,
    throughput_text,
)
from planner.core import StratagemError
from planner.cost import ParallelConfig
from planner.plan import strategy_label
from planner.profile import ClusterProfile, ModelProfile


def estimate_to_json(est, config: ParallelConfig) -> dict:
    """The ``--json`` document: headline figures, breakdown, per pp rank and per chunk."""
    return {
        "step_time_s": est.step_time_s,
        "tokens_per_s": est.tokens_per_s,
        "samples_per_s": est.samples_per_s,
        "model_tflops_per_gpu": est.model_tflops_per_gpu,
        "hardware_tflops_per_gpu": est.hardware_tflops_per_gpu,
        "mfu": est.mfu,
        "hfu": est.hfu,
        "peak_memory_bytes": est.peak_memory_bytes,
        "fits_in_memory": est.fits_in_memory,
        "flop_convention": est.flop_convention,
        "breakdown": est.breakdown_s,
        "config": {
            "tp": config.tp,
            "pp": config.pp,
            "dp": config.dp,
            "micro_batch": config.micro_batch,
            "num_micro_batches": config.num_micro_batches,
            "schedule": config.schedule,
            "virtual_stages": config.virtual_stages,
            "zero_stage": config.zero_stage,
            "ep": config.ep,
            "etp": config.etp,
            "recompute": config.recompute if isinstance(config.recompute, str) else dict(config.recompute),
            "sequence_parallel": config.sequence_parallel,
            "stage_node_types": list(config.stage_node_types or []),
            "replica_node_types": list(config.replica_node_types or []),
            "batch_shares": list(config.batch_shares or []),
        },
        "per_replica_type": [
            {
                "node_type": t.node_type,
                "replicas": list(t.replicas),
                "micro_batches": t.micro_batches,
                "batch_share_total": t.batch_share_total,
                "pipeline_s": t.pipeline_s,
                "tail_s": t.tail_s,
            }
            for t in est.per_replica_type
        ],
        "per_rank": [
            {
                "pp_rank": r.pp_rank,
                "node_type": r.node_type,
                "microbatch_s": r.microbatch_s,
                "inflight_microbatches": r.inflight_microbatches,
                "dp_sync_s": r.dp_sync_s,
                "dp_sync_exposed_s": r.dp_sync_exposed_s,
                "zero_comm_s": r.zero_comm_s,
                "optimizer_s": r.optimizer_s,
                "peak_memory_bytes": r.memory.peak_bytes,
                "memory_bytes": r.memory.as_dict(),
            }
            for r in est.per_rank
        ],
        "per_stage": [
            {
                "stage": ch.index,
                "pp_rank": ch.pp_rank,
                "node_type": ch.node_type,
                "layers": len(ch.module_paths),
                "first": ch.module_paths[0],
                "last": ch.module_paths[-1],
                "time_per_microbatch_s": ch.time_s,
            }
            for ch in est.per_stage
        ],
    }


def print_estimate_table(est, config: ParallelConfig, model: ModelProfile, cluster: ClusterProfile, gpus: int) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = 2**30
    console = Console()
    recompute = config.recompute if isinstance(config.recompute, str) else None
    blocks = sum(layer.kind == "block" for layer in model.layers)
    modes: list[str] = [] if isinstance(config.recompute, str) else list(config.recompute.values())
    counts: dict[str, int] = {recompute: blocks} if recompute else {m: modes.count(m) for m in set(modes)}
    label = strategy_label(
        tp=config.tp,
        pp=config.pp,
        dp=config.dp,
        schedule=config.schedule,
        virtual_stages=config.virtual_stages,
        micro_batch=config.micro_batch,
        num_micro_batches=config.num_micro_batches,
        zero_stage=config.zero_stage,
        sequence_parallel=config.sequence_parallel,
        recompute=counts,
        cp=config.cp,
        context_parallel=config.context_parallel,
    )
    head = Table(title=f"{model.name} on {gpus} x {cluster.name}: {label}")
    head.add_column("quantity")
    head.add_column("value", justify="right")
    head.add_row("step time", f"{est.step_time_s:.4g} s")
    head.add_row("throughput", throughput_text(est.samples_per_s, est.tokens_per_s, model.model.family))
    head.add_row("model TFLOP/s per device (MFU)", f"{est.model_tflops_per_gpu:.3g} ({100 * est.mfu:.1f} %)")
    head.add_row("hardware TFLOP/s per device (HFU)", f"{est.hardware_tflops_per_gpu:.3g} ({100 * est.hfu:.1f} %)")
    worst = max(est.per_rank, key=lambda r: r.memory.peak_bytes / r.memory.capacity)
    head.add_row(
        "peak memory per device",
        f"{est.peak_memory_bytes / gib:.2f} GiB (pp rank {worst.pp_rank}: "
        f"{worst.memory.peak_bytes / gib:.2f} of its {worst.memory.capacity / gib:.0f} GiB)"
        + ("" if est.fits_in_memory else "  [red]DOES NOT FIT[/red]"),
    )
    for key, value in est.breakdown_s.items():
        head.add_row(f"  {key}", f"{value:.4g} s")
    console.print(no_ellipsis(head))
    times = Table(title="per pipeline rank: time")
    for col in ("pp rank", "node type", "s per micro-batch", "micro-batches in flight"):
        times.add_column(col, justify="left" if col == "node type" else "right")
    for r in est.per_rank:
        times.add_row(str(r.pp_rank), r.node_type, f"{r.microbatch_s:.4g}", f"{r.inflight_microbatches:.3g}")
    console.print(no_ellipsis(times))
    memory = Table(title="per pipeline rank: memory per device, GiB", show_edge=False)
    experts = any(r.memory.expert_states for r in est.per_rank)  # Mixture-of-Experts: a column of its own
    cols = ("pp", "param", "grad", "optim", *(("experts",) if experts else ()), "activ", "buf")
    for col in (*cols, "resv", "peak", "cap"):
        memory.add_column(col, justify="right")
    for r in est.per_rank:
        mem = r.memory
        values = (mem.params, mem.grads, mem.optimizer, *((mem.expert_states,) if experts else ()), mem.activations)
        memory.add_row(
            str(r.pp_rank),
            *(f"{v / gib:.3g}" for v in (*values, mem.comm_buffers, mem.reserve, mem.peak_bytes, mem.capacity)),
        )
    console.print(no_ellipsis(memory))
    console.print(
        "[dim]pp = pp rank, param/grad/optim = parameters, gradients, optimizer state, "
        + ("experts = routed experts' weights, gradients and optimizer state (over ep, edp), " if experts else "")
        + "activ = activations, buf = communication buffers, resv = allocator reserve, cap = the rank's device "
        "capacity[/dim]"
    )
    for t in est.per_replica_type:
        console.print(
            f"replicas {list(t.replicas)} on {t.node_type}: {t.micro_batches} micro-batches "
            f"({100 * t.batch_share_total:.1f} % of the batch), pipeline {t.pipeline_s:.4g} s, "
            f"tail {t.tail_s:.4g} s" + ("  [bold](critical: ranks above)[/bold]" if t.per_rank == est.per_rank else "")
        )
    if config.dp > 1:
        console.print(_algorithm_comparison(est, config, cluster))
    console.print(f"[dim]{est.flop_convention}[/dim]")
    if cluster.calibration is not None:
        console.print(f"cluster {cluster.name}: {cluster.calibration_note()}", soft_wrap=True)
    if cluster.fabric_load is not None:
        console.print(f"cluster {cluster.name}: {cluster.fabric_note()}", soft_wrap=True)


def _algorithm_comparison(est, config: ParallelConfig, cluster: ClusterProfile) -> str:
    """One all-reduce of pp rank 0's gradients over its DP group, per algorithm (for comparison)."""
    from planner.core import STATE_BYTES_PER_PARAM
    from planner.cost import collective_time, dp_group

    node = cluster.node_type(est.per_rank[0].node_type)
    sync = config.dp * config.cp  # gradients sync over dp x cp (planner/cost/context.py)
    group = dp_group(sync, config.tp, node.devices_per_node)
    per = STATE_BYTES_PER_PARAM["mixed"]
    params = est.per_rank[0].memory.params / per["params"] * (sync if config.zero_stage == 3 else 1)
    grad_bytes = params * per["grads"]
    parts = []
    for algorithm in ("ring", "tree", "hierarchical", "parameter_server"):
        try:
            t = collective_time(
                cluster,
                "all_reduce",
                grad_bytes,
                group.n_ranks,
                node_type=node,
                spans_nodes=group.spans_nodes,
                ranks_per_node=group.ranks_per_node,
                algorithm=algorithm,
            )
        except StratagemError:
            continue
        parts.append(f"{algorithm} {t:.3g} s")
    over = f"dp x cp = {config.dp * config.cp}" if config.cp > 1 else f"dp={config.dp}"
    head = f"one all-reduce of rank 0's gradients ({grad_bytes / 2**30:.2f} GiB) over {over}: "
    return head + ", ".join(parts)
