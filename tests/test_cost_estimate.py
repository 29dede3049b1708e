"""estimate(): hand-computed terms on a synthetic cluster, properties, and errors naming the fix."""

import dataclasses

import pytest
from test_cost_helpers import INTRA_BW, MEM_BW, RATE, cluster, model

from planner.core import (
    CUDA_CONTEXT_BYTES,
    DDP_BUCKET_BYTES,
    FRAGMENTATION_FRACTION,
    MEMORY_BW_EFFICIENCY,
    OPTIMIZER_BYTES_PER_PARAM,
    StratagemError,
)
from planner.cost import ParallelConfig, collective_time, estimate
from planner.plan import Predictions

CL = cluster()
OPT_S = 1e6 * OPTIMIZER_BYTES_PER_PARAM / (MEM_BW * MEMORY_BW_EFFICIENCY)


def test_pipeline_two_stages_hand_computed():
    cfg = ParallelConfig(pp=2, micro_batch=1, num_micro_batches=4)
    est = estimate(model(2), CL, cfg, global_batch=4)
    # per chunk: fwd 1e12/50e12, bwd 2e12/50e12, and the one boundary (send_recv 1 us + 1e6 B / 100 GB/s)
    # paid once by each side (paired send/receive exchanges)
    one_way = 1e-6 + 1e6 / INTRA_BW
    t = 1e12 / RATE + 2e12 / RATE + one_way
    assert est.per_rank[0].microbatch_s == pytest.approx(t)
    assert est.per_rank[1].microbatch_s == pytest.approx(t)
    assert est.step_time_s == pytest.approx((4 - 1) * t + 2 * t + OPT_S)
    assert est.breakdown_s["bubble"] == pytest.approx(t)
    assert est.breakdown_s["pp_comm"] == pytest.approx(4 * one_way)
    assert est.breakdown_s["forward"] == pytest.approx(4 * 0.02)
    # memory (torch.distributed.pipelining): 16 B/param states (the gradients of a later backward), the
    # boundary activation it sent held for each of its 2 micro-batches in flight, and one receive buffer per
    # micro-batch for the gradients coming back (4 x 1e6 B); reserve = context + 10 %
    allocated = 16e6 + 2 * 1e6 + 4 * 1e6
    assert est.per_rank[0].memory.peak_bytes == pytest.approx(
        allocated * (1 + FRAGMENTATION_FRACTION) + CUDA_CONTEXT_BYTES
    )
    assert sum(v for k, v in est.breakdown_s.items() if k != "dp_sync_overlapped") == pytest.approx(est.step_time_s)


def test_tensor_parallel_adds_the_layer_all_reduces():
    cfg = ParallelConfig(tp=2, micro_batch=2, num_micro_batches=1)
    est = estimate(model(1), CL, cfg, global_batch=2)
    # two all-reduces (fwd + bwd) of 2 samples x 1e6 B over 2 ranks: 2 steps of 1 us + 2*(1/2)*2e6/100e9
    ar = 2e-6 + 1.0 * 2e6 / INTRA_BW
    assert est.breakdown_s["tp_comm"] == pytest.approx(2 * ar)
    assert est.breakdown_s["forward"] == pytest.approx(2 * 1e12 / 2 / RATE)


def test_data_parallel_sync_exposed_and_overlapped():
    base = dict(dp=4, micro_batch=1, num_micro_batches=1)
    # all-reduce of 1e6 params x 2 B over 4 ranks in one node, in 25 MiB buckets: 2e6 * t(bucket) / bucket
    sync = 2e6 * (6e-6 + 1.5 * DDP_BUCKET_BYTES / INTRA_BW) / DDP_BUCKET_BYTES
    est = estimate(model(1), CL, ParallelConfig(**base, overlap_grad_reduce=False), global_batch=4)
    assert est.breakdown_s["dp_sync_exposed"] == pytest.approx(sync)
    one = estimate(
        model(1), CL, ParallelConfig(**base, overlap_grad_reduce=False, grad_bucket_bytes=None), global_batch=4
    )
    assert one.breakdown_s["dp_sync_exposed"] == pytest.approx(6e-6 + 1.5 * 2e6 / INTRA_BW)
    est = estimate(model(1), CL, ParallelConfig(**base), global_batch=4)
    # the 2 MB of gradients fit in one bucket, and the last bucket is always exposed
    assert est.breakdown_s["dp_sync_exposed"] == pytest.approx(sync)
    big = model(1, params=100_000_000)
    est = estimate(big, CL, ParallelConfig(**base), global_batch=4)
    assert est.breakdown_s["dp_sync_overlapped"] > 0
    assert est.breakdown_s["dp_sync_exposed"] < est.per_rank[0].dp_sync_s


