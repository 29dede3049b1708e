"""Measured step time and peak memory of `stratagem launch` next to the cost model's predictions.

    python benchmarks/runtime_vs_prediction.py                  # DP2, TP2, PP2, FSDP2 x gpt:tiny, gpt:small
    python benchmarks/runtime_vs_prediction.py --models gpt:tiny --layouts dp,tp --repeats 3
    python benchmarks/runtime_vs_prediction.py --cluster cal.json --compare cal-old.json   # + min/cmp column

Each layout is a hand-made plan (``fixtures.plans.make_plan``; no search, so
the figures do not depend on the ILP) on 2 CPU ranks, global batch 8 x seq 64, fp32:

- ``dp``: dp 2, ZeRO-0 (FSDP2 ``replicate``), one micro-batch of 4 per replica;
- ``tp``: tp 2, every splittable layer split, one micro-batch of 8;
- ``pp``: pp 2, 1F1B, 4 micro-batches of 2, layers cut evenly by count;
- ``fsdp``: dp 2, ZeRO-3 (FSDP2 ``fully_shard`` per block).

The prediction is :func:`planner.cost.estimate` on the measured model profile
(``profiles/models/gpt-<preset>.json``) and the measured cluster profile ``local-cpu-2core`` with the
plan's configuration (``overlap_grad_reduce=False``, see ``config_for_plan``; other fields at their
defaults, as the search uses them); it is
written into the plan, so the launch's summary compares the two. Measured = median step time over steps
2.. (max over ranks per step); peak memory on CPU = growth of the process RSS while the plan ran
(runtime/executor/metrics.py), which also holds allocator slack and gloo buffers. This host's CPU
steal and the other users of its 2 cores make single timings vary 2-5x
(docs/torch-distributed-on-cpu.md): the 2-process matmul rate moved between 63 and 185 GFLOP/s
within an hour here. So each launch is bracketed by the cluster profiler's matmul benchmark run by two
processes at once, and the prediction is repeated with that rate as the cluster's compute figure
("at load"): the model profile's timings are then scaled by its reference matmul over this rate
(``planner.cost.framework.timings_scale``). Blocking collectives are also given the per-call latency
measured after compute (``runtime/profiling/sync_latency.py``: ~1 ms here, vs the back-to-back alpha
of ~0.2 ms) as their alpha, TP's DTensor collectives the functional one measured then, and ZeRO-3's
FSDP2 all-gathers and reduce-scatters the plain one (the static prediction already charges the profile's
:class:`planner.profile.load.BlockingLatency` for both: ``planner.cost.compute``, ``planner.cost.zero3``).
Measured, nothing fitted with the shipped profile; use ``--repeats`` and read the spread. With a calibrated
``--cluster``, ``--fitted`` names the configurations it was fitted on (``calibrate_cpu.py`` passes its runs):
the printout leads with the held-out rows' min/static and reports the fitted ones apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CLUSTER = REPO / "profiles/hardware/local-cpu-2core.json"
LAYOUTS = ("dp", "tp", "pp", "fsdp")
GLOBAL_BATCH, SEQ = 8, 64


def build_plan(model: str, layout: str):
    """The hand-made plan of ``layout`` (see the module docstring)."""
    from fixtures.plans import make_plan
    from planner.model import parse_model
    from runtime.models import is_splittable, layer_paths

    spec = parse_model(model)
    kw = dict(global_batch=GLOBAL_BATCH, seq_len=SEQ)
    if layout == "dp":
        return make_plan(spec, dp=2, **kw)
    if layout == "fsdp":
        return make_plan(spec, dp=2, zero_stage=3, **kw)
    if layout == "tp":
        return make_plan(spec, tp=2, split=[p for p in layer_paths(spec) if is_splittable(spec, p)], **kw)
    if layout == "pp":
        return make_plan(spec, pp=2, schedule="1f1b", num_micro_batches=4, **kw)
    raise SystemExit(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")


def config_for_plan(plan):
    """The cost model's ParallelConfig for ``plan`` (``planner.calibrate.metrics_runs.plan_config``).

    ``overlap_grad_reduce=False``: how the runtime runs on CPU. FSDP2 has no side stream there and its
    gloo all-gathers and reduce-scatters block the rank (torch.profiler, 2 gloo ranks, gpt:tiny ZeRO-3:
    the collectives' time is spent inside FSDP::all_gather / post_backward_reduce), and ``replicate``
    reduces its single unit after the whole backward.
    """
    from dataclasses import replace  # a hand-made plan's node type names none of the cluster's

    from planner.cost import plan_config

    return replace(plan_config(plan, overlap_grad_reduce=False), stage_node_types=None)


def _bare(profile):
    """The profile without wrapper overheads and reference matmul: what the cost model used before them."""
    return profile.model_copy(
        update={
            "reference_matmul": None,
            "layers": [la.model_copy(update={"runtime_overhead": None}) for la in profile.layers],
        }
    )


# Blocking collectives take the per-call latency measured after compute (runtime/profiling/sync_latency.py);
# pipeline transfers keep the profile's fit: torch.distributed.pipelining posts them as non-blocking
# batch_isend_irecv, and the time a stage waits for its peer is the pipeline model's bubble.
SYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def at_load(cluster, rate_flops_per_s: float, latency_s: dict[str, float] | None = None):
    """``cluster`` with its fp32 achieved matmul rate, and the alpha of its 2-rank intra-node fits for
    ``SYNC_OPS``, replaced by figures measured now."""
    node = cluster.node_types[0]
    compute = [
        c.model_copy(update={"achieved_flops_per_s": rate_flops_per_s}) if c.dtype == "fp32" else c
        for c in node.compute
    ]
    fits = [
        f.model_copy(update={"alpha_s": latency_s[f.op]})
        if latency_s and f.op in SYNC_OPS and f.op in latency_s and f.n_ranks == 2
        else f
        for f in node.intra_node
    ]
    update = {"compute": compute, "intra_node": fits}
    if latency_s and node.blocking_latency is not None and "functional_all_reduce" in latency_s:
        now = {"functional_collective_s": latency_s["functional_all_reduce"]}
        fsdp_ops = [latency_s[op] for op in ("all_gather", "reduce_scatter") if op in latency_s]
        if node.blocking_latency.plain_collective_s is not None and fsdp_ops:
            now["plain_collective_s"] = statistics.mean(fsdp_ops)  # as the profiler records it
        update["blocking_latency"] = node.blocking_latency.model_copy(update=now)
    node = node.model_copy(update=update)
    return cluster.model_copy(update={"node_types": [node, *cluster.node_types[1:]]})


def host_sync_latency(folder: Path) -> dict[str, float]:
    """Per-call collective latency after compute on 2 ranks, now (runtime/profiling/sync_latency.py)."""
    out = folder / "latency.json"
    for _ in range(3):  # gloo on this host sometimes aborts a rank at start-up; try again
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "runtime.profiling.sync_latency",
                "--out",
                str(out),
            ],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode == 0:
            return json.loads(out.read_text())
        print(f"sync-latency probe failed (exit {proc.returncode}):\n{proc.stderr[-1500:]}", file=sys.stderr)
    raise SystemExit("the sync-latency probe failed 3 times; see above")


RATE_SNIPPET = (
    "import sys, torch; torch.set_num_threads(1); sys.path.insert(0, {repo!r}); "
    "from runtime.profiling.cluster_bench import time_matmul; "
    "r = time_matmul('fp32', 1024, device=torch.device('cpu'), repeats=5); "
    "print(' '.join(str(r.flops_per_matmul / t) for t in r.times_s))"
)


def host_matmul_rates(ranks: int = 2) -> list[float]:
    """The cluster profiler's fp32 matmul benchmark run by ``ranks`` processes at once, now (FLOP/s each)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RATE_SNIPPET.format(repo=str(REPO))], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(ranks)
    ]
    return [float(v) for proc in procs for v in proc.communicate(timeout=120)[0].split()]


