"""``stratagem show plan.json [--metrics run.jsonl] [--html report.html] [--png DIR]``: read a plan.

Prints a summary (degrees, schedule, predictions, stages, step-time terms, runner-ups, and predicted vs
measured when a launch's metrics file is given); writes a self-contained HTML report and/or PNG pictures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from planner.cli.common import check_layer_paths, check_out_path, no_ellipsis, nonempty_path, out_path, throughput_text
from planner.core import check_output_folder
from planner.inspect import bytes_unit, fmt_bytes, fmt_seconds
from planner.plan import Plan, costed, load_plan, stage_memory_predictions, validate

from .compare_cli import add_compare_argument, print_comparison

# the pictures `--png` writes (planner.inspect.report.build_figures)
PNG_NAMES = (
    "layer_placement",
    "timeline",
    "memory_per_rank",
    "step_breakdown",
    "plan_comparison",
    "metrics",
    "run_plans",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "show",
        help="summarize a plan file; write HTML or PNG pictures of it",
        description="Print a readable summary of a plan (and of a launch's metrics beside its predictions); "
        "optionally write a self-contained HTML report or the pictures as PNG files.",
    )
    parser.add_argument("plan", type=nonempty_path, help="plan file written by `stratagem plan`")
    parser.add_argument(
        "--metrics", type=nonempty_path, metavar="FILE", help="metrics JSON lines written by `stratagem launch`"
    )
    parser.add_argument("--html", type=out_path, metavar="FILE", help="write a self-contained HTML report here")
    parser.add_argument("--png", type=nonempty_path, metavar="DIR", help="write one PNG per picture into this folder")
    add_compare_argument(parser)
    parser.set_defaults(func=run)


def _check_outputs(args: argparse.Namespace) -> None:
    """--html is a writable file and --png a folder, neither replacing the plan or metrics they are made from."""
    inputs = {"plan": args.plan, "--metrics": args.metrics}
    if args.html is not None:
        check_out_path(args.html, flag="--html", inputs=inputs)
    if args.png is not None:
        check_output_folder(args.png, flag="--png")
        for name in PNG_NAMES:
            check_out_path(args.png / f"{name}.png", flag="--png", inputs=inputs)


def run(args: argparse.Namespace) -> int:
    from planner.inspect import metrics_frame

    _check_outputs(args)
    plan = load_plan(args.plan)
    validate(plan, plan.world_size)  # what `launch` would refuse is not shown as a plan either
    check_layer_paths(
        plan.model,
        [p for st in sorted(plan.stages, key=lambda s: s.index) for p in st.module_paths],
        source=f"plan {args.plan}",
    )
    metrics = metrics_frame(args.metrics) if args.metrics else None
    console = Console(highlight=False)
    console.print(no_ellipsis(_overview(plan)))
    console.print(no_ellipsis(_stages_table(plan)))
    if plan.predictions is not None:
        console.print(no_ellipsis(_stage_costs_table(plan)))
        console.print(no_ellipsis(_terms_table(plan)))
    if plan.search is not None and plan.search.top_k:
        console.print(no_ellipsis(_alternatives_table(plan)))
    segments = None
    if metrics is not None:
        from planner.inspect import run_segments

        segments = run_segments(args.metrics)
        if len(segments) > 1:  # restarts or re-plans: which plan trained which steps, first
            console.print(no_ellipsis(_segments_table(segments)))
        console.print(no_ellipsis(_measured_table(plan, metrics)))
        console.print(_gap_explanation(plan, metrics))
    print_comparison(console, plan, args)
    if args.html or args.png:
        from planner.inspect import render_pngs, save_html, save_pngs

        pngs = render_pngs(plan, metrics)
        if segments is not None and len(segments) > 1 and not segments["_last_time"].isna().any():
            from planner.inspect import figure_png, plot_run_segments

            pngs["run_plans"] = figure_png(plot_run_segments(segments))
        if args.html:
            console.print(f"wrote {save_html(plan, args.html, metrics, pngs)}")
        if args.png:
            for path in save_pngs(plan, args.png, metrics, pngs):
                console.print(f"wrote {path}")
    return 0


def _segments_table(segments) -> Table:
    """The run's timeline of plans (``planner.inspect.run_segments``)."""
    table = Table(title="the run's plans: which plan trained which steps, and the time lost between them")
    for column in ("attempt", "why", "ranks", "batch", "plan", "steps", "redone", "time lost"):
        table.add_column(column, justify="left" if column in ("why", "plan") else "right")
    for attempt, row in segments.iterrows():
        plan = Path(str(row["plan_path"])).name if row["plan_path"] else str(row["plan_hash"])[:19]
        lost = "" if row["time_lost_s"] != row["time_lost_s"] else f"{row['time_lost_s']:.1f} s"
        table.add_row(
            str(attempt),
            row["why"],
            str(row["world_size"]),
            ""
            if row.get("global_batch") is None or row["global_batch"] != row["global_batch"]
            else str(int(row["global_batch"])),
            plan,
            f"{row['first_step']}-{row['last_step']}",
            str(row["steps_redone"]),
            lost,
        )
    return table


