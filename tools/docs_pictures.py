"""Regenerate the example pictures in ``docs/``: one of each kind.

    python -m tools.docs_pictures --out docs [--plan plan.json] [--metrics run.jsonl] [--spatial-plan plan.json]

The three timelines always come from hand-made example plans (``planner.inspect.examples``: 4 pp ranks,
8 micro-batches) so the schedules can be compared on the same costs. The other pictures come from
``--plan`` when given (a searched plan; its timeline becomes ``timeline_searched.png``), else from the 1F1B
example; ``metrics.png`` only from a real ``--metrics`` file (with ``--metrics-plan``, the plan it ran);
``spatial_placement.png`` only from a 3D CNN's spatial plan (``--spatial-plan``; ``docs/`` holds CosmoFlow 512^3,
``stratagem plan --model cosmoflow:volume512 --cluster aws-p3-16xlarge --gpus 1024 --global-batch 64 --dtype fp16``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from planner.core import atomic_write_bytes
from planner.inspect import (
    build_example_plan,
    figure_png,
    metrics_frame,
    plot_layer_placement,
    plot_memory_per_rank,
    plot_metrics,
    plot_plan_comparison,
    plot_step_breakdown,
    plot_timeline,
)
from planner.plan import load_plan

log = logging.getLogger(__name__)
EXAMPLE = dict(
    pp=4,
    num_micro_batches=8,
    dp=2,
    tp=2,
    forward_s=0.010,
    backward_s=0.020,
    recompute_s=0.006,
    tp_comm_s=0.002,
    pp_comm_s=0.001,
    dp_comm_s=0.015,
    hidden=8192,
    heads=64,
)


def save_docs_pictures(
    out: Path,
    plan_path: Path | None = None,
    metrics_path: Path | None = None,
    metrics_plan_path: Path | None = None,
    spatial_plan_path: Path | None = None,
) -> list[Path]:
    """Write every picture into ``out``; returns the paths written."""
    figures = {
        "timeline_gpipe": plot_timeline(build_example_plan("gpipe", **EXAMPLE)),
        "timeline_1f1b": plot_timeline(build_example_plan("1f1b", **EXAMPLE)),
        "timeline_interleaved": plot_timeline(build_example_plan("interleaved_1f1b", virtual_stages=2, **EXAMPLE)),
    }
    plan = load_plan(plan_path) if plan_path else build_example_plan("1f1b", **EXAMPLE)
    if plan_path:
        figures["timeline_searched"] = plot_timeline(plan)
    figures.update(
        memory_per_rank=plot_memory_per_rank(plan),
        layer_placement=plot_layer_placement(plan),
        step_breakdown=plot_step_breakdown(plan),
        plan_comparison=plot_plan_comparison(plan),
    )
    if metrics_path:
        metrics_plan = load_plan(metrics_plan_path) if metrics_plan_path else plan
        figures["metrics"] = plot_metrics(metrics_frame(metrics_path), metrics_plan)
    if spatial_plan_path:
        figures["spatial_placement"] = plot_layer_placement(load_plan(spatial_plan_path))
    return [atomic_write_bytes(out / f"{name}.png", figure_png(fig)) for name, fig in figures.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--plan", type=Path, default=None, help="plan file for the non-timeline pictures")
    parser.add_argument("--metrics", type=Path, default=None, help="metrics file of a launch")
    parser.add_argument("--metrics-plan", type=Path, default=None, help="the plan that launch ran (default --plan)")
    parser.add_argument("--spatial-plan", type=Path, default=None, help="a 3D CNN's spatial plan")
    args = parser.parse_args(argv)
    for path in save_docs_pictures(args.out, args.plan, args.metrics, args.metrics_plan, args.spatial_plan):
        log.warning("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
