"""ZeRO-3 communication terms (planner/cost/zero3.py), checked against hand-computed values.

Ring figures used by hand (profiles/hardware/dgx-a100-80g.json, intra-node, 8 ranks): all-gather and
reduce-scatter alpha 32.2 us for the 7 ring steps, bus bandwidth 229.35 GB/s; one ring collective of S bytes
over the 8 GPUs of one node is 32.2e-6 + (7/8) S / 229.35e9 seconds.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from planner.core import StratagemError
from planner.cost import ParallelConfig, estimate, list_collective_s, parameter_tensors, with_gpus
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile

ROOT = Path(__file__).resolve().parents[1]
ALPHA_S, BUS_BW = 32.2e-6, 229.35e9
DEEPSPEED_2021 = dict(
    zero3_overlap=False, zero3_param_gathers=3, zero3_granularity="tensor", zero3_list_collectives=True
)


def _ring_s(nbytes: float) -> float:
    return ALPHA_S + 7 / 8 * nbytes / BUS_BW


@pytest.fixture(scope="module")
def tiny():
    """GPT with h=256, f=1024, 2 blocks, vocab 1000, 128 positions (tied head: 0 parameters)."""
    spec = parse_model("gpt", layers=2, hidden=256, heads=4, vocab=1000, max_seq=128, dropout=0.1, tie_embeddings=True)
    model = build_gpt_profile(spec, seq_len=128, dtype="bf16", tp_degrees=[1])
    cluster = with_gpus(load_cluster_profile(ROOT / "profiles" / "hardware" / "dgx-a100-80g.json"), 8)
    return model, cluster


def test_gpt_block_has_twelve_tensors(tiny):
    model, _ = tiny
    tensors = parameter_tensors(model.layer("blocks.0"), "gpt", 256, 0)
    # QKV 3h^2, 3h; proj h^2, h; LN1 h, h; LN2 h, h; FC1 h*4h, 4h; FC2 4h*h, h
    assert tensors == [196608, 768, 65536, 256, 256, 256, 256, 256, 262144, 1024, 262144, 256]
    assert parameter_tensors(model.layer("embed"), "gpt", 256, 0) == [288768]  # 1000*256 + 128*256


def test_list_collective_hand_computed():
    # host-bound: 1000 ranks, no HBM figure, NCCL 10 ms -> all-gather: 1000 views (3.3 ms) then the kernel,
    # whose 1000 output-copy launches (3.3 ms) run on the host while it runs; reduce-scatter: 3 x 3.3 ms + NCCL
    assert list_collective_s("all_gather", 0.01, 0.0, 1000, None) == pytest.approx(3.3e-3 + 0.01)
    assert list_collective_s("all_gather", 0.001, 0.0, 1000, None) == pytest.approx(2 * 3.3e-3)
    assert list_collective_s("reduce_scatter", 0.01, 0.0, 1000, None) == pytest.approx(9.9e-3 + 0.01)
    # copy-bound: 10 ranks, 1 GB, HBM 2 TB/s x 0.85 = 1.7 TB/s: zero-fill 1 GB, views, NCCL, copy 2 GB
    assert list_collective_s("all_gather", 0.01, 1e9, 10, 2e12) == pytest.approx(33e-6 + 0.01 + 3e9 / 1.7e12)
    # reduce-scatter: 2 x 10 x 3.3 us of slicing, then the 2 GB flatten copy, then NCCL
    assert list_collective_s("reduce_scatter", 0.01, 1e9, 10, 2e12) == pytest.approx(66e-6 + 2e9 / 1.7e12 + 0.01)
    assert list_collective_s("all_gather", 0.01, 1e9, 1, 2e12) == 0.01


def test_per_tensor_three_gathers_no_overlap_hand_computed(tiny):
    model, cluster = tiny
    cfg = ParallelConfig(
        dp=8,
        micro_batch=1,
        num_micro_batches=2,
        zero_stage=3,
        recompute="full",
        zero3_overlap=False,
        zero3_param_gathers=3,
        zero3_granularity="tensor",
        zero3_grad_sync="micro_batch",
    )
    rank = estimate(model, cluster, cfg, global_batch=16, dtype="bf16").per_rank[0]
    gathered_block = (196608 + 262144 + 262144) * 2  # QKV, FC1, FC2; the 65536-element projection persists
    block = 3 * (3 * ALPHA_S + 7 / 8 * gathered_block / BUS_BW) + 12 * ALPHA_S + 7 / 8 * 789760 * 2 / BUS_BW
    embed = 3 * _ring_s(288768 * 2) + _ring_s(288768 * 2)
    norm = _ring_s(512 * 2)  # persistent LayerNorm: no gather, but its gradient is reduce-scattered
    assert rank.zero_comm_s == pytest.approx(2 * (embed + 2 * block + norm), rel=1e-12)


def test_default_layer_granularity_hand_computed(tiny):
    model, cluster = tiny
    cfg = ParallelConfig(dp=8, micro_batch=1, num_micro_batches=1, zero_stage=3, overlap_grad_reduce=False)
    rank = estimate(model, cluster, cfg, global_batch=8, dtype="bf16").per_rank[0]
    per_layer = [3 * _ring_s(p * 2) for p in (288768, 789760, 789760, 512)]  # 2 gathers + 1 reduce-scatter
    assert rank.zero_comm_s == pytest.approx(sum(per_layer), rel=1e-12)


def test_grad_sync_per_step_hand_computed(tiny):
    # m = 4, no overlap: per micro-batch 2 gathers + 1 reduce-scatter per layer (8 gathers, 4 scatters);
    # once per step: m (G - 1) + 1 = 5 gathers and 1 reduce-scatter per layer
    model, cluster = tiny
    sizes = (288768, 789760, 789760, 512)
    base = ParallelConfig(dp=8, num_micro_batches=4, zero_stage=3, overlap_grad_reduce=False)
    for sync, gathers, scatters in (("micro_batch", 8, 4), ("step", 5, 1)):
        rank = estimate(model, cluster, replace(base, zero3_grad_sync=sync), global_batch=32, dtype="bf16").per_rank[0]
        assert rank.zero_comm_s == pytest.approx(sum((gathers + scatters) * _ring_s(p * 2) for p in sizes), rel=1e-12)


def test_grad_sync_per_step_holds_unsharded_weights_and_grads(tiny):
    # bf16 mixed precision: 2-byte weights, 2-byte gradients (STATE_BYTES_PER_PARAM) of all 1,868,800 params
    model, cluster = tiny
    cfg = ParallelConfig(dp=8, num_micro_batches=4, zero_stage=3)
    mem = [
        estimate(model, cluster, replace(cfg, zero3_grad_sync=s), global_batch=32, dtype="bf16")
        .per_rank[0]
        .memory.unsharded
        for s in ("micro_batch", "step")
    ]
    assert mem[1] - mem[0] == pytest.approx(sum((288768, 789760, 789760, 512)) * 4, rel=1e-12)
    one = replace(cfg, num_micro_batches=1, zero3_grad_sync="step")
    assert (
        estimate(model, cluster, one, global_batch=8, dtype="bf16").peak_memory_bytes
        == estimate(
            model, cluster, replace(one, zero3_grad_sync="micro_batch"), global_batch=8, dtype="bf16"
        ).peak_memory_bytes
    )


def test_grad_sync_default_follows_the_runtime():
    # LocalRunner (pp = 1) syncs every micro-batch; torch.distributed.pipelining stages (pp > 1) once per step
    assert ParallelConfig(zero_stage=3).zero3_grad_sync_mode == "micro_batch"
    assert ParallelConfig(zero_stage=3, pp=2).zero3_grad_sync_mode == "step"
    assert ParallelConfig(zero_stage=3, pp=2, zero3_grad_sync="micro_batch").zero3_grad_sync_mode == "micro_batch"


def test_first_layer_gather_and_reduce_scatter_are_never_hidden(tiny):
    # overlapped, k = contention: max(C - (1 - k) m W, k C) + gather(embed) + reduce_scatter(embed);
    # pp = 1, m = 2: the runtime reduce-scatters every micro-batch (2 gathers + 1 reduce-scatter each)
    model, cluster = tiny
    from planner.cost import contention

    cfg = ParallelConfig(dp=8, num_micro_batches=2, zero_stage=3)
    est = estimate(model, cluster, cfg, global_batch=16, dtype="bf16")
    rank, k = est.per_rank[0], contention(cluster.node_types[0])
    per_step = 2 * sum(3 * _ring_s(p * 2) for p in (288768, 789760, 789760, 512))
    window = sum(ch.time_s["forward"] + ch.time_s["backward"] + ch.time_s["recompute"] for ch in est.per_stage)
    expected = max(per_step - (1 - k) * 2 * window, k * per_step) + 2 * _ring_s(288768 * 2)
    assert rank.zero_comm_s == pytest.approx(expected, rel=1e-12)


def test_zero3_overlap_none_follows_overlap_grad_reduce(tiny):
    model, cluster = tiny
    for overlap in (True, False):
        base = ParallelConfig(dp=8, num_micro_batches=2, zero_stage=3, overlap_grad_reduce=overlap)
        a = estimate(model, cluster, base, global_batch=16, dtype="bf16").step_time_s
        b = estimate(model, cluster, replace(base, zero3_overlap=overlap), global_batch=16, dtype="bf16").step_time_s
        assert a == b


def test_each_deepspeed_assumption_adds_time(tiny):
    # (from no overlap: with compute this small the overlapped formula's separately charged first gather
    # can exceed the whole overlap gain, so "+ no overlap" is not monotone here)
    model, cluster = tiny
    cfg = ParallelConfig(dp=8, num_micro_batches=2, zero_stage=3, recompute="full", zero3_overlap=False)
    times = []
    for key in (None, "zero3_granularity", "zero3_param_gathers", "zero3_list_collectives"):
        if key is not None:
            cfg = replace(cfg, **{key: DEEPSPEED_2021[key]})
        times.append(estimate(model, cluster, cfg, global_batch=16, dtype="bf16").step_time_s)
    assert all(later > earlier for earlier, later in zip(times, times[1:])), times


def test_bad_zero3_fields_are_refused(tiny):
    model, cluster = tiny
    for bad in (dict(zero3_param_gathers=0), dict(zero3_granularity="module"), dict(zero3_grad_sync="never")):
        with pytest.raises(StratagemError):
            estimate(model, cluster, ParallelConfig(dp=8, zero_stage=3, **bad), global_batch=8, dtype="bf16")


def test_benchmark_states_zero3_model_and_leads_with_the_held_out_headline(capsys):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cost_accuracy

    if not cost_accuracy.DEFAULT_CSV.exists():
        pytest.skip("benchmarks/data/published_cases.csv not present")
    cost_accuracy.main([])
    lines = capsys.readouterr().out.strip().splitlines()
    zero3_rows = [line for line in lines if " z3 " in line and "dgx-a100" in line]
    assert len(zero3_rows) == 6 and all("[ZeRO-3: DeepSpeed-2021" in line for line in zero3_rows)
    n_cases = sum(
        1
        for line in lines
        if line[:3].strip().isdigit() and ("dgx" in line or "aws-p3" in line) and "  reference" not in line
    )  # reference rows (hardware no shipped profile describes) are printed but not in the headline
    assert lines[0].startswith("HELD OUT ") and "neither fitted a constant nor chose a mechanism" in lines[0]
    assert lines[-1].startswith(f"ALL {n_cases} predicted cases (in-sample rows included, not a headline)")
