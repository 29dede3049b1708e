"""Context parallelism in the cost model (planner/cost/context.py): what the split divides and what it
does not, the K/V exchange, gradient sync over dp x cp, and one-line errors for bad input."""

from __future__ import annotations

import pytest

from planner.cli.common import resolve_cluster_path
from planner.cost import (
    ContextParallelError,
    ParallelConfig,
    check_context,
    context_view,
    estimate,
    fold,
    kv_bytes_per_sample,
    with_gpus,
)
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile

CLUSTER = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), 64)
LLAMA = build_gpt_profile(parse_model("llama:llama3-8b"), seq_len=32768, tp_degrees=[1, 2, 4, 8])
BASE = dict(tp=2, pp=1, micro_batch=1, flash_attention=True, causal_skip=True, sequence_parallel=True, zero_stage=1)


def _est(cp: int, dp: int, mode: str | None = "allgather", batch: int = 16, **kw):
    cfg = ParallelConfig(
        **{**BASE, **kw}, dp=dp, cp=cp, context_parallel=mode if cp > 1 else None, num_micro_batches=batch // dp
    )
    return estimate(LLAMA, CLUSTER, cfg, global_batch=batch, dtype="bf16")


def test_view_divides_every_per_sample_figure_by_cp():
    view = context_view(LLAMA, 4)
    assert view.seq_len == 32768 // 4
    for full, mine in zip(LLAMA.layers, view.layers):
        assert mine.output_bytes_per_sample == pytest.approx(full.output_bytes_per_sample / 4)
        for a, b in zip(full.shards, mine.shards):
            assert b.params == a.params  # weights are not split by cp
            assert b.fwd_flops_per_sample == pytest.approx(a.fwd_flops_per_sample / 4)
            assert b.attention_scores_flops_per_sample == pytest.approx(a.attention_scores_flops_per_sample / 4)
            assert b.saved_bytes_per_sample == pytest.approx(a.saved_bytes_per_sample / 4)
    scores = next(op for op in view.layer("blocks.0").shards[0].ops if op.name == "scores")
    assert (scores.rows_per_sample, scores.n) == (32768 // 4, 32768)  # local queries x every key


def test_total_flops_and_tokens_are_those_of_the_whole_sequence():
    one, two = _est(cp=1, dp=4), _est(cp=2, dp=2)
    assert two.tokens_per_s * two.step_time_s == pytest.approx(16 * 32768)
    assert two.samples_per_s * two.step_time_s == pytest.approx(16)
    # the same model FLOPs per step on the same 8 GPUs (tp 2 x dp 4 vs tp 2 x dp 2 x cp 2)
    assert two.model_tflops_per_gpu * two.step_time_s == pytest.approx(one.model_tflops_per_gpu * one.step_time_s)


def test_activations_divide_by_cp_and_allgather_keeps_the_gathered_kv():
    one = _est(cp=1, dp=4).per_rank[0].memory.activations
    ring = _est(cp=2, dp=2, mode="ring").per_rank[0].memory.activations
    gather = _est(cp=2, dp=2, mode="allgather").per_rank[0].memory.activations
    assert ring == pytest.approx(one / 2)
    blocks = sum(1 for layer in LLAMA.layers if layer.kind == "block")
    # per attention layer: (1 - 1/cp) of a whole sequence's K and V, on a tp 2 shard
    assert gather - ring == pytest.approx(blocks * kv_bytes_per_sample(LLAMA) / 2 * (1 - 1 / 2))


def test_gradients_sync_over_dp_times_cp():
    two = _est(cp=2, dp=2).per_rank[0]
    four = _est(cp=1, dp=4).per_rank[0]
    assert two.dp_sync_s == pytest.approx(four.dp_sync_s)
    assert two.memory.optimizer == pytest.approx(four.memory.optimizer)  # ZeRO-1 shards over dp x cp


def test_exchange_costs_time_and_ring_hides_behind_long_attention():
    plain, gather, ring = _est(cp=1, dp=4), _est(cp=2, dp=2), _est(cp=2, dp=2, mode="ring")
    fold_view, folded, _ = fold(ParallelConfig(**BASE, dp=2, cp=2, context_parallel="ring"), LLAMA, 16)
    assert folded.dp == 4 and folded.kv_exchange.mode == "ring" and fold_view.seq_len == 16384
    # all-gather: exposed; ring at 32k tokens: each step's 1/cp of K/V hides behind 1/cp of the attention
    assert gather.step_time_s > plain.step_time_s
    assert ring.step_time_s < gather.step_time_s
    exposed = ring.step_time_s - plain.step_time_s
    assert exposed >= 0 and exposed < 0.05 * plain.step_time_s


def test_layer_exchange_is_inside_forward_and_backward():
    from planner.cost import kv_exchange, layer_cost

    view, node = context_view(LLAMA, 4), CLUSTER.node_types[0]
    block = view.layer("blocks.0")
    args = dict(
        node=node,
        cluster=CLUSTER,
        tp=2,
        style="split",
        recompute="none",
        sequence_parallel=True,
        micro_batch=1,
        flash_attention=True,
        dtype="bf16",
        causal_skip=True,
    )
    plain = layer_cost(block, **args)
    gather = layer_cost(block, **args, context=kv_exchange(LLAMA, 4, "allgather"))
    assert plain.cp_comm_s == 0 and gather.cp_comm_s > 0
    assert gather.forward_s + gather.backward_s == pytest.approx(plain.forward_s + plain.backward_s + gather.cp_comm_s)
    # the gathered K/V of the other 3/4 of the sequence stay saved (tp 2 shard of 2 s h_kv e bytes)
    assert gather.act_bytes - plain.act_bytes == pytest.approx(kv_bytes_per_sample(LLAMA) / 2 * 3 / 4)
    assert layer_cost(view.layer("head"), **args, context=kv_exchange(LLAMA, 4, "allgather")).cp_comm_s == 0


def test_cp_combines_with_pipeline_and_zero3():
    est = _est(cp=2, dp=2, pp=2, schedule="1f1b", zero_stage=3, batch=16)
    assert est.fits_in_memory and len(est.per_rank) == 2
    assert est.step_time_s > 0


def test_bad_input_is_one_line():
    with pytest.raises(ContextParallelError, match=r"--seq 32768 does not split into 2 x cp = 6.*multiple of 6"):
        check_context(LLAMA, 3, "ring")
    mlp = build_gpt_profile(parse_model("gpt:tiny"), seq_len=64)
    mlp = mlp.model_copy(update={"model": parse_model("mlp:tiny")})
    with pytest.raises(ContextParallelError, match="no attention to split.*use --cp 1"):
        check_context(mlp, 2, "allgather")
    with pytest.raises(ContextParallelError, match="unknown"):
        check_context(LLAMA, 2, "bogus")
    with pytest.raises(ContextParallelError, match="2 x cp = 6"):  # estimate checks it too
        estimate(LLAMA, CLUSTER, ParallelConfig(**BASE, dp=2, cp=3, context_parallel="ring"), global_batch=2)


def test_published_long_context_runs_within_15_percent():
    """Regression guard on benchmarks/long_context_accuracy.py (NeMo CP table, Llama 3 405B at 128k)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import long_context_accuracy

    res = long_context_accuracy.run()
    long_rows = [r for r in res["cases"] if r["role"] == "validate"]
    assert len(long_rows) >= 7
    assert res["max_abs_error_validate"] <= 0.15, res["cases"]
