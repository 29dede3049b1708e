"""Pictures of a plan, each a function returning a matplotlib :class:`~matplotlib.figure.Figure`.

No pyplot: figures are built directly (thread-safe, nothing global, any backend; ``fig.savefig`` renders
with Agg). Every axis names its unit, every figure has a legend. Drawn artists carry a ``gid`` so tests
can check what was drawn. The timeline is in :mod:`planner.inspect.fig_timeline`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from planner.core import StratagemError
from planner.inspect.fig_spatial import is_spatial, plot_spatial_placement
from planner.inspect.frames import plan_label, rank_frame, stage_frame
from planner.inspect.units import bytes_unit, fmt_bytes, time_unit
from planner.plan import Plan, Predictions

MEMORY_COLORS = {
    "params": "#3182bd",
    "grads": "#9ecae1",
    "optimizer": "#31a354",
    "expert_states": "#756bb1",
    "unsharded_params": "#6baed6",
    "activations": "#fd8d3c",
}
TERM_COLORS = {
    "compute": "#3182bd",
    "forward": "#1f5f9e",
    "backward": "#2b7a2b",
    "recompute": "#6a3d9a",
    "tp_comm": "#636363",
    "layout": "#969696",
    "pp_comm": "#e6550d",
    "ep_comm": "#e7ba52",
    "expert_sync": "#e7969c",
    "bubble": "#bdbdbd",
    "dp_comm": "#de2d26",
    "dp_sync_exposed": "#de2d26",
    "zero_comm": "#fb6a4a",
    "optimizer": "#8c6d31",
}
MAX_NAMED_POINTS = 12
OTHER_COLORS = ("#756bb1", "#e7ba52", "#ad494a", "#8ca252", "#7b4173", "#843c39")


def _color(table: dict[str, str], key: str, index: int) -> str:
    return table.get(key, OTHER_COLORS[index % len(OTHER_COLORS)])


def _needs_predictions(plan: Plan, what: str) -> Predictions:
    if plan.predictions is None:
        raise StratagemError(
            f"plan has no predictions, so there is no {what} to draw; re-plan with `stratagem plan` to fill them"
        )
    return plan.predictions


def plot_memory_per_rank(plan: Plan) -> Figure:
    """Predicted memory per device, stacked by kind, against the device capacity, one bar per pp rank.

    All ranks of one pp rank (its dp x tp group) hold the same stages, so they share one bar.
    """
    _needs_predictions(plan, "memory")
    frame = rank_frame(plan, simulated=False).groupby("pp", sort=True).first()
    kinds = [c for c in frame.columns if c.startswith("mem_") and c.endswith("_bytes")]
    scale, unit = bytes_unit(max(frame["memory_capacity_bytes"].max(), frame["peak_memory_bytes"].max()))
    group = plan.mesh.size("dp") * plan.mesh.size("cp") * plan.mesh.size("tp")
    mixed = frame["node_type"].nunique() > 1
    fig = Figure(figsize=(max(6.0, 1.0 + (1.0 if mixed else 0.7) * len(frame)), 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = list(range(len(frame)))
    bottom = [0.0] * len(frame)
    for i, column in enumerate(kinds):
        kind = column[len("mem_") : -len("_bytes")]
        values = (frame[column].fillna(0.0) * scale).tolist()
        ax.bar(x, values, bottom=bottom, color=_color(MEMORY_COLORS, kind, i), width=0.6, label=kind, gid=f"mem:{kind}")
        bottom = [b + v for b, v in zip(bottom, values)]
    capacity = (frame["memory_capacity_bytes"] * scale).tolist()
    ax.hlines(
        capacity,
        [i - 0.4 for i in x],
        [i + 0.4 for i in x],
        colors="#cb181d",
        linewidth=2.2,
        label="device capacity",
        gid="capacity",
    )
    peaks = (frame["peak_memory_bytes"] * scale).tolist()
    ax.scatter(x, peaks, marker="D", color="black", zorder=3, s=18, label="predicted peak", gid="peak")
    if len(frame) <= 16:
        top = max(max(capacity), max(bottom))
        for xi, peak_bytes, peak in zip(x, frame["peak_memory_bytes"], peaks):
            ax.annotate(fmt_bytes(peak_bytes), (xi, peak + 0.015 * top), ha="center", va="bottom", fontsize=7)
    if mixed and len(frame) <= 16:
        ax.set_xticks(x, [f"{r}\n{node}" for r, node in zip(frame.index, frame["node_type"])], fontsize=7)
    elif len(frame) <= 6:
        ax.set_xticks(x, [f"pp {r}" + (f"\n({group} ranks)" if group > 1 else "") for r in frame.index])
    else:
        step = max(1, len(frame) // 16)
        ax.set_xticks(x[::step], [str(r) for r in frame.index[::step]])
    ax.set_xlabel(f"pipeline rank (each bar = the {group} device(s) of one pp rank)")
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_ylim(0, max(max(capacity), max(bottom)) * 1.12)
    fig.suptitle(f"{plan_label(plan)}: predicted memory per device", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_layer_placement(plan: Plan) -> Figure:
    """Which pp rank and stage holds each module (model order), hatched where tensor-parallel split,
    with a marker where recomputed and one on Mixture-of-Experts blocks (experts sharded over ep); for a 3D
    CNN's spatial plan, each layer's spatial split instead."""
    if is_spatial(plan):
        return plot_spatial_placement(plan)
    modules = [(p, st) for st in sorted(plan.stages, key=lambda s: s.index) for p in st.module_paths]
    expert_blocks = moe_block_paths(plan)
    pp = plan.mesh.size("pp")
    fig = Figure(figsize=(min(16.0, max(7.0, 2.5 + 0.28 * len(modules))), 1.6 + 0.45 * pp + 0.9), layout="constrained")
    ax = fig.add_subplot()
    cmap = _stage_colors(len(plan.stages))
    for i, (path, st) in enumerate(modules):
        split = plan.layout.get(path) is not None and plan.layout[path].style == "split"
        ax.bar(
            i,
            0.8,
            bottom=st.pp_rank - 0.4,
            width=1.0,
            color=cmap[st.index],
            edgecolor="white",
            hatch="///" if split else None,
            gid=f"module:{path}",
        )
        if path in expert_blocks:
            ax.plot(i, st.pp_rank + 0.22, marker="D", color="#756bb1", markersize=4, gid=f"experts:{path}")
        mode = st.recompute.get(path, "none")
        if mode != "none":
            ax.plot(
                i,
                st.pp_rank - 0.52,
                marker="v",
                color="black",
                markersize=4,
                markerfacecolor="black" if mode == "full" else "white",
                gid=f"recompute:{path}",
            )
    step = max(1, len(modules) // 24)
    ax.set_xticks(
        range(0, len(modules), step),
        [modules[i][0] for i in range(0, len(modules), step)],
        rotation=60,
        ha="right",
        fontsize=7,
    )
    node_of = {st.pp_rank: st.node_type for st in plan.stages}
    mixed = len(set(node_of.values())) > 1
    ax.set_yticks(range(pp), [f"pp rank {r}" + (f"\n{node_of[r]}" if mixed else "") for r in range(pp)])
    ax.set_ylim(pp - 0.4, -0.75)
    ax.set_xlim(-0.6, len(modules) - 0.4)
    ax.set_xlabel("top-level module, in model order (module path)")
    ax.set_ylabel("pipeline rank")
    ax.set_title(
        f"{plan_label(plan)}: layer placement ({len(modules)} modules, {len(plan.stages)} stages)", fontsize=10
    )
    handles = _placement_legend(plan, cmap)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def moe_block_paths(plan: Plan) -> set[str]:
    """Module paths of the plan's Mixture-of-Experts blocks (``blocks.i`` from ``dense_layers`` on)."""
    if not plan.model.is_moe:
        return set()
    dense, layers = int(plan.model.dim("dense_layers")), int(plan.model.dim("layers"))
    return {f"blocks.{i}" for i in range(dense, layers)}


