"""A plan as pandas tables: per stage, per rank, per layer, and one summary row.

Columns carry their unit in the name (``_s``, ``_bytes``). Time columns marked ``per micro-batch`` come
straight from ``StagePrediction.time_breakdown_s``; per-step figures multiply by the micro-batch count or
come from the schedule simulation (:mod:`planner.inspect.timeline`). A plan without predictions gives the
structural columns only.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from planner.inspect.timeline import Timeline, simulate_plan
from planner.plan import Plan, mesh_coords, plan_label

MICRO_BATCH_TERMS = ("forward", "backward", "recompute", "tp_comm", "layout", "pp_comm", "ep_comm")


def plan_timeline(plan: Plan) -> Timeline | None:
    """The simulated step of ``plan``, or None when it has no predictions."""
    return simulate_plan(plan) if plan.predictions is not None else None


def _recompute_label(modes: Mapping[str, str]) -> str:
    """``"full x2, selective x1"`` style summary of a stage's recompute choices (``"none"`` if empty)."""
    counts: dict[str, int] = {}
    for mode in modes.values():
        if mode != "none":
            counts[mode] = counts.get(mode, 0) + 1
    return ", ".join(f"{m} x{n}" for m, n in sorted(counts.items())) or "none"


def stage_frame(plan: Plan, timeline: Timeline | None = None, *, simulated: bool = True) -> pd.DataFrame:
    """One row per stage (model chunk): placement, per micro-batch and per step seconds, memory by kind of
    the device holding it.

    ``bubble_s`` and ``exposed_pp_comm_s`` are those of the stage's pp rank (shared by its chunks when
    interleaved); ``compute_s`` = m x (forward + backward + recompute), ``comm_s`` = m x (tp + pp comm).
    ``simulated=False`` skips the schedule simulation (and those two columns).
    """
    timeline = timeline or (plan_timeline(plan) if simulated else None)
    preds = {sp.stage: sp for sp in plan.predictions.stages} if plan.predictions else {}
    m = plan.schedule.max_micro_batches
    rows = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        row = dict(
            stage=st.index,
            pp_rank=st.pp_rank,
            modules=len(st.module_paths),
            first_module=st.module_paths[0],
            last_module=st.module_paths[-1],
            ranks=len(st.ranks),
            node_type=st.node_type,
            recompute=_recompute_label(st.recompute),
            tp_split_modules=sum(
                plan.layout.get(p) is not None and plan.layout[p].style == "split" for p in st.module_paths
            ),
        )
        sp = preds.get(st.index)
        if sp is not None:
            t = sp.time_breakdown_s
            row.update({f"{k}_s_per_micro_batch": t.get(k, 0.0) for k in MICRO_BATCH_TERMS})
            row["compute_s"] = m * sum(t.get(k, 0.0) for k in ("forward", "backward", "recompute"))
            row["comm_s"] = m * sum(t.get(k, 0.0) for k in ("tp_comm", "layout", "pp_comm", "ep_comm"))
            row.update({f"mem_{k}_bytes": v for k, v in sp.memory_breakdown_bytes.items()})
            row.update(
                peak_memory_bytes=sp.peak_memory_bytes,
                memory_capacity_bytes=sp.memory_capacity_bytes,
                memory_headroom_bytes=sp.memory_capacity_bytes - sp.peak_memory_bytes,
            )
        if timeline is not None:
            row.update(
                bubble_s=timeline.total_s("bubble", st.pp_rank),
                exposed_pp_comm_s=timeline.exposed_pp_comm_s(st.pp_rank),
            )
        rows.append(row)
    return pd.DataFrame(rows).set_index("stage")


def rank_coordinates(plan: Plan, rank: int) -> dict[str, int]:
    """Mesh coordinates of a global rank: axes row-major, last axis fastest (planner/plan/schema.py); pp, dp and tp
    always present (0 on a plan without that axis, e.g. a 3D CNN's dp x sd plan)."""
    coords = mesh_coords(plan.mesh, rank)
    base = {axis: 0 for axis in ("pp", "dp", "tp") if axis not in plan.mesh.axes}
    return {**{axis: coords[axis] for axis in plan.mesh.axes}, **base}


