"""``stratagem frontier``: the best plan for every GPU type and count, with days, cost and energy to train.

Example::

    stratagem frontier --model llama:llama3-70b --seq 8192 --global-batch 2048 --train-tokens 2e12 \\
        --cluster dgx-h100 --cluster dgx-a100-80g --cluster dgx-h200 --gpus 64:4096 \\
        --out frontier.csv --png frontier.png

Every row is the plan `stratagem plan` returns for the same flags (its ``plan_command`` column): the same exact
search, run once per (cluster, count), in ``--jobs`` processes that keep each cluster's layer costs across counts.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from multiprocessing import get_context

from planner.core import DTYPES, StratagemError, atomic_write_text
from planner.frontier import (
    FrontierRow,
    choose_within,
    csv_text,
    gpu_counts,
    mark_pareto,
    run_economics,
    terminal_lines,
    utilisation,
)

from .common import (
    MAX_BATCH,
    MAX_SEQ,
    DefaultsHelpFormatter,
    check_out_path,
    float_in,
    int_in,
    out_path,
    resolve_cluster_path,
)
from .model_args import OVERRIDES, add_model_arguments

MAX_TOKENS = 1e16


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "frontier",
        help="days, cost and energy to train across GPU types and counts (the best plan of each)",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument("--seq", type=int_in(1, MAX_SEQ), required=True, metavar="TOKENS", help="tokens per sample")
    p.add_argument(
        "--global-batch",
        type=int_in(1, MAX_BATCH),
        required=True,
        metavar="SAMPLES",
        help="samples per optimizer step (the user's; a count that cannot use it says why)",
    )
    p.add_argument(
        "--train-tokens",
        type=float_in(0, MAX_TOKENS, low_open=True),
        required=True,
        metavar="TOKENS",
        help="tokens the run trains on, e.g. 2e12",
    )
    p.add_argument(
        "--cluster",
        action="append",
        required=True,
        metavar="NAME",
        help="cluster type (shipped name or profile JSON); repeat for several",
    )
    p.add_argument(
        "--gpus",
        required=True,
        metavar="RANGE",
        help="device counts: LOW:HIGH (the powers of two in it and its ends when whole nodes) or a list 64,96,128",
    )
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="CLUSTER=USD",
        help="US dollars per GPU-hour for a cluster (default: the profile's list price)",
    )
    p.add_argument(
        "--pue",
        type=float_in(1, 10),
        default=None,
        help="facility power usage effectiveness, >= 1 (default: the profile's)",
    )
    p.add_argument(
        "--deadline-days",
        type=float_in(0, 1e6, low_open=True),
        default=None,
        metavar="DAYS",
        help="choose the cheapest configuration that trains within this many days",
    )
    p.add_argument(
        "--budget-usd",
        type=float_in(0, 1e15, low_open=True),
        default=None,
        metavar="USD",
        help="choose the fastest configuration that costs at most this",
    )
    p.add_argument(
        "--batch-range",
        default=None,
        metavar="LOW:HIGH",
        help="also try global batches --global-batch x 2^k within LOW..HIGH samples, the learning rate scaled "
        "linearly (Goyal et al. 2017) and the tokens to the same loss assumed unchanged",
    )
    p.add_argument("--dtype", default=None, choices=DTYPES, help="training dtype (default: plan's default per GPU)")
    p.add_argument(
        "--memory-margin",
        type=float_in(0, 0.9, high_open=True),
        default=None,
        metavar="FRACTION",
        help="share of each device's memory to keep free (plan's default when not given)",
    )
    p.add_argument("--allow", default=None, help="dimensions the search may use (as `stratagem plan --allow`)")
    p.add_argument(
        "--jobs",
        type=int_in(1, 256),
        default=None,
        metavar="N",
        help="searches run at once, one process each (default: the CPU cores)",
    )
    p.add_argument("--out", type=out_path, required=True, metavar="FILE", help="frontier CSV to write")
    p.add_argument("--png", type=out_path, default=None, metavar="FILE", help="time vs cost picture to write")
    p.set_defaults(func=run)


@dataclass(frozen=True, kw_only=True, slots=True)
class RowTask:
    """One search: the `stratagem plan` arguments of a row, and what its economics need."""

    cluster: str
    cluster_path: str
    gpus: int
    global_batch: int
    lr_scale: float
    plan_argv: tuple[str, ...]
    train_tokens: float
    price: float | None
    pue: float | None


def plan_argv(args: argparse.Namespace, cluster: str, gpus: int, global_batch: int) -> list[str]:
    """The `stratagem plan` arguments of one row (without ``--out``)."""
    argv = ["plan", "--model", args.model]
    for flag in OVERRIDES:
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            argv += [f"--{flag}", str(value)]
    if args.dropout is not None:
        argv += ["--dropout", repr(args.dropout)]
    argv += ["--cluster", cluster, "--gpus", str(gpus), "--global-batch", str(global_batch), "--seq", str(args.seq)]
    for flag, value in (("--dtype", args.dtype), ("--memory-margin", args.memory_margin), ("--allow", args.allow)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def command_text(argv: Sequence[str]) -> str:
    """A row's `stratagem plan` command line, quoted for a POSIX shell."""
    import shlex

    return "stratagem " + " ".join(shlex.quote(a) for a in [*argv, "--out", "plan.json"])


