"""ZeRO-3's FSDP2 collectives on CPU ranks pay the measured after-compute latency per call, counted per FSDP2
unit (``planner.cost.zero3.fsdp_call_latency_s``; ``BlockingLatency.plain_collective_s``); GPU profiles and
CPU profiles without the figure are unchanged, and the search prices it exactly as ``estimate`` does.

Hand-computed from the shipped measured profiles: gpt:tiny has 2 blocks (each its own unit) and 3 other
layers with parameters (embed, norm, head: the root unit), so per micro-batch at ``zero3_param_gathers = 2``
the runtime makes 3 units x (2 all-gathers + 1 reduce-scatter) calls (torch.profiler: 6
``c10d::_allgather_base_`` and 3 ``c10d::_reduce_scatter_base_`` per step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.calibrate import apply
from planner.cost import SYNC_PROBE_BYTES, ParallelConfig, collective_time, estimate, root_unit_layers
from planner.profile import BlockingLatency, load_cluster_profile, load_model_profile
from planner.search import (
    CandidateCosts,
    SearchConfig,
    build_problem,
    check_exact,
    enumerate_outer,
    extract_assignment,
    solve,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "profiles/models/gpt-tiny.json"
CPU = REPO / "profiles/hardware/local-cpu-2core.json"
FSDP = ParallelConfig(dp=2, zero_stage=3, micro_batch=4, num_micro_batches=1, overlap_grad_reduce=False)


def _with_plain(cluster, plain_s: float | None):
    node = cluster.node_types[0]
    blocking = BlockingLatency(functional_collective_s=1e-3, plain_collective_s=plain_s, source="test")
    return cluster.model_copy(update={"node_types": [node.model_copy(update={"blocking_latency": blocking})]})


def _zero_comm(cluster, config=FSDP) -> float:
    return estimate(load_model_profile(TINY), cluster, config, global_batch=8, dtype="fp32").breakdown_s["zero_comm"]


def _probe(cluster, op: str) -> float:
    node = cluster.node_types[0]
    return collective_time(cluster, op, SYNC_PROBE_BYTES, 2, node_type=node, spans_nodes=False, ranks_per_node=2)


def test_shipped_cpu_profile_has_the_plain_latency_and_gpu_profiles_none():
    cpu = load_cluster_profile(CPU).node_types[0].blocking_latency
    assert cpu is not None and cpu.plain_collective_s is not None and 1e-4 < cpu.plain_collective_s < 1e-2
    assert "plain_collective_s" in cpu.source
    a100 = load_cluster_profile(REPO / "profiles/hardware/dgx-a100-80g.json").node_types[0]
    assert a100.blocking_latency is None


def test_a_profile_from_before_the_field_loads_and_prices_zero3_by_the_fits(tmp_path):
    data = json.loads(CPU.read_text())
    del data["node_types"][0]["blocking_latency"]["plain_collective_s"]
    data.pop("content_hash")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    cluster = load_cluster_profile(old)
    assert cluster.node_types[0].blocking_latency.plain_collective_s is None
    assert _zero_comm(cluster) == pytest.approx(_zero_comm(_with_plain(cluster, None)))


def test_each_fsdp_unit_call_pays_the_latency_once():
    cluster = load_cluster_profile(CPU)
    assert root_unit_layers(load_model_profile(TINY).layers) == 3  # embed, norm, head
    plain = 2e-3
    ag, rs = _probe(cluster, "all_gather"), _probe(cluster, "reduce_scatter")
    # blocks: 2 x (2 gathers + 1 scatter), each L - a; the 3 root layers: their 3 x a per call become one L
    want = 2 * (2 * (plain - ag) + (plain - rs)) + (2 * (plain - 3 * ag) + (plain - 3 * rs))
    assert _zero_comm(_with_plain(cluster, plain)) - _zero_comm(_with_plain(cluster, None)) == pytest.approx(want)


def test_a_latency_under_the_fits_alpha_is_no_discount_per_call():
    cluster = load_cluster_profile(CPU)
    ag, rs = _probe(cluster, "all_gather"), _probe(cluster, "reduce_scatter")
    # each unit call costs at least the fit's alpha: blocks unchanged, the root's three alphas become one
    want = 2 * (-2 * ag) + (-2 * rs)
    got = _zero_comm(_with_plain(cluster, 0.0)) - _zero_comm(_with_plain(cluster, None))
    assert got == pytest.approx(want)


def test_other_layouts_do_not_move():
    cluster = load_cluster_profile(CPU)
    model = load_model_profile(TINY)
    for config in (
        ParallelConfig(dp=2, micro_batch=4, num_micro_batches=1, overlap_grad_reduce=False),
        ParallelConfig(dp=2, zero_stage=2, micro_batch=4, num_micro_batches=1, overlap_grad_reduce=False),
        ParallelConfig(tp=2, micro_batch=8, num_micro_batches=1, overlap_grad_reduce=False),
    ):
        a, b = (
            estimate(model, c, config, global_batch=8, dtype="fp32").step_time_s
            for c in (_with_plain(cluster, None), _with_plain(cluster, 2e-3))
        )
        assert a == pytest.approx(b)


def test_calibrated_alpha_scale_scales_the_plain_latency_too():
    cluster = _with_plain(load_cluster_profile(CPU), 1e-3)
    scaled = apply(cluster, {"intra_alpha_scale": 3.0}).node_types[0].blocking_latency
    assert scaled is not None and scaled.plain_collective_s == pytest.approx(3e-3)
    assert scaled.functional_collective_s == pytest.approx(3e-3)


@pytest.mark.parametrize("plain_s", [None, 2e-3])
def test_search_prices_the_latency_exactly_as_estimate(plain_s):
    """The ILP's ZeRO-3 terms at the solver's answer equal estimate's to 1e-9 (check_exact raises otherwise)."""
    profile = load_model_profile(TINY)
    cluster = _with_plain(load_cluster_profile(CPU), plain_s)
    config = SearchConfig(time_limit_s=30, allow=frozenset({"dp", "zero", "recompute"}))
    costs = CandidateCosts(profile, cluster, global_batch=8, config=config)
    outers = [
        o
        for o in enumerate_outer(
            cluster=cluster,
            gpus=2,
            global_batch=8,
            n_layers=len(profile.layers),
            n_blocks=2,
            tp_degrees=profile.tp_degrees,
            config=config,
        )
        if o.zero_stage == 3 and o.dp == 2
    ]
    assert outers
    for outer in outers:
        tables = costs.tables(outer)
        problem = build_problem(tables)
        result = solve(problem, config)
        assert result.status == "optimal", outer.summary()
        assignment = extract_assignment(problem)
        est = costs.estimate(costs.parallel_config(outer, tables, assignment))
        check_exact(tables, assignment, est, outer, result.objective_s)
        assert est.breakdown_s["zero_comm"] > 0


def test_cluster_profiler_records_the_mean_of_the_plain_fsdp_ops():
    from types import SimpleNamespace

    from runtime.profiling.cluster import _blocking_latency

    raw = SimpleNamespace(
        nproc_per_node=2,
        backend="gloo",
        sync_latency={"all_reduce": 8e-4, "all_gather": 6e-4, "reduce_scatter": 1e-3, "functional_all_reduce": 1.5e-3},
    )
    latency = _blocking_latency(raw)  # type: ignore[arg-type]
    assert latency is not None and latency.plain_collective_s == pytest.approx(8e-4)
    assert latency.functional_collective_s == 1.5e-3 and "plain_collective_s" in latency.source
    raw.sync_latency = {"all_reduce": 8e-4, "functional_all_reduce": 1.5e-3}  # a probe without the FSDP ops
    latency = _blocking_latency(raw)  # type: ignore[arg-type]
    assert latency is not None and latency.plain_collective_s is None