def make_case(model: str, layout: str, folder: Path, cluster_path: Path) -> dict:
    """Plan of ``layout`` with the static predictions written in, and what is needed to re-predict."""
    from planner.cost import estimate
    from planner.plan import save_plan
    from planner.profile import load_cluster_profile, load_model_profile

    plan = build_plan(model, layout)
    profile = load_model_profile(REPO / f"profiles/models/{model.replace(':', '-')}.json")
    cluster, config = load_cluster_profile(cluster_path), config_for_plan(plan)
    est = estimate(profile, cluster, config, global_batch=GLOBAL_BATCH, dtype=plan.training.dtype)
    before = estimate(_bare(profile), cluster, config, global_batch=GLOBAL_BATCH, dtype=plan.training.dtype)
    plan = plan.model_copy(update={"predictions": est.to_predictions(), "cluster_name": cluster.name})
    path = save_plan(plan, folder / f"{model.replace(':', '-')}_{layout}.json")
    return dict(
        name=path.stem,
        path=path,
        profile=profile,
        cluster=cluster,
        config=config,
        before_s=before.step_time_s,
        pred_s=est.step_time_s,
        pred_mem=est.peak_memory_bytes,
    )


def predict_at(case: dict, rate_flops_per_s: float, latency_s: dict[str, float] | None) -> float:
    """The case's predicted step time with the host's matmul rate and sync latency measured at the run."""
    from planner.cost import estimate

    return estimate(
        case["profile"],
        at_load(case["cluster"], rate_flops_per_s, latency_s),
        case["config"],
        global_batch=GLOBAL_BATCH,
        dtype="fp32",
    ).step_time_s