def _stage_colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(n)]


def _placement_legend(plan: Plan, colors: list) -> list:
    shown = sorted(plan.stages, key=lambda s: s.index)
    handles: list = [Patch(facecolor=colors[st.index], label=f"stage {st.index}") for st in shown[:12]]
    if len(shown) > 12:
        handles.append(Patch(facecolor="white", label=f"... {len(shown) - 12} more stages"))
    if any(lay.style == "split" for lay in plan.layout.values()):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="tensor-parallel split"))
    if plan.experts is not None and moe_block_paths(plan):
        e = plan.experts
        per_rank = int(plan.model.dim("experts")) // e.ep
        label = f"routed experts over ep={e.ep} ({per_rank} per rank)" + (f", etp={e.etp}" if e.etp > 1 else "")
        handles.append(Line2D([], [], marker="D", color="#756bb1", linestyle="", label=label))
    modes = {m for st in plan.stages for m in st.recompute.values()}
    if "full" in modes:
        handles.append(Line2D([], [], marker="v", color="black", linestyle="", label="full recompute"))
    if "selective" in modes:
        handles.append(
            Line2D(
                [], [], marker="v", color="black", markerfacecolor="white", linestyle="", label="selective recompute"
            )
        )
    return handles


def plot_step_breakdown(plan: Plan) -> Figure:
    """Left: the predicted step time split into its terms (those named ``*overlapped*`` are hidden behind
    compute, so they are listed, not stacked). Right: per stage, seconds per step by kind."""
    p = _needs_predictions(plan, "step-time breakdown")
    stacked = {t: v for t, v in p.breakdown_s.items() if "overlapped" not in t and v > 0}
    hidden = {t: v for t, v in p.breakdown_s.items() if "overlapped" in t and v > 0}
    scale, unit = time_unit(max(p.step_time_s, sum(stacked.values())))
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 2.2])
    x = 0.0
    for i, (term, seconds) in enumerate(stacked.items()):
        left.bar(
            0, seconds * scale, bottom=x, width=0.5, color=_color(TERM_COLORS, term, i), label=term, gid=f"term:{term}"
        )
        x += seconds * scale
    for term, seconds in hidden.items():
        left.plot([], [], " ", label=f"{term}: {seconds * scale:.3g} {unit} (hidden)")
    left.axhline(p.step_time_s * scale, color="black", linestyle="--", linewidth=1, label="predicted step time")
    left.set_xticks([0], ["step"])
    left.set_xlim(-0.6, 0.6)
    left.set_ylabel(f"time per training step ({unit})")
    left.set_title("predicted step-time terms", fontsize=10)
    left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _per_stage_bars(right, plan, scale, unit)
    fig.suptitle(f"{plan_label(plan)}: step time {p.step_time_s * scale:.3g} {unit}", fontsize=10)
    return fig


