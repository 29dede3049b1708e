"""``stratagem profile cluster``: time collectives and matmul on this cluster, fit alpha-beta, write a profile.

Example (one node, two CPU ranks, small sweep)::

    stratagem profile cluster --nproc-per-node 2 --quick --out profiles/hardware/local-cpu-2core.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from planner.cli.common import (
    MAX_SECONDS,
    DefaultsHelpFormatter,
    check_out_path,
    float_in,
    int_in,
    nonempty_path,
    out_path,
)
from planner.core import StratagemError, save_document
from planner.profile import ClusterProfile, CollectiveFit

from .common import command_line, utc_now

# The quick sweep reaches 16 MiB because on a loaded 2-core VM small-message times jitter by ~2 ms (wake-up
# latency), more than a 4 MiB transfer takes: without larger messages the bandwidth term drowns in noise.
QUICK_SIZES = "4KiB..16MiB"
FULL_SIZES = "1KiB..64MiB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``"4KiB"`` -> 4096; ``"1MB"`` -> 1000000; a bare number is bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS or int(match.group(1)) < 1:
        raise StratagemError(
            f"malformed message size {text!r}; write a positive number with an optional "
            f"unit B, KiB, MiB, GiB, KB, MB or GB, e.g. 64KiB"
        )
    return int(match.group(1)) * _UNITS[unit]


def parse_sizes(text: str) -> list[int]:
    """``"1KiB..64MiB"`` (x4 steps; ``"1KiB..64MiB:x2"`` for x2) or a list ``"4KiB,1MiB"``, in bytes."""
    if ".." not in text:
        return _check_sizes(sorted({parse_size(part) for part in text.split(",") if part.strip()}), text)
    span, _, step = text.partition(":")
    lo_text, _, hi_text = span.partition("..")
    lo, hi = parse_size(lo_text), parse_size(hi_text)
    factor = int(step.lower().removeprefix("x")) if step.lower().removeprefix("x").isdigit() else 0
    if step and factor < 2 or lo > hi:
        raise StratagemError(
            f"malformed size range {text!r}; write LOW..HIGH[:xFACTOR] with LOW <= HIGH and "
            f"FACTOR >= 2, e.g. 1KiB..64MiB:x4"
        )
    sizes, size = [], lo
    while size <= hi:
        sizes.append(size)
        size *= factor or 4
    return _check_sizes(sizes, text)


MAX_MESSAGE_BYTES = 16 * 2**30  # one collective message: 16 GiB (an H200's memory is 141 GB)
MAX_SIZES = 64


def _check_sizes(sizes: list[int], text: str) -> list[int]:
    if not sizes or len(sizes) > MAX_SIZES or max(sizes) > MAX_MESSAGE_BYTES:
        raise StratagemError(
            f"--sizes {text!r} gives {len(sizes)} message sizes up to {max(sizes, default=0):,} "
            f"bytes; give 1..{MAX_SIZES} sizes of at most 16GiB, e.g. 4KiB..16MiB"
        )
    return sizes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cluster",
        help="measure collectives (alpha-beta) and matmul throughput with torchrun",
        description="Time collectives and matmul on this cluster with torchrun, fit alpha-beta per collective and "
        "link level, and write a cluster profile JSON.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--nproc-per-node", type=int_in(1, 4096), required=True, help="ranks (devices) per node, count")
    p.add_argument(
        "--nnodes", type=int_in(1, 100_000), default=1, help="nodes, count; >1 also measures the inter-node level"
    )
    p.add_argument(
        "--node-rank", type=int_in(0, 100_000), default=0, help="this node's index, 0..nnodes-1 (0 writes the profile)"
    )
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 when --nnodes > 1")
    p.add_argument(
        "--sizes",
        default=None,
        help=f"message sizes in bytes (suffix B, KiB, MiB, GiB, KB, MB, GB): LOW..HIGH[:xF] (x4 steps "
        f"unless F is given) or a list 4KiB,1MiB (default {FULL_SIZES}, --quick {QUICK_SIZES})",
    )
    p.add_argument(
        "--repeats",
        type=int_in(1, 1000),
        default=None,
        help="repeats (count) per size, for the run-to-run spread (default 5, --quick 3)",
    )
    p.add_argument(
        "--iters",
        type=int_in(1, 100_000),
        default=None,
        help="most timed iterations (count) per repeat (default 10, --quick 5)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"small sweep that finishes in seconds ({QUICK_SIZES}, 3 repeats, 5 iterations)",
    )
    p.add_argument(
        "--timeout-s",
        type=float_in(0, MAX_SECONDS, low_open=True),
        default=300.0,
        help="kill the whole run after this many seconds (exit 2, no file)",
    )
    p.add_argument("--name", default=None, help="profile and node-type name (default: the --out file stem)")
    p.add_argument(
        "--out",
        required=True,
        type=out_path,
        help="cluster profile JSON file to write (atomically; only node 0 writes)",
    )
    p.set_defaults(func=run)
    check = subparsers.add_parser(
        "check",
        help="validate profile files (schema version, fields, content hash)",
        description="Load each cluster or model profile file as the planner would; exit 2 on the first bad one.",
    )
    check.add_argument("files", nargs="+", type=nonempty_path, help="cluster or model profile JSON files to validate")
    check.set_defaults(func=run_check)


def _fit_table(profile: ClusterProfile):
    from rich.table import Table

    table = Table(title=f"alpha-beta fits: {profile.name}")
    for col in ("op", "level", "ranks", "latency µs", "bus GB/s", "r2", "max err", "run CV"):
        table.add_column(col, justify="left" if col in ("op", "level") else "right", no_wrap=True)
    fits: list[CollectiveFit] = [f for nt in profile.node_types for f in nt.intra_node] + profile.inter_node
    for f in fits:
        table.add_row(
            f.op,
            f.level,
            str(f.n_ranks),
            f"{f.alpha_s * 1e6:.1f}",
            f"{f.bus_bw_bytes_per_s / 1e9:.3f}",
            "-" if f.fit_r2 is None else f"{f.fit_r2:.2f}",
            "-" if f.fit_max_rel_err is None else f"{100 * f.fit_max_rel_err:.0f}%",
            "-" if f.run_cv is None else f"{100 * f.run_cv:.0f}%",
        )
    return table, fits


def _print_summary(profile: ClusterProfile) -> None:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or logged: don't squeeze the table into 80 columns
        console = Console(width=120)
    table, fits = _fit_table(profile)
    console.print(table)
    cvs = sorted(f.run_cv for f in fits if f.run_cv is not None)
    if cvs:
        console.print(
            f"run-to-run spread (CV across repeats, median per op): {100 * cvs[0]:.0f}% .. {100 * cvs[-1]:.0f}%"
        )
    for c in profile.node_types[0].compute:
        console.print(
            f"matmul {c.dtype}: {c.achieved_flops_per_s / 1e9:.1f} GFLOP/s median, {c.peak_flops_per_s / 1e9:.1f} best"
        )
    console.print(f"notes: {profile.provenance.notes}")
    for line in poor_fit_warnings(fits):
        print(line, file=sys.stderr)


# A fit this poor predicts collective times off by about a factor of two somewhere in the measured range.
POOR_FIT_R2 = 0.9
POOR_FIT_MAX_REL_ERR = 0.5


def poor_fit_warnings(fits: list[CollectiveFit]) -> list[str]:
    """One ``warning:`` line per fit whose r2 is below 0.9 or whose largest error exceeds 50 %."""
    lines = []
    for f in fits:
        r2, err = f.fit_r2, f.fit_max_rel_err
        if (r2 is not None and r2 < POOR_FIT_R2) or (err is not None and err > POOR_FIT_MAX_REL_ERR):
            lines.append(
                f"warning: the {f.op} {f.level} fit is poor (r2 {r2 if r2 is not None else float('nan'):.2f}, "
                f"max error {100 * (err or 0):.0f} %): plans will mis-price it; re-run on an idle machine "
                f"with more --repeats, or larger --sizes"
            )
    return lines


def load_any_profile(path: Path):
    """Load a cluster or a model profile, telling them apart by their top-level keys."""
    from planner.core import read_json
    from planner.profile import load_cluster_profile, load_model_profile

    data = read_json(path, what="profile")
    if "node_types" in data:
        return load_cluster_profile(path)
    if "layers" in data:
        return load_model_profile(path)
    raise StratagemError(
        f"{path} is neither a cluster profile (no 'node_types') nor a model profile (no "
        f"'layers'); pass a file written by 'stratagem profile cluster' or 'profile model'"
    )


def run_check(args: argparse.Namespace) -> int:
    for path in args.files:
        profile = load_any_profile(path)
        print(f"ok {path}: {type(profile).__name__} {profile.name!r}")
    return 0


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from runtime.profiling.cluster import ClusterBenchConfig, build_cluster_profile, run_cluster_bench

    cfg = ClusterBenchConfig(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        sizes_bytes=tuple(
            parse_sizes(args.sizes if args.sizes is not None else (QUICK_SIZES if args.quick else FULL_SIZES))
        ),
        repeats=(3 if args.quick else 5) if args.repeats is None else args.repeats,
        iters=(5 if args.quick else 10) if args.iters is None else args.iters,
        timeout_s=args.timeout_s,
    )
    if args.node_rank >= args.nnodes:
        raise StratagemError(
            f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes} (nodes are "
            f"numbered 0..{args.nnodes - 1})"
        )
    if args.node_rank == 0:
        check_out_path(args.out)  # fail before the benchmark, not after it
    with Progress(transient=True) as progress:
        task = progress.add_task("profiling cluster", total=None)

        def on_progress(done: int, total: int, label: str) -> None:
            progress.update(task, completed=done, total=total, description=label)

        raw = run_cluster_bench(cfg, on_progress)
    if raw is None:
        print(f"node {args.node_rank} done; node 0 writes the profile")
        return 0
    profile = build_cluster_profile(
        raw, name=args.name or args.out.stem, command=command_line(), created_utc=utc_now(), cfg=cfg
    )
    _print_summary(profile)
    save_document(profile, args.out)
    print(f"wrote {args.out}")
    return 0
