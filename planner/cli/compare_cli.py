"""``--from`` (estimate) and ``--compare-to`` (plan, show): the user's Megatron / DeepSpeed / torchtitan config.

stratagem estimate --from megatron "--tensor-model-parallel-size 8 ..." --cluster dgx-a100-80g --gpus 1024
stratagem estimate --from deepspeed ds_config.json --model gpt:gpt3-175b --cluster dgx-a100-80g --gpus 1024
stratagem plan ... --compare-to megatron "<args>"      (summary and the plan file's comparison)
stratagem show plan.json --compare-to torchtitan my_config.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.core import StratagemError
from planner.export import FrameworkSettings
from planner.plan import ComparisonRecord, Plan
from planner.profile import ClusterProfile, ModelProfile

IMPORT_FRAMEWORKS = ("megatron", "deepspeed", "torchtitan")


def add_source_argument(p: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """``flag FRAMEWORK SOURCE`` into ``args.from_config`` (--from) or ``args.compare_to``."""
    dest = "from_config" if flag == "--from" else flag.lstrip("-").replace("-", "_")
    p.add_argument(
        flag,
        nargs=2,
        metavar=("FRAMEWORK", "SOURCE"),
        default=None,
        dest=dest,
        help=f"{help_text}: FRAMEWORK is {', '.join(IMPORT_FRAMEWORKS)}; SOURCE is the Megatron "
        f"arguments in quotes (or a file holding them), a ds_config.json, or a torchtitan config file",
    )


def read_source(framework: str, source: str) -> str:
    """The config text: a file's content, or (Megatron) the argument string itself."""
    if framework not in IMPORT_FRAMEWORKS:
        raise StratagemError(f"cannot read {framework!r} configs; choose one of {', '.join(IMPORT_FRAMEWORKS)}")
    path = Path(source)
    try:
        is_file = not source.lstrip().startswith("-") and "\n" not in source and path.is_file()
    except OSError:  # an argument string too long to be a file name
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if framework == "megatron":
        return source
    raise StratagemError(f"{framework} config file {source} does not exist; check the path")


def settings_from_source(framework: str, source: str, *, gpus: int | None, layers: int | None) -> FrameworkSettings:
    from planner.export import import_config

    return import_config(framework, read_source(framework, source), world_size=gpus, layers=layers)


def describe(s: FrameworkSettings) -> str:
    """The user's config in the one strategy vocabulary (planner.plan.schema.strategy_label)."""
    from planner.plan import strategy_label

    label = strategy_label(
        tp=s.tp,
        pp=s.pp,
        dp=s.dp,
        schedule=s.schedule,
        virtual_stages=s.virtual_stages,
        micro_batch=s.micro_batch,
        num_micro_batches=s.num_micro_batches,
        zero_stage=s.zero_stage,
        sequence_parallel=s.sequence_parallel,
        cp=s.cp,
        context_parallel=s.context_parallel or ("ring" if s.cp > 1 else None),
        ep=s.ep,
        etp=s.etp,
    )
    if s.recompute == "none":
        return label
    return f"{label} recompute {s.recompute}" + (
        f" (first {s.recompute_blocks_per_chunk}/chunk)" if s.recompute_blocks_per_chunk else ""
    )


def model_profile_for(
    settings: FrameworkSettings, model_arg: str | None, *, seq: int | None, dtype: str | None
) -> ModelProfile:
    """The closed-form profile of the config's own model dims, or of ``--model``."""
    from planner.model import parse_model
    from planner.profile import build_gpt_profile

    spec = settings.model
    if model_arg:
        spec = parse_model(model_arg)
    if spec is None:
        raise StratagemError("the config does not state the model's dimensions; pass --model (e.g. gpt:gpt3-175b)")
    seq_len = seq or settings.seq_len or int(spec.dim("max_seq"))
    return build_gpt_profile(spec, seq_len=seq_len, dtype=dtype or settings.dtype or "bf16")