def rank_frame(plan: Plan, timeline: Timeline | None = None, *, simulated: bool = True) -> pd.DataFrame:
    """One row per global rank: mesh coordinates, its stages, memory by kind of the device (every chunk's
    prediction carries its device's memory), peak vs capacity, and its pp rank's busy / bubble /
    exposed pp-comm seconds per step (``simulated=False`` skips the simulation and those columns)."""
    timeline = timeline or (plan_timeline(plan) if simulated else None)
    preds = {sp.stage: sp for sp in plan.predictions.stages} if plan.predictions else {}
    stages_of: dict[int, list] = {}
    for st in sorted(plan.stages, key=lambda s: s.index):
        for r in st.ranks:
            stages_of.setdefault(r, []).append(st)
    rows = []
    for rank in range(plan.world_size):
        held = stages_of.get(rank, [])
        row = dict(
            rank=rank,
            **rank_coordinates(plan, rank),
            stages=",".join(str(s.index) for s in held),
            node_type=held[0].node_type if held else "",
        )
        chunk_preds = [preds[s.index] for s in held if s.index in preds]
        if chunk_preds:  # each chunk carries its device's memory (planner.cost.records): take the largest
            for sp in chunk_preds:
                for kind, value in sp.memory_breakdown_bytes.items():
                    row[f"mem_{kind}_bytes"] = max(row.get(f"mem_{kind}_bytes", 0.0), value)
            row["peak_memory_bytes"] = max(sp.peak_memory_bytes for sp in chunk_preds)
            row["memory_capacity_bytes"] = min(sp.memory_capacity_bytes for sp in chunk_preds)
        if timeline is not None and held:
            r = held[0].pp_rank
            row.update(
                busy_s=timeline.busy_s(r),
                bubble_s=timeline.total_s("bubble", r),
                exposed_pp_comm_s=timeline.exposed_pp_comm_s(r),
            )
        rows.append(row)
    return pd.DataFrame(rows).set_index("rank")


def layer_frame(plan: Plan) -> pd.DataFrame:
    """One row per top-level module in model order: stage, pp rank, ranks, node type, TP layout, recompute,
    spatial split (3D CNNs: its grid, e.g. ``d4xh2``; "" unsplit).

    The plan holds no per-layer costs (those live in the model profile), so this frame has none.
    """
    rows = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        for position, path in enumerate(st.module_paths):
            layout = plan.layout.get(path)
            rows.append(
                dict(
                    module=path,
                    stage=st.index,
                    pp_rank=st.pp_rank,
                    position_in_stage=position,
                    ranks=len(st.ranks),
                    node_type=st.node_type,
                    tp_style=layout.style if layout else "replicate",
                    sequence_parallel=bool(layout and layout.sequence_parallel),
                    recompute=st.recompute.get(path, "none"),
                    spatial="x".join(f"{d}{g}" for d, g in zip("dhw", layout.spatial.grid) if g > 1)
                    if layout and layout.spatial
                    else "",
                )
            )
    return pd.DataFrame(rows).set_index("module")


def summary_frame(plan: Plan, name: str | None = None, timeline: Timeline | None = None) -> pd.DataFrame:
    """One row describing the plan: degrees, schedule, predicted speed and memory, search outcome."""
    s = plan.schedule
    row = dict(
        plan=name or plan_label(plan),
        model=plan.model.name,
        cluster=plan.cluster_name,
        world_size=plan.world_size,
        pp=plan.mesh.size("pp"),
        dp=plan.mesh.size("dp"),
        cp=plan.mesh.size("cp"),
        tp=plan.mesh.size("tp"),
        schedule=s.kind,
        virtual_stages=s.virtual_stages,
        micro_batch_size=s.micro_batch_size,
        num_micro_batches=s.max_micro_batches,
        global_batch=plan.training.global_batch,
        zero_stage=plan.zero_stage,
        recompute_modules=sum(m != "none" for st in plan.stages for m in st.recompute.values()),
        tp_split_modules=sum(lay.style == "split" for lay in plan.layout.values()),
    )
    if plan.experts is not None:  # Mixture-of-Experts: the expert layout (planner.plan.schema.ExpertLayout)
        edp = plan.experts.edp(dp=plan.mesh.size("dp"), tp=plan.mesh.size("tp"))
        row.update(ep=plan.experts.ep, etp=plan.experts.etp, edp=edp)
    p = plan.predictions
    if p is not None:
        capacity = min(sp.memory_capacity_bytes for sp in p.stages) if p.stages else float("nan")
        row.update(
            step_time_s=p.step_time_s,
            tokens_per_s=p.tokens_per_s,
            samples_per_s=p.samples_per_s,
            model_tflops_per_gpu=p.model_tflops_per_gpu,
            mfu=p.mfu,
            peak_memory_bytes=p.peak_memory_bytes,
            memory_capacity_bytes=capacity,
            memory_fraction=p.peak_memory_bytes / capacity,
            bubble_fraction_of_step=p.breakdown_s.get("bubble", 0.0) / p.step_time_s,
            simulated_step_time_s=(timeline or simulate_plan(plan)).makespan_s,
        )
    if plan.search is not None:
        row.update(
            search_status=plan.search.status, search_gap=plan.search.gap, search_wall_time_s=plan.search.wall_time_s
        )
    return pd.DataFrame([row]).set_index("plan")
