"""What each rank will build, in words, without starting a process (``stratagem launch --dry-run``)."""

from __future__ import annotations

from planner.plan import Plan
from runtime.executor.checks import check_replica_schedules
from runtime.executor.data import replica_rows
from runtime.executor.fsdp import ZERO_MAPPING
from runtime.executor.moe import describe_experts
from runtime.executor.tp_plan import plan_tp_styles, uses_loss_parallel


def describe_ranks(plan: Plan, ranks: list[int] | None = None) -> list[str]:
    """One line per rank: mesh coordinates, stage(s) and module paths, TP placements, recompute, dp mode,
    and the rows of each global batch it trains on, in how many micro-batches.

    >>> describe_ranks(make_plan(parse_model("gpt:tiny"), dp=2))[0]  # doctest: +ELLIPSIS
    'rank 0 (pp 0, dp 0, tp 0): stage 0 [embed, blocks.0, blocks.1, norm, head] ...'
    """
    if "sd" in plan.mesh.axes:
        return describe_spatial_ranks(plan, ranks)
    dims = plan.parallel_dims
    split = check_replica_schedules(plan)
    dp_mode = ZERO_MAPPING[plan.zero_stage] if dims.dp * dims.cp > 1 else "none"  # over dp x cp
    lines = []
    for rank in range(dims.world_size) if ranks is None else ranks:
        c = dims.coords(rank)
        parts = []
        for st in sorted((s for s in plan.stages if s.pp_rank == c["pp"]), key=lambda s: s.index):
            styles = plan_tp_styles(plan, st.module_paths) if dims.tp > 1 else {}
            tp_text = ", ".join(f"{k}={v}" for k, v in styles.items()) or "replicated"
            rec = ", ".join(f"{k}={v}" for k, v in st.recompute.items() if v != "none") or "none"
            lp = " +loss_parallel" if uses_loss_parallel(styles) else ""
            paths = st.module_paths
            names = ", ".join(paths) if len(paths) <= 6 else f"{paths[0]}, ..{len(paths) - 2} more.., {paths[-1]}"
            parts.append(f"stage {st.index} [{names}] tp: {tp_text}{lp}; recompute: {rec}")
        start, stop = replica_rows(split.rows, c["dp"])
        m = split.micro_batches[c["dp"]]
        cp = f", cp {c['cp']} (sequence chunks {c['cp']} and {2 * dims.cp - 1 - c['cp']})" if dims.cp > 1 else ""
        lines.append(
            f"rank {rank} (pp {c['pp']}, dp {c['dp']}{cp}, tp {c['tp']}): "
            + " | ".join(parts)
            + f"; dp: {dp_mode}; batch rows {start}..{stop - 1} in {m} micro-batch{'es' * (m > 1)}"
            + f" of {(stop - start) // m}"
            + describe_experts(plan, dims, rank)
        )
    return lines


def describe_spatial_ranks(plan: Plan, ranks: list[int] | None = None) -> list[str]:
    """A 3D CNN's spatial plan: per rank its dp replica, spatial-group index, and each split layer's shard.

    >>> from fixtures.spatial_plans import make_spatial_plan
    >>> describe_spatial_ranks(make_spatial_plan("unet3d:tiny", dp=1, sd=2, grids={"head": (2, 1, 1)}))[1]
    'rank 1 (dp 0, sd 1): whole model; split: head d2 shard (1, 0, 0); batch rows 0..3 in 4 micro-batches of 1'
    """
    from runtime.executor.spatial import grid_coords

    dp, sd = plan.mesh.size("dp"), plan.mesh.size("sd")
    rows = plan.training.global_batch // dp
    m = plan.schedule.max_micro_batches
    lines = []
    for rank in range(dp * sd) if ranks is None else ranks:
        d, i = divmod(rank, sd)
        splits = [
            f"{path} {'x'.join(f'{a}{g}' for a, g in zip('dhw', lay.spatial.grid) if g > 1)} "
            f"shard {grid_coords(i, tuple(lay.spatial.grid))}"  # type: ignore[arg-type]
            for path, lay in plan.layout.items()
            if lay.spatial is not None
        ]
        shown = "; ".join(splits[:4]) + (f"; ..{len(splits) - 4} more" if len(splits) > 4 else "")
        lines.append(
            f"rank {rank} (dp {d}, sd {i}): whole model; split: {shown or 'none'}; "
            f"batch rows {d * rows}..{(d + 1) * rows - 1} in {m} micro-batch{'es' * (m > 1)} of {rows // m}"
        )
    return lines
