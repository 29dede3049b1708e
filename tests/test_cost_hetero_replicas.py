"""estimate() with dp replicas on different node types (ParallelConfig.replica_node_types): reduction to the
ordinary estimate, formula (H) assembled by hand from the per-type records, the DP link, and errors."""

import dataclasses
from pathlib import Path

import pytest

from planner.core import DDP_BUCKET_BYTES, StratagemError
from planner.cost import (
    ParallelConfig,
    collective_time,
    estimate,
    pipeline_step_time,
    proportional_shares,
    replica_micro_batches,
    with_gpus,
)
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile

HW = Path(__file__).resolve().parents[1] / "profiles" / "hardware"
MIXED = load_cluster_profile(HW / "mixed-a100-v100.json")
A100, V100 = "dgx-a100-80g", "p3.16xlarge"
TYPES = (A100, A100, V100, V100)
GPT = build_gpt_profile(parse_model("gpt:megatron-1.7b"), seq_len=2048, dtype="fp16")


def _mixed(shares=None, micro_batch=1, **kw) -> ParallelConfig:
    return ParallelConfig(
        tp=8, pp=1, dp=4, micro_batch=micro_batch, replica_node_types=TYPES, batch_shares=shares, **kw
    )


@pytest.mark.parametrize(
    "tp,pp,dp,schedule,v", [(2, 2, 4, "1f1b", 1), (2, 2, 2, "interleaved_1f1b", 2), (8, 1, 2, "1f1b", 1)]
)
def test_one_type_with_equal_shares_is_the_ordinary_estimate(tp, pp, dp, schedule, v):
    cluster = with_gpus(load_cluster_profile(HW / "dgx-a100-80g.json"), tp * pp * dp)
    gb, mb = 32, 2
    base = ParallelConfig(
        tp=tp, pp=pp, dp=dp, micro_batch=mb, num_micro_batches=gb // (dp * mb), schedule=schedule, virtual_stages=v
    )
    ref = estimate(GPT, cluster, base, global_batch=gb, dtype="fp16")
    est = estimate(
        GPT, cluster, dataclasses.replace(base, replica_node_types=(A100,) * dp), global_batch=gb, dtype="fp16"
    )
    for name in ("step_time_s", "mfu", "hfu", "peak_memory_bytes", "model_tflops_per_gpu", "tokens_per_s"):
        assert getattr(est, name) == pytest.approx(getattr(ref, name), rel=1e-12, abs=0)
    assert est.fits_in_memory == ref.fits_in_memory
    assert est.breakdown_s == pytest.approx(ref.breakdown_s, rel=1e-12, abs=1e-15)
    assert [rk.tail_s for rk in est.per_rank] == pytest.approx([rk.tail_s for rk in ref.per_rank], rel=1e-12)
    assert [rk.memory.peak_bytes for rk in est.per_rank] == pytest.approx(
        [rk.memory.peak_bytes for rk in ref.per_rank], rel=1e-12
    )
    (only,) = est.per_replica_type
    assert (only.node_type, only.replicas, only.micro_batches) == (A100, tuple(range(dp)), gb // (dp * mb))
    assert ref.per_replica_type == ()


def test_proportional_shares_largest_remainder():
    # fp16 achieved: A100 230.88, V100 95 TFLOP/s; 64 micro-batches: ideal 22.67, 22.67, 9.33, 9.33
    assert proportional_shares(MIXED, list(TYPES), 64, 1, dtype="fp16") == (23, 23, 9, 9)
    # 4 micro-batches of 2 samples: ideal 1.42, 1.42, 0.58, 0.58 -> floors 1,1,1,1 (at least one each)
    assert proportional_shares(MIXED, list(TYPES), 8, 2, dtype="fp16") == (1, 1, 1, 1)
    # 6: ideal 2.13, 2.13, 0.87, 0.87 -> 2, 2, 1, 1
    assert proportional_shares(MIXED, list(TYPES), 6, 1, dtype="fp16") == (2, 2, 1, 1)
    with pytest.raises(StratagemError, match="bf16"):
        proportional_shares(MIXED, list(TYPES), 64, 1, dtype="bf16")


def test_mixed_step_is_formula_h_and_speed_shares_beat_equal_shares():
    counts = proportional_shares(MIXED, list(TYPES), 64, 1, dtype="fp16")
    fast = estimate(GPT, MIXED, _mixed(tuple(c / 64 for c in counts)), global_batch=64, dtype="fp16")
    equal = estimate(GPT, MIXED, _mixed(), global_batch=64, dtype="fp16")
    assert fast.step_time_s < equal.step_time_s
    for est, (m_a, m_v) in ((fast, (23, 9)), (equal, (16, 16))):
        a, v = est.per_replica_type
        assert (a.node_type, a.replicas, a.micro_batches) == (A100, (0, 1), m_a)
        assert (v.node_type, v.replicas, v.micro_batches) == (V100, (2, 3), m_v)
        assert a.batch_share_total + v.batch_share_total == pytest.approx(1.0)
        # V100: 125 vs 312 TFLOP/s peak, 900 vs 2039 GB/s HBM: its micro-batch takes longer
        assert v.per_rank[0].microbatch_s > 1.5 * a.per_rank[0].microbatch_s
        # pp = 1: (P) is m_t * T_t; step (H) = max_t pipeline_t + max_{t,r} tail_{t,r}
        for t in (a, v):
            assert t.pipeline_s == pytest.approx(t.micro_batches * t.per_rank[0].microbatch_s, rel=1e-12)
            assert t.pipeline_s == pytest.approx(
                pipeline_step_time([r.microbatch_s for r in t.per_rank], t.micro_batches), rel=1e-12
            )
        tail = max(r.tail_s for t in (a, v) for r in t.per_rank)
        assert est.step_time_s == pytest.approx(max(a.pipeline_s, v.pipeline_s) + tail, rel=1e-12)
        critical = max((a, v), key=lambda t: t.pipeline_s + t.tail_s)
        assert est.per_rank == critical.per_rank
        assert sum(x for k, x in est.breakdown_s.items() if k != "dp_sync_overlapped") == pytest.approx(est.step_time_s)
    assert equal.per_rank[0].node_type == V100 and fast.per_rank[0].node_type == A100


def test_mixed_gradient_sync_runs_on_the_inter_node_link():
    est = estimate(GPT, MIXED, _mixed(micro_batch=8), global_batch=64, dtype="fp16")
    a, v = est.per_replica_type
    # tp = 8 fills a node: the DP group is 4 ranks, one per node. Flat ring over the inter-node fit
    # (alpha 296.4 us for its 16-rank ring = 30 steps; bus bw 2.8 GB/s per node, 1/8 of it per rank,
    # collectives._flat_link), 2(n-1) = 6 latency steps, bus factor 2(n-1)/n = 1.5, per 25 MiB bucket.
    # Layers that cannot be tensor-split (the final norm) are replicated over the TP group and, on batch slices
    # of the micro-batch of 8, sync over the dp x tp group instead: 32 ranks, 8 per node, at the slower node
    # type's time (V100's intra-node steps).
    wide_bytes = 2 * sum(layer.shards[0].params for layer in GPT.layers if layer.tp_style == "none")
    split_bytes = a.per_rank[0].memory.params - wide_bytes  # fp16: 2 bytes per parameter, weights and grads
    per_bucket_s = 6 * 2.964e-4 / 30 + 1.5 * DDP_BUCKET_BYTES / (2.8e9 / 8)
    wide_s = {
        t: collective_time(MIXED, "all_reduce", DDP_BUCKET_BYTES, 32, node_type=t, spans_nodes=True, ranks_per_node=8)
        for t in (A100, V100)
    }
    assert wide_s[V100] > wide_s[A100]
    expected_s = (split_bytes * per_bucket_s + wide_bytes * wide_s[V100]) / DDP_BUCKET_BYTES
    assert a.per_rank[0].dp_sync_s == pytest.approx(expected_s, rel=1e-10)
    assert v.per_rank[0].dp_sync_s == a.per_rank[0].dp_sync_s
    # at micro-batch 1 the replicated norm runs on the whole micro-batch on every TP rank: it syncs over dp
    whole = estimate(GPT, MIXED, _mixed(), global_batch=64, dtype="fp16").per_replica_type[0]
    assert whole.per_rank[0].dp_sync_s == pytest.approx(a.per_rank[0].memory.params * per_bucket_s / DDP_BUCKET_BYTES)
    # exposed against each type's own backward window (the V100's is longer: less exposed)
    assert v.per_rank[0].dp_sync_exposed_s < a.per_rank[0].dp_sync_exposed_s


def test_mixed_flops_memory_and_micro_batches():
    est = estimate(GPT, MIXED, _mixed((0.375, 0.375, 0.125, 0.125)), global_batch=64, dtype="fp16")
    peak_flops = 8 * (2 * 312e12 + 2 * 125e12)  # tp x (each replica's type's fp16 peak)
    assert est.mfu == pytest.approx(est.model_tflops_per_gpu * 1e12 * 32 / peak_flops, rel=1e-12)
    assert est.peak_memory_bytes == max(r.memory.peak_bytes for t in est.per_replica_type for r in t.per_rank)
    assert {r.memory.capacity for t in est.per_replica_type for r in t.per_rank} == {80 * 2**30, 16 * 2**30}
    assert replica_micro_batches(_mixed((0.375, 0.375, 0.125, 0.125)), 64) == (24, 24, 8, 8)
    assert [t.micro_batches for t in est.per_replica_type] == [24, 8]


@pytest.mark.parametrize(
    "config,match",
    [
        (_mixed(), "names 4 node types for dp=2"),
        (ParallelConfig(tp=8, dp=4, replica_node_types=(A100, A100, V100, "tpu-v4")), "not in cluster"),
        (ParallelConfig(tp=8, dp=4, replica_node_types=(A100, V100, V100, V100)), "need 24 devices"),
        (_mixed((0.3, 0.3, 0.2, 0.2)), "not a whole number"),
        (_mixed((0.5, 0.5, 0.25, 0.25)), "summing to 1"),
        (ParallelConfig(tp=4, pp=2, dp=4, replica_node_types=TYPES, stage_node_types=(A100, V100)), "not both"),
        (_mixed(zero_stage=3), "ZeRO-3"),
        (
            ParallelConfig(
                tp=4,
                pp=2,
                dp=4,
                schedule="interleaved_1f1b",
                virtual_stages=2,
                replica_node_types=TYPES,
                batch_shares=(0.375, 0.375, 0.140625, 0.109375),
            ),
            "multiple of pp=2",
        ),
    ],
)
def test_bad_replica_configs_raise_one_line_errors(config, match):
    dp = 2 if match.startswith("names") else config.dp
    with pytest.raises(StratagemError, match=match) as err:
        estimate(GPT, MIXED, dataclasses.replace(config, dp=dp), global_batch=64, dtype="fp16")
    assert "\n" not in str(err.value) and ";" in str(err.value)


def test_cli_estimate_takes_replica_node_types_and_shares(capsys):
    import json

    from planner.cli.main import main

    argv = [
        "estimate",
        "--model",
        "gpt:megatron-1.7b",
        "--seq",
        "2048",
        "--cluster",
        "mixed-a100-v100",
        "--tp",
        "8",
        "--dp",
        "4",
        "--global-batch",
        "64",
        "--dtype",
        "fp16",
        "--json",
        "--replica-node-types",
        ",".join(TYPES),
        "--no-flash-attention",  # the API's ParallelConfig default (the CLI's default on GPUs is fused attention)
        "--batch-shares",
        "0.359375,0.359375,0.140625,0.140625",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["micro_batches"] for t in doc["per_replica_type"]] == [23, 9]
    api = estimate(GPT, MIXED, _mixed((23 / 64, 23 / 64, 9 / 64, 9 / 64)), global_batch=64, dtype="fp16")
    assert doc["step_time_s"] == pytest.approx(api.step_time_s, rel=1e-12)
    assert main(argv[:-1] + ["0.3,0.3,0.2,0.2"]) == 2
    assert "not a whole number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "tp,pp,dp,per_node_dp,per_node_dpt,sends_cross",
    [
        (1, 8, 4, 1, 1, False),  # a replica fills a node: one DP member per node
        (1, 4, 4, 2, 2, False),  # two replicas of 4 ranks per node
        (4, 1, 8, 2, 8, False),  # two tp4 replicas per node
        (1, 16, 2, 1, 1, True),  # a replica spans two nodes: its sends are charged inter-node
    ],
)
def test_replica_groups_follow_the_dp_outer_rank_layout(tp, pp, dp, per_node_dp, per_node_dpt, sends_cross):
    """Plans with replicas on several types lay ranks out as dp, pp, tp (replica j = j-th block of pp x tp
    ranks): DP members are pp x tp ranks apart, so a node of 8 holds 8 // (pp x tp) of them."""
    from planner.cost import replica_sends_cross_nodes, replica_sets

    types = (A100,) * (dp // 2) + (V100,) * (dp // 2)
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch=1, num_micro_batches=dp, replica_node_types=types)
    sets = replica_sets(MIXED, config, (1,) * dp)
    assert {s.dp_group.ranks_per_node for s in sets} == {per_node_dp}
    assert {s.dp_tp_group.ranks_per_node for s in sets} == {per_node_dpt}
    assert replica_sends_cross_nodes(config, 8) is sends_cross
