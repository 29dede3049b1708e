"""Closed-form model profile of a Mixture-of-Experts decoder (family ``moe``) — no torch, instant for any size.

The model is a Llama decoder (``planner.profile.gpt``: RMSNorm, RoPE, SwiGLU, grouped-query attention) whose
FFN, after the first ``dense_layers`` blocks, is a router plus experts (Shazeer et al. 2017; GShard, Lepikhin
et al. 2020; fine-grained and shared experts as in DeepSeekMoE, Dai et al. 2024 §3):

- the first ``dense_layers`` blocks are Llama blocks with a dense SwiGLU FFN of width ``ffn_hidden``;
- every other block holds attention, a router (an ``h x E`` linear, replicated over tp) and
  ``shared_experts`` always-on SwiGLU experts of width ``expert_ffn`` (a dense FFN of width
  ``shared_experts * expert_ffn``, tensor-parallel like the attention), all in the block's shards; and
  ``experts`` routed SwiGLU experts of width ``expert_ffn``, each token sent to ``top_k`` of them, described
  by the layer's :class:`planner.profile.load.ExpertProfile` and costed per expert-parallel layout by
  ``planner.cost.moe`` (their FLOPs, weights, activations and the all-to-all depend on ep and etp).

Per token, a routed expert costs ``6 h f_e`` forward FLOPs (three ``2 h f_e`` GEMMs), so the routed part
of a block costs ``6 h f_e k`` per token (``k = top_k``) while holding ``3 h f_e E`` parameters; the router
``2 h E``. TP collectives of an MoE block: the attention's (one all-reduce, or all-gather + reduce-scatter with
sequence parallelism, each way) and the shared experts' (one more); the routed experts' traffic is the
all-to-all (``planner.cost.moe``).
"""

from __future__ import annotations

from dataclasses import replace

from planner.core import DTYPE_BYTES, StratagemError
from planner.model import ModelSpec
from planner.profile.schema import CollectiveNeed, ExpertProfile, LayerProfile, ModelProfile, ShardProfile
from planner.profile.transformer_layers import (
    SOURCES as DENSE_SOURCES,
)
from planner.profile.transformer_layers import (
    Dims,
    analytic_profile,
    block_collectives,
    block_shard,
    default_tp_degrees,
    dims_of,
    embed_layer,
    head_layer,
    norm_layer,
)

SOURCES = [
    *DENSE_SOURCES,
    "Lepikhin et al. 2020 (GShard), arXiv:2006.16668, §2 (top-k routing, expert FFNs, all-to-all dispatch)",
    "Dai et al. 2024 (DeepSeekMoE), arXiv:2401.06066, §3 (fine-grained and shared experts)",
]
_MLP_OPS = ("mlp_in", "activation", "mlp_out")


def _moe_block_shard(d: Dims, t: int, router_params: int) -> ShardProfile:
    """The non-routed part of an MoE block on one of ``t`` TP ranks: attention, shared experts (``d.f``
    wide, 0 = none) and the replicated router weights."""
    shard = block_shard(d, t)
    ops = shard.ops if d.f else [op for op in shard.ops if op.name not in _MLP_OPS]
    params = shard.params + router_params
    return shard.model_copy(update=dict(params=params, param_bytes=params * d.e, ops=ops))


def _moe_collectives(d: Dims, shared: bool) -> list[CollectiveNeed]:
    """Attention's TP collectives, plus the shared experts' (Megatron-LM layout: one each way per TP block)."""
    count = 2 if shared else 1
    return [need.model_copy(update=dict(count=count)) for need in block_collectives(d)]


def build_moe_profile(
    spec: ModelSpec,
    *,
    seq_len: int | None = None,
    dtype: str = "bf16",
    tp_degrees: list[int] | None = None,
    created_utc: str = "",
    head_dim: int | None = None,
) -> ModelProfile:
    """The closed-form :class:`ModelProfile` of an ``moe`` ``spec`` at ``seq_len`` tokens per sample.

    ``head_dim``: an attention head width other than ``hidden / heads`` (Qwen3-MoE: 128 with hidden 4096 and
    64 heads), for cost studies of published models (``benchmarks/moe_validation.py``); the zoo's ``moe``
    module, which the runtime builds from the spec, has ``hidden / heads``.

    >>> from planner.model.spec import parse_model
    >>> p = build_moe_profile(parse_model("moe:mixtral-8x7b"))
    >>> round(p.total_params / 1e9, 1)   # Jiang et al. 2024: 46.7B parameters
    46.7
    """
    if not spec.is_moe:
        raise StratagemError(f"{spec.name} is not an moe model; use planner.profile.gpt for gpt and llama")
    if dtype not in DTYPE_BYTES:
        raise StratagemError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    seq = int(seq_len or spec.dim("max_seq"))
    dense = dims_of(spec, seq, dtype)
    if head_dim is not None:
        kv_heads = dense.h_kv * dense.a // dense.h
        dense = replace(dense, q=dense.a * head_dim, h_kv=kv_heads * head_dim)
    tps = tp_degrees or default_tp_degrees(spec)
    bad = [t for t in tps if dense.a % t or (dense.h_kv * dense.a // dense.q) % t]
    if bad or tps[0] != 1:
        raise StratagemError(f"TP degrees {tps} must start at 1 and divide heads {dense.a}; drop {bad}")
    n_experts, f_e, shared = int(spec.dim("experts")), int(spec.dim("expert_ffn")), int(spec.dim("shared_experts"))
    cf = float(spec.dim("capacity_factor"))
    moe = replace(dense, f=shared * f_e)
    experts = ExpertProfile(
        experts=n_experts,
        top_k=int(spec.dim("top_k")),
        hidden=dense.h,
        expert_ffn=f_e,
        tokens_per_sample=seq,
        capacity_factor=cf if cf > 0 else None,
    )
    act = dense.e * dense.s * dense.h
    attn = f"h{dense.h}-q{dense.q}-a{dense.a}-kv{dense.h_kv}"
    dense_sig = f"moe-dense-block-{attn}-f{dense.f}-s{seq}"
    moe_sig = f"moe-block-{attn}-E{n_experts}-k{experts.top_k}-fe{f_e}-sh{shared}-s{seq}"
    dense_shards = [block_shard(dense, t) for t in tps]
    moe_shards = [_moe_block_shard(moe, t, dense.h * n_experts) for t in tps]
    blocks = []
    for i in range(int(spec.dim("layers"))):
        is_dense = i < int(spec.dim("dense_layers"))
        blocks.append(
            LayerProfile(
                path=f"blocks.{i}",
                kind="block",
                signature=dense_sig if is_dense else moe_sig,
                tp_style="megatron_block",
                input_bytes_per_sample=act,
                output_bytes_per_sample=act,
                shards=dense_shards if is_dense else moe_shards,
                collectives=block_collectives(dense) if is_dense else _moe_collectives(dense, shared > 0),
                experts=None if is_dense else experts,
            )
        )
    layers = [embed_layer(dense, tps), *blocks, norm_layer(dense), head_layer(dense, tps)]
    return analytic_profile(
        spec,
        seq=seq,
        dtype=dtype,
        tps=tps,
        layers=layers,
        total_params=sum(layer.total_params for layer in layers),
        created_utc=created_utc,
        sources=SOURCES,
        notes="closed-form (planner.profile.moe); routed experts costed per ep/etp by planner.cost.moe",
    )
