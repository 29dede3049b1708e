"""The runtime's measured wrapper overheads and the timing scale in the cost model (planner/cost/framework.py).

Hand-computed from the numbers written in the tests or read from the shipped measured profile; the GPU
path (analytic profiles) must not move.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.cost import (
    ParallelConfig,
    chunk_overhead_s,
    dp_wrapper,
    estimate,
    layer_cost,
    layer_overhead_s,
    timings_scale,
)
from planner.profile import (
    ComputeFigure,
    LayerProfile,
    LayerTiming,
    RuntimeOverhead,
    ShardProfile,
    TimingStats,
    load_cluster_profile,
    load_model_profile,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "profiles/models/gpt-tiny.json"
CPU = REPO / "profiles/hardware/local-cpu-2core.json"

OVERHEAD = RuntimeOverhead(
    micro_batch=1,
    tp_forward_s=1e-3,
    tp_backward_s=2e-3,
    replicate_forward_s=3e-4,
    replicate_backward_s=4e-4,
    fully_shard_forward_s=5e-4,
    fully_shard_backward_s=6e-4,
    replicate_unit_forward_s=7e-5,
    replicate_unit_backward_s=8e-5,
    fully_shard_unit_forward_s=9e-5,
    fully_shard_unit_backward_s=1e-4,
    optimizer_step_s=1e-3,
    optimizer_step_dtensor_s=3e-3,
)


def _stats(t: float) -> TimingStats:
    return TimingStats(median_s=t, min_s=t, max_s=t, repeats=1, warmup=0)


def _block(overhead: RuntimeOverhead | None = OVERHEAD) -> LayerProfile:
    shard = ShardProfile(
        tp=1,
        params=100,
        param_bytes=400,
        fwd_flops_per_sample=1e6,
        bwd_flops_per_sample=2e6,
        saved_bytes_per_sample=0.0,
        timings=[LayerTiming(micro_batch=2, forward=_stats(0.01), backward=_stats(0.02))],
        time_origin="measured",
    )
    return LayerProfile(
        path="blocks.0",
        kind="block",
        signature="b",
        input_bytes_per_sample=0.0,
        output_bytes_per_sample=0.0,
        shards=[shard, shard.model_copy(update={"tp": 2})],
        tp_style="megatron_block",
        runtime_overhead=overhead,
    )


def test_dp_wrapper_follows_the_runtime_mapping():
    assert [dp_wrapper(1, 0), dp_wrapper(2, 0), dp_wrapper(2, 1), dp_wrapper(4, 3)] == [
        "none",
        "replicate",
        "fully_shard",
        "fully_shard",
    ]


def test_layer_overhead_terms_hand_computed():
    layer = _block()
    assert layer_overhead_s(layer, split_tp=False, wrapper="none") == (0.0, 0.0, 1e-3)
    fwd, bwd, opt = layer_overhead_s(layer, split_tp=True, wrapper="replicate")
    assert (fwd, bwd, opt) == pytest.approx((1e-3 + 3e-4, 2e-3 + 4e-4, 3e-3))
    # fully_shard: a block is its own unit, so it also pays the unit's fixed cost
    assert layer_overhead_s(layer, split_tp=False, wrapper="fully_shard") == pytest.approx(
        (5e-4 + 9e-5, 6e-4 + 1e-4, 3e-3)
    )
    assert layer_overhead_s(_block(None), split_tp=True, wrapper="fully_shard") == (0.0, 0.0, 0.0)


def test_layer_cost_adds_overheads_to_measured_timings_and_scales_them():
    cluster = load_cluster_profile(CPU)
    node = cluster.node_types[0]
    kw = dict(
        node=node,
        cluster=cluster,
        tp=2,
        style="split",
        recompute="none",
        sequence_parallel=False,
        micro_batch=2,
        flash_attention=False,
        dtype="fp32",
    )
    base = layer_cost(_block(), **kw)
    assert (base.forward_s, base.backward_s) == pytest.approx((0.01 + 1e-3, 0.02 + 2e-3))  # TP dispatch only
    cost = layer_cost(_block(), dp_wrapper="replicate", timings_scale=2.0, **kw)
    assert cost.forward_s == pytest.approx(2 * (0.01 + 1e-3 + 3e-4))
    assert cost.backward_s == pytest.approx(2 * (0.02 + 2e-3 + 4e-4))
    assert cost.optimizer_s == pytest.approx(2 * 3e-3)
    assert cost.tp_comm_s == base.tp_comm_s  # collectives come from the cluster profile, unscaled
    analytic = layer_cost(_block(), use_timings=False, dp_wrapper="replicate", timings_scale=2.0, **kw)
    assert analytic.optimizer_s == 0.0 and analytic.forward_s < 1e-3  # no measured term without timings


def test_timings_scale_is_the_ratio_of_the_two_measured_matmul_rates():
    model, cluster = load_model_profile(TINY), load_cluster_profile(CPU)
    node = cluster.node_types[0]
    ref = ComputeFigure(
        dtype="fp32", peak_flops_per_s=150e9, achieved_flops_per_s=120e9, origin="measured", source="test"
    )
    scaled = model.model_copy(update={"reference_matmul": ref})
    assert timings_scale(scaled, node) == pytest.approx(120e9 / node.compute_for("fp32").achieved_flops_per_s)
    assert timings_scale(scaled.model_copy(update={"reference_matmul": None}), node) == 1.0


def test_shipped_tiny_profile_carries_the_measurements():
    model = load_model_profile(TINY)
    assert model.reference_matmul is not None and model.reference_matmul.dtype == "fp32"
    for layer in model.layers:
        o = layer.runtime_overhead
        assert o is not None and o.optimizer_step_dtensor_s >= o.optimizer_step_s > 0
    assert all(layer.runtime_overhead.tp_forward_s > 0 for layer in model.layers if layer.kind == "block")


def _bare(model):
    return model.model_copy(
        update={
            "reference_matmul": None,
            "layers": [layer.model_copy(update={"runtime_overhead": None}) for layer in model.layers],
        }
    )


@pytest.mark.parametrize("zero", [0, 3])
def test_dp2_step_grows_by_the_hand_summed_overheads(zero):
    """dp 2, one micro-batch, no overlap: step(with) - step(bare) = s * (sum of layer overheads + one root unit
    + sum of DTensor AdamW steps); s = reference / cluster matmul rate."""
    model, cluster = load_model_profile(TINY), load_cluster_profile(CPU)
    node = cluster.node_types[0]
    cfg = ParallelConfig(dp=2, micro_batch=4, zero_stage=zero, overlap_grad_reduce=False)
    wrapper = dp_wrapper(2, zero)
    s = timings_scale(model, node)
    per_layer = [layer_overhead_s(layer, split_tp=False, wrapper=wrapper) for layer in model.layers]
    unit_f, unit_b = chunk_overhead_s(model, wrapper)
    timed = sum(f + b for f, b, _ in per_layer) + unit_f + unit_b
    optimizer = sum(o for _, _, o in per_layer)
    extra_measured = estimate(model, cluster, cfg, global_batch=8, dtype="fp32").step_time_s
    bare_model = _bare(model)
    bare = estimate(bare_model, cluster, cfg, global_batch=8, dtype="fp32").step_time_s
    # the bare estimate's measured layer timings are unscaled; scale them by hand for the comparison
    layer_times = sum(
        layer_cost(
            layer,
            node=node,
            cluster=cluster,
            tp=1,
            style="replicate",
            recompute="none",
            sequence_parallel=False,
            micro_batch=4,
            flash_attention=False,
            dtype="fp32",
        ).forward_s
        + layer_cost(
            layer,
            node=node,
            cluster=cluster,
            tp=1,
            style="replicate",
            recompute="none",
            sequence_parallel=False,
            micro_batch=4,
            flash_attention=False,
            dtype="fp32",
        ).backward_s
        for layer in bare_model.layers
    )
    expected = bare + (s - 1) * layer_times + s * (timed + optimizer)
    assert extra_measured == pytest.approx(expected, rel=1e-9)
    assert unit_f > 0 and optimizer > 0


def test_one_root_unit_per_chunk_with_pipelining():
    model, cpu = load_model_profile(TINY), load_cluster_profile(CPU)
    # 4 ranks in one node (the measured node has 2; the fits are reused as they are)
    cluster = cpu.model_copy(update={"node_types": [cpu.node_types[0].model_copy(update={"devices_per_node": 4})]})
    s = timings_scale(model, cluster.node_types[0])
    unit_f, unit_b = chunk_overhead_s(model, "replicate", s)
    with_dp = estimate(
        model, cluster, ParallelConfig(pp=2, dp=2, micro_batch=1, num_micro_batches=2), global_batch=4, dtype="fp32"
    )
    no_dp = estimate(
        model, cluster, ParallelConfig(pp=2, dp=1, micro_batch=1, num_micro_batches=4), global_batch=4, dtype="fp32"
    )
    for a, b in zip(with_dp.per_stage, no_dp.per_stage):
        layers = [model.layer(p) for p in a.module_paths]
        per_layer = [layer_overhead_s(layer, split_tp=False, wrapper="replicate") for layer in layers]
        assert a.time_s["forward"] - b.time_s["forward"] == pytest.approx(
            unit_f + s * sum(f for f, _, _ in per_layer), rel=1e-9
        )


def test_gpu_estimates_ignore_cpu_measurements():
    """Measured CPU overheads never reach a GPU cluster (timings apply on their device only)."""
    model = load_model_profile(TINY)
    cluster = load_cluster_profile(REPO / "profiles/hardware/dgx-a100-80g.json")
    cfg = ParallelConfig(tp=2, dp=2, micro_batch=2, num_micro_batches=2)
    a = estimate(model, cluster, cfg, global_batch=8, dtype="bf16")
    b = estimate(_bare(model), cluster, cfg, global_batch=8, dtype="bf16")
    assert a.step_time_s == b.step_time_s


def test_profiler_measures_wrapper_overheads_of_one_block():
    """The real measurement on a one-rank gloo group: DTensor dispatch of a split block is not free."""
    import torch

    from planner.model import parse_model
    from runtime.models import build_layer, example_batch, init_weights
    from runtime.profiling.overhead import measure_runtime_overhead, single_rank_group

    spec = parse_model("gpt:tiny")
    x, _ = example_batch(spec, 1, 16)
    with torch.no_grad():
        h = build_layer(spec, "embed")(x)

    def build():
        layer = build_layer(spec, "blocks.0")
        init_weights(layer, seed=0)
        return layer

    with single_rank_group():
        o = measure_runtime_overhead(build, spec, "blocks.0", h, first=False, splittable=True, warmup=1, repeats=5)
    # each figure is a difference of medians (with and without the wrapper), clipped at 0: on a busy host one
    # direction can come out 0, so each wrapper's forward + backward must be positive, not each alone
    assert o.micro_batch == 1 and o.optimizer_step_s > 0
    assert o.tp_forward_s + o.tp_backward_s > 0
    assert o.replicate_unit_forward_s + o.replicate_unit_backward_s > 0
    assert o.fully_shard_unit_forward_s + o.fully_shard_unit_backward_s > 0
