"""DeepSpeed-2021 ZeRO-3 terms (planner/cost/zero3.py, module docstring 4.-5.) against hand-computed values:
the bucketed gradient all-reduce (``zero3_grad_reduce="all_reduce"``), the post-step gather of the persistent
tensors (the loaded-fabric cluster of benchmarks/cost_accuracy.py: tests/test_fabric_load.py).

Figures used by hand (profiles/hardware/dgx-a100-80g.json, one node, 8 ranks): HBM 2039 GB/s at 0.85;
all-gather alpha 32.2 us for 7 ring steps and bus bandwidth 229.35 GB/s; host call 3.3 us.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from planner.core import StratagemError
from planner.cost import ParallelConfig, collective_time, deepspeed_buckets, estimate, with_gpus
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile

ROOT = Path(__file__).resolve().parents[1]
HBM = 2039e9 * 0.85
CALL = 3.3e-6
AG_ALPHA, BUS_BW = 32.2e-6, 229.35e9
# tiny GPT (h=256, f=1024, 2 blocks, vocab 1000, 128 positions): per block 12 tensors; QKV, FC1, FC2 are
# gathered (>= 1e5 elements), the other 9 persist (the 65,536-element projection too); the embedding is one
# gathered tensor, the final LayerNorm one persistent tensor
BLOCK = [196608, 768, 65536, 256, 256, 256, 256, 256, 262144, 1024, 262144, 256]
EMBED, NORM = 288768, 512
DS2021 = dict(
    zero3_overlap=False,
    zero3_param_gathers=3,
    zero3_granularity="tensor",
    zero3_list_collectives=True,
    zero3_grad_reduce="all_reduce",
)


@pytest.fixture(scope="module")
def tiny():
    spec = parse_model("gpt", layers=2, hidden=256, heads=4, vocab=1000, max_seq=128, dropout=0.1, tie_embeddings=True)
    model = build_gpt_profile(spec, seq_len=128, dtype="bf16", tp_degrees=[1])
    cluster = with_gpus(load_cluster_profile(ROOT / "profiles" / "hardware" / "dgx-a100-80g.json"), 8)
    return model, cluster


def _all_reduce_s(cluster, nbytes: float) -> float:
    return collective_time(
        cluster, "all_reduce", nbytes, 8, node_type="dgx-a100-80g", spans_nodes=False, ranks_per_node=8
    )


def _list_gather_s(nbytes: float) -> float:
    # zero-fill, 8 views, then NCCL (alpha + 7/8 S / bw) followed by the 2 S output copies (host launches hidden)
    nccl = AG_ALPHA + 7 / 8 * nbytes / BUS_BW
    return nbytes / HBM + 8 * CALL + max(nccl + 2 * nbytes / HBM, 8 * CALL)


def test_buckets_follow_deepspeeds_overflow_rule():
    # reduce when the next gradient would pass the bucket; a tensor larger than the bucket is alone
    assert deepspeed_buckets([3, 4, 2, 9, 1], bucket=8) == [7, 2, 9, 1]
    assert deepspeed_buckets([9], bucket=8) == [9]
    assert deepspeed_buckets([], bucket=8) == []
    # a GPT-3 175B block in backward order (h = 12288): FC2 and FC1 (6.0e8) each alone, their biases alone
    # between them; LN2, the projection and the QKV bias share one; QKV (4.5e8) opens the last with LN1
    h = 12288
    backward = [h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h * h, 3 * h, 3 * h * h, h, h]
    expected = [h, 4 * h * h, 4 * h, 4 * h * h, 6 * h + h * h, 3 * h * h + 2 * h]
    assert deepspeed_buckets(backward, bucket=5e8) == expected


def test_gradients_all_reduced_in_one_bucket_hand_computed(tiny):
    # the whole tiny model's 1,868,800 gradients fit one 5e8-element bucket: one all-reduce of 2-byte
    # gradients plus flatten, divide and copy-back (6 bytes of HBM traffic per gradient byte)
    model, cluster = tiny
    total = 2 * sum(BLOCK) + EMBED + NORM
    cfg = ParallelConfig(dp=8, micro_batch=1, num_micro_batches=2, zero_stage=3, recompute="full", **DS2021)
    base = replace(cfg, zero3_grad_reduce="reduce_scatter")
    rank = estimate(model, cluster, cfg, global_batch=16, dtype="bf16").per_rank[0]
    gathers = 3 * (_list_gather_s(EMBED * 2) + 2 * sum(_list_gather_s(t * 2) for t in BLOCK if t >= 100_000))
    persistent = [t for t in BLOCK if t < 100_000] * 2 + [NORM]
    post_step = _list_gather_s(sum(persistent) * 2) + len(persistent) * 8 * 4 * CALL
    reduce = _all_reduce_s(cluster, total * 2) + 6 * total * 2 / HBM
    assert rank.zero_comm_s == pytest.approx(2 * (gathers + reduce) + post_step, rel=1e-12)
    # the per-tensor reduce-scatter alternative costs the same gathers and post-step gather
    other = estimate(model, cluster, base, global_batch=16, dtype="bf16").per_rank[0].zero_comm_s
    assert other != pytest.approx(rank.zero_comm_s, rel=1e-6)


def test_persistent_gather_is_per_tensor_per_rank(tiny):
    # doubling the ranks doubles the Python loop of the post-step gather (4 host calls per tensor and rank)
    model, cluster = tiny
    n_persistent = 2 * 9 + 1
    cfg = ParallelConfig(dp=8, micro_batch=1, num_micro_batches=1, zero_stage=3, recompute="full", **DS2021)
    with_list = estimate(model, cluster, cfg, global_batch=8, dtype="bf16").per_rank[0].zero_comm_s
    no_list = replace(cfg, zero3_list_collectives=False)
    without = estimate(model, cluster, no_list, global_batch=8, dtype="bf16").per_rank[0].zero_comm_s
    assert with_list - without > n_persistent * 8 * 4 * CALL


def test_fsdp_defaults_do_not_pay_deepspeed_terms(tiny):
    # defaults: reduce-scatter per layer, no list collectives, no post-step gather
    model, cluster = tiny
    cfg = ParallelConfig(dp=8, num_micro_batches=1, zero_stage=3, overlap_grad_reduce=False)
    assert cfg.zero3_grad_reduce == "reduce_scatter"
    rank = estimate(model, cluster, cfg, global_batch=8, dtype="bf16").per_rank[0]
    ring = sum(AG_ALPHA + 7 / 8 * p * 2 / BUS_BW for p in (EMBED, sum(BLOCK), sum(BLOCK), NORM))
    assert rank.zero_comm_s == pytest.approx(3 * ring, rel=1e-12)


def test_unknown_grad_reduce_is_refused(tiny):
    model, cluster = tiny
    with pytest.raises(StratagemError, match="zero3_grad_reduce"):
        estimate(model, cluster, ParallelConfig(dp=8, zero_stage=3, zero3_grad_reduce="broadcast"), global_batch=8)