class _Worker:
    """A search process's state: cluster profiles and their layer costs, kept across the rows it solves."""

    def __init__(self) -> None:
        from planner.search import LayerCostCache

        self.clusters: dict[str, object] = {}
        self.caches: dict[str, LayerCostCache] = defaultdict(LayerCostCache)


_WORKER: _Worker | None = None  # one per search process (set by _init_worker); never shared between processes


def _init_worker() -> None:
    global _WORKER
    _WORKER = _Worker()
    # `run` says once which clusters are resized past their listed devices; the searches would say it per row
    logging.getLogger("planner.cost.placement").setLevel(logging.ERROR)


def solve_row(task: RowTask) -> FrontierRow:
    """The row of one (cluster, count, batch): `stratagem plan`'s search for its arguments, then the economics; a
    row without a plan carries the search's one-line reason."""
    from planner.cli.cmd_plan import assemble_plan, prepare_search
    from planner.cli.main import build_parser
    from planner.plan import plan_label
    from planner.profile import load_cluster_profile
    from planner.search import plan_search

    worker = _WORKER or _Worker()
    start = time.perf_counter()
    base = FrontierRow(
        cluster=task.cluster,
        device="",
        gpus=task.gpus,
        global_batch=task.global_batch,
        lr_scale=task.lr_scale,
        status="no plan",
        plan_command=command_text(task.plan_argv),
        price_usd_per_gpu_hour=task.price,
    )
    try:
        args = build_parser().parse_args([*task.plan_argv, "--out", "plan.json"])
        if task.cluster_path not in worker.clusters:
            worker.clusters[task.cluster_path] = load_cluster_profile(task.cluster_path)
        inputs = prepare_search(args, cluster=worker.clusters[task.cluster_path])  # type: ignore[arg-type]
        node = inputs.cluster.node_types[0]
        base = replace(base, device=node.device, memory_gib=node.device_memory_bytes / 2**30)
        result = plan_search(
            inputs.profile,
            inputs.cluster,
            gpus=task.gpus,
            global_batch=task.global_batch,
            config=inputs.config,
            shared=worker.caches[task.cluster_path],
        )
        plan = assemble_plan(inputs, args, result)
    except StratagemError as exc:
        return replace(base, reason=str(exc).splitlines()[0], search_s=time.perf_counter() - start)
    est = result.best.estimate
    util = utilisation(est.hardware_tflops_per_gpu * 1e12, node, inputs.profile.dtype)
    econ = run_economics(
        step_s=est.step_time_s,
        gpus=task.gpus,
        global_batch=task.global_batch,
        seq_len=inputs.profile.seq_len,
        train_tokens=task.train_tokens,
        node=node,
        util=util,
        price_per_gpu_hour=task.price,
        pue=task.pue,
    )
    search = "optimal" if result.status == "optimal" else f"{result.status} (gap {result.gap:.2%})"
    return replace(
        base,
        status="ok",
        strategy=plan_label(plan),
        step_time_s=est.step_time_s,
        tokens_per_s=est.tokens_per_s,
        mfu=est.mfu,
        utilisation=util,
        peak_memory_gib=est.peak_memory_bytes / 2**30,
        train_days=econ.days,
        gpu_hours=econ.gpu_hours,
        cost_usd=econ.cost_usd,
        energy_mwh=econ.energy_mwh,
        search=search,
        search_s=time.perf_counter() - start,
    )


