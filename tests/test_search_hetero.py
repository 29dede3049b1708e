"""Whale's hardware-aware data parallelism in the search: dp replicas on different GPU types get batch
shares by speed, and the plan file says where each replica runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cli.common import resolve_cluster_path
from planner.cost import block_count
from planner.model import parse_model
from planner.plan import TrainingSettings, load_plan, save_plan, validate
from planner.profile import build_gpt_profile, load_cluster_profile
from planner.search import CandidateCosts, SearchConfig, build_plan, plan_search

A100, V100 = "dgx-a100-80g", "p3.16xlarge"
NO_PP = frozenset({"tp", "dp", "zero", "recompute", "mixed"})  # mixed without pipelines: replicas only


@pytest.fixture(scope="module")
def searched():
    cluster = load_cluster_profile(resolve_cluster_path("mixed-a100-v100"))
    spec = parse_model("gpt:megatron-1.7b")
    profile = build_gpt_profile(spec, seq_len=2048, dtype="fp16")
    config = SearchConfig(allow=NO_PP, top_k=3)
    result = plan_search(profile, cluster, gpus=32, global_batch=64, config=config)
    return cluster, spec, profile, config, result


def test_faster_replicas_get_more_of_the_batch(searched):
    cluster, _, profile, config, result = searched
    best = result.best
    assert result.status == "optimal"
    types = best.outer.replica_node_types
    assert types is not None and set(types) == {A100, V100}
    shares = dict(zip(types, best.config.batch_shares))
    assert shares[A100] > shares[V100]
    # the same degrees with equal shares (what ignoring the speed difference gives) is slower
    costs = CandidateCosts(profile, cluster, global_batch=64, config=config)
    even = replace(best.config, batch_shares=None)
    assert costs.estimate(even).step_time_s > best.step_s * 1.05
    # per type: the A100 replicas run more micro-batches, and the estimate records both types
    per_type = {t.node_type: t for t in best.estimate.per_replica_type}
    assert per_type[A100].micro_batches > per_type[V100].micro_batches


def test_plan_file_places_replicas_by_type(searched, tmp_path):
    cluster, spec, profile, _, result = searched
    plan = build_plan(
        result,
        model=spec,
        profile=profile,
        cluster=cluster,
        training=TrainingSettings(global_batch=64, seq_len=2048, dtype="fp16"),
    )
    validate(plan, 32)
    assert plan.mesh.axes == ["dp", "pp", "tp"]
    assert plan.replica_node_types == list(result.best.outer.replica_node_types)
    assert abs(sum(plan.batch_shares) - 1.0) < 1e-12
    # replica j is the j-th block of pp x tp ranks; the A100 replicas come first, as the A100 nodes do
    tp, pp = plan.mesh.size("tp"), plan.mesh.size("pp")
    first_v100 = plan.replica_node_types.index(V100)
    assert all(t == A100 for t in plan.replica_node_types[:first_v100])
    assert first_v100 * pp * tp == 16  # 2 DGX A100 nodes x 8 GPUs
    # predictions per replica type: each type's memory against its own capacity (80 GB A100, 16 GB V100)
    per_type = {t.node_type: t for t in plan.predictions.per_replica_type}
    assert set(per_type) == {A100, V100}
    assert per_type[A100].micro_batches > per_type[V100].micro_batches
    for t, capacity_gib in ((A100, 80), (V100, 16)):
        for sp in per_type[t].stages:
            assert sp.memory_capacity_bytes == capacity_gib * 2**30
            assert sp.peak_memory_bytes <= 0.9 * sp.memory_capacity_bytes
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").model_copy(update={"content_hash": None}) == plan


def test_prove_top_k_gives_the_k_best_candidates():
    """--prove-top-k: no candidate outside the ranked list has an optimum below the k-th plan (unless a
    ranked plan dominates it: same time terms, no more memory), each candidate solved on its own."""
    import math

    from planner.cost import with_gpus
    from planner.search import build_problem, dominates, enumerate_outer, memory_shortfall_bytes, solve

    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-a100-80g")), 4)
    profile = build_gpt_profile(
        parse_model("gpt", layers=3, hidden=128, heads=4, vocab=512, max_seq=64),
        seq_len=64,
        dtype="bf16",
        tp_degrees=[1, 2],
    )
    config = SearchConfig(top_k=4, exhaustive_top_k=True, allow=frozenset({"tp", "pp", "dp", "zero"}))
    result = plan_search(profile, cluster, gpus=4, global_batch=8, config=config)
    assert result.status == "optimal" and result.runners_up_proven and len(result.ranked) == 4
    costs = CandidateCosts(profile, cluster, global_batch=8, config=config)
    kth = result.ranked[-1].step_s
    ranked_tables = [costs.tables(c.outer) for c in result.ranked]
    below = 0
    for outer in enumerate_outer(
        cluster=cluster,
        gpus=4,
        global_batch=8,
        n_layers=len(profile.layers),
        n_blocks=block_count(profile),
        tp_degrees=[1, 2],
        config=config,
    ):
        tables = costs.tables(outer)
        if memory_shortfall_bytes(tables) > 0:
            continue
        solved = solve(build_problem(tables), config)
        if solved.objective_s is None or solved.objective_s >= kth * (1 - 1e-9):
            continue
        below += 1
        assert outer in [c.outer for c in result.ranked] or any(dominates(t, tables) for t in ranked_tables), (
            outer.summary(),
            solved.objective_s,
            kth,
        )
    assert below >= 3, below  # the ranked plans themselves (the 4th is the bound)
    assert math.isclose(result.best.step_s, min(c.step_s for c in result.ranked))


@pytest.mark.parametrize("preset,gpus,batch", [("gpt3-175b", 1024, 1536), ("megatron-1.7b", 32, 512)])
def test_parallel_jobs_find_the_same_optimum(preset, gpus, batch):
    """--jobs 2 solves two candidates at once (each its own CBC process): same proven optimum as one."""
    cluster = load_cluster_profile(resolve_cluster_path("dgx-a100-80g"))
    profile = build_gpt_profile(parse_model(f"gpt:{preset}"), seq_len=2048)
    one = plan_search(profile, cluster, gpus=gpus, global_batch=batch, config=SearchConfig(jobs=1))
    two = plan_search(profile, cluster, gpus=gpus, global_batch=batch, config=SearchConfig(jobs=2))
    assert one.status == two.status == "optimal"
    assert two.best.step_s == pytest.approx(one.best.step_s, rel=1e-9)
    assert all(a.step_s <= b.step_s for a, b in zip(two.ranked, two.ranked[1:]))
