"""Inspect plans: pandas frames, matplotlib pictures, comparisons and reports (no torch needed).

Tables: :func:`stage_frame`, :func:`rank_frame`, :func:`layer_frame`, :func:`summary_frame`,
:func:`metrics_frame`, :func:`predicted_vs_measured`. Pictures (each returns a Figure):
:func:`plot_timeline`, :func:`plot_memory_per_rank`, :func:`plot_layer_placement`,
:func:`plot_step_breakdown`, :func:`plot_plan_comparison`, :func:`plot_metrics`. Comparing:
:func:`compare_plans`, :func:`diff_plans`. Reports: :func:`save_html`, :func:`save_pngs`.
The schedule simulation behind the timeline is :func:`simulate_plan`.
"""

from planner.inspect.compare import compare_plans, diff_plans
from planner.inspect.examples import build_example_plan
from planner.inspect.fig_timeline import plot_timeline
from planner.inspect.figures import (
    plot_layer_placement,
    plot_memory_per_rank,
    plot_metrics,
    plot_plan_comparison,
    plot_step_breakdown,
)
from planner.inspect.frames import layer_frame, rank_frame, stage_frame, summary_frame
from planner.inspect.measured import load_metrics, metrics_frame, predicted_vs_measured
from planner.inspect.report import build_figures, build_html, save_html, save_pngs
from planner.inspect.timeline import simulate, simulate_plan

__all__ = [
    "build_example_plan",
    "build_figures",
    "build_html",
    "compare_plans",
    "diff_plans",
    "layer_frame",
    "load_metrics",
    "metrics_frame",
    "plot_layer_placement",
    "plot_memory_per_rank",
    "plot_metrics",
    "plot_plan_comparison",
    "plot_step_breakdown",
    "plot_timeline",
    "predicted_vs_measured",
    "rank_frame",
    "save_html",
    "save_pngs",
    "simulate",
    "simulate_plan",
    "stage_frame",
    "summary_frame",
]
