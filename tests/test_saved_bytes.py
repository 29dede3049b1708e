"""One definition of recompute (issue 23): the bytes a zoo block keeps for backward at run time are the bytes the
cost model charges for it, for recompute none, selective and full, on the fused (SDPA) and the math attention path.

Run time: one block built as ``stratagem launch`` builds it (``apply_attention`` for the plan's flash_attention,
then ``apply_ac``), the bytes of every tensor autograd saves during its forward counted once per storage, weights
left out (``runtime.profiling.measure.saved_bytes``, the profiler's own ``saved_tensors_hooks`` count; full and
selective recompute save their checkpoint inputs through the same hooks — tensors kept in the cache of torch's
op-level selective checkpointing, which selective recompute used before, would be invisible here). Cost model:
``layer_cost(...).act_bytes`` of the block in the closed-form profile (``planner.profile.gpt``, Korthikanti et al.
2022 §4.1 counts), for the same micro-batch. Both in fp32 on CPU; the gap allowed (5 %) covers what the formula
leaves out on purpose (LayerNorm mean and rstd, the fused kernel's log-sum-exp: under 1 % at these sizes).

On CPU, SDPA with dropout falls back to the math kernel (torch's CPU flash kernel has no dropout) and keeps the
score tensors, so the fused cases run without dropout; on CUDA flash and memory-efficient SDPA do dropout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.cost import layer_cost, with_gpus
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile, resolve_cluster_path
from runtime.executor.recompute import apply_ac
from runtime.models.attention import apply_attention
from runtime.models.zoo import build_layer
from runtime.profiling.measure import SavedBytes, make_input, saved_bytes

SEQ, HIDDEN, HEADS, MICRO_BATCH = 128, 128, 4, 2
REL_TOL = 0.05
SPECS = {
    "gpt-dropout": parse_model("gpt", layers=1, hidden=HIDDEN, heads=HEADS, max_seq=SEQ, vocab=256, dropout=0.1),
    "gpt": parse_model("gpt", layers=1, hidden=HIDDEN, heads=HEADS, max_seq=SEQ, vocab=256, dropout=0.0),
    "llama-gqa": parse_model("llama", layers=1, hidden=HIDDEN, heads=HEADS, kv_heads=2, max_seq=SEQ, vocab=256),
}
CASES = [  # (model, fused attention): dropout only where the CPU keeps it fused (see the module docstring)
    ("gpt-dropout", False),
    ("gpt", True),
    ("llama-gqa", False),
    ("llama-gqa", True),
]
MODES = ("none", "selective", "full")


@pytest.fixture(scope="module")
def node_and_cluster():
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), 1)
    return cluster.node_types[0], cluster


def _runtime_saved_bytes(name: str, *, fused: bool, recompute: str) -> SavedBytes:
    """Bytes the block keeps for backward after one training forward of ``MICRO_BATCH`` samples, as launched."""
    torch.manual_seed(0)
    holder = nn.ModuleDict({"block": build_layer(SPECS[name], "blocks.0")})  # apply_* take a model and paths
    apply_attention(holder, fused=fused)
    apply_ac(holder, {"block": recompute})
    holder.train()
    x = make_input(torch.randn(MICRO_BATCH, SEQ, HIDDEN), needs_grad=True)
    return saved_bytes(holder["block"], x, seq_len=SEQ)


def _block_profile(name: str):
    return build_gpt_profile(SPECS[name], seq_len=SEQ, dtype="fp32", tp_degrees=[1]).layer("blocks.0")


def _cost_model_bytes(name: str, *, fused: bool, recompute: str, node_and_cluster) -> float:
    """The cost model's activation bytes of the block for one micro-batch (tp 1, no sequence parallelism)."""
    node, cluster = node_and_cluster
    cost = layer_cost(
        _block_profile(name),
        node=node,
        cluster=cluster,
        tp=1,
        style="split",
        recompute=recompute,
        sequence_parallel=False,
        micro_batch=MICRO_BATCH,
        flash_attention=fused,
        dtype="fp32",
    )
    return cost.act_bytes


@pytest.mark.parametrize("recompute", MODES)
@pytest.mark.parametrize(("name", "fused"), CASES, ids=[f"{n}-{'sdpa' if f else 'math'}" for n, f in CASES])
def test_block_saves_what_the_cost_model_charges(name, fused, recompute, node_and_cluster):
    got = _runtime_saved_bytes(name, fused=fused, recompute=recompute).total_bytes
    want = _cost_model_bytes(name, fused=fused, recompute=recompute, node_and_cluster=node_and_cluster)
    rel = (got - want) / want
    assert abs(rel) <= REL_TOL, (
        f"{name} block, {'SDPA' if fused else 'math'} attention, recompute {recompute}: the runtime saves "
        f"{got:,} bytes, the cost model charges {want:,.0f} ({rel:+.1%}; allowed ±{REL_TOL:.0%})"
    )


@pytest.mark.parametrize(("name", "fused"), CASES, ids=[f"{n}-{'sdpa' if f else 'math'}" for n, f in CASES])
def test_more_recompute_keeps_less(name, fused):
    """none >= selective > full; selective frees exactly the score tensors, so nothing on the fused path."""
    none, selective, full = (_runtime_saved_bytes(name, fused=fused, recompute=mode).total_bytes for mode in MODES)
    assert none >= selective > full == MICRO_BATCH * SEQ * HIDDEN * 4  # full keeps the fp32 block input only
    if fused:
        assert selective == none
    else:  # at least the (b, heads, s, s) fp32 probabilities
        assert none - selective >= MICRO_BATCH * HEADS * SEQ * SEQ * 4


@pytest.mark.parametrize("name", ["gpt-dropout", "llama-gqa"])
def test_profiler_finds_the_score_tensors_the_cost_model_counts(name):
    """The math path's (s x s) tensors — fp32 probabilities, and with dropout its 1-byte mask and fp32 output —
    are the profile's ``saved_attention_scores_bytes``, the part selective recompute and flash attention drop;
    grouped-query attention reaches its product as (groups * s, s) rows and must still be found."""
    got = _runtime_saved_bytes(name, fused=False, recompute="none").attention_scores_bytes
    want = _block_profile(name).shard(1).saved_attention_scores_bytes_per_sample * MICRO_BATCH
    assert got == want, f"{name}: the profiler finds {got:,} bytes of score tensors, the cost model counts {want:,.0f}"