def check_inputs(task: RowTask) -> None:
    """Read a row's `stratagem plan` arguments and profile its model without searching: a one-line error for
    what every row of the cluster would fail on (the model, the sequence, the dtype)."""
    from planner.cli.cmd_plan import prepare_search
    from planner.cli.main import build_parser

    prepare_search(build_parser().parse_args([*task.plan_argv, "--out", "plan.json"]))


def _prices(items: list[str], clusters: list[str]) -> dict[str, float]:
    prices: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            usd = float(value) if sep else math.nan
        except ValueError:
            usd = math.nan
        if not sep or not math.isfinite(usd) or usd <= 0:
            raise StratagemError(f"--price {item!r}: write CLUSTER=USD with a positive price, e.g. dgx-h100=2.50")
        if name not in clusters:
            raise StratagemError(
                f"--price {item!r}: {name!r} is not one of the --cluster values ({', '.join(clusters)})"
            )
        prices[name] = usd
    return prices


def batches(global_batch: int, batch_range: str | None) -> list[int]:
    """The global batches to try: --global-batch, or with --batch-range LOW:HIGH every --global-batch x 2^k in it.

    >>> batches(2048, "512:4096")
    [512, 1024, 2048, 4096]
    """
    if batch_range is None:
        return [global_batch]
    try:
        lo_text, hi_text = batch_range.split(":", 1)
        lo, hi = int(lo_text), int(hi_text)
        if lo < 1 or hi < lo:
            raise ValueError
    except ValueError:
        raise StratagemError(f"--batch-range {batch_range!r}: write LOW:HIGH samples, e.g. 1024:4096") from None
    out = {b for b in (global_batch << k for k in range(0, 40)) if lo <= b <= hi}
    out |= {
        global_batch >> k
        for k in range(1, 40)
        if (global_batch >> k) << k == global_batch and lo <= global_batch >> k <= hi
    }
    if not out:
        raise StratagemError(
            f"--batch-range {batch_range!r} holds no --global-batch {global_batch} x 2^k; widen it or change "
            "--global-batch"
        )
    return sorted(out)


def build_tasks(args: argparse.Namespace) -> list[RowTask]:
    """One task per (cluster, count, batch), with the cluster's price (--price, else its profile's)."""
    from planner.profile import load_cluster_profile

    prices = _prices(args.price, args.cluster)
    tasks = []
    for name in dict.fromkeys(args.cluster):
        path = str(resolve_cluster_path(name))
        cluster = load_cluster_profile(path)
        if cluster.is_mixed:
            raise StratagemError(f"cluster {name} mixes node types; the frontier compares one GPU type per cluster")
        node = cluster.node_types[0]
        counts = gpu_counts(args.gpus, node.devices_per_node)
        if cluster.is_inventory and counts[-1] > cluster.total_devices:
            raise StratagemError(
                f"cluster {name} is a measured profile of {cluster.total_devices} devices; --gpus {args.gpus} "
                f"asks for {counts[-1]}: lower the range or use a datasheet profile"
            )
        if counts[-1] > cluster.total_devices:
            print(
                f"note: {name} lists {cluster.total_devices} devices; counts above are planned on its node type "
                "(a datasheet template, resized)",
                file=sys.stderr,
            )
        price = prices.get(name, node.price_per_gpu_hour)
        for gpus in counts:
            for batch in batches(args.global_batch, args.batch_range):
                tasks.append(
                    RowTask(
                        cluster=name,
                        cluster_path=path,
                        gpus=gpus,
                        global_batch=batch,
                        lr_scale=batch / args.global_batch,
                        plan_argv=tuple(plan_argv(args, name, gpus, batch)),
                        train_tokens=args.train_tokens,
                        price=price,
                        pue=args.pue,
                    )
                )
    return tasks


