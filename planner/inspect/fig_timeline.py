"""The pipeline timeline: a Gantt chart of one simulated step, one row per pp rank.

Each forward, recompute and backward of each micro-batch is one bar (lighter shades for later model
chunks when interleaved). Communication the rank waits for is drawn as strips inside an operation (black
hatch: tensor-parallel collectives; orange: blocking pipeline send/recv), and idle time is drawn too:
grey for the pipeline bubble, orange cross-hatch for waiting on a transfer in flight (``async`` mode), red
for the exposed data-parallel sync at the end. Every drawn collection has a ``gid`` ``"<kind>:<chunk>"``
(chunk ``-`` for idle and step-level spans) so tests can count what was drawn.
"""

from __future__ import annotations

from typing import TypedDict

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from planner.inspect.frames import plan_label
from planner.inspect.timeline import Interval, Timeline, simulate_plan
from planner.inspect.units import fmt_seconds, time_unit
from planner.plan import Plan


class _Style(TypedDict, total=False):
    """Keyword arguments of a bar and its legend patch (``matplotlib.patches.Patch``)."""

    facecolor: str
    edgecolor: str
    hatch: str
    linewidth: float
    label: str


SHADES = {
    "forward": ("#1f5f9e", "#4f8fd0", "#86b5e3", "#b9d5f0"),
    "recompute": ("#6a3d9a", "#8c62b8", "#b096d3", "#d2c3e8"),
    "backward": ("#2b7a2b", "#4fa84f", "#86cc86", "#bde3bd"),
}
IDLE_STYLE: dict[str, _Style] = {
    "bubble": dict(facecolor="#d9d9d9", edgecolor="#a0a0a0", label="bubble (idle)"),
    "pp_wait": dict(facecolor="#fdd0a2", edgecolor="#e6550d", hatch="xx", label="waiting on pp transfer (idle)"),
    "dp_sync_exposed": dict(facecolor="#de2d26", edgecolor="#a50f15", label="exposed dp sync"),
    "dp_comm": dict(facecolor="#de2d26", edgecolor="#a50f15", label="exposed dp sync"),
    "zero_comm": dict(facecolor="#fb6a4a", edgecolor="#a50f15", label="ZeRO collectives"),
    "expert_sync": dict(facecolor="#e7969c", edgecolor="#843c39", label="expert grad sync + step (edp)"),
    "optimizer": dict(facecolor="#8c6d31", edgecolor="#5a4620", label="optimizer step"),
}
STRIP_STYLE: dict[str, _Style] = {  # communication inside an operation, drawn over the lower part of its bar
    "tp_comm": dict(facecolor="none", edgecolor="#222222", hatch="////", linewidth=0.0, label="tp comm (inside op)"),
    "ep_comm": dict(facecolor="#e7ba52", edgecolor="#8c6d31", linewidth=0.0, label="MoE all-to-all (inside op)"),
    "pp_comm": dict(facecolor="#fd8d3c", edgecolor="#a63603", linewidth=0.0, label="pp send/recv (inside op)"),
}
STRIP_HEIGHT = 0.22
BAR_HEIGHT = 0.8
MAX_LABELLED_OPS = 160
MAX_EDGED_OPS_PER_RANK = 60
MIN_LABELLED_FRACTION = 0.012  # of the step: narrower bars get no micro-batch number


