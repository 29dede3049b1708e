"""layer_cost details: measured timings, roofline traffic, flash attention, TP-comm overlap, layouts."""

import pytest
from test_cost_helpers import INTRA_BW, MEM_BW, RATE, block, cluster

from planner.core import BACKWARD_TRAFFIC_FACTOR, MEMORY_BW_EFFICIENCY, TRAFFIC_PER_SAVED_BYTE
from planner.cost import layer_cost, layout_change_cost
from planner.profile import LayerTiming, TimingStats

CL = cluster()
NODE = CL.node_types[0]


def _cost(layer, **kw):
    args = dict(
        node=NODE,
        cluster=CL,
        tp=1,
        style="split",
        recompute="none",
        sequence_parallel=False,
        micro_batch=1,
        flash_attention=False,
        dtype="bf16",
    )
    args.update(kw)
    return layer_cost(layer, **args)


def _stats(t):
    return TimingStats(median_s=t, min_s=t, max_s=t, repeats=3, warmup=1)


def test_measured_timings_interpolate_and_extrapolate():
    layer = block("blocks.0")
    timed = layer.shards[0].model_copy(
        update={
            "timings": [
                LayerTiming(micro_batch=1, forward=_stats(1.0), backward=_stats(2.0)),
                LayerTiming(micro_batch=3, forward=_stats(2.0), backward=_stats(5.0)),
            ]
        }
    )
    layer = layer.model_copy(update={"shards": [timed, *layer.shards[1:]]})
    assert _cost(layer, micro_batch=2).forward_s == pytest.approx(1.5)
    assert _cost(layer, micro_batch=2).backward_s == pytest.approx(3.5)
    assert _cost(layer, micro_batch=6).forward_s == pytest.approx(4.0)  # proportional beyond the range
    assert _cost(layer, micro_batch=1, use_timings=False).forward_s == pytest.approx(1e12 / RATE)


def test_roofline_adds_memory_traffic_of_saved_bytes():
    layer = block("blocks.0", saved=1e9)  # all "rest" (no replicated/scores split in the helper)
    k = _cost(layer)
    traffic_s = TRAFFIC_PER_SAVED_BYTE["split"] * 1e9 / (MEM_BW * MEMORY_BW_EFFICIENCY)
    assert k.forward_s == pytest.approx(1e12 / RATE + traffic_s)
    assert k.backward_s == pytest.approx(2e12 / RATE + BACKWARD_TRAFFIC_FACTOR * traffic_s)
    assert k.act_bytes == pytest.approx(1e9)


def test_overlapped_tp_comm_hides_behind_gemms():
    layer = block("blocks.0", act_bytes=1e9)
    plain = _cost(layer, tp=2)
    hidden = _cost(layer, tp=2, overlap_tp_comm=True)
    comm = 2e-6 + 1.0 * 1e9 / INTRA_BW  # one all-reduce of 1 GB over 2 ranks per phase
    assert plain.tp_comm_s == pytest.approx(2 * comm)
    # forward GEMMs 1e12/2/RATE = 10 ms hide all of the 10 ms collective but its latency
    assert hidden.tp_comm_s == pytest.approx(max(0.0, comm - 0.01) + max(0.0, comm - 0.02))


def test_whale_layout_changes_gather_along_the_batch():
    col = block("cls").model_copy(update={"tp_style": "column"})
    nxt = block("next")
    gather = 1e-6 + 0.5 * 2e6 / INTRA_BW  # all-gather of 2 samples x 1e6 B over 2 ranks (ring, 1 step)

    def change(prev, a, b):
        return layout_change_cost(prev, nxt, a, b, node=NODE, cluster=CL, tp=2, micro_batch=2)

    # column-split output (sharded features) -> batch-split replica: gather forward, gather the grad backward
    assert change(col, "split", "replicate") == pytest.approx(2 * gather)
    # whole output -> replica: a local slice forward, an all-gather of the batch-sliced gradient backward
    assert change(nxt, "split", "replicate") == pytest.approx(gather)
    # replica -> split: all-gather along the batch forward, reduce-scatter (same ring volume) backward
    assert change(nxt, "replicate", "split") == pytest.approx(2 * gather)
    assert change(col, "split", "split") == 0 and change(nxt, "replicate", "replicate") == 0
    assert layout_change_cost(col, nxt, "split", "replicate", node=NODE, cluster=CL, tp=1, micro_batch=2) == 0


def test_replica_computes_a_batch_slice_under_tp():
    layer = block("blocks.0", saved=1e9)
    whole = _cost(layer, tp=1, style="replicate", micro_batch=1)
    sliced = _cost(layer, tp=2, style="replicate", micro_batch=2)  # each TP rank: 1 of the 2 samples
    assert sliced.forward_s == pytest.approx(whole.forward_s) and sliced.act_bytes == pytest.approx(1e9)
    assert sliced.params == whole.params and sliced.tp_comm_s == 0
    # 3 samples do not split over 2 ranks: both run the whole micro-batch (runtime.executor.tp, whole replicas)
    odd = _cost(layer, tp=2, style="replicate", micro_batch=3)
    assert odd.act_bytes == pytest.approx(3e9)


def test_flash_attention_drops_scores_and_makes_selective_free():
    from planner.core import CAUSAL_FLASH_WORK_FRACTION
    from planner.model import parse_model
    from planner.profile import build_gpt_profile

    blk = build_gpt_profile(parse_model("gpt:korthikanti-22b", dropout=0.1), tp_degrees=[1, 2]).layer("blocks.0")
    shard = blk.shard(2)
    plain = _cost(blk, tp=2, micro_batch=1)
    flash = _cost(blk, tp=2, micro_batch=1, flash_attention=True)
    assert plain.act_bytes - flash.act_bytes == pytest.approx(shard.saved_attention_scores_bytes_per_sample)
    assert _cost(blk, tp=2, recompute="selective", flash_attention=True).recompute_s == 0
    assert _cost(blk, tp=2, recompute="selective").recompute_s > 0
    # the flash backward recomputes QK^T: half of the score FLOPs
    extra = shard.attention_scores_flops_per_sample / 2
    assert flash.hardware_flops - flash.model_flops == pytest.approx(extra)
    # a causal flash kernel skips the masked blocks: half of that, and a faster forward
    causal = _cost(blk, tp=2, micro_batch=1, flash_attention=True, causal_skip=True)
    assert causal.hardware_flops - causal.model_flops == pytest.approx(extra * CAUSAL_FLASH_WORK_FRACTION)
    skipped = shard.attention_scores_flops_per_sample * (1 - CAUSAL_FLASH_WORK_FRACTION)
    assert causal.forward_s < flash.forward_s
    assert causal.model_flops == pytest.approx(flash.model_flops - 3 * skipped)  # forward + 2 backward products