def solve_rows(tasks: list[RowTask], jobs: int, *, log=None) -> list[FrontierRow]:
    """Every task's row, in task order; ``jobs`` > 1 runs them in that many processes (spawned: no state is
    inherited), each keeping its clusters' layer costs across the rows it solves. ``log(line)`` per row done."""
    rows: list[FrontierRow | None] = [None] * len(tasks)
    done = 0

    def note(i: int, row: FrontierRow) -> None:
        nonlocal done
        rows[i], done = row, done + 1
        if log is not None:
            what = f"{row.step_time_s:.3g} s/step, {row.strategy}" if row.ok else f"no plan: {row.reason}"
            where = f"{row.gpus} x {row.cluster}, batch {row.global_batch}"
            log(f"[{done}/{len(tasks)}] {where}: {what} ({row.search_s or 0:.1f} s)")

    if jobs <= 1 or len(tasks) <= 1:
        _init_worker()
        for i, task in enumerate(tasks):
            note(i, solve_row(task))
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
            futures = {pool.submit(solve_row, task): i for i, task in enumerate(tasks)}
            for fut in as_completed(futures):
                note(futures[fut], fut.result())
    return [r for r in rows if r is not None]


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    check_out_path(args.out)
    if args.png is not None:
        check_out_path(args.png, flag="--png")
    tasks = build_tasks(args)
    _init_worker()  # this process too: the checks below and --jobs 1 search here
    for task in {t.cluster: t for t in tasks}.values():  # flags every row shares fail here, before any search
        check_inputs(task)
    jobs = args.jobs or max(1, min(os.cpu_count() or 1, len(tasks)))
    print(f"frontier: {len(tasks)} searches in {jobs} process(es)", file=sys.stderr)
    rows = mark_pareto(solve_rows(tasks, jobs, log=lambda line: print(line, file=sys.stderr)))
    if not any(r.ok for r in rows):
        first = rows[0]
        raise StratagemError(
            f"no GPU count in {args.gpus} of {', '.join(args.cluster)} can train {args.model} at global batch "
            f"{args.global_batch}: {first.gpus} x {first.cluster}: {first.reason}"
        )
    wall_s = time.perf_counter() - start
    _, why = choose_within(rows, deadline_days=args.deadline_days, budget_usd=args.budget_usd)
    atomic_write_text(args.out, csv_text(rows))
    if args.png is not None:
        from planner.inspect import save_frontier_png

        save_frontier_png(rows, args.png, title=f"{args.model}, {args.train_tokens:.3g} tokens")
    for line in terminal_lines(rows, batch_column=args.batch_range is not None):
        print(line)
    print("PF: Pareto-optimal in (days, cost) C and (days, energy) E; energy is facility MWh (device, host, PUE)")
    if args.batch_range is not None:
        print(
            "batches other than --global-batch: learning rate scaled linearly (Goyal et al. 2017); the tokens "
            "to the same loss are assumed unchanged, so steps = tokens / (batch x seq)"
        )
    unpriced = sorted({r.cluster for r in rows if r.ok and r.cost_usd is None})
    if unpriced:
        print(f"no price for {', '.join(unpriced)}: give --price CLUSTER=USD for its cost")
    if why:
        print(why)
    print(
        f"{len(rows)} rows ({sum(r.ok for r in rows)} with a plan) in {wall_s:.1f} s; wrote {args.out}"
        + (f" and {args.png}" if args.png else "")
    )
    return 0
