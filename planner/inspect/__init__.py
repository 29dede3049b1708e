"""Inspect plans: pandas frames, matplotlib pictures, comparisons and reports (no torch needed).

Tables: :func:`stage_frame`, :func:`rank_frame`, :func:`layer_frame`, :func:`summary_frame`,
:func:`metrics_frame`, :func:`predicted_vs_measured`, :func:`run_segments`. Pictures (each returns a Figure):
:func:`plot_timeline`, :func:`plot_memory_per_rank`, :func:`plot_layer_placement`,
:func:`plot_step_breakdown`, :func:`plot_plan_comparison`, :func:`plot_metrics`, :func:`plot_run_segments`. Comparing:
:func:`compare_plans`, :func:`diff_plans`. Reports: :func:`save_html`, :func:`save_pngs`.
The schedule simulation behind the timeline is :func:`simulate_plan`.
"""

from typing import TYPE_CHECKING

from planner.core import lazy_getattr

# name -> submodule: loaded on first use (PEP 562), so that `stratagem` commands which never draw anything do not
# pay for pandas and matplotlib at start-up
_WHERE = {
    "compare_plans": "compare",
    "diff_plans": "compare",
    "build_example_plan": "examples",
    "plot_timeline": "fig_timeline",
    "frontier_figure": "fig_frontier",
    "save_frontier_png": "fig_frontier",
    "plot_layer_placement": "figures",
    "plot_memory_per_rank": "figures",
    "plot_metrics": "figures",
    "plot_plan_comparison": "figures",
    "plot_step_breakdown": "figures",
    "plot_run_segments": "figures",
    "layer_frame": "frames",
    "plan_label": "frames",
    "rank_coordinates": "frames",
    "rank_frame": "frames",
    "stage_frame": "frames",
    "summary_frame": "frames",
    "load_metrics": "measured",
    "metrics_frame": "measured",
    "predicted_vs_measured": "measured",
    "run_segments": "measured",
    "build_figures": "report",
    "build_html": "report",
    "figure_png": "report",
    "render_pngs": "report",
    "save_html": "report",
    "save_pngs": "report",
    "StageCost": "timeline",
    "schedule_order": "timeline",
    "simulate": "timeline",
    "simulate_plan": "timeline",
    "bytes_unit": "units",
    "fmt_bytes": "units",
    "fmt_seconds": "units",
}

if TYPE_CHECKING:
    from planner.inspect.compare import compare_plans, diff_plans
    from planner.inspect.examples import build_example_plan
    from planner.inspect.fig_frontier import frontier_figure, save_frontier_png
    from planner.inspect.fig_timeline import plot_timeline
    from planner.inspect.figures import (
        plot_layer_placement,
        plot_memory_per_rank,
        plot_metrics,
        plot_plan_comparison,
        plot_run_segments,
        plot_step_breakdown,
    )
    from planner.inspect.frames import layer_frame, plan_label, rank_coordinates, rank_frame, stage_frame, summary_frame
    from planner.inspect.measured import load_metrics, metrics_frame, predicted_vs_measured, run_segments
    from planner.inspect.report import build_figures, build_html, figure_png, render_pngs, save_html, save_pngs
    from planner.inspect.timeline import StageCost, schedule_order, simulate, simulate_plan
    from planner.inspect.units import bytes_unit, fmt_bytes, fmt_seconds


__getattr__ = lazy_getattr("planner.inspect", _WHERE)


__all__ = [
    "StageCost",
    "build_example_plan",
    "build_figures",
    "build_html",
    "bytes_unit",
    "compare_plans",
    "diff_plans",
    "figure_png",
    "frontier_figure",
    "fmt_bytes",
    "fmt_seconds",
    "layer_frame",
    "load_metrics",
    "metrics_frame",
    "plan_label",
    "plot_layer_placement",
    "plot_memory_per_rank",
    "plot_metrics",
    "plot_plan_comparison",
    "plot_run_segments",
    "plot_step_breakdown",
    "plot_timeline",
    "predicted_vs_measured",
    "rank_coordinates",
    "rank_frame",
    "render_pngs",
    "run_segments",
    "save_frontier_png",
    "save_html",
    "save_pngs",
    "schedule_order",
    "simulate",
    "simulate_plan",
    "stage_frame",
    "summary_frame",
]