def test_zero_stages_shrink_memory_and_zero3_is_about_zero0_over_dp():
    m = model(2, params=50_000_000)
    mems = {}
    for z in (0, 1, 2, 3):
        est = estimate(
            m,
            CL,
            ParallelConfig(dp=8, zero_stage=z, micro_batch=1, num_micro_batches=1, overlap_grad_reduce=False),
            global_batch=8,
        )
        mem = est.per_rank[0].memory
        mems[z] = (mem.params + mem.optimizer, mem.unsharded)
        if z == 3:
            assert est.breakdown_s["zero_comm"] > 0
    # what a rank always holds: weights and AdamW state, sharded over dp from ZeRO-1 on (FSDP2 shards the weights
    # at rest at every stage, and the runtime runs ZeRO-1 as ZeRO-2), and below ZeRO-3 the gathered weights
    (rest0, gathered0), (rest1, gathered1), (rest2, gathered2), (rest3, gathered3) = (mems[z] for z in range(4))
    assert rest1 == rest2 == rest3 == pytest.approx(rest0 / 8)
    assert gathered0 == gathered1 == gathered2 == pytest.approx(2 * 50_000_000 * 2)  # bf16, 2 layers
    # ZeRO-3: the block whose backward is the peak (the backward sweep; these layers are blocks, no root unit)
    assert gathered3 == pytest.approx(50_000_000 * 2)


def test_more_data_parallelism_lowers_per_rank_compute():
    m = model(2)
    t1 = estimate(m, CL, ParallelConfig(dp=1, micro_batch=1, num_micro_batches=8), global_batch=8)
    t4 = estimate(m, CL, ParallelConfig(dp=4, micro_batch=1, num_micro_batches=2), global_batch=8)
    assert t4.breakdown_s["forward"] == pytest.approx(t1.breakdown_s["forward"] / 4)
    assert t4.step_time_s < t1.step_time_s


def test_replicate_style_is_data_parallel_inside_the_tp_group():
    m = model(2)
    split = estimate(m, CL, ParallelConfig(tp=2, micro_batch=2, num_micro_batches=1), global_batch=2)
    single = estimate(m, CL, ParallelConfig(micro_batch=1, num_micro_batches=1), global_batch=1)
    both = {"blocks.0": "replicate", "blocks.1": "replicate"}
    repl = estimate(m, CL, ParallelConfig(tp=2, micro_batch=2, num_micro_batches=1, layout=both), global_batch=2)
    assert repl.breakdown_s["tp_comm"] == 0  # no TP collectives, no layout change between equal styles
    # Whale's replica: each TP rank runs the whole layer on half the micro-batch (1 sample)
    assert repl.breakdown_s["forward"] == pytest.approx(single.breakdown_s["forward"])
    assert repl.per_rank[0].memory.params == pytest.approx(2 * split.per_rank[0].memory.params)
    # its gradients are averaged over dp x tp = 2 ranks although dp = 1: one all-reduce of all of them
    grads = repl.per_rank[0].memory.grads
    assert split.per_rank[0].dp_sync_s == 0
    per_bucket_s = collective_time(
        CL, "all_reduce", DDP_BUCKET_BYTES, 2, node_type=CL.node_types[0], spans_nodes=False, ranks_per_node=2
    )
    assert repl.per_rank[0].dp_sync_s == pytest.approx(grads * per_bucket_s / DDP_BUCKET_BYTES)
    one = {"blocks.1": "replicate"}
    mixed = estimate(m, CL, ParallelConfig(tp=2, micro_batch=2, num_micro_batches=1, layout=one), global_batch=2)
    # whole -> batch slice: local forward, one all-gather of the 2-sample x 1e6 B gradient backward
    gather = 1e-6 + 0.5 * 2e6 / INTRA_BW
    assert mixed.per_stage[0].time_s["layout"] == pytest.approx(gather)
    mixed_sp = estimate(
        m,
        CL,
        ParallelConfig(tp=2, micro_batch=2, num_micro_batches=1, layout=one, sequence_parallel=True),
        global_batch=2,
    )
    # sequence-sharded -> whole -> slice: one more all-gather forward
    assert mixed_sp.per_stage[0].time_s["layout"] == pytest.approx(2 * gather)


