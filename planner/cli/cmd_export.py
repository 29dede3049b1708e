"""``stratagem export plan.json --to megatron|torchtitan|deepspeed|accelerate [--out F]``.

Writes the framework's nearest configuration to the plan (Megatron-LM arguments as a shell fragment, a
torchtitan 0.3 config function, ``ds_config.json``, an Accelerate FSDP config), and prints what had to change
and the cost model's estimate of the exported configuration next to the plan's.
"""

from __future__ import annotations

import argparse
import sys

from planner.core import StratagemError, atomic_write_text
from planner.export import FRAMEWORKS
from planner.plan import Plan, load_plan
from planner.profile import ClusterProfile, ModelProfile, load_cluster_profile, load_model_profile

from .common import DefaultsHelpFormatter, check_out_path, nonempty_path, out_path, resolve_cluster_path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a plan as a Megatron-LM / torchtitan / DeepSpeed / Accelerate config",
        description=__doc__.split("\n\n")[1].replace("``", "'"),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("plan", type=nonempty_path, help="plan file written by `stratagem plan`")
    p.add_argument("--to", required=True, choices=FRAMEWORKS, help="the framework whose config to write")
    p.add_argument(
        "--out", type=out_path, default=None, metavar="FILE", help="file to write (default: print the config to stdout)"
    )
    add_costing_arguments(p)
    p.set_defaults(func=run)


def add_costing_arguments(p: argparse.ArgumentParser) -> None:
    """--cluster / --model-profile: what the estimates are computed on (default: the plan's own)."""
    p.add_argument(
        "--cluster",
        default=None,
        help="cluster profile to estimate on (default: the plan's cluster, by its shipped name)",
    )
    p.add_argument(
        "--model-profile",
        type=nonempty_path,
        default=None,
        help="model profile JSON (default: the closed-form GPT/Llama profile of the plan's model)",
    )


def costing_inputs(plan: Plan, args: argparse.Namespace) -> tuple[ModelProfile, ClusterProfile]:
    """The model profile and cluster the plan's estimates are computed on."""
    try:
        cluster = load_cluster_profile(resolve_cluster_path(args.cluster or plan.cluster_name))
    except StratagemError as exc:
        raise StratagemError(f"{exc} (the plan was made on cluster {plan.cluster_name!r}; pass --cluster)") from None
    if args.model_profile is not None:
        return load_model_profile(args.model_profile), cluster
    if plan.model.family not in ("gpt", "llama", "moe"):
        raise StratagemError(
            f"{plan.model.family} models need their profile to be estimated; pass --model-profile "
            f"(the one the plan was made with)"
        )
    from planner.profile import build_gpt_profile

    return build_gpt_profile(plan.model, seq_len=plan.training.seq_len, dtype=plan.training.dtype), cluster


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from planner.export import export_plan

    if args.out is not None:
        check_out_path(args.out, inputs={"plan": args.plan, "--model-profile": args.model_profile})
    plan = load_plan(args.plan)
    if "sd" in plan.mesh.axes:
        raise StratagemError(
            f"{args.plan} is a spatial plan of a 3D CNN ({plan.model.name}); {args.to} has no spatial parallelism "
            f"to export it to: run it with `stratagem launch {args.plan}`"
        )
    profile, cluster = costing_inputs(plan, args)
    export = export_plan(plan, args.to, profile=profile, cluster=cluster)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in export.summary_lines():
        err.print(line, markup=False)
    if args.out is None:
        sys.stdout.write(export.text)
    else:
        atomic_write_text(args.out, export.text)
        err.print(f"wrote {args.out}")
    return 0
