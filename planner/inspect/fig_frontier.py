"""The frontier picture: days to train vs cost, one curve per GPU type, the (days, cost) Pareto front marked."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from planner.core import atomic_write_bytes
from planner.frontier import FrontierRow


def frontier_figure(rows: Sequence[FrontierRow], *, title: str = ""):
    """A matplotlib Figure (Agg): x days to train, y cost in US dollars, both logarithmic; each cluster's rows joined
    in device-count order and labelled with the count; the Pareto-optimal rows ringed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5))
    ax = fig.add_subplot()
    plotted = [r for r in rows if r.ok and r.cost_usd is not None]
    for cluster in dict.fromkeys(r.cluster for r in plotted):
        own = sorted((r for r in plotted if r.cluster == cluster), key=lambda r: (r.gpus, r.global_batch))
        xs, ys = _days_cost(own)
        ax.plot(xs, ys, marker="o", label=cluster)
        for r, x, y in zip(own, xs, ys):
            ax.annotate(str(r.gpus), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = [r for r in plotted if r.pareto_time_cost]
    if front:
        xs, ys = _days_cost(front)
        ax.plot(
            xs,
            ys,
            linestyle="none",
            marker="o",
            markersize=13,
            markerfacecolor="none",
            markeredgecolor="black",
            label="Pareto-optimal (days, cost)",
        )
    ax.set(xscale="log", yscale="log", xlabel="days to train", ylabel="cost (US$, list prices)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _days_cost(rows: Sequence[FrontierRow]) -> tuple[list[float], list[float]]:
    return [float(r.train_days or 0.0) for r in rows], [float(r.cost_usd or 0.0) for r in rows]


def save_frontier_png(rows: Sequence[FrontierRow], path: str | Path, *, title: str = "") -> Path:
    """Write :func:`frontier_figure` as a PNG, atomically."""
    fig = frontier_figure(rows, title=title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return atomic_write_bytes(path, buf.getvalue(), flag="--png")