def test_to_predictions_is_a_valid_plan_section():
    est = estimate(
        model(4),
        CL,
        ParallelConfig(pp=2, micro_batch=1, num_micro_batches=4, schedule="interleaved_1f1b", virtual_stages=2),
        global_batch=4,
    )
    pred = est.to_predictions()
    assert isinstance(pred, Predictions)
    assert [s.stage for s in pred.stages] == [0, 1, 2, 3]
    assert pred.step_time_s == est.step_time_s


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(tp=2, pp=4, dp=4), "cluster test has 16"),
        (dict(pp=3), "chunks"),
        (dict(num_micro_batches=3), "global batch 4"),
        (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, num_micro_batches=3), "multiple of pp"),
        (dict(tp=3), "tp=3"),
        (dict(zero_stage=4), "ZeRO stage 4"),
    ],
)
def test_impossible_configs_name_the_fix(change, match):
    cfg = dataclasses.replace(ParallelConfig(micro_batch=1, num_micro_batches=4), **change)
    gb = cfg.dp * cfg.micro_batch * 4
    with pytest.raises(StratagemError, match=match):
        estimate(model(2), CL, cfg, global_batch=gb)


def test_mixed_cluster_stage_on_the_slower_node_type_hand_computed():
    """pp=2 on a mixed cluster: pp rank 1 on a node type with half the FLOP/s takes twice the compute, and the
    uneven pipeline runs (m - 1) x the slowest rank + the sum over ranks (SC21 §2.2 with unequal stages)."""
    from test_cost_helpers import fits, node

    from planner.profile import ComputeFigure, NodeGroup

    slow = node("slow").model_copy(
        update={
            "compute": [
                ComputeFigure(
                    dtype="bf16",
                    peak_flops_per_s=100e12,
                    achieved_flops_per_s=RATE / 2,
                    origin="derived",
                    source="test",
                )
            ]
        }
    )
    groups = [NodeGroup(node_type="fast", count=1), NodeGroup(node_type="slow", count=1)]
    mixed = CL.model_copy(
        update={"node_types": [node("fast"), slow], "nodes": groups, "inter_node": fits("inter_node", 30e-6, 10e9, 16)}
    )
    cfg = ParallelConfig(pp=2, micro_batch=1, num_micro_batches=4, stage_node_types=("fast", "slow"))
    est = estimate(model(2), mixed, cfg, global_batch=4)
    fast, slow_rank = est.per_rank
    assert (fast.node_type, slow_rank.node_type) == ("fast", "slow")
    compute_fast, compute_slow = 3e12 / RATE, 3e12 / (RATE / 2)  # fwd 1e12 + bwd 2e12 FLOPs per block
    p2p = fast.microbatch_s - compute_fast
    assert p2p > 0 and slow_rank.microbatch_s == pytest.approx(compute_slow + p2p)
    pipeline = (4 - 1) * slow_rank.microbatch_s + fast.microbatch_s + slow_rank.microbatch_s
    assert est.step_time_s == pytest.approx(pipeline + OPT_S)
