"""Build one rank's pipeline chunk(s) from a plan: cut, init, TP, recompute, data parallelism.

Order (torchtitan's ``parallelize_*``): build on meta -> cut to the stage's module paths -> materialize
on CPU and init from the seed (per module path, so the values equal a single-process run's) -> move to
the device -> ``apply_tp`` -> ``apply_ac`` -> ``apply_dp``. Weights are initialized whole and then
sharded, which keeps the init independent of the layout but needs one stage's full weights in host
memory per rank; sharded init for models larger than that is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from planner.plan import Plan, Stage
from runtime.executor.context import ContextShard, apply_cp, data_parallel_mesh
from runtime.executor.fsdp import apply_dp
from runtime.executor.moe import (
    ExpertGradSync,
    ExpertGroups,
    apply_ep,
    apply_expert_dp,
    expert_params,
)
from runtime.executor.recompute import apply_ac
from runtime.executor.speed import apply_compile, compile_mode, fsdp_mp_policy, precision_scheme, weight_dtype
from runtime.executor.stage import cut_stage
from runtime.executor.tied import retie
from runtime.executor.tp import ReplicaGradSync, apply_tp, record_replica_rows
from runtime.executor.tp_plan import plan_tp_styles, replica_paths, uses_loss_parallel
from runtime.models.attention import apply_attention
from runtime.models.external import localise_head_counts
from runtime.models.layered import LayeredModel


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """One pipeline chunk this rank runs, with what was applied to it."""

    stage: Stage
    module: LayeredModel  # cut to the stage (runtime.executor.stage), wrapped in place
    tp_styles: dict[str, str] = field(default_factory=dict)
    recomputed: list[str] = field(default_factory=list)
    dp_mode: str = "none"
    replica_sync: ReplicaGradSync | None = None  # Whale replicas under tp > 1: gradients summed over TP
    replica_rows: dict[str, int] = field(default_factory=dict)  # rows each replica last computed
    context_paths: list[str] = field(default_factory=list)  # modules that split the sequence over cp
    experts_held: dict[str, list[int]] = field(default_factory=dict)  # MoE path -> global expert indices here
    expert_dp_mode: str = "none"  # ZeRO of the experts over edp (runtime.executor.moe.apply_expert_dp)
    expert_sync: ExpertGradSync | None = None  # MoE: expert grads over edp, token-sliced grads over tp
    attention: str = "none"  # "sdpa" (fused) or "math" when the chunk holds attention (runtime.models.attention)
    compiled: list[str] = field(default_factory=list)  # blocks compiled in place (runtime.executor.speed)
    cuda_graphs: bool = False  # the compiled blocks replay as CUDA graphs (runtime.executor.speed.compile_mode)
    precision: str = "fp32"  # runtime.executor.speed.precision_scheme

    @property
    def loss_parallel(self) -> bool:
        return uses_loss_parallel(self.tp_styles)


def build_chunk(
    plan: Plan,
    stage: Stage,
    mesh,
    device: torch.device,
    context: ContextShard | None = None,
    experts: ExpertGroups | None = None,
    *,
    compile_blocks: bool = False,
) -> Chunk:
    """Build, shard and wrap the chunk of ``stage`` for this rank (collective over the mesh).

    ``context``: the rank's share of the sequence under context parallelism (gradients then average over
    dp x cp). ``experts`` (an MoE model): keep this rank's experts and route over its ep group (``apply_ep``)
    after TP, and leave the experts out of the data-parallel wrapper. ``compile_blocks``: ``torch.compile`` each
    block after recompute and before data parallelism (``runtime.executor.speed``)."""
    from runtime.models import build_model, init_weights, layer_paths

    paths = layer_paths(plan.model)
    model = build_model(plan.model, device="meta")  # fp32 master weights
    cut_stage(model, stage.module_paths, paths)
    model.to_empty(device="cpu")
    init_weights(model, seed=plan.training.seed)
    model.to(device=device, dtype=weight_dtype(plan))  # bf16 under bf16-master (fp32 copies in the optimizer)
    attention = apply_attention(model, fused=plan.flash_attention)
    if plan.model.family == "hf":  # transformers' fused experts: the per-expert loop, not per-row weight copies
        from runtime.models.hf import use_loop_experts

        use_loop_experts(model)
    styles = plan_tp_styles(plan, stage.module_paths) if mesh["tp"].size() > 1 else {}
    apply_tp(model, mesh["tp"], styles)
    if plan.model.is_external and styles:  # as shard_module does: head counts kept as attributes (OPT)
        for path in (p for p in stage.module_paths if any(s.startswith(p + ".") for s in styles)):
            localise_head_counts(model.get_submodule(path), mesh["tp"].size())
    replicas = replica_paths(styles)
    rows: dict[str, int] = {}
    record_replica_rows(model, replicas, rows)
    sp_blocks = [p for p, lay in plan.layout.items() if lay.sequence_parallel and mesh["tp"].size() > 1]
    held = apply_ep(model, experts, sequence_parallel=sp_blocks, replicas=replicas) if experts is not None else {}
    retie(model, plan)
    context_paths = apply_cp(model, context)
    recomputed = apply_ac(model, stage.recompute)
    blocks = [p for p in stage.module_paths if p.startswith("blocks.")]
    mode = compile_mode(plan, device) if compile_blocks else None
    compiled = apply_compile(model, blocks, mode) if compile_blocks else []
    dp_mesh = data_parallel_mesh(mesh, plan.mesh.size("cp"))
    expert_dp = apply_expert_dp(model, experts, zero_stage=plan.zero_stage) if experts is not None and held else "none"
    dp_mode = apply_dp(
        model,
        dp_mesh,
        zero_stage=plan.zero_stage,
        block_paths=blocks,
        ignored_params=expert_params(model) if held and expert_dp == "none" else None,
        mp_policy=fsdp_mp_policy(plan),
    )
    # a replica's routed experts are reduced over edp by ExpertGradSync, not over TP
    sync = ReplicaGradSync(model, mesh["tp"], replicas, exclude=expert_params(model)) if replicas else None
    # after apply_dp, which replaces the wrapped Parameters (the experts, left out, keep theirs)
    expert_sync = (
        ExpertGradSync(model, experts, experts_sharded=expert_dp != "none") if experts is not None and held else None
    )
    return Chunk(
        stage=stage,
        module=model,
        tp_styles=styles,
        recomputed=recomputed,
        dp_mode=dp_mode,
        replica_sync=sync,
        replica_rows=rows,
        context_paths=context_paths,
        experts_held=held,
        expert_dp_mode=expert_dp,
        expert_sync=expert_sync,
        attention=("sdpa" if plan.flash_attention else "math") if attention else "none",
        compiled=compiled,
        cuda_graphs=bool(compiled) and mode == "reduce-overhead",
        precision=precision_scheme(plan),
    )


def describe_params(module: nn.Module, limit: int = 0) -> dict[str, dict]:
    """FQN -> {type, placements, mesh_dims, local_shape, global_shape, dtype}: what each rank really holds."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        info: dict = {"global_shape": list(p.shape), "dtype": str(p.dtype)}
        if isinstance(p, DTensor):
            info.update(
                type="DTensor",
                placements=[str(pl) for pl in p.placements],
                mesh_dims=list(p.device_mesh.mesh_dim_names or ()),
                local_shape=list(p.to_local().shape),
            )
        else:
            info.update(type="Tensor", placements=[], mesh_dims=[], local_shape=list(p.shape))
        out[name.replace("_checkpoint_wrapped_module.", "")] = info
        if limit and len(out) >= limit:
            break
    return out
