"""``plan --compare-to megatron`` against the published Megatron-LM configuration of every SC21 Table 1 row.

    .venv/bin/python benchmarks/compare_to_published.py [--rows 0,1,2] [--budget 120] [--jobs 2]

For each row of Narayanan et al. SC21 Table 1 (benchmarks/data/published_cases.csv, read as
benchmarks/cost_accuracy.py reads it: tp/pp/dp, micro-batch, interleaving and DDP overlap of
examples/sc21/run_table_1.sh) this writes the published run as Megatron-LM arguments, searches the plan for
the same model, GPUs, global batch and precision (fp16) on the shipped DGX A100 cluster profile, its memory
priced as Megatron-LM holds it (``plan --compare-to megatron`` implies ``--for megatron``), and
prints what ``stratagem plan --compare-to megatron "<args>"`` reports: the cost model's step time of the
published configuration, of the plan, and of the plan as Megatron can run it (its nearest Megatron
arguments), the predicted speed-up, peak memory, and how many Megatron flags change. ``meas s`` is the step
time the paper measured (from its TFLOP/s with SC21 eq. 3), beside the model's ``pub s`` for the same
configuration, so the model's error on each row is in view. All other figures are
predictions of the same cost model (its accuracy on these rows: benchmarks/cost_accuracy.py); nothing here
is measured on GPUs.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cost_accuracy import DEFAULT_CSV, Case, load_cases  # noqa: E402

from planner.cli.compare_cli import build_comparison  # noqa: E402
from planner.model import parse_model  # noqa: E402
from planner.plan import TrainingSettings  # noqa: E402
from planner.profile import (  # noqa: E402
    build_gpt_profile,
    load_cluster_profile,
)
from planner.search import (  # noqa: E402
    SearchConfig,
    build_plan,
    plan_search,
)


def megatron_args(case: Case) -> str:
    """The published run as Megatron-LM arguments (examples/sc21/run_table_1.sh's choices)."""
    c = case.config
    args = [
        f"--tensor-model-parallel-size {c.tp}",
        f"--pipeline-model-parallel-size {c.pp}",
        f"--num-layers {case.layers}",
        f"--hidden-size {case.hidden}",
        f"--num-attention-heads {case.heads}",
        f"--seq-length {case.seq}",
        f"--max-position-embeddings {case.seq}",
        f"--vocab-size {case.vocab}",
        f"--micro-batch-size {c.micro_batch}",
        f"--global-batch-size {case.global_batch}",
        "--fp16",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    ]
    if c.virtual_stages > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage {case.layers // (c.pp * c.virtual_stages)}")
    if c.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
    return " ".join(args)


def table_1_cases(path: Path) -> list[Case]:
    """The SC21 Table 1 rows of the csv (its source names both)."""
    with open(path, newline="", encoding="utf-8") as fh:
        sources = [r["source"] for r in csv.DictReader(fh)]
    return [c for c in load_cases(path) if "SC21" in sources[c.row] and "Table 1" in sources[c.row]]


def compare_row(case: Case, cluster, search: SearchConfig) -> dict:
    """Search the plan for ``case``'s model, GPUs and batch and compare it with the published configuration:
    the comparison record (``plan --compare-to megatron``), the search result and its wall time."""
    spec = parse_model(
        "gpt",
        layers=case.layers,
        hidden=case.hidden,
        heads=case.heads,
        vocab=case.vocab,
        max_seq=case.seq,
        tie_embeddings=True,
    )
    profile = build_gpt_profile(spec, seq_len=case.seq, dtype=case.dtype)
    start = time.perf_counter()
    result = plan_search(profile, cluster, gpus=case.gpus, global_batch=case.global_batch, config=search)
    plan = build_plan(
        result,
        model=spec,
        profile=profile,
        cluster=cluster,
        training=TrainingSettings(global_batch=case.global_batch, seq_len=case.seq, dtype=case.dtype),
    )
    record = build_comparison(plan, "megatron", megatron_args(case), profile=profile, cluster=cluster)
    return {"case": case, "record": record, "result": result, "wall_s": time.perf_counter() - start}


def format_row(row: dict) -> str:
    case, record, result = row["case"], row["record"], row["result"]
    gib = 2**30
    status = "opt" if result.status == "optimal" else f"gap{result.gap:.1%}"
    return (
        f"{case.label[:34]:34s} {case.published_s:8.2f} {record.current_step_time_s:8.2f} {record.plan_step_time_s:8.2f} "
        f"{record.exported_step_time_s:8.2f} {record.speedup:6.2f}x "
        f"{record.current_peak_memory_bytes / gib:6.1f} {record.exported_peak_memory_bytes / gib:6.1f} "
        f"{len(record.flag_changes):4d} {row['wall_s']:6.1f} {status:8s} {result.best.outer.summary()}"
    )


def default_search(budget_s: float = 120.0, jobs: int = 1) -> SearchConfig:
    """The search ``plan --compare-to megatron`` runs: memory priced as Megatron-LM holds it (``plan --for``)."""
    return SearchConfig(budget_s=budget_s, jobs=jobs, memory_semantics="textbook")


def dgx_a100():
    return load_cluster_profile(ROOT / "profiles" / "hardware" / "dgx-a100-80g.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--rows", default=None, help="indices into the Table 1 rows, comma-separated (default all)")
    parser.add_argument("--budget", type=float, default=120.0, help="search budget per row, seconds")
    parser.add_argument("--jobs", type=int, default=1, help="CBC processes per search")
    args = parser.parse_args()
    cases = table_1_cases(args.csv)
    if args.rows:
        cases = [cases[int(i)] for i in args.rows.split(",")]
    cluster, search = dgx_a100(), default_search(args.budget, args.jobs)
    print("SC21 Table 1 (published Megatron config) vs the Stratagem plan, cost-model predictions on dgx-a100-80g")
    print(
        f"{'row':34s} {'meas s':>8s} {'pub s':>8s} {'plan s':>8s} {'plan@M s':>8s} {'speedup':>7s} {'pubGiB':>6s} "
        f"{'newGiB':>6s} {'flags':>4s} {'wall s':>6s} {'search':8s} plan"
    )
    speedups = []
    for case in cases:
        row = compare_row(case, cluster, search)
        speedups.append(row["record"].speedup)
        print(format_row(row), flush=True)
    print(
        f"predicted speed-up of the plan (as Megatron arguments) over the published configuration: "
        f"min {min(speedups):.2f}x, max {max(speedups):.2f}x over {len(speedups)} rows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