def plot_timeline(plan: Plan, timeline: Timeline | None = None, *, width_in: float = 12.0) -> Figure:
    """Gantt chart of one step of ``plan`` (simulated from its predictions if ``timeline`` is None)."""
    timeline = timeline or simulate_plan(plan)
    scale, unit = time_unit(timeline.makespan_s)
    fig = Figure(
        figsize=(width_in, 1.6 + 0.5 * timeline.pp + 0.25 * (len(handles_needed(timeline, plan)) // 5)),
        layout="constrained",
    )
    ax = fig.add_subplot()
    ops_per_rank = sum(iv.kind in SHADES for iv in timeline.intervals) / timeline.pp
    edge = 0.6 if ops_per_rank <= MAX_EDGED_OPS_PER_RANK else 0.0  # thin bars would drown in their edges
    _draw_operations(ax, timeline, scale, edge)
    _draw_idle(ax, timeline, scale, edge)
    handles = _legend_handles(timeline, plan.schedule.virtual_stages)
    if plan.predictions is not None:
        line = ax.axvline(
            plan.predictions.step_time_s * scale,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label="predicted step time",
        )
        handles.append(line)
    ax.set_yticks(range(timeline.pp), [f"pp rank {r}" for r in range(timeline.pp)])
    ax.set_ylim(timeline.pp - 0.5, -0.5)
    ax.set_xlim(0, timeline.makespan_s * scale * 1.01)
    ax.set_xlabel(f"time within one training step ({unit})")
    ax.set_ylabel("pipeline rank")
    ax.set_title(
        f"{plan_label(plan)}: simulated step {fmt_seconds(timeline.makespan_s)}, "
        f"bubble {timeline.total_s('bubble') / (timeline.pp * timeline.makespan_s):.1%} of device time",
        fontsize=10,
    )
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return fig


def handles_needed(timeline: Timeline, plan: Plan) -> list:
    """Legend entries the figure will carry (to size the figure before drawing)."""
    return _legend_handles(timeline, plan.schedule.virtual_stages) + [None]


def _draw_operations(ax, timeline: Timeline, scale: float, edge: float) -> None:
    groups: dict[tuple[str, int, int], list[Interval]] = {}
    for iv in timeline.intervals:
        if iv.stage is not None and (iv.kind in SHADES or iv.kind in STRIP_STYLE):
            chunk = iv.stage // timeline.pp
            groups.setdefault((iv.kind, chunk, iv.pp_rank), []).append(iv)
    n_ops = sum(len(g) for (kind, _, _), g in groups.items() if kind in SHADES)
    for (kind, chunk, rank), ivs in sorted(groups.items()):
        spans = [(iv.start_s * scale, iv.duration_s * scale) for iv in ivs]
        if kind in STRIP_STYLE:
            style = {k: v for k, v in STRIP_STYLE[kind].items() if k != "label"}
            ax.broken_barh(spans, (rank + BAR_HEIGHT / 2 - STRIP_HEIGHT, STRIP_HEIGHT), gid=f"{kind}:{chunk}", **style)
            continue
        ax.broken_barh(
            spans,
            (rank - BAR_HEIGHT / 2, BAR_HEIGHT),
            facecolors=SHADES[kind][chunk % 4],
            edgecolors="white" if edge else "none",
            linewidth=edge,
            gid=f"{kind}:{chunk}",
        )
        if n_ops <= MAX_LABELLED_OPS:
            for iv in ivs:
                if iv.duration_s < MIN_LABELLED_FRACTION * timeline.makespan_s:
                    continue  # no room for the number
                ax.text(
                    (iv.start_s + iv.duration_s / 2) * scale,
                    rank,
                    str(iv.micro_batch),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if chunk % 4 < 2 else "black",
                )


def _draw_idle(ax, timeline: Timeline, scale: float, edge: float) -> None:
    for kind, style in IDLE_STYLE.items():
        for rank in range(timeline.pp):
            spans = [
                (iv.start_s * scale, iv.duration_s * scale)
                for iv in timeline.intervals
                if iv.kind == kind and iv.pp_rank == rank
            ]
            if spans:
                style_args = {k: v for k, v in style.items() if k != "label"}
                if not edge:
                    style_args["edgecolor"] = "none" if "hatch" not in style_args else style_args["edgecolor"]
                ax.broken_barh(
                    spans, (rank - BAR_HEIGHT / 2, BAR_HEIGHT), gid=f"{kind}:-", linewidth=edge, **style_args
                )


def _legend_handles(timeline: Timeline, v: int) -> list:
    present = {iv.kind for iv in timeline.intervals}
    handles = []
    for kind in ("forward", "recompute", "backward"):
        if kind not in present:
            continue
        if v == 1:
            numbered = sum(iv.kind in SHADES for iv in timeline.intervals) <= MAX_LABELLED_OPS
            suffix = " (number = micro-batch)" if numbered else ""
            handles.append(Patch(facecolor=SHADES[kind][0], label=kind + suffix))
        else:
            handles += [Patch(facecolor=SHADES[kind][c % 4], label=f"{kind}, chunk {c}") for c in range(v)]
    handles += [Patch(**style) for kind, style in STRIP_STYLE.items() if kind in present]
    handles += [Patch(**style) for kind, style in IDLE_STYLE.items() if kind in present]
    return handles
