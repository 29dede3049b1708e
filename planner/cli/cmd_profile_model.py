"""``stratagem profile model``: measure (or derive, with --analytic) a model's per-layer profile."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from planner.cli.common import (
    MAX_BATCH,
    MAX_DEVICES,
    MAX_SEQ,
    DefaultsHelpFormatter,
    check_out_path,
    command_line,
    host_name,
    int_in,
    int_list,
    out_path,
    resolve_cluster_path,
    utc_now,
)
from planner.cli.model_args import add_model_arguments, spec_from_args
from planner.core import DTYPES, StratagemError
from planner.profile import DTYPE_HELP, default_dtype, load_cluster_profile, save_profile

# A measured profile runs each layer on micro-batch x seq tokens in this process: above this many tokens
# one activation of even a small model needs GiBs (1e6 x 128 tokens crashed with an allocation failure).
MAX_MEASURED_TOKENS = 2**20


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "model",
        help="per-layer FLOPs, memory and times of a model",
        description="Profile a model layer by layer (each top-level layer run standalone on its saved input; "
        "identical layers profiled once) and write a model profile JSON.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument("--micro-batch", default="1", help="micro-batch sizes to time, in samples, e.g. 1,2,4")
    p.add_argument(
        "--seq",
        type=int_in(1, MAX_SEQ),
        default=128,
        help="sequence length in tokens per sample (ignored for resnet/mlp)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help=DTYPE_HELP + "; sets bytes per element and the matmul precision",
    )
    p.add_argument(
        "--tp",
        default="1",
        help="tensor-parallel degrees (ranks per layer) to profile shards for, e.g. 1,2,4; 1 is always included",
    )
    p.add_argument("--out", required=True, type=out_path, help="model profile JSON file to write (atomically)")
    p.add_argument(
        "--analytic",
        action="store_true",
        help="no measurement: run on the meta device, times = FLOPs / the cluster's achieved FLOP/s",
    )
    p.add_argument("--cluster", help="cluster name or profile file (needed with --analytic)")
    p.add_argument("--warmup", type=int_in(0, 1000), default=2, help="untimed runs (count) per layer before timing")
    p.add_argument(
        "--repeats",
        type=int_in(1, 1000),
        default=5,
        help="timed runs (count) per layer and micro-batch; the file keeps their median and spread in seconds",
    )
    p.set_defaults(func=run)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def _analytic_default_dtype(cluster_name: str | None) -> str:
    if not cluster_name:
        raise StratagemError("--analytic needs --cluster NAME (or a cluster profile file) for its FLOP/s")
    cluster = load_cluster_profile(resolve_cluster_path(cluster_name))
    return default_dtype(cluster.node_types[:1], cluster.name)


def _achieved_flops(cluster_name: str | None, dtype: str) -> tuple[float, str]:
    if not cluster_name:
        raise StratagemError("--analytic needs --cluster NAME (or a cluster profile file) for its FLOP/s")
    cluster = load_cluster_profile(resolve_cluster_path(cluster_name))
    node = cluster.node_types[0]
    try:
        figure = node.compute_for(dtype)
    except KeyError:
        have = ", ".join(c.dtype for c in node.compute)
        raise StratagemError(
            f"cluster {cluster.name} node type {node.name} has no {dtype} throughput "
            f"(has {have}); use --dtype among those"
        ) from None
    return figure.achieved_flops_per_s, f"analytic (meta) / {node.device}"


def run(args: argparse.Namespace) -> int:
    # imported here: runtime (torch models) is only needed by this command
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from runtime.models import layer_paths
    from runtime.profiling.model import ProfileSettings, profile_model

    spec = spec_from_args(args)
    micro_batches = int_list(args.micro_batch, high=MAX_BATCH, flag="--micro-batch")
    tps = int_list(args.tp, high=MAX_DEVICES, flag="--tp")
    if not args.analytic and max(micro_batches) * args.seq > MAX_MEASURED_TOKENS:
        raise StratagemError(
            f"measuring --micro-batch {max(micro_batches)} x --seq {args.seq} tokens per layer run "
            f"exceeds {MAX_MEASURED_TOKENS:,} tokens and would not fit in memory; profile smaller "
            f"micro-batches (times scale linearly) or use --analytic"
        )
    cluster_path = resolve_cluster_path(args.cluster) if args.cluster else None
    out = check_out_path(args.out, inputs={"--cluster": cluster_path})
    if args.dtype is None:  # the rule every command shares; a measured CPU run computes in its native fp32
        args.dtype = _analytic_default_dtype(args.cluster) if args.analytic else "fp32"
    flops_per_s, device_name = _achieved_flops(args.cluster, args.dtype) if args.analytic else (None, _cpu_name())
    settings = ProfileSettings(
        micro_batches=tuple(sorted(set(micro_batches))),
        seq_len=args.seq,
        dtype=args.dtype,
        tp_degrees=tuple(sorted(set(tps) | {1})),
        device="meta" if args.analytic else "cpu",
        warmup=args.warmup,
        repeats=args.repeats,
        achieved_flops_per_s=flops_per_s,
    )
    paths = layer_paths(spec)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = Console(stderr=True)
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(f"profiling {spec.name}", total=len(paths))
        profile = profile_model(
            spec,
            settings,
            created_utc=utc_now(),
            command=command_line(),
            host=host_name(),
            device_name=device_name,
            on_layer=lambda _path: bar.advance(task),
        )
    save_profile(profile, out)
    print(
        f"wrote {out}: {len(profile.layers)} layers, {profile.total_params:,} parameters, {profile.provenance.method}"
    )
    return 0