def run_estimate_from(args: argparse.Namespace) -> int:
    """``stratagem estimate --from FRAMEWORK SOURCE``: read the config, estimate it, print as estimate does."""
    import json
    import sys

    from planner.cli.common import resolve_cluster_path
    from planner.cli.estimate_report import estimate_to_json, print_estimate_table
    from planner.cost import with_gpus
    from planner.export import estimate_config, layer_kinds, to_parallel_config
    from planner.profile import load_cluster_profile

    framework, source = args.from_config
    layers = None
    if args.model:
        from planner.model import parse_model

        layers = (
            int(parse_model(args.model).dim("layers")) if parse_model(args.model).family in ("gpt", "llama") else None
        )
    settings = settings_from_source(framework, source, gpus=args.gpus, layers=layers)
    profile = model_profile_for(settings, args.model, seq=args.seq, dtype=args.dtype)
    cluster = load_cluster_profile(resolve_cluster_path(args.cluster))
    config = to_parallel_config(settings, layer_kinds(profile), framework)
    est = estimate_config(config, profile=profile, cluster=cluster, global_batch=settings.global_batch)
    if args.json:
        json.dump({"source": framework, **estimate_to_json(est, config)}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from rich.console import Console

        Console().print(
            f"read from {framework}: {describe(settings)}, global batch {settings.global_batch}", markup=False
        )
        print_estimate_table(est, config, profile, with_gpus(cluster, config.world_size), config.world_size)
    return 0


def build_comparison(
    plan: Plan, framework: str, source: str, *, profile: ModelProfile, cluster: ClusterProfile
) -> ComparisonRecord:
    """The plan against the user's config, for the plan file and the summaries."""
    from planner.export import compare

    layers = int(plan.model.dim("layers")) if plan.model.family in ("gpt", "llama") else None
    current = settings_from_source(framework, source, gpus=plan.world_size, layers=layers)
    if current.global_batch != plan.training.global_batch:
        raise StratagemError(
            f"the {framework} config trains {current.global_batch} samples per step but the plan "
            f"{plan.training.global_batch}; compare at the same global batch"
        )
    if current.world_size != plan.world_size:
        raise StratagemError(
            f"the {framework} config uses {current.world_size} GPUs but the plan {plan.world_size}; "
            f"compare on the same GPU count"
        )
    c = compare(plan, current, framework, profile=profile, cluster=cluster)
    return ComparisonRecord(
        framework=framework,
        source=source,
        current_summary=describe(current),
        current_step_time_s=c.current_estimate.step_time_s,
        current_peak_memory_bytes=c.current_estimate.peak_memory_bytes,
        current_fits_in_memory=c.current_estimate.fits_in_memory,
        plan_step_time_s=c.plan_estimate.step_time_s,
        plan_peak_memory_bytes=c.plan_estimate.peak_memory_bytes,
        exported_step_time_s=c.proposed_estimate.step_time_s,
        exported_peak_memory_bytes=c.proposed_estimate.peak_memory_bytes,
        speedup=c.speedup,
        flag_changes=c.flag_changes,
        plan_changes=[ch.line() for ch in c.changes],
    )


def comparison_table(record: ComparisonRecord):
    """Side by side: the user's config, the plan, the plan as the framework runs it; then the flag changes."""
    from rich.table import Table

    gib = 2**30
    table = Table(title=f"against your {record.framework} config: predicted speed-up {record.speedup:.2f}x")
    for col in ("", "your config", "the plan", f"the plan in {record.framework}"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row(
        "step time",
        f"{record.current_step_time_s:.4g} s",
        f"{record.plan_step_time_s:.4g} s",
        f"{record.exported_step_time_s:.4g} s",
    )
    table.add_row(
        "peak memory per GPU",
        f"{record.current_peak_memory_bytes / gib:.2f} GiB"
        + ("" if record.current_fits_in_memory else " (does not fit)"),
        f"{record.plan_peak_memory_bytes / gib:.2f} GiB",
        f"{record.exported_peak_memory_bytes / gib:.2f} GiB",
    )
    table.add_row(
        "speed-up vs yours",
        "1.00x",
        f"{record.current_step_time_s / record.plan_step_time_s:.2f}x",
        f"{record.speedup:.2f}x",
    )
    table.caption = "yours: " + record.current_summary
    changes = Table(title=f"what to change in your {record.framework} config", show_header=False)
    changes.add_column("change")
    for line in record.flag_changes or ["nothing: your config is the plan"]:
        changes.add_row(line)
    for line in record.plan_changes:
        changes.add_row(f"[dim](not expressible) {line}[/dim]")
    return table, changes


def add_compare_argument(p: argparse.ArgumentParser) -> None:
    """``show``: ``--compare-to FRAMEWORK SOURCE`` (else the comparison stored by ``plan --compare-to``)."""
    add_source_argument(p, "--compare-to", "compare the plan with this config instead of the stored comparison")
    p.add_argument("--cluster", default=None, help="cluster profile for --compare-to (default: the plan's cluster)")
    p.add_argument(
        "--model-profile",
        type=Path,
        default=None,
        help="model profile for --compare-to (default: the closed-form profile of the plan's model)",
    )


def print_comparison(console, plan: Plan, args: argparse.Namespace) -> None:
    """Print the plan against the user's config: from ``--compare-to`` if given, else the stored one."""
    record = plan.comparison
    if getattr(args, "compare_to", None):
        from planner.cli.cmd_export import costing_inputs

        profile, cluster = costing_inputs(plan, args)
        record = build_comparison(plan, *args.compare_to, profile=profile, cluster=cluster)
    if record is not None:
        console.print(*comparison_table(record))
