"""``stratagem tune suggest``: the next configurations worth measuring, or stop with the measured best.

Example (one round of the loop; the user runs ``next.csv``'s rows on their own trainer, appends the measured step
times to ``runs.csv`` and asks again)::

    stratagem tune suggest --model gpt:gpt2 --cluster dgx-h100 --gpus 8 --global-batch 64 --seq 1024 \\
        --runs runs.csv --k 2 --out next.csv

``runs.csv`` has ``stratagem calibrate``'s columns (it may hold only the header); ``--candidates`` the same
columns without ``step_time_s``. ``next.csv`` gets the suggested rows with their predicted step time, its
uncertainty and the chance each beats the measured best; on stop it holds only the header. How the uncertainty
and the stop are decided: ``planner/tune/suggest.py``.
"""

from __future__ import annotations

import argparse
import csv
import io

from planner.calibrate import CANDIDATE_COLUMNS, DIMS, OPTIONAL, load_candidates_csv, load_runs_csv, run_columns
from planner.core import DTYPES, atomic_write_text
from planner.profile import load_cluster_profile
from planner.tune import Suggestion, Target, label, suggest

from .common import (
    DefaultsHelpFormatter,
    check_out_path,
    float_in,
    int_in,
    memory_fraction_of,
    nonempty_path,
    out_path,
    resolve_cluster_path,
)
from .model_args import add_model_arguments, spec_from_args

PREDICTION_COLUMNS = ("predicted_step_time_s", "uncertainty_rel", "p_better", "expected_gain_s")
# step_time_s is there, empty, to be filled in by whoever measures the row (then the row is a run)
COLUMNS = (*CANDIDATE_COLUMNS[:1], *DIMS, *CANDIDATE_COLUMNS[1:], *OPTIONAL, "step_time_s", *PREDICTION_COLUMNS)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "suggest",
        help="the configurations worth measuring next (or stop), from the runs measured so far",
        description="Calibrate the cluster on the measured runs, re-price every candidate configuration and "
        "write the k most worth measuring next (largest expected gain over the measured best, with the "
        "cross-validated uncertainty), or print 'stop' when none is likely to beat the measured best.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_arguments(p)
    add_job_arguments(p)
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype of the runs")
    p.add_argument(
        "--runs",
        required=True,
        type=nonempty_path,
        help="measured runs so far (calibrate's CSV columns; a file with only the header is no runs)",
    )
    p.add_argument(
        "--candidates",
        type=nonempty_path,
        default=None,
        help="the configurations you can run (the runs columns without step_time_s); default: every uniform "
        "configuration (tp inside a node, pp, dp, micro-batch, 1F1B/interleaved, recompute none/full, ZeRO 0/1, sp)",
    )
    p.add_argument("--k", type=int_in(1, 64), default=2, help="configurations to suggest, count")
    p.add_argument("--out", required=True, type=out_path, help="the suggested configurations (CSV)")
    p.set_defaults(func=run)


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The job both tune commands take: cluster, GPUs, batch, sequence and the memory a configuration may use."""
    p.add_argument("--cluster", required=True, help="shipped cluster name or a cluster profile path")
    p.add_argument("--gpus", required=True, type=int_in(1, 1_000_000), help="GPUs (CPU ranks) of the job, count")
    p.add_argument("--global-batch", required=True, type=int_in(1, 1 << 24), help="samples per step, count")
    p.add_argument("--seq", required=True, type=int_in(1, 1 << 24), help="tokens per sample")
    p.add_argument("--memory-fraction", type=float_in(0.05, 1.0), default=None, help="share of device memory a "
                   "configuration may use")  # fmt: skip
    p.add_argument("--memory-margin", type=float_in(0.0, 0.95), default=None, help="share of device memory kept free")


def run(args: argparse.Namespace) -> int:
    cluster_path = resolve_cluster_path(args.cluster)
    inputs = {"--cluster": cluster_path, "--runs": args.runs}
    if args.candidates is not None:
        inputs["--candidates"] = args.candidates
    check_out_path(args.out, inputs=inputs)
    spec = spec_from_args(args, max_seq=args.seq)
    target = Target(
        model=args.model, spec=spec, seq=args.seq, gpus=args.gpus, global_batch=args.global_batch, dtype=args.dtype
    )
    runs = load_runs_csv(args.runs, allow_empty=True)
    candidates = load_candidates_csv(args.candidates) if args.candidates is not None else None
    cluster = load_cluster_profile(cluster_path)
    result = suggest(target, cluster, runs, candidates=candidates, k=args.k, memory_fraction=memory_fraction_of(args))
    for line in report_lines(result):
        print(line)
    atomic_write_text(args.out, suggestion_csv(result))
    print(f"wrote {args.out} ({len(result.next)} configuration{'s' if len(result.next) != 1 else ''})")
    return 0


def report_lines(result: Suggestion) -> list[str]:
    cal = result.calibration
    lines = [
        f"calibration: {cal.note}",
        f"uncertainty: {'none yet' if cal.sigma is None else f'{cal.sigma:.1%}'} ({cal.sigma_source})",
        f"candidates: {result.candidates} priced, {result.unfit} predicted not to fit, {result.measured} measured",
    ]
    if result.best is not None:
        lines.append(f"measured best: {result.best.step_time_s:.4g} s  {label(result.best.config)}")
    if result.stop:
        lines.append(f"stop: {result.reason}")
        return lines
    lines.append(f"next ({result.reason}):")
    for s in result.next:
        odds = "" if s.p_better is None else f"  P(better) {s.p_better:.0%}  gain {s.expected_gain_s:.3g} s"
        sigma = "" if s.sigma is None else f" +- {s.sigma:.1%}"
        lines.append(f"  {label(s.run.config):40s} predicted {s.predicted_s:.4g} s{sigma}{odds}")
    return lines


def suggestion_csv(result: Suggestion) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    writer.writeheader()
    for s in result.next:
        writer.writerow(
            {
                **run_columns(s.run),
                "step_time_s": "",
                "predicted_step_time_s": f"{s.predicted_s:.6g}",
                "uncertainty_rel": "" if s.sigma is None else f"{s.sigma:.4f}",
                "p_better": "" if s.p_better is None else f"{s.p_better:.4f}",
                "expected_gain_s": "" if s.expected_gain_s is None else f"{s.expected_gain_s:.6g}",
            }
        )
    return buf.getvalue()
