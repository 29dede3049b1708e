"""``stratagem plan`` and ``estimate`` for 3D CNNs (unet3d, cosmoflow): hybrid data + spatial parallelism.

``plan`` runs the spatial search (``planner/search/spatial.py``) and prints the per-layer table (which layers
are split and why); ``estimate --sd N --spatial-dims d|dh|dhw`` costs every volume layer split ``N`` ways.
"""

from __future__ import annotations

import argparse

from planner.core import StratagemError
from planner.cost import with_gpus
from planner.model import ModelSpec
from planner.plan import TrainingSettings, costed, validate
from planner.profile import ClusterProfile, ModelProfile

# plan flags of the transformer search that the spatial search has no use for: (attribute, default, flag)
_NOT_APPLICABLE = (
    ("compare_to", None, "--compare-to"),
    ("allow", None, "--allow"),
    ("jobs", 1, "--jobs"),
    ("prove_top_k", False, "--prove-top-k"),
    ("gap", 0.0, "--gap"),
    ("budget", 600.0, "--budget-s"),  # the spatial search takes < 1 s; --time-limit-s bounds each ILP
)


def run_spatial(
    args: argparse.Namespace, *, spec: ModelSpec, profile: ModelProfile, cluster: ClusterProfile, lr_schedule
) -> int:
    """Search, write the plan, print the summary and the per-layer memory table (which layers split, why)."""
    from rich.console import Console
    from rich.table import Table

    from planner.cli.common import memory_fraction_of
    from planner.core import save_document
    from planner.search import build_spatial_plan, memory_table, plan_spatial_search

    for key, default, flag in _NOT_APPLICABLE:
        if getattr(args, key, default) not in (default, None):
            raise StratagemError(
                f"{flag} does not apply to {spec.name}'s data + spatial search (planner/search/spatial.py); drop it"
            )
    if cluster.is_mixed:
        raise StratagemError(f"spatial plans run on one node type; {cluster.name} is mixed, pick a uniform cluster")
    sized = with_gpus(cluster, args.gpus)
    result = plan_spatial_search(
        profile,
        sized,
        gpus=args.gpus,
        global_batch=args.global_batch,
        time_limit_s=args.time_limit,
        keep=args.top_k,
        memory_fraction=memory_fraction_of(args),
    )
    training = TrainingSettings(
        global_batch=args.global_batch, seq_len=profile.seq_len, dtype=profile.dtype, lr_schedule=lr_schedule
    )
    plan = build_spatial_plan(result, model=spec, profile=profile, cluster=sized, training=training)
    validate(plan, args.gpus)
    save_document(plan, args.out)
    out = Console()
    pred, _ = costed(plan)
    summary = Table(title=f"plan for {spec.name} on {plan.world_size} x {cluster.name}")
    summary.add_column("item")
    summary.add_column("value")
    est = result.best.estimate
    summary.add_row("strategy", f"dp {plan.mesh.size('dp')} x sd {plan.mesh.size('sd')} (spatial group)")
    summary.add_row("predicted step time", f"{pred.step_time_s:.4g} s")
    summary.add_row("breakdown", ", ".join(f"{k} {v:.3g} s" for k, v in pred.breakdown_s.items()))
    summary.add_row("peak memory", f"{pred.peak_memory_bytes / 2**30:.2f} / {est.capacity_bytes / 2**30:.2f} GiB")
    if plan.search is not None:
        summary.add_row("search", f"{plan.search.status}, {plan.search.wall_time_s:.2f} s; {plan.search.notes}")
    out.print(summary)
    table = Table(title="layers: spatial split, time per micro-batch and saved activations per rank")
    rows = memory_table(profile, sized, plan)
    for col in rows[0]:
        table.add_column(col)
    for row in rows:
        table.add_row(*row.values())
    out.print(table)
    if plan.search is not None and plan.search.top_k:
        others = Table(title="runners-up")
        for col in ("#", "strategy", "step time", "slowdown", "peak memory"):
            others.add_column(col)
        for i, alt in enumerate(plan.search.top_k, start=2):
            others.add_row(
                str(i), alt.summary, f"{alt.step_time_s:.4g} s", f"{alt.slowdown:.3f}x",
                f"{alt.peak_memory_bytes / 2**30:.2f} GiB",
            )  # fmt: skip
        out.print(others)
    out.print(f"wrote {args.out}")
    return 0


def run_spatial_estimate(args: argparse.Namespace, *, spec: ModelSpec, cluster: ClusterProfile, dtype: str) -> int:
    """``estimate`` of a 3D CNN: every volume layer split over ``--sd`` ranks along ``--spatial-dims``."""
    import json
    import sys

    from rich.console import Console
    from rich.table import Table

    from planner.cost import SpatialConfig, SpatialOption, check_split, estimate_spatial, split_grid
    from planner.model import volume_layers
    from runtime.profiling.model import profile_model_analytic

    if args.tp != 1 or args.pp != 1:
        raise StratagemError(
            f"{spec.name} runs data + spatial parallel (--dp, --sd), not tensor or pipeline parallel; drop --tp/--pp"
        )
    sd = args.sd
    gpus = args.gpus or sd * (args.dp or 1)
    dp = args.dp if args.dp is not None else gpus // sd
    if dp * sd != gpus:
        raise StratagemError(f"--dp {dp} x --sd {sd} = {dp * sd} devices, not --gpus {gpus}; make them agree")
    if args.global_batch % (dp * args.micro_batch):
        raise StratagemError(
            f"global batch {args.global_batch} does not split into dp {dp} x micro-batches of {args.micro_batch}; "
            f"choose a global batch divisible by {dp * args.micro_batch}"
        )
    layout = {}
    if sd > 1:
        option = SpatialOption(grid=split_grid(sd, tuple(args.spatial_dims)))
        for layer in volume_layers(spec):
            if layer.splittable:
                check_split(layer, option)
                layout[layer.path] = option
    if getattr(args, "model_profile", None) is not None:
        from planner.cli.model_args import load_matching_profile

        profile = load_matching_profile(args.model_profile, spec, args.seq)
    else:
        profile = profile_model_analytic(spec, seq_len=1, dtype=dtype)
    sized = with_gpus(cluster, gpus)
    config = SpatialConfig(
        dp=dp, sd=sd, micro_batch=args.micro_batch,
        num_micro_batches=args.global_batch // (dp * args.micro_batch), layout=layout,
    )  # fmt: skip
    est = estimate_spatial(profile, sized, config)
    if args.json:
        record = {
            "step_time_s": est.step_time_s, "breakdown_s": est.breakdown_s, "memory_bytes": est.memory_bytes,
            "peak_memory_bytes": est.peak_memory_bytes, "capacity_bytes": est.capacity_bytes, "fits": est.fits,
            "layers": [{"path": r.path, "split": r.option, "time_s": r.time_s, "act_bytes": r.act_bytes}
                       for r in est.layers],
        }  # fmt: skip
        json.dump(record, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    table = Table(title=f"{spec.name} on {gpus} x {cluster.name}: dp {dp} x sd {sd}")
    table.add_column("item")
    table.add_column("value")
    table.add_row("predicted step time", f"{est.step_time_s:.4g} s")
    table.add_row("breakdown", ", ".join(f"{k} {v:.3g} s" for k, v in est.breakdown_s.items()))
    verdict = "fits" if est.fits else "DOES NOT FIT"
    table.add_row(
        "peak memory", f"{est.peak_memory_bytes / 2**30:.2f} / {est.capacity_bytes / 2**30:.2f} GiB ({verdict})"
    )
    Console().print(table)
    return 0