def _overview(plan: Plan) -> Table:
    from planner.inspect import plan_label

    table = Table(title=f"plan: {plan.model.name} on {plan.cluster_name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    s = plan.schedule
    table.add_row(
        "ranks",
        f"{plan.world_size} = pp {plan.mesh.size('pp')} x dp {plan.mesh.size('dp')} x "
        + (f"sd {plan.mesh.size('sd')} x " if "sd" in plan.mesh.axes else "")
        + f"tp {plan.mesh.size('tp')}  (axes {', '.join(plan.mesh.axes)})",
    )
    table.add_row(
        "schedule",
        f"{s.kind}, {_counts(s.micro_batches_per_replica, s.micro_batch_size)}, "
        f"{s.virtual_stages} chunk(s) per pp rank",
    )
    table.add_row(
        "training",
        f"global batch {plan.training.global_batch}, seq {plan.training.seq_len}, "
        f"{plan.training.dtype}, ZeRO stage {plan.zero_stage}",
    )
    if plan.experts is not None:
        ex = plan.experts
        routing = f"capacity factor {ex.capacity_factor:g}" if ex.capacity_factor else "dropless"
        table.add_row(
            "experts",
            f"ep {ex.ep}, etp {ex.etp}, {routing}, load imbalance {ex.load_imbalance:g} (busiest ep rank / mean)",
        )
    p = plan.predictions
    if p is None:
        table.add_row("predictions", "none (the plan was not costed)")
    else:
        table.add_row(
            "step time",
            f"{fmt_seconds(p.step_time_s)}  ({throughput_text(p.samples_per_s, p.tokens_per_s, plan.model.family)})",
        )
        table.add_row("compute", f"{p.model_tflops_per_gpu:.3g} model TFLOP/s per device, MFU {p.mfu:.1%}")
        table.add_row("peak memory", _peak_memory_text(plan))
    if plan.search is not None:
        sr = plan.search
        table.add_row(
            "search",
            f"{sr.solver}: {sr.status}, gap {sr.gap:.2g}, {sr.wall_time_s:.3g} s, "
            f"{sr.candidates_solved} solved / {sr.candidates_pruned} pruned",
        )
        fallbacks = sum(1 for alt in sr.top_k if alt.plan is not None)
        table.add_row(
            "memory margin",
            f"{sr.memory_margin:.0%} of each device kept free (plan --memory-margin); {fallbacks} runner-up "
            f"plan{'s' if fallbacks != 1 else ''} in the file for launch to move to on an out-of-memory error",
        )
        table.add_row(
            "memory priced for",
            "Megatron-LM / DeepSpeed (ZeRO's states, gradients through the step, DDP buckets; plan --for)"
            if sr.memory_semantics == "textbook"
            else "stratagem launch, torchtitan, Accelerate (FSDP2 and torch pipelining; plan --for)",
        )
        if sr.notes.startswith("cluster calibrated"):
            table.add_row("cluster", sr.notes.split(". ", 1)[0].removeprefix("cluster "))
        if sr.notes:
            table.add_row("notes", sr.notes)
    else:
        table.add_row("search", "none recorded (a hand-made or edited plan): nothing in it is claimed optimal")
    if plan.content_hash is None:
        table.add_row("integrity", "no content_hash (written by hand, edited, or migrated from an older schema)")
    if plan.model.source:
        table.add_row("model source", plan.model.source)
    table.add_row("label", plan_label(plan))
    return table


def _peak_memory_text(plan: Plan) -> str:
    """The fullest stage's peak against its own device's memory (stages of a mixed plan differ)."""
    p, _ = costed(plan)
    if not p.stages:
        return f"{fmt_bytes(p.peak_memory_bytes)} (no per-stage figures)"
    full, node = max(
        stage_memory_predictions(p, plan), key=lambda x: x[0].peak_memory_bytes / x[0].memory_capacity_bytes
    )
    node = node or "?"
    return (
        f"{fmt_bytes(full.peak_memory_bytes)} of {fmt_bytes(full.memory_capacity_bytes)} "
        f"({full.peak_memory_bytes / full.memory_capacity_bytes:.0%}, stage {full.stage} on {node}); "
        f"max over ranks {fmt_bytes(p.peak_memory_bytes)}"
    )


def _stages_table(plan: Plan) -> Table:
    """Where each stage runs: modules, ranks, node type, recompute, tensor-parallel split modules."""
    from planner.inspect import stage_frame

    frame = stage_frame(plan, simulated=False)
    table = Table(title="stages: placement", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("stage", "pp", "modules", "n", "ranks", "node type", "recompute", "tp split"):
        left = name in ("modules", "node type", "recompute")
        table.add_column(name, justify="left" if left else "right", no_wrap=left)
    for index, row in frame.iterrows():
        modules = row["first_module"] if row["modules"] == 1 else f"{row['first_module']}..{row['last_module']}"
        table.add_row(
            str(index),
            str(row["pp_rank"]),
            modules,
            str(row["modules"]),
            str(row["ranks"]),
            row["node_type"],
            row["recompute"],
            str(row["tp_split_modules"]),
        )
    return table


def _stage_costs_table(plan: Plan) -> Table:
    """Predicted seconds per micro-batch by term and memory per device of each stage."""
    from planner.inspect import stage_frame

    frame = stage_frame(plan, simulated=False)
    table = Table(
        title="stages: predicted time per micro-batch and memory per device", box=box.SIMPLE_HEAD, pad_edge=False
    )
    terms = ("forward", "backward", "recompute", "tp_comm", "pp_comm")
    for name in ("stage", *terms, "peak/capacity", "headroom"):
        table.add_column(name, justify="right", no_wrap=name in ("peak/capacity", "headroom"))
    for index, row in frame.iterrows():
        cells = [fmt_seconds(row[f"{t}_s_per_micro_batch"]) if row[f"{t}_s_per_micro_batch"] else "-" for t in terms]
        peak, capacity = row["peak_memory_bytes"], row["memory_capacity_bytes"]
        table.add_row(str(index), *cells, _peak_of_capacity(peak, capacity), _headroom(peak, capacity))
    return table


def _headroom(peak_bytes: float, capacity_bytes: float) -> str:
    """What each device of a stage has left beyond the predicted peak: ``"71.2 GiB (89 %)"``.

    >>> _headroom(8 * 2**30, 80 * 2**30)
    '72 GiB (90%)'
    """
    left = capacity_bytes - peak_bytes
    return f"{fmt_bytes(left)} ({left / capacity_bytes:.0%})" if left >= 0 else f"short by {fmt_bytes(-left)}"


def _peak_of_capacity(peak_bytes: float, capacity_bytes: float) -> str:
    """``"5.84/80 GiB"`` (both in the capacity's unit when the peak reads well in it)."""
    scale, unit = bytes_unit(capacity_bytes)
    if peak_bytes * scale < 0.1:
        return f"{fmt_bytes(peak_bytes)}/{fmt_bytes(capacity_bytes)}"
    return f"{peak_bytes * scale:.3g}/{capacity_bytes * scale:.3g} {unit}"


def _terms_table(plan: Plan) -> Table:
    p, _ = costed(plan)
    table = Table(title="step-time terms", caption=f"predicted step {fmt_seconds(p.step_time_s)}")
    table.add_column("term")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    for term, seconds in p.breakdown_s.items():
        if seconds == 0:
            continue
        if "overlapped" in term:  # hidden behind compute: not part of the step time
            table.add_row(term, fmt_seconds(seconds), "hidden")
        else:
            table.add_row(term, fmt_seconds(seconds), f"{seconds / p.step_time_s:.1%}")
    return table


def _alternatives_table(plan: Plan) -> Table:
    table = Table(title="runner-up plans from the search")
    for name in ("plan", "step time", "slowdown", "peak memory"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    for alt in plan.search.top_k if plan.search else []:
        table.add_row(
            alt.summary, fmt_seconds(alt.step_time_s), f"{alt.slowdown:.3f}x", fmt_bytes(alt.peak_memory_bytes)
        )
    return table


def _gap_explanation(plan: Plan, metrics) -> str:
    """One paragraph on why measured and predicted step times differ, with the size of the gap."""
    from planner.inspect import predicted_vs_measured

    frame = predicted_vs_measured(plan, metrics)
    ratio = frame.loc["step_time_s", "measured_over_predicted"]
    memory = frame.loc["peak_memory_bytes", "measured_over_predicted"]
    memory_note = (
        f" Measured memory ({memory:.1f}x) also counts what the prediction leaves out: the allocator's "
        f"slack, communication and autograd buffers, and on CPUs the resident pages of the process."
        if memory == memory and memory > 1.5
        else ""
    )
    if ratio != ratio:
        return "no step-time prediction to compare with (the plan was not costed)"
    if 0.8 <= ratio <= 1.25:
        return (
            f"measured step time is {ratio:.2f}x the prediction: within the cost model's usual accuracy "
            f"(0.8-1.25x on this kind of machine).{memory_note}"
        )
    return (
        f"measured step time is {ratio:.2f}x the prediction. The prediction prices the profiled layer times "
        f"and the cluster's collective fits; a gap this size usually means the machine was busier than when it "
        f"was profiled (shared CPUs vary 2-5x between runs), or per-step costs the profile does not hold "
        f"(first-step warm-up is excluded above, Python and process-group overhead are not). Re-profile on "
        f"this machine while it is idle (stratagem profile model / profile cluster) and re-plan to close it."
        + memory_note
    )


def _measured_table(plan: Plan, metrics) -> Table:
    from planner.inspect import predicted_vs_measured

    frame = predicted_vs_measured(plan, metrics)
    steady = metrics.index[1:] if len(metrics) > 1 else metrics.index
    table = Table(title=f"predicted vs measured (measured = median of steps {steady[0]}..{steady[-1]})")
    for name in ("quantity", "predicted", "measured", "measured / predicted"):
        table.add_column(name, justify="left" if name == "quantity" else "right")
    fmt = {
        "step_time_s": fmt_seconds,
        "peak_memory_bytes": fmt_bytes,
        "peak_tensor_bytes": fmt_bytes,
        "tokens_per_s": lambda v: f"{v:,.0f}",
    }
    for quantity, row in frame.iterrows():
        show = fmt[quantity]
        cells = [show(row[c]) if row[c] == row[c] else "-" for c in ("predicted", "measured")]
        ratio = row["measured_over_predicted"]
        table.add_row(quantity, *cells, f"{ratio:.2f}" if ratio == ratio else "-")
    return table


def _counts(per_replica: list[int], size: int) -> str:
    """``8 micro-batches of 2`` when every dp replica runs 8, else ``micro-batches of 2: 6/2 per dp replica``."""
    if len(set(per_replica)) == 1:
        return f"{per_replica[0]} micro-batches of {size}"
    return f"micro-batches of {size}: {'/'.join(map(str, per_replica))} per dp replica"
