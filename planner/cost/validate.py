"""Reject impossible configurations with one line naming what to change."""

from __future__ import annotations

from planner.core import StratagemError
from planner.cost.config import ParallelConfig
from planner.core import SCHEDULES
from planner.cost.placement import block_count, interleaved_chunk_sizes
from planner.plan import check_expert_layout, split_counts
from planner.profile import ClusterProfile, ModelProfile


def micro_batches_per_replica(config: ParallelConfig, global_batch: int) -> int:
    """Micro-batches the busiest DP replica runs per step."""
    return max(replica_micro_batches(config, global_batch))


def replica_micro_batches(config: ParallelConfig, global_batch: int) -> tuple[int, ...]:
    """Micro-batches of each dp replica: the plan file's one derivation of the batch split
    (:func:`planner.plan.schema.split_counts`), ``m_j = share_j * global_batch / micro_batch`` with batch shares (equal
    ones for replicas on node types without shares), ``num_micro_batches`` on every replica otherwise; a split
    that does not work out is a one-line error.

    >>> replica_micro_batches(ParallelConfig(dp=2, batch_shares=(0.75, 0.25)), 8)
    (6, 2)
    """
    shares = list(config.batch_shares) if config.batch_shares else None
    if shares is None and config.replica_node_types is not None:  # replicas by type: counts from equal shares
        shares = [1.0 / config.dp] * config.dp
    return split_counts(
        global_batch=global_batch,
        dp=config.dp,
        shares=shares,
        micro_batch_size=config.micro_batch,
        num_micro_batches=config.num_micro_batches,
    ).micro_batches


def _check_degrees(config: ParallelConfig, cluster: ClusterProfile) -> None:
    for name in ("tp", "pp", "dp", "micro_batch", "num_micro_batches", "virtual_stages"):
        if getattr(config, name) < 1:
            raise StratagemError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.world_size > cluster.total_devices:
        raise StratagemError(
            f"tp {config.tp} x pp {config.pp} x dp {config.dp} = {config.world_size} GPUs but "
            f"cluster {cluster.name} has {cluster.total_devices}; use --gpus "
            f"{config.world_size} (single-type clusters scale) or smaller degrees"
        )
    if config.zero_stage not in (0, 1, 2, 3):
        raise StratagemError(f"ZeRO stage {config.zero_stage} does not exist; use 0, 1, 2 or 3")


def _check_schedule(config: ParallelConfig) -> None:
    if config.schedule not in SCHEDULES:
        raise StratagemError(f"unknown schedule {config.schedule!r}; use one of {', '.join(SCHEDULES)}")
    v = config.virtual_stages
    if config.schedule == "interleaved_1f1b":
        if v < 2:
            raise StratagemError("interleaved_1f1b needs --virtual-stages >= 2; use 1f1b for one chunk per rank")
        if config.pp < 2:
            raise StratagemError("interleaved_1f1b needs pp >= 2; use 1f1b with pp 1")
        if config.replica_node_types is None and config.num_micro_batches % config.pp:
            raise StratagemError(
                f"interleaved 1F1B needs the micro-batch count ({config.num_micro_batches}) to "
                f"be a multiple of pp={config.pp} (Megatron-LM); change --global-batch or "
                f"--micro-batch"
            )
    elif v != 1:
        raise StratagemError(
            f"{config.schedule} runs one chunk per rank but virtual_stages={v}; use "
            f"--schedule interleaved_1f1b or --virtual-stages 1"
        )


def _check_shares(config: ParallelConfig) -> None:
    if config.batch_shares is not None:
        if len(config.batch_shares) != config.dp or abs(sum(config.batch_shares) - 1) > 1e-9:
            raise StratagemError(
                f"batch_shares needs {config.dp} fractions summing to 1, got "
                f"{list(config.batch_shares)}; give one fraction per dp replica"
            )


