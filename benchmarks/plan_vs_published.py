"""The planner against the published configuration, per SC21 Table 1 row, both under the same cost model.

For every Narayanan et al. SC21 Table 1 row (benchmarks/data/published_cases.csv): the published step time,
the cost model's estimate of the published configuration, the searched plan's estimate, and what the plan
changed. The closing note explains each predicted speed-up in one line from the two estimates' step-time
breakdowns (which terms shrank and what the plan changed to shrink them). Prints; never a timed test.

    .venv/bin/python benchmarks/plan_vs_published.py [--budget 30] [--rows 0,1,2] [--loaded-fabric]

``--loaded-fabric``: both estimates and the search on the profile with Selene's fabric load
(``planner.profile.load.FabricLoad``, ``SELENE_FABRIC_LOAD``: the inter-node bandwidth share of a job of that many
nodes, measured 0.37 at 384 nodes by SC21 §5.9), where the Table 1 runs ran. The default is the profile as
shipped (2-node nccl-tests bandwidth), on which the A100 kernel parameters were fitted to these rows.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cost_accuracy as ca  # noqa: E402

from planner.cost import estimate, with_gpus  # noqa: E402
from planner.model import parse_model  # noqa: E402
from planner.profile import build_gpt_profile  # noqa: E402
from planner.search import (  # noqa: E402
    SearchConfig,
    plan_search,
)

TERMS = (
    "forward",
    "backward",
    "recompute",
    "tp_comm",
    "pp_comm",
    "bubble",
    "dp_sync_exposed",
    "zero_comm",
    "optimizer",
)


def _choices(cfg) -> dict[str, object]:
    recompute = (
        cfg.recompute if isinstance(cfg.recompute, str) else ",".join(sorted(set(cfg.recompute.values()))) or "none"
    )
    return {
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "mb": cfg.micro_batch,
        "schedule": cfg.schedule,
        "v": cfg.virtual_stages,
        "zero": cfg.zero_stage,
        "sp": cfg.sequence_parallel,
        "recompute": recompute,
    }


def _changed(old, new) -> str:
    a, b = _choices(old), _choices(new)
    return ", ".join(f"{k} {a[k]}->{b[k]}" for k in a if a[k] != b[k]) or "nothing"


def _why(pub_bd: dict[str, float], plan_bd: dict[str, float], changed: str) -> str:
    """The terms that account for the speed-up, largest first (seconds per step), and the change."""
    deltas = sorted(((pub_bd.get(t, 0.0) - plan_bd.get(t, 0.0), t) for t in TERMS), reverse=True)
    gains = [f"{t} -{d:.2f} s" for d, t in deltas if d > 0.01][:3]
    costs = [f"{t} +{-d:.2f} s" for d, t in deltas if d < -0.01][:2]
    return f"{changed}: " + ", ".join(gains) + (f" (paid: {', '.join(costs)})" if costs else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=30.0, help="search budget per row, seconds")
    parser.add_argument("--rows", default=None, help="CSV row numbers to run, comma-separated (default: all)")
    parser.add_argument(
        "--loaded-fabric", action="store_true", help="estimate and search with Selene's fabric load (docstring)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    wanted = {int(x) for x in args.rows.split(",")} if args.rows else None
    cases = [
        c
        for c in ca.load_cases(ca.DEFAULT_CSV)
        if c.role == "calib" and c.cluster == "dgx-a100-80g" and (wanted is None or c.row in wanted)
    ]  # the SC21 Table 1 rows
    clusters: dict = {}
    notes = []
    fabric = "Selene's fabric load (FabricLoad)" if args.loaded_fabric else "the 2-node inter-node bandwidth"
    print(f"dgx-a100-80g with {fabric}")
    print(
        f"{'row':>3} {'model':<12} {'GPUs':>5} {'published':>9} {'pub.cfg':>8} {'plan':>8} {'speed-up':>8} "
        f"{'search':>7}  plan"
    )
    for case in cases:
        name = case.cluster + (ca.LOADED_FABRIC if args.loaded_fabric else "")
        if name not in clusters:
            clusters[name] = ca._load_cluster(name)
        cluster = with_gpus(clusters[name], case.gpus)
        profile = build_gpt_profile(
            parse_model(
                "gpt",
                layers=case.layers,
                hidden=case.hidden,
                heads=case.heads,
                vocab=case.vocab,
                max_seq=case.seq,
                dropout=0.1,
                tie_embeddings=True,
            ),
            seq_len=case.seq,
            dtype=case.dtype,
        )
        pub = estimate(profile, cluster, case.config, global_batch=case.global_batch, dtype=case.dtype)
        start = time.perf_counter()
        result = plan_search(
            profile,
            cluster,
            gpus=case.gpus,
            global_batch=case.global_batch,
            config=SearchConfig(budget_s=args.budget),
        )
        wall_s = time.perf_counter() - start
        best = result.best
        changed = _changed(case.config, best.config)
        model_name = case.label.split(" ")[1]
        print(
            f"{case.row:>3} {model_name:<12} {case.gpus:>5} {case.published_s:>8.2f}s {pub.step_time_s:>7.2f}s "
            f"{best.step_s:>7.2f}s {pub.step_time_s / best.step_s:>7.2f}x {wall_s:>6.1f}s  "
            f"{best.outer.summary()} [{result.status}]",
            flush=True,
        )
        notes.append(f"row {case.row} {model_name}: " + _why(pub.breakdown_s, best.estimate.breakdown_s, changed))
    print("\nWhy each plan is predicted faster than the published configuration (terms of the step time):")
    for line in notes:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
