"""Every picture of a plan at once: as PNG files, or as one self-contained HTML page (base64 PNGs).

>>> from planner.inspect.examples import build_example_plan
>>> sorted(build_figures(build_example_plan()))[:2]
['layer_placement', 'memory_per_rank']
"""

from __future__ import annotations

import base64
import html
import io
import logging
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from planner.core import StratagemError, atomic_write_bytes, atomic_write_text
from planner.inspect.fig_timeline import plot_timeline
from planner.inspect.figures import (
    plot_layer_placement,
    plot_memory_per_rank,
    plot_metrics,
    plot_plan_comparison,
    plot_step_breakdown,
)
from planner.inspect.frames import plan_label, plan_timeline, stage_frame, summary_frame
from planner.inspect.measured import predicted_vs_measured
from planner.inspect.timeline import Timeline
from planner.plan import Plan

log = logging.getLogger(__name__)
PNG_DPI = 110


def build_figures(
    plan: Plan, metrics: pd.DataFrame | None = None, timeline: Timeline | None = None
) -> dict[str, Figure]:
    """Name -> figure for every picture that applies: placement always; timeline, memory, breakdown and
    comparison when the plan has predictions; metrics when a metrics table is given."""
    figures = {"layer_placement": plot_layer_placement(plan)}
    if plan.predictions is not None:
        figures["timeline"] = plot_timeline(plan, timeline)
        figures["memory_per_rank"] = plot_memory_per_rank(plan)
        figures["step_breakdown"] = plot_step_breakdown(plan)
        figures["plan_comparison"] = plot_plan_comparison(plan)
    else:
        log.warning("plan has no predictions: only the layer placement can be drawn")
    if metrics is not None:
        figures["metrics"] = plot_metrics(metrics, plan)
    return figures


def figure_png(fig: Figure, *, dpi: int = PNG_DPI) -> bytes:
    """The figure rendered to PNG bytes (Agg)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def render_pngs(plan: Plan, metrics: pd.DataFrame | None = None, timeline: Timeline | None = None) -> dict[str, bytes]:
    """Name -> PNG bytes of every picture of :func:`build_figures` (render once, write as PNG and HTML)."""
    return {name: figure_png(fig) for name, fig in build_figures(plan, metrics, timeline).items()}


def save_pngs(
    plan: Plan, folder: str | Path, metrics: pd.DataFrame | None = None, pngs: dict[str, bytes] | None = None
) -> list[Path]:
    """Write ``<name>.png`` for each picture into ``folder`` (rendered unless ``pngs`` is given)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise StratagemError(f"--png {folder} is a file, not a folder; give a folder path")
    pngs = pngs if pngs is not None else render_pngs(plan, metrics)
    return [atomic_write_bytes(folder / f"{name}.png", data, flag="--png") for name, data in pngs.items()]


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(float_format=lambda v: f"{v:.4g}", border=0, classes="t")


def build_html(
    plan: Plan, metrics: pd.DataFrame | None = None, *, title: str | None = None, pngs: dict[str, bytes] | None = None
) -> str:
    """A self-contained HTML page: summary, stages, predicted vs measured, search, every picture."""
    title = title or f"Stratagem plan: {plan.model.name} on {plan.cluster_name} ({plan_label(plan)})"
    timeline = plan_timeline(plan)
    parts = [f"<h1>{html.escape(title)}</h1>", "<h2>Summary</h2>", _table(summary_frame(plan, timeline=timeline).T)]
    parts += ["<h2>Stages</h2>", _table(stage_frame(plan, timeline, simulated=timeline is not None))]
    if metrics is not None:
        parts += ["<h2>Predicted vs measured</h2>", _table(predicted_vs_measured(plan, metrics))]
    if plan.search is not None:
        s = plan.search
        parts.append(
            f"<h2>Search</h2><p>{html.escape(s.solver)}: {html.escape(s.status)}, gap {s.gap:.3g}, "
            f"{s.wall_time_s:.3g} s, {s.candidates_solved} solved, {s.candidates_pruned} pruned. "
            f"{html.escape(s.notes)}</p>"
        )
        if s.top_k:
            parts.append(_table(pd.DataFrame([a.model_dump() for a in s.top_k]).set_index("summary")))
    pngs = pngs if pngs is not None else render_pngs(plan, metrics, timeline)
    for name, data in pngs.items():
        encoded = base64.b64encode(data).decode("ascii")
        parts.append(
            f"<h2>{html.escape(name.replace('_', ' '))}</h2>"
            f'<img alt="{html.escape(name)}" src="data:image/png;base64,{encoded}">'
        )
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:1400px}img{max-width:100%}"
        "table.t{border-collapse:collapse;font-size:12px}table.t td,table.t th{padding:2px 8px;"
        "border-bottom:1px solid #ddd;text-align:right}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


def save_html(
    plan: Plan, path: str | Path, metrics: pd.DataFrame | None = None, pngs: dict[str, bytes] | None = None
) -> Path:
    """Write :func:`build_html` atomically to ``path``."""
    return atomic_write_text(path, build_html(plan, metrics, pngs=pngs), flag="--html")