def _check_replica_types(config: ParallelConfig, cluster: ClusterProfile) -> None:
    """One known node type per dp replica, with the devices its replicas need, and no per-stage types too."""
    types = config.replica_node_types or ()
    if len(types) != config.dp:
        raise StratagemError(
            f"replica_node_types names {len(types)} node types for dp={config.dp}; give one per dp replica"
        )
    names = [nt.name for nt in cluster.node_types]
    for t in types:
        if t not in names:
            raise StratagemError(
                f"replica node type {t!r} is not in cluster {cluster.name}; use one of {', '.join(names)}"
            )
    if config.stage_node_types and len(set(config.stage_node_types)) > 1:
        raise StratagemError(
            f"stage_node_types {list(config.stage_node_types)} and replica_node_types both place "
            f"ranks on node types; give per-stage types or per-replica types, not both"
        )
    for name in dict.fromkeys(types):
        need = types.count(name) * config.tp * config.pp
        have = sum(g.count for g in cluster.nodes if g.node_type == name) * cluster.node_type(name).devices_per_node
        if need > have:
            raise StratagemError(
                f"{types.count(name)} dp replicas on {name} need {need} devices (x tp {config.tp} "
                f"x pp {config.pp}) but the cluster has {have}; move replicas to another node type "
                f"or reduce tp or pp"
            )
    if config.zero_stage == 3 and len(set(types)) > 1:
        raise StratagemError(
            "ZeRO-3 gathers weights per layer and micro-batch across all dp replicas, which "
            "ties replicas of different node types together; use --zero 0, 1 or 2 or one node type"
        )


def _check_replica_batches(config: ParallelConfig, global_batch: int) -> None:
    """Each replica's samples ``share_j * B`` are a whole number >= 1 of micro-batches (and, interleaved, of
    ``pp`` micro-batches: Megatron-LM's rule, as for ``num_micro_batches``)."""
    shares = config.batch_shares or (1.0 / config.dp,) * config.dp
    for j, share in enumerate(shares):
        exact = share * global_batch / config.micro_batch
        if abs(exact - round(exact)) > 1e-6 or round(exact) < 1:
            raise StratagemError(
                f"dp replica {j} gets {share * global_batch:g} of the {global_batch} samples, not a "
                f"whole number >= 1 of {config.micro_batch}-sample micro-batches; choose shares "
                f"that are multiples of {config.micro_batch}/{global_batch}"
            )
        if config.schedule == "interleaved_1f1b" and round(exact) % config.pp:
            raise StratagemError(
                f"interleaved 1F1B needs dp replica {j}'s {round(exact)} micro-batches to be a "
                f"multiple of pp={config.pp} (Megatron-LM); change its batch share"
            )


def _check_batch(config: ParallelConfig, global_batch: int) -> None:
    if config.replica_node_types is not None:
        _check_shares(config)
        _check_replica_batches(config, global_batch)
        return
    if config.batch_shares is not None:
        _check_shares(config)
        return
    per_step = config.dp * config.micro_batch * config.num_micro_batches
    if per_step != global_batch:
        per_replica = global_batch / (config.dp * config.micro_batch)
        fix = (
            f"use {int(per_replica)} micro-batches"
            if per_replica.is_integer() and per_replica >= 1
            else "choose dp and micro-batch whose product divides the global batch"
        )
        raise StratagemError(
            f"global batch {global_batch} != dp {config.dp} x micro-batch {config.micro_batch} x "
            f"{config.num_micro_batches} micro-batches = {per_step}; {fix}"
        )