def _per_stage_bars(ax, plan: Plan, scale: float, unit: str) -> None:
    frame = stage_frame(plan, simulated=False)
    m = plan.schedule.max_micro_batches
    bottom = [0.0] * len(frame)
    for i, term in enumerate(("forward", "backward", "recompute", "tp_comm", "layout", "pp_comm", "ep_comm")):
        column = f"{term}_s_per_micro_batch"
        if column not in frame or not (frame[column] > 0).any():
            continue
        values = (frame[column] * m * scale).tolist()
        ax.bar(
            frame.index,
            values,
            bottom=bottom,
            color=_color(TERM_COLORS, term, i),
            width=0.6,
            label=f"{term} (x{m} micro-batches)",
            gid=f"stage:{term}",
        )
        bottom = [b + v for b, v in zip(bottom, values)]
    if len(frame) <= 12:
        ax.set_xticks(frame.index, [f"{s}\n(pp {r})" for s, r in zip(frame.index, frame["pp_rank"])], fontsize=8)
        ax.set_xlabel("stage (pp rank)")
    else:  # stage s runs on pp rank s mod pp
        step = max(1, len(frame) // 16)
        ax.set_xticks(frame.index[::step], [str(s) for s in frame.index[::step]], fontsize=8)
        ax.set_xlabel(f"stage (on pp rank stage mod {plan.mesh.size('pp')})")
    ax.set_ylabel(f"time per training step ({unit})")
    ax.set_title("per stage: work per step (stages on one pp rank run in turn)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)


def comparison_points(plans: Plan | Sequence[Plan], names: Sequence[str] | None = None) -> pd.DataFrame:
    """(label, step_time_s, peak_memory_bytes, chosen) rows: several plans (first = chosen), or one plan
    and its search's top-k alternatives."""
    if isinstance(plans, Plan):
        plan = plans
        predictions = _needs_predictions(plan, "comparison")
        rows = [
            dict(
                label=names[0] if names else plan_label(plan),
                step_time_s=predictions.step_time_s,
                peak_memory_bytes=predictions.peak_memory_bytes,
                chosen=True,
            )
        ]
        for alt in plan.search.top_k if plan.search else []:
            rows.append(
                dict(
                    label=alt.summary,
                    step_time_s=alt.step_time_s,
                    peak_memory_bytes=alt.peak_memory_bytes,
                    chosen=False,
                )
            )
        return pd.DataFrame(rows)
    rows = []
    for i, plan in enumerate(plans):
        predictions = _needs_predictions(plan, "comparison")
        rows.append(
            dict(
                label=names[i] if names else plan_label(plan),
                step_time_s=predictions.step_time_s,
                peak_memory_bytes=predictions.peak_memory_bytes,
                chosen=i == 0,
            )
        )
    return pd.DataFrame(rows)


def plot_plan_comparison(
    plans: Plan | Sequence[Plan], names: Sequence[str] | None = None, *, memory_capacity_bytes: float | None = None
) -> Figure:
    """Step time vs peak memory per device of several plans (the first is the chosen one, starred), or
    of one plan and its search's top-k alternatives."""
    points = comparison_points(plans, names)
    first = plans if isinstance(plans, Plan) else plans[0]
    if memory_capacity_bytes is None and first.predictions and first.predictions.stages:
        memory_capacity_bytes = min(sp.memory_capacity_bytes for sp in first.predictions.stages)
    t_scale, t_unit = time_unit(points["step_time_s"].max())
    m_scale, m_unit = bytes_unit(max(points["peak_memory_bytes"].max(), memory_capacity_bytes or 0.0))
    fig = Figure(figsize=(11, 5), layout="constrained")
    ax = fig.add_subplot()
    others, chosen = points[~points["chosen"]], points[points["chosen"]]
    ax.scatter(
        others["step_time_s"] * t_scale,
        others["peak_memory_bytes"] * m_scale,
        s=40,
        color="#6baed6",
        edgecolor="#08519c",
        label="alternative",
        gid="alternatives",
    )
    ax.scatter(
        chosen["step_time_s"] * t_scale,
        chosen["peak_memory_bytes"] * m_scale,
        s=220,
        marker="*",
        color="#fdae6b",
        edgecolor="#a63603",
        zorder=3,
        label="chosen plan",
        gid="chosen",
    )
    if memory_capacity_bytes:
        mixed = first.predictions and len({sp.memory_capacity_bytes for sp in first.predictions.stages}) > 1
        ax.axhline(
            memory_capacity_bytes * m_scale,
            color="#cb181d",
            linestyle="--",
            label="smallest device capacity" if mixed else "device capacity",
        )
    for i, row in points.head(MAX_NAMED_POINTS).iterrows():  # numbers on the plot, names in the legend
        ax.annotate(
            f"#{i + 1}",
            (row["step_time_s"] * t_scale, row["peak_memory_bytes"] * m_scale),
            xytext=(5, 4 + 8 * (i % 2)),
            textcoords="offset points",
            fontsize=8,
            gid=f"point:{i + 1}",
        )
        label = row["label"] if len(row["label"]) <= 60 else row["label"][:57] + "..."
        ax.plot([], [], " ", label=f"#{i + 1} {label}")
    ax.set_xlabel(f"predicted step time ({t_unit})")
    ax.set_ylabel(f"predicted peak memory per device ({m_unit})")
    ax.set_xlim(0, points["step_time_s"].max() * t_scale * 1.15)
    ax.set_ylim(0, max(points["peak_memory_bytes"].max(), memory_capacity_bytes or 0.0) * m_scale * 1.15)
    ax.set_title("plans compared: lower left is better", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return fig


def plot_metrics(frame: pd.DataFrame, plan: Plan | None = None) -> Figure:
    """A launch's measured step time (with the prediction) and loss per step, from ``metrics_frame``."""
    if "step_time_s" not in frame:
        raise StratagemError("metrics have no step_time_s column; pass the file `stratagem launch --metrics` wrote")
    predicted = plan.predictions.step_time_s if plan is not None and plan.predictions else None
    if predicted is None and "predicted_step_time_s" in frame and frame["predicted_step_time_s"].notna().any():
        predicted = float(frame["predicted_step_time_s"].dropna().iloc[0])
    scale, unit = time_unit(max(frame["step_time_s"].max(), predicted or 0.0))
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(frame.index, frame["step_time_s"] * scale, marker="o", label="measured", gid="measured")
    if predicted is not None:
        left.axhline(predicted * scale, color="black", linestyle="--", label="predicted")
    left.set_xlabel("training step (index)")
    left.set_ylabel(f"step time ({unit})")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    left.set_title("step time: measured vs predicted", fontsize=10)
    if "loss" in frame:
        right.plot(frame.index, frame["loss"], marker=".", color="#e6550d", label="training loss", gid="loss")
    right.set_xlabel("training step (index)")
    right.set_ylabel("loss (cross-entropy, nats)")
    right.legend(fontsize=8)
    right.set_title("loss", fontsize=10)
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def plot_run_segments(segments: pd.DataFrame) -> Figure:
    """The run's timeline of plans (``measured.run_segments``): one bar per attempt along wall-clock time, labelled
    with its world size, plan and steps, and the time lost between attempts shaded and labelled."""
    if segments[["_first_time", "_last_time"]].isna().any().any():
        raise StratagemError("these metrics carry no unix_time (written by an older stratagem); relaunch to draw them")
    t0 = float(segments["_first_time"].min())
    fig = Figure(figsize=(10, 1.2 + 0.6 * len(segments)), layout="constrained")
    ax = fig.subplots()
    for y, (attempt, row) in enumerate(segments.iterrows()):
        start, end = row["_first_time"] - t0, row["_last_time"] - t0
        ax.barh(y, end - start, left=start, color=_color({}, str(row["plan_hash"]), y), gid=f"attempt{attempt}")
        plan = Path(str(row["plan_path"])).name if row["plan_path"] else str(row["plan_hash"])[:12]
        ax.text(
            end, y, f"  {row['world_size']} ranks, {plan}: steps {row['first_step']}-{row['last_step']}", va="center"
        )
        if y > 0 and not pd.isna(row["time_lost_s"]):
            lost_from = start - row["time_lost_s"]
            ax.axvspan(lost_from, start, color="#d62728", alpha=0.2)
            ax.text((lost_from + start) / 2, y - 0.5, f"{row['why']}: {row['time_lost_s']:.1f} s lost", ha="center")
    ax.set_yticks(range(len(segments)), [f"attempt {a}" for a in segments.index])
    ax.invert_yaxis()
    ax.set_xlabel("wall-clock time since the first step (s)")
    ax.set_title("the run's plans: which plan trained which steps, and the time lost between them", fontsize=10)
    ax.set_xlim(right=float(segments["_last_time"].max() - t0) * 1.6 + 1)
    return fig
