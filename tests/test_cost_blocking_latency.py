"""TP collectives on CPU ranks pay the after-compute latency of DTensor's functional collectives
(planner.profile.load.BlockingLatency, planner/cost/compute.py ``_tp_comm_s``); GPU profiles are unchanged.

Hand-computed from the shipped measured profiles: the difference a measured latency makes is, per TP
call of the layer, that latency minus the fit's time at the probe's 1 KiB message.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.calibrate import apply
from planner.cost import SYNC_PROBE_BYTES, ParallelConfig, collective_time, estimate, layer_cost
from planner.profile import BlockingLatency, load_cluster_profile, load_model_profile

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "profiles/models/gpt-tiny.json"
CPU = REPO / "profiles/hardware/local-cpu-2core.json"


def _with_latency(cluster, latency_s: float | None):
    node = cluster.node_types[0]
    blocking = None if latency_s is None else BlockingLatency(functional_collective_s=latency_s, source="test")
    return cluster.model_copy(update={"node_types": [node.model_copy(update={"blocking_latency": blocking})]})


def _block_tp_comm(cluster, *, spans_nodes: bool = False) -> float:
    block = next(la for la in load_model_profile(TINY).layers if la.path == "blocks.0")
    return layer_cost(
        block,
        node=cluster.node_types[0],
        cluster=cluster,
        tp=2,
        style="split",
        recompute="none",
        sequence_parallel=False,
        micro_batch=4,
        flash_attention=False,
        dtype="fp32",
        tp_group_spans_nodes=spans_nodes,
    ).tp_comm_s


def test_shipped_cpu_profile_has_a_measured_latency_and_gpu_profiles_none():
    cpu = load_cluster_profile(CPU).node_types[0]
    assert cpu.blocking_latency is not None and "sync_latency.py" in cpu.blocking_latency.source
    a100 = load_cluster_profile(REPO / "profiles/hardware/dgx-a100-80g.json").node_types[0]
    assert a100.blocking_latency is None


def test_each_tp_call_pays_the_measured_latency_instead_of_the_fit_alpha():
    cluster = load_cluster_profile(CPU)
    bare, slow = _with_latency(cluster, None), _with_latency(cluster, 2e-3)
    probe = collective_time(
        cluster, "all_reduce", SYNC_PROBE_BYTES, 2, node_type=cluster.node_types[0], spans_nodes=False, ranks_per_node=2
    )
    # a GPT block without SP: 2 all-reduces forward (attention out, MLP out) and 2 backward (their inputs)
    assert _block_tp_comm(slow) - _block_tp_comm(bare) == pytest.approx(4 * (2e-3 - probe))
    # a latency under the fit's own is no discount: the fit's time stays the floor
    assert _block_tp_comm(_with_latency(cluster, 0.0)) == pytest.approx(_block_tp_comm(bare))


def test_whole_step_grows_by_the_latency_of_every_tp_call_and_other_layouts_do_not_move():
    model, cluster = load_model_profile(TINY), load_cluster_profile(CPU)
    bare, slow = _with_latency(cluster, None), _with_latency(cluster, 2e-3)
    tp = ParallelConfig(tp=2, micro_batch=8, num_micro_batches=1, overlap_grad_reduce=False)
    a, b = (estimate(model, c, tp, global_batch=8, dtype="fp32") for c in (bare, slow))
    assert b.step_time_s > a.step_time_s + 10 * (2e-3 - 1e-3)  # >= 13 TP calls per step on gpt:tiny
    dp = ParallelConfig(dp=2, micro_batch=4, num_micro_batches=1, overlap_grad_reduce=False)
    assert estimate(model, bare, dp, global_batch=8, dtype="fp32").step_time_s == pytest.approx(
        estimate(model, slow, dp, global_batch=8, dtype="fp32").step_time_s
    )


def test_calibrated_alpha_scale_scales_the_latency_too():
    cluster = _with_latency(load_cluster_profile(CPU), 1e-3)
    scaled = apply(cluster, {"intra_alpha_scale": 3.0}).node_types[0].blocking_latency
    assert scaled is not None and scaled.functional_collective_s == pytest.approx(3e-3)


def test_probe_message_size_matches_the_profiler():
    from runtime.profiling import sync_latency

    assert SYNC_PROBE_BYTES == sync_latency.MESSAGE_ELEMENTS * 4  # fp32