QUIET_IDLE = 0.9  # a launch starts once a 1-s window of /proc/stat shows both cores this idle ...
QUIET_WAIT_S = 60.0  # ... or after this long (the host's other users come in bursts)
IDLE_SEEN: list[float] = []  # the idle fraction each launch started at (printed with the tables)


def _idle_fraction(window_s: float = 1.0) -> float:
    """Fraction of all CPUs' time idle (idle + iowait) over ``window_s``, from /proc/stat (proc(5)); 1.0 off Linux."""

    def read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as fh:
                fields = [int(v) for v in fh.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return fields[3] + fields[4], sum(fields)

    a = read()
    time.sleep(window_s)
    b = read()
    if a is None or b is None or b[1] <= a[1]:
        return 1.0
    return (b[0] - a[0]) / (b[1] - a[1])


def wait_quiet(max_wait_s: float = QUIET_WAIT_S) -> float:
    """Wait until the host's CPUs are idle (``QUIET_IDLE``) or ``max_wait_s`` passed; the last idle fraction."""
    deadline = time.monotonic() + max_wait_s
    idle = _idle_fraction()
    while idle < QUIET_IDLE and time.monotonic() < deadline:
        idle = _idle_fraction()
    IDLE_SEEN.append(idle)
    return idle


def measure(plan_path: Path, folder: Path, steps: int, attempt: int, quiet_wait_s: float = 0.0) -> dict:
    """One ``stratagem launch`` of ``plan_path``; its summary record ({} when it failed). ``quiet_wait_s`` > 0:
    first wait up to that long for idle CPUs (:func:`wait_quiet`)."""
    if quiet_wait_s > 0:
        wait_quiet(quiet_wait_s)
    metrics = folder / f"{plan_path.stem}_{attempt}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "planner.cli.main",
            "launch",
            str(plan_path),
            "--steps",
            str(steps),
            "--metrics",
            str(metrics),
            "--timeout-s",
            "300",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        log_tail = (proc.stdout + proc.stderr)[-3000:]
        print(f"stratagem launch {plan_path.name} failed (exit {proc.returncode}); tail:\n{log_tail}", file=sys.stderr)
        return {}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records[-1]


def _ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.3g}"


HEADER = (
    f"{'plan':<16} {'before':>7} {'static':>7} {'at load (rate)':>15} {'+ sync latency':>15} "
    f"{'measured':>15} {'meas/pred':>9} {'min/static':>10} {'pred MiB':>8} {'meas MiB':>8} {'load':>5}"
)


def run_case(
    case: dict, folder: Path, steps: int, repeats: int, compare: dict | None = None, quiet_wait_s: float = 0.0
) -> tuple[str, float | None]:
    """Launch ``repeats`` times, each between host measurements (matmul rate, sync latency): (one table row,
    its min/static or None when every launch failed). ``compare``: the same plan's case under another cluster
    profile (``--compare``): its min/static is added."""
    preds, plain, times, peaks = [], [], [], []
    for i in range(repeats):
        rates, latency = host_matmul_rates(), host_sync_latency(folder)
        summary = measure(case["path"], folder, steps, i, quiet_wait_s) or measure(
            case["path"], folder, steps, i + 100, quiet_wait_s
        )
        if not summary:
            continue  # failed twice: the tail was printed
        rates += host_matmul_rates()
        plain.append(predict_at(case, statistics.median(rates), None))
        preds.append(predict_at(case, statistics.median(rates), latency))
        times.append(summary["measured_step_time_s"])
        peaks.append(summary["measured_peak_memory_bytes"])
    if not times:
        return f"{case['name']:<16} launch failed", None
    ratio = statistics.median(t / p for t, p in zip(times, preds))
    static = min(times) / case["pred_s"]  # a calibrated --cluster is judged on this (min of repeats)
    return (
        f"{case['name']:<16} {_ms(case['before_s']):>7} {_ms(case['pred_s']):>7} "
        f"{'/'.join(map(_ms, plain)):>15} {'/'.join(map(_ms, preds)):>15} {'/'.join(map(_ms, times)):>15} "
        f"{ratio:>8.2f}x {static:>9.2f}x "
        f"{case['pred_mem'] / 2**20:>8.3g} {max(peaks) / 2**20:>8.3g} {os.getloadavg()[0]:>5.1f}"
        + (f" {min(times) / compare['pred_s']:>9.2f}x" if compare else "")
    ), static


