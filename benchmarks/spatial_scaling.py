"""Spatial parallelism against what Oyama et al. (TPDS 2021, arXiv:2007.12856) report, and its predicted
strong scaling (rows: benchmarks/data/spatial_published.csv).

1. The claim's shape: LBANN's CosmoFlow at 128^3 trains data parallel on 16 GB V100s (micro-batch 1 fits);
   at 512^3 (64x the voxels) it does not, and the spatial search plans it on 2,048 V100 with each sample
   split over a spatial group.
2. Strong scaling beyond the batch: CosmoFlow 512^3 at a fixed global batch of 64 on 64-2,048 GPUs (more GPUs
   per sample as the count grows); the predicted speed-up over the smallest count that fits. No published
   figure is compared (the paper's figures were not available to this session): no error is stated.

Cluster: aws-p3-16xlarge (8 x V100-16GB per node, 25 Gbit/s between nodes; Oyama et al. ran on Lassen and
ABCI, whose InfiniBand is faster, so spatial groups that span nodes cost more here).

    .venv/bin/python benchmarks/spatial_scaling.py
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

from planner.cli.common import resolve_cluster_path
from planner.core import StratagemError
from planner.cost import SpatialConfig, estimate_spatial, with_gpus
from planner.model import parse_model
from planner.profile import load_cluster_profile
from planner.search import plan_spatial_search
from runtime.profiling.model import profile_model_analytic

DATA = Path(__file__).resolve().parent / "data" / "spatial_published.csv"
GIB = 2**30


def _data_parallel(profile, cluster, gpus: int, batch: int):
    config = SpatialConfig(dp=gpus, sd=1, micro_batch=1, num_micro_batches=batch // gpus, layout={})
    return estimate_spatial(profile, with_gpus(cluster, gpus), config)


def claim_shape(cluster) -> None:
    rows = list(csv.DictReader(DATA.open()))
    print(f"published: {rows[0]['claim']} ({rows[0]['source'].split(',')[0]})")
    for preset, gpus, batch in (("cosmoflow:volume128", 64, 64), ("cosmoflow:volume512", 2048, 2048)):
        profile = profile_model_analytic(parse_model(preset), seq_len=1, dtype="fp16")
        dp = _data_parallel(profile, cluster, gpus, batch)
        start = time.perf_counter()
        try:
            best = plan_spatial_search(
                profile, with_gpus(cluster, gpus), gpus=gpus, global_batch=batch, memory_fraction=0.9
            ).best
            plan = (
                f"plan dp{best.config.dp} sd{best.config.sd} mb{best.config.micro_batch}: "
                f"{best.estimate.step_time_s:.3f} s/step, {best.estimate.peak_memory_bytes / GIB:.1f} GiB"
            )
        except StratagemError as exc:
            plan = f"no plan ({exc})"
        print(
            f"  {preset:22s} {gpus:5d} GPUs  data parallel needs {dp.peak_memory_bytes / GIB:6.1f} GiB "
            f"({'fits' if dp.fits else 'does not fit'} 16 GiB); {plan} "
            f"(searched in {time.perf_counter() - start:.2f} s)"
        )


def strong_scaling(cluster, preset: str = "cosmoflow:volume512", batch: int = 64) -> None:
    """Fixed global batch, more GPUs per sample: step time of the best plan at each GPU count, and its
    speed-up over the smallest GPU count that fits (Oyama et al.'s strong-scaling experiment, in shape)."""
    profile = profile_model_analytic(parse_model(preset), seq_len=1, dtype="fp16")
    print(f"strong scaling, {preset}, global batch {batch} (data parallel alone never fits):")
    print(f"  {'GPUs':>5s} {'plan':>24s} {'step s':>8s} {'grad sync s':>11s} {'speed-up':>8s}")
    first = None
    for gpus in (64, 128, 256, 512, 1024, 2048):
        try:
            best = plan_spatial_search(
                profile, with_gpus(cluster, gpus), gpus=gpus, global_batch=batch, memory_fraction=0.9
            ).best
        except StratagemError:
            print(f"  {gpus:5d} {'no plan fits':>24s}")
            continue
        first = first or best.estimate.step_time_s
        label = f"dp{best.config.dp} sd{best.config.sd} split {len(best.config.layout)}"
        sync = best.estimate.breakdown_s["dp_grad_sync"]
        print(
            f"  {gpus:5d} {label:>24s} {best.estimate.step_time_s:8.4f} {sync:11.4f} "
            f"{first / best.estimate.step_time_s:8.2f}"
        )
    print("  error vs published: not computed (no published speed-up figure in benchmarks/data)")


def main() -> None:
    cluster = load_cluster_profile(resolve_cluster_path("aws-p3-16xlarge"))
    claim_shape(cluster)
    strong_scaling(cluster)


if __name__ == "__main__":
    main()
