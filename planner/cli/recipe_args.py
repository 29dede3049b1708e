"""``stratagem plan`` flags for the training recipe the plan carries (planner/plan/recipe.py, Goyal et al. 2017)."""

from __future__ import annotations

import argparse

from planner.core import StratagemError
from planner.plan import LRSchedule, build_lr_schedule


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training recipe (Goyal et al. 2017; carried by the plan and every export)")
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        metavar="RATE",
        help="learning rate tuned at --reference-batch samples per step; scaled linearly to the global "
        "batch (no recipe without it)",
    )
    g.add_argument(
        "--reference-batch",
        type=int,
        default=None,
        metavar="SAMPLES",
        help="samples per step --lr was tuned for (default: the global batch, i.e. no scaling)",
    )
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="STEPS",
        help="linear warm-up from --lr to the scaled rate, optimizer steps",
    )
    g.add_argument(
        "--lr-decay", default="cosine", choices=("cosine", "step", "constant"), help="decay after the warm-up"
    )
    g.add_argument(
        "--train-steps",
        type=int,
        default=None,
        metavar="STEPS",
        help="optimizer steps of the run (end of the cosine); required with --lr",
    )
    g.add_argument("--min-lr", type=float, default=0.0, metavar="RATE", help="rate at the end of the cosine")
    g.add_argument(
        "--lr-milestones",
        default="",
        metavar="STEPS",
        help="step decay: comma-separated steps at which the rate is multiplied by 0.1",
    )


def recipe_from_args(args: argparse.Namespace) -> LRSchedule | None:
    if args.lr is None:
        return None
    if args.train_steps is None:
        raise StratagemError("--lr needs --train-steps (the run's optimizer steps, where the decay ends)")
    try:
        milestones = tuple(int(x) for x in args.lr_milestones.split(",") if x.strip())
    except ValueError:
        raise StratagemError(
            f"--lr-milestones {args.lr_milestones!r}: write steps separated by commas, e.g. 30000,60000"
        ) from None
    if args.warmup_steps > args.train_steps:
        raise StratagemError(
            f"--warmup-steps {args.warmup_steps} exceeds --train-steps {args.train_steps}; shorten the warm-up"
        )
    return build_lr_schedule(
        base_lr=args.lr,
        reference_batch=args.reference_batch or args.global_batch,
        total_steps=args.train_steps,
        warmup_steps=args.warmup_steps,
        decay=args.lr_decay,
        min_lr=args.min_lr,
        step_milestones=milestones,
    )