def _check_interleaved(model: ModelProfile, config: ParallelConfig) -> None:
    """Interleaved 1F1B runs equal chunks (``placement.interleaved_chunk_sizes``): the blocks divide into
    pp x v chunks, and explicit stage boundaries are exactly that split."""
    if config.schedule != "interleaved_1f1b" or config.virtual_stages < 2:
        return
    blocks, chunks = block_count(model), config.pp * config.virtual_stages
    if blocks % chunks:
        fits = [v for v in range(2, blocks // config.pp + 1) if blocks % (config.pp * v) == 0]
        raise StratagemError(
            f"interleaved 1F1B runs equal chunks (Megatron-LM): {blocks} blocks do not divide into "
            f"pp {config.pp} x {config.virtual_stages} virtual stages = {chunks} chunks; use "
            + (
                f"--virtual-stages {' or '.join(map(str, fits[:4]))}"
                if fits
                else "1f1b, or a pp that divides the block count"
            )
        )
    if config.stage_layers is not None:
        sizes = interleaved_chunk_sizes(model, config)
        given = tuple(len(chunk) for chunk in config.stage_layers)
        if sizes is not None and given != sizes:
            raise StratagemError(
                f"interleaved 1F1B runs equal chunks of {blocks // chunks} blocks, but stage_layers "
                f"has chunks of {list(given)} layers; use the even split {list(sizes)} or 1f1b"
            )


def _check_model(model: ModelProfile, config: ParallelConfig) -> None:
    if config.tp > 1 and model.model.family in ("gpt", "llama"):
        heads = int(model.model.dim("heads"))
        if heads % config.tp:
            raise StratagemError(
                f"{heads} attention heads are not divisible by tp={config.tp}; choose a tp that divides {heads}"
            )
    for path, style in config.layout.items():
        if style not in ("split", "replicate"):
            raise StratagemError(f"layout of {path} is {style!r}; use 'split' or 'replicate'")
    if not isinstance(config.recompute, str):
        known = {layer.path for layer in model.layers}
        unknown = sorted(set(config.recompute) - known)
        if unknown:
            raise StratagemError(f"recompute names unknown layers {unknown[:3]}; use module paths of the profile")


def _check_zero3(config: ParallelConfig) -> None:
    if config.zero3_param_gathers < 1:
        raise StratagemError(
            f"zero3_param_gathers must be >= 1 (2 = forward + backward), got {config.zero3_param_gathers}"
        )
    if config.zero3_granularity not in ("layer", "tensor"):
        raise StratagemError(f"zero3_granularity {config.zero3_granularity!r} is unknown; use 'layer' or 'tensor'")
    if config.zero3_grad_reduce not in ("reduce_scatter", "all_reduce"):
        raise StratagemError(
            f"zero3_grad_reduce {config.zero3_grad_reduce!r} is unknown; use 'reduce_scatter' or 'all_reduce'"
        )
    if config.zero3_grad_sync not in (None, "micro_batch", "step"):
        raise StratagemError(
            f"zero3_grad_sync {config.zero3_grad_sync!r} is unknown; use 'micro_batch' "
            f"(reduce-scatter after every micro-batch) or 'step' (after the last one)"
        )


def _check_experts(model: ModelProfile, config: ParallelConfig) -> None:
    """Expert parallelism (``planner.cost.moe``): an MoE model, experts % ep == 0, ep * etp | dp * tp."""

    experts = next((layer.experts for layer in model.layers if layer.experts is not None), None)
    if experts is None:
        if config.ep > 1 or config.etp > 1:
            raise StratagemError(
                f"ep={config.ep} / etp={config.etp} need a Mixture-of-Experts model, and {model.name} has no "
                f"experts; use ep 1 and etp 1"
            )
        return
    if config.ep < 1 or config.etp < 1 or config.moe_load_imbalance < 1:
        raise StratagemError(
            f"ep {config.ep}, etp {config.etp} must be >= 1 and the load imbalance {config.moe_load_imbalance} "
            f">= 1 (busiest rank over the mean)"
        )
    if config.moe_dispatcher not in ("alltoall", "deepep"):
        raise StratagemError(
            f"unknown MoE dispatcher {config.moe_dispatcher!r}; use 'alltoall' (NCCL) or 'deepep' (DeepEP)"
        )
    check_expert_layout(experts=experts.experts, ep=config.ep, etp=config.etp, dp=config.dp, tp=config.tp)
    if config.replica_node_types is not None and config.ep * config.etp > 1:
        raise StratagemError(
            "expert parallelism with dp replicas on several node types is not modelled; plan the MoE model "
            "on one node type (--no-mixed) or with ep 1"
        )


def check_config(
    model: ModelProfile, cluster: ClusterProfile, config: ParallelConfig, *, global_batch: int, dtype: str
) -> None:
    """Raise :class:`StratagemError` for a configuration that cannot run (chunk/placement checks are in
    ``placement``)."""
    if global_batch < 1:
        raise StratagemError(f"global batch must be >= 1, got {global_batch}")
    _check_degrees(config, cluster)
    _check_zero3(config)
    _check_schedule(config)
    if config.replica_node_types is not None:
        _check_replica_types(config, cluster)
    _check_batch(config, global_batch)
    _check_model(model, config)
    _check_interleaved(model, config)
    _check_experts(model, config)
    used = set(config.replica_node_types or config.stage_node_types or (cluster.nodes[0].node_type,))
    for nt in cluster.node_types:  # only the node types the configuration runs on need the dtype
        if nt.name in used and not any(c.dtype == dtype for c in nt.compute):
            raise StratagemError(
                f"node type {nt.name} has no {dtype} compute figure; use --dtype "
                f"{nt.compute[0].dtype} or add the figure to the cluster profile"
            )
