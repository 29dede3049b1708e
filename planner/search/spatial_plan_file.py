"""The plan file of a hybrid data + spatial search, and why each layer is split (``planner/search/spatial.py``).

Mesh axes ``dp, sd`` (``sd`` fastest: spatial groups are consecutive ranks); one stage holding every layer;
gradient accumulation over ``num_micro_batches``; each split layer's :class:`planner.plan.schema.SpatialSplit` in
``layout`` with the reason: *memory* when leaving that layer unsplit (the others as planned) would not fit a
rank, else *time* (splitting it is faster).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import replace

import pulp

from planner import __version__
from planner.core import StratagemError, is_gpu
from planner.cost import UNSPLIT, SpatialConfig, SpatialEstimate, SpatialOption, check_split, estimate_spatial
from planner.model import SPATIAL_FAMILIES, ModelSpec, volume_layers
from planner.plan import (
    Alternative,
    LayerLayout,
    Mesh,
    Plan,
    Predictions,
    SearchRecord,
    SpatialSplit,
    Stage,
    StagePrediction,
    TrainingSettings,
    make_schedule,
)
from planner.profile import ClusterProfile, ModelProfile
from planner.search.spatial import SpatialSearchResult

GIB = 2**30


def split_reasons(profile: ModelProfile, cluster: ClusterProfile, config: SpatialConfig) -> dict[str, str]:
    """Per split layer: why the plan splits it (module docstring), with the numbers."""
    base = estimate_spatial(profile, cluster, config)
    reasons = {}
    for path in config.layout:
        layout = {p: o for p, o in config.layout.items() if p != path}
        alt = estimate_spatial(profile, cluster, replace(config, layout=layout))
        if not alt.fits:
            reasons[path] = f"memory: unsplit {alt.peak_memory_bytes / GIB:.1f} > {alt.capacity_bytes / GIB:.1f} GiB"
        else:
            reasons[path] = f"time: unsplit +{alt.step_time_s - base.step_time_s:.3g} s/step"
    return reasons


def _predictions(profile: ModelProfile, cluster: ClusterProfile, config: SpatialConfig, est: SpatialEstimate):
    world = config.dp * config.sd
    batch = config.dp * config.micro_batch * config.num_micro_batches
    flops = sum(lay.shards[0].fwd_flops_per_sample + lay.shards[0].bwd_flops_per_sample for lay in profile.layers)
    node = cluster.node_types[0]
    peak = node.compute_for(profile.dtype).peak_flops_per_s
    tflops = flops * batch / est.step_time_s / world / 1e12
    stage = StagePrediction(
        stage=0,
        time_breakdown_s=est.per_micro_batch_s,
        memory_breakdown_bytes=est.memory_bytes,
        peak_memory_bytes=est.peak_memory_bytes,
        memory_capacity_bytes=est.capacity_bytes,
    )
    return Predictions(
        step_time_s=est.step_time_s,
        tokens_per_s=batch * profile.seq_len / est.step_time_s,
        samples_per_s=batch / est.step_time_s,
        model_tflops_per_gpu=tflops,
        hardware_tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / peak if is_gpu(node.device) else 0.0,
        peak_memory_bytes=est.peak_memory_bytes,
        breakdown_s=est.breakdown_s,
        stages=[stage],
    )


def _summary(config: SpatialConfig) -> str:
    split = len(config.layout)
    return f"dp{config.dp} sd{config.sd} mb{config.micro_batch}x{config.num_micro_batches} split {split} layers"


def build_spatial_plan(
    result: SpatialSearchResult,
    *,
    model: ModelSpec,
    profile: ModelProfile,
    cluster: ClusterProfile,
    training: TrainingSettings,
) -> Plan:
    """The plan file of the best candidate of ``result``."""
    best = result.best
    config = best.config
    reasons = split_reasons(profile, cluster, config)
    layout = {
        path: LayerLayout(
            style="replicate",
            spatial=SpatialSplit(degree=o.degree, dims=list(o.dims), grid=list(o.grid), reason=reasons[path]),
        )
        for path, o in config.layout.items()
        if o != UNSPLIT
    }
    world = config.dp * config.sd
    best_s = best.estimate.step_time_s
    top = [
        Alternative(
            summary=_summary(c.config),
            step_time_s=c.estimate.step_time_s,
            peak_memory_bytes=c.estimate.peak_memory_bytes,
            slowdown=c.estimate.step_time_s / best_s,
            choices={"dp": c.config.dp, "sd": c.config.sd, "micro_batch": c.config.micro_batch},
        )
        for c in result.ranked[1:]
    ]
    record = SearchRecord(
        solver=f"CBC via PuLP {pulp.__version__} (per-layer spatial options, planner/search/spatial.py)",
        status=result.status,
        gap=0.0,
        wall_time_s=result.wall_time_s,
        candidates_solved=result.candidates_solved,
        candidates_pruned=result.candidates_pruned,
        top_k=top,
        notes=f"{result.notes}; the best is proven optimal under the cost model",
    )
    return Plan(
        planner_version=__version__,
        created_utc=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        model=model,
        model_profile_hash=profile.content_hash,
        cluster_name=cluster.name,
        cluster_hash=cluster.content_hash,
        training=training,
        mesh=Mesh(axes=["dp", "sd"], sizes=[config.dp, config.sd]),
        schedule=make_schedule(
            "1f1b",
            micro_batch_size=config.micro_batch,
            global_batch=training.global_batch,
            dp=config.dp,
            num_micro_batches=config.num_micro_batches,
        ),
        stages=[
            Stage(
                index=0,
                pp_rank=0,
                module_paths=[lay.path for lay in profile.layers],
                ranks=list(range(world)),
                node_type=cluster.node_types[0].name,
            )
        ],
        layout=layout,
        predictions=_predictions(profile, cluster, config, best.estimate),
        search=record,
    )


def spatial_config_of(plan: Plan) -> SpatialConfig:
    """The :class:`SpatialConfig` a spatial plan file describes (for re-estimating and the runtime)."""
    layout = {
        path: SpatialOption(grid=tuple(lay.spatial.grid))  # type: ignore[arg-type]
        for path, lay in plan.layout.items()
        if lay.spatial is not None
    }
    return SpatialConfig(
        dp=plan.mesh.size("dp"),
        sd=plan.mesh.size("sd"),
        micro_batch=plan.schedule.micro_batch_size,
        num_micro_batches=plan.schedule.max_micro_batches,
        layout=layout,
    )


def memory_table(profile: ModelProfile, cluster: ClusterProfile, plan: Plan) -> list[dict[str, str]]:
    """Rows per layer: option, time per micro-batch, saved GiB per rank split and unsplit, and why."""
    est = estimate_spatial(profile, cluster, spatial_config_of(plan))
    rows = []
    for row in est.layers:
        lay = plan.layout.get(row.path)
        rows.append(
            {
                "layer": row.path,
                "split": row.option,
                "ms/mb": f"{row.time_s * 1e3:.2f}",
                "halo ms": f"{row.halo_s * 1e3:.2f}",
                "GiB/rank": f"{row.act_bytes / GIB:.2f}",
                "unsplit": f"{row.act_bytes_unsplit / GIB:.2f}",
                "why": lay.spatial.reason if lay is not None and lay.spatial is not None else "",
            }
        )
    return rows


def check_spatial_plan(plan: Plan) -> None:
    """Reject a spatial plan the runtime cannot run, in one line (degree not dividing the volume, halo wider
    than the shard, a split over a different group size, a dense layer split)."""
    if plan.model.family not in SPATIAL_FAMILIES:
        raise StratagemError(f"mesh axis sd splits 3D CNN volumes; {plan.model.name} is not one, re-plan it")
    if plan.mesh.axes != ["dp", "sd"]:
        raise StratagemError(f"a spatial plan has mesh axes dp, sd; this one has {plan.mesh.axes}; re-plan")
    table = {v.path: v for v in volume_layers(plan.model)}
    sd = plan.mesh.size("sd")
    for path, lay in plan.layout.items():
        if path not in table:
            raise StratagemError(f"plan lays out layer {path!r}, which {plan.model.name} does not have; re-plan")
        if lay.spatial is None:
            continue
        if sd % lay.spatial.degree:
            raise StratagemError(
                f"layer {path} is split {lay.spatial.degree} ways, which does not divide the spatial group's "
                f"{sd} ranks (mesh axis sd); choose a degree dividing {sd}"
            )
        check_split(table[path], SpatialOption(grid=tuple(lay.spatial.grid)))  # type: ignore[arg-type]
