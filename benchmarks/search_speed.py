"""Search wall time and plan quality: the planner vs a Megatron-style grid search under the same cost model.

Cases: GPT-3 175B on 1,024 A100 (batch 1536, seq 2048); the Megatron-LM SC21 Table 1 models at their GPU
counts and batches (benchmarks/data/published_cases.csv); a 10,000-GPU case (1T parameters); the mixed
cluster (16 A100 + 16 V100) against the best plan that ignores the difference (planned as if every GPU
were the smaller V100, then placed in cluster order); a 3D U-Net on 512^3 single-channel volumes on 64 V100
(aws-p3-16xlarge), where data parallelism alone does not fit and the spatial search
(planner/search/spatial.py) splits layers; long context: a Llama-3-70B-shaped model at 131,072 tokens on
512 H100 (batch 128 sequences, 16.8M tokens: Llama 3's long-context batch, arXiv:2407.21783 §3.4.2) with
context parallelism searched, followed by the best plan at every cp degree (why it chose its cp); and two
Mixture-of-Experts cases on H100 (``moe``): Mixtral-8x7B on 64 GPUs (batch 256, seq 4096) and DeepSeek-V3
on 2,048 GPUs (batch 15360, seq 4096, the DeepSeek-V3 report's pre-training batch), the latter under a 7 s
search budget (a solve started before it ends finishes; the gap is printed).
Prints one row per case; never a timed test.

    .venv/bin/python benchmarks/search_speed.py [--quick] [--cases 175b,table1,10k,mixed,unet3d,long,moe]
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace

from planner.cli.common import resolve_cluster_path
from planner.core import StratagemError
from planner.cost import estimate, fill_stage_node_types, with_gpus
from planner.model import parse_model
from planner.profile import ClusterProfile, build_gpt_profile, load_cluster_profile
from planner.search import DEFAULT_DIMENSIONS, SearchConfig, grid_search, plan_search

MIXED_ALLOW = frozenset({"tp", "pp", "dp", "zero", "recompute", "mixed"})
# Narayanan et al. SC21 Table 1 (benchmarks/data/published_cases.csv): preset, GPUs, global batch.
TABLE_1 = [
    ("megatron-1.7b", 32, 512),
    ("megatron-3.6b", 64, 512),
    ("megatron-7.5b", 128, 512),
    ("megatron-18.4b", 256, 1024),
    ("megatron-39.1b", 512, 1536),
    ("megatron-76.1b", 1024, 1792),
    ("megatron-145.6b", 1536, 2304),
    ("megatron-310.1b", 1920, 2160),
    ("megatron-529.6b", 2520, 2520),
    ("megatron-1008b", 3072, 3072),
]


def _row(name: str, gpus: int, wall_s: float, plan_s: float, summary: str, status: str, grid) -> str:
    grid_s = f"{grid.step_time_s:9.3f}" if grid else "  no fit "
    ok = "yes" if grid is None or plan_s <= grid.step_time_s * (1 + 1e-9) else "NO"
    return f"{name:18s} {gpus:6d} {wall_s:8.2f} {plan_s:9.3f} {grid_s} {ok:>5s}  {status:28s} {summary}"


def run_case(
    name: str, preset: str, gpus: int, batch: int, config: SearchConfig, cluster: ClusterProfile, seq: int = 2048
) -> None:
    profile = build_gpt_profile(parse_model(preset if ":" in preset else f"gpt:{preset}"), seq_len=seq)
    start = time.perf_counter()
    try:
        result = plan_search(profile, cluster, gpus=gpus, global_batch=batch, config=config)
    except StratagemError as exc:  # e.g. a search budget that ran out on a loaded machine: the row says so
        print(f"{name:18s} {gpus:6d} {time.perf_counter() - start:8.2f}  no plan: {exc}", flush=True)
        return
    wall_s = time.perf_counter() - start
    grid = grid_search(profile, cluster, gpus=gpus, global_batch=batch, memory_fraction=config.memory_fraction)
    status = result.status if result.status == "optimal" else f"{result.status} gap<={result.gap:.2%}"
    print(
        _row(
            name,
            gpus,
            wall_s,
            result.best.step_s,
            result.best.outer.summary(),
            f"{status} ({result.candidates_solved} ILPs)",
            grid,
        ),
        flush=True,
    )


def run_mixed(config: SearchConfig) -> None:
    """16 A100 + 16 V100: the planner vs the best plan that ignores the difference (planned as if every GPU
    were a V100 — the smaller one, so it fits — then run with pp ranks placed in cluster order)."""
    cluster = load_cluster_profile(resolve_cluster_path("mixed-a100-v100"))
    profile = build_gpt_profile(parse_model("gpt:megatron-1.7b"), seq_len=2048, dtype="fp16")  # V100: no bf16
    gpus, batch = cluster.total_devices, 64
    config = replace(config, allow=MIXED_ALLOW)
    start = time.perf_counter()
    mixed = plan_search(profile, cluster, gpus=gpus, global_batch=batch, config=config)
    wall_s = time.perf_counter() - start
    v100 = cluster.nodes[-1].node_type
    uniform = cluster.model_copy(
        update={"nodes": [g.model_copy(update={"node_type": v100}) for g in cluster.nodes], "content_hash": None}
    )
    naive = plan_search(
        profile, uniform, gpus=gpus, global_batch=batch, config=replace(config, allow=MIXED_ALLOW - {"mixed"})
    )
    placed = fill_stage_node_types(cluster, replace(naive.best.config, stage_node_types=None))
    real = estimate(profile, cluster, placed, global_batch=batch, dtype=profile.dtype)
    a100 = cluster.nodes[0].node_type
    on_a100 = sum(len(st.module_paths) for st in mixed.best.estimate.per_stage if st.node_type == a100)
    print(
        f"\nmixed 16 x A100 + 16 x V100, gpt:megatron-1.7b fp16, batch {batch} (dims {sorted(MIXED_ALLOW)}): "
        f"search {wall_s:.2f} s, {mixed.status}"
    )
    print(f"  planner (node type per stage) : {mixed.best.step_s:8.3f} s  {mixed.best.outer.summary()}")
    print(
        f"     layers per stage: {[(st.node_type[:4], len(st.module_paths)) for st in mixed.best.estimate.per_stage]}"
        f" -> {on_a100} of {len(profile.layers)} layers on A100"
    )
    print(
        f"  ignoring the difference       : {real.step_time_s:8.3f} s  {naive.best.outer.summary()} "
        f"(planned as all-V100, placed in cluster order; fits={real.fits_in_memory})"
    )
    # Whale's hardware-aware data parallelism alone (no pipeline): replicas on both types, shares by speed
    start = time.perf_counter()
    reps = plan_search(
        profile, cluster, gpus=gpus, global_batch=batch, config=replace(config, allow=MIXED_ALLOW - {"pp"})
    )
    wall_s = time.perf_counter() - start
    even = estimate(
        profile, cluster, replace(reps.best.config, batch_shares=None), global_batch=batch, dtype=profile.dtype
    )
    shares = {
        t: round(s * batch)
        for t, s in zip(reps.best.config.replica_node_types or (), reps.best.config.batch_shares or ())
    }
    print(
        f"  dp replicas only (no pp)      : {reps.best.step_s:8.3f} s  {reps.best.outer.summary()} "
        f"(samples per replica {shares}; search {wall_s:.2f} s, {reps.status})"
    )
    print(f"     same degrees, equal shares : {even.step_time_s:8.3f} s")
    # every dimension the search has (tp, pp, dp, ZeRO, recompute, sp, interleaving, GPipe, layouts, mixed)
    start = time.perf_counter()
    full = plan_search(
        profile, cluster, gpus=gpus, global_batch=batch, config=replace(config, allow=DEFAULT_DIMENSIONS)
    )
    print(
        f"  full dimension set            : {full.best.step_s:8.3f} s  {full.best.outer.summary()} "
        f"(search {time.perf_counter() - start:.2f} s, {full.status}, {full.candidates_solved} ILPs)"
    )


def run_unet3d(gpus: int = 64, batch: int = 64) -> None:
    """3D U-Net 512^3 on 64 V100: analytic profile + spatial search wall time, and why layers are split."""
    from planner.cost import SpatialConfig, estimate_spatial
    from planner.search import plan_spatial_search
    from runtime.profiling.model import profile_model_analytic

    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("aws-p3-16xlarge")), gpus)
    start = time.perf_counter()
    profile = profile_model_analytic(parse_model("unet3d:volume512"), seq_len=1, dtype="fp16")
    profiled_s = time.perf_counter() - start
    result = plan_spatial_search(profile, cluster, gpus=gpus, global_batch=batch, memory_fraction=0.9)
    wall_s = time.perf_counter() - start
    dp_only = estimate_spatial(
        profile, cluster, SpatialConfig(dp=gpus, sd=1, micro_batch=1, num_micro_batches=batch // gpus, layout={})
    )
    best = result.best
    gib = 2**30
    print(
        f"{'unet3d 512^3 V100':18s} {gpus:6d} {wall_s:8.2f} {best.estimate.step_time_s:9.3f} {'':9s} {'':>5s}  "
        f"{result.status:28s} dp{best.config.dp} sd{best.config.sd} mb{best.config.micro_batch}"
        f"x{best.config.num_micro_batches}, {len(best.config.layout)}/{len(profile.layers)} layers split"
    )
    print(
        f"  planned in {wall_s:.2f} s (analytic profile {profiled_s:.2f} s, search {result.wall_time_s:.2f} s); "
        f"peak memory {best.estimate.peak_memory_bytes / gib:.1f} GiB of {best.estimate.capacity_bytes / gib:.0f}; "
        f"data parallel alone needs {dp_only.peak_memory_bytes / gib:.0f} GiB per GPU"
    )


def run_long_context(config: SearchConfig) -> None:
    """Llama-3-70B shape at 131,072 tokens on 512 H100: the search with cp, then the best plan per cp."""
    from planner.search import best_per_cp, format_cp_table

    cluster = load_cluster_profile(resolve_cluster_path("dgx-h100"))
    profile = build_gpt_profile(parse_model("llama:llama3-70b"), seq_len=131072)
    gpus, batch = 512, 128
    config = replace(config, flash_attention=True)
    start = time.perf_counter()
    result = plan_search(profile, cluster, gpus=gpus, global_batch=batch, config=config)
    wall_s = time.perf_counter() - start
    status = result.status if result.status == "optimal" else f"{result.status} gap<={result.gap:.2%}"
    print(
        _row(
            "llama3-70b 128k",
            gpus,
            wall_s,
            result.best.step_s,
            result.best.outer.summary(),
            f"{status} ({result.candidates_solved} ILPs)",
            None,
        ).replace("  no fit ", "  (no cp)"),
        flush=True,
    )
    est = result.best.estimate
    print(
        f"  {est.tokens_per_s / gpus:.0f} tokens/s per GPU, MFU {est.mfu:.1%} (causal attention FLOPs), "
        f"peak memory {est.peak_memory_bytes / 2**30:.1f} GiB"
    )
    start = time.perf_counter()
    rows = best_per_cp(profile, cluster, gpus=gpus, global_batch=batch, config=config)
    print(f"\nbest plan per context-parallel degree ({time.perf_counter() - start:.1f} s, one exact search per cp):")
    for line in format_cp_table(rows):
        print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="175b,table1,10k,mixed,unet3d,long,moe")
    parser.add_argument("--time-limit", type=float, default=30.0, help="CBC limit per ILP, seconds")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="search budget per case, seconds")
    parser.add_argument("--jobs", type=int, default=1, help="candidates solved in parallel (CBC processes)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    config = SearchConfig(
        time_limit_s=args.time_limit, top_k=args.top_k, allow=DEFAULT_DIMENSIONS, budget_s=args.budget, jobs=args.jobs
    )
    cluster = load_cluster_profile(resolve_cluster_path("dgx-a100-80g"))
    cases = set(args.cases.split(","))
    print(f"{'case':18s} {'GPUs':>6s} {'search_s':>8s} {'plan_s':>9s} {'grid_s':>9s} {'<=grid':>5s}  status / strategy")
    if "175b" in cases:
        run_case("gpt3-175b", "gpt3-175b", 1024, 1536, config, cluster)
    if "table1" in cases:
        for preset, gpus, batch in TABLE_1:
            run_case(preset, preset, gpus, batch, config, cluster)
    if "10k" in cases:
        run_case("1T on 10k GPUs", "megatron-1008b", 10_000, 10_000, config, cluster)
    if "mixed" in cases:
        run_mixed(config)
    if "unet3d" in cases:
        run_unet3d()
    if "long" in cases:
        run_long_context(config)
    if "moe" in cases:  # Mixture-of-Experts: ep and etp searched too (planner.search.space.expert_layouts)
        h100 = load_cluster_profile(resolve_cluster_path("dgx-h100"))
        run_case("mixtral-8x7b", "moe:mixtral-8x7b", 64, 256, config, h100, seq=4096)
        run_case("deepseek-v3", "moe:deepseek-v3", 2048, 15360, replace(config, budget_s=7.0), h100, seq=4096)


if __name__ == "__main__":
    main()