def print_headline(rows: list[tuple[str, float | None, str]]) -> None:
    """The held-out rows' min/static first (mean and max distance from 1, how many inside 0.8-1.25), then the
    rows the --cluster was calibrated on (in-sample), apart."""
    for label, keep in (("HELD OUT", "held out"), ("in-sample, not a headline:", "in-sample")):
        ratios = [r for _, r, role in rows if r is not None and role.startswith(keep)]
        if not ratios:
            print(f"{label} no rows")
            continue
        dist = [abs(r - 1) for r in ratios]
        inside = sum(0.8 <= r <= 1.25 for r in ratios)
        print(
            f"{label} {len(ratios)} rows: min/static {min(ratios):.2f}-{max(ratios):.2f}, mean |min/static - 1| "
            f"{statistics.fmean(dist):.1%}, max {max(dist):.1%}; {inside}/{len(ratios)} inside 0.8-1.25"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt:tiny,gpt:small")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="launches per plan")
    p.add_argument("--cluster", type=Path, default=CLUSTER, help="cluster profile for the predictions")
    p.add_argument(
        "--quiet-wait-s",
        type=float,
        default=0.0,
        help=f"before each launch wait up to this long for the CPUs to be {QUIET_IDLE:.0%} idle (shared hosts)",
    )
    p.add_argument(
        "--compare", type=Path, help="a second cluster profile: its min/static on the same launches is added (min/cmp)"
    )
    p.add_argument(
        "--fitted",
        default="",
        help="model/layout pairs the --cluster was calibrated on (calibrate_cpu.py passes its --runs): in-sample "
        "rows, reported apart from the held-out headline",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rt-vs-pred-") as tmp:
        folder = Path(tmp)
        pairs = [(m, lay) for m in args.models.split(",") for lay in args.layouts.split(",")]
        cases = [make_case(m, lay, folder, args.cluster) for m, lay in pairs]
        others: list[dict | None] = [None] * len(cases)
        if args.compare:
            (folder / "cmp").mkdir()
            others = [make_case(m, lay, folder / "cmp", args.compare) for m, lay in pairs]
        fitted = {tuple(r.split("/")) for r in args.fitted.split(",")} if args.fitted else set()
        rows = []
        for (model, layout), case, other in zip(pairs, cases, others):
            line, static = run_case(case, folder, args.steps, args.repeats, other, args.quiet_wait_s)
            role = "in-sample (a calibration run)" if (model, layout) in fitted else "held out"
            rows.append((line, static, role))
            print(f"... {line}", file=sys.stderr, flush=True)  # progress; the table follows, headline first
        print_headline(rows)
        print(
            "step times in ms; before = no wrapper overheads, no timing scale (the cost model before); static ="
            " now, with the cluster profile as shipped; at load = now, with the cluster's fp32 matmul rate measured"
            " around each launch (2 processes at once); + sync latency = also the collectives' per-call latency"
            " after compute measured before each launch; meas/pred = median of measured / the last; min/static ="
            " fastest measured / static (the check for a calibrated --cluster: 0.8-1.25); load = 1-min load average"
        )
        if args.compare:
            print(f"min/cmp = fastest measured / static prediction of --compare {args.compare}")
        print(HEADER + (f" {'min/cmp':>10}" if args.compare else "") + "  role")
        for line, _, role in rows:
            print(f"{line}  {role}")
        if IDLE_SEEN:
            print(f"CPU idle when the launches started: {', '.join(f'{v:.0%}' for v in IDLE_SEEN)}")


if __name__ == "__main__":
    main()
