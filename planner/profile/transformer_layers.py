"""The closed-form layer profiles of a decoder transformer (embedding, block, final norm, LM head) per TP degree,
and the :class:`planner.profile.load.ModelProfile` around them: the pieces :mod:`planner.profile.gpt` (GPT, Llama)
and :mod:`planner.profile.moe` (their MoE blocks) assemble. The formulas and their sources are
:mod:`planner.profile.gpt`'s docstring."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import __version__
from planner.core import DTYPE_BYTES, StratagemError
from planner.model import ModelSpec, ffn_width
from planner.profile.schema import (
    CollectiveNeed,
    LayerProfile,
    ModelProfile,
    OpProfile,
    Provenance,
    ShardProfile,
)

FP32_BYTES = 4

SOURCES = [
    "Narayanan et al., SC21, arXiv:2104.04473, eq. 2-3 (parameters, FLOPs)",
    "Korthikanti et al. 2022, arXiv:2205.05198, §4 and Table 2 (activation memory, SP collectives)",
    "Shoeybi et al. 2019, arXiv:1909.08053, §3 (tensor-parallel layout and its all-reduces)",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Dims:
    s: int
    h: int
    a: int
    h_kv: int
    f: int
    vocab: int
    max_seq: int
    e: int
    dropout: bool
    swiglu: bool
    tied: bool
    learned_positions: bool
    q: int  # attention width, heads x head dim (= h unless a head dim is given: planner.profile.moe)


def dims_of(spec: ModelSpec, seq_len: int, dtype: str) -> Dims:
    if spec.family not in ("gpt", "llama", "moe"):
        raise StratagemError(
            f"closed-form profiles cover gpt and llama models, not {spec.family}; profile it "
            f"with `stratagem profile model` and pass --model-profile"
        )
    h, a = int(spec.dim("hidden")), int(spec.dim("heads"))
    if h % a:
        raise StratagemError(f"hidden {h} is not divisible by heads {a}; choose --hidden a multiple of --heads")
    llama_like = spec.family in ("llama", "moe")  # moe: a Llama decoder whose FFNs are experts (planner.profile.moe)
    kv = int(spec.dim("kv_heads")) if llama_like else 0
    kv = kv or a
    f = ffn_width(spec)
    dropout = spec.family == "gpt" and float(spec.dim("dropout")) > 0
    return Dims(
        s=seq_len,
        h=h,
        a=a,
        h_kv=h * kv // a,
        f=f,
        vocab=int(spec.dim("vocab")),
        max_seq=int(spec.dim("max_seq")),
        e=DTYPE_BYTES[dtype],
        dropout=dropout,
        swiglu=llama_like,
        tied=bool(spec.dim("tie_embeddings")),
        learned_positions=spec.family == "gpt",
        q=h,
    )


def block_params(d: Dims) -> tuple[int, int]:
    """(tensor-split, replicated) parameters of one block at tp=1."""
    h, hkv, f, q = d.h, d.h_kv, d.f, d.q
    if d.swiglu:
        return h * (q + 2 * hkv) + q * h + 3 * h * f, 2 * h
    split = h * (q + 2 * hkv) + (q + 2 * hkv) + q * h + 2 * h * f + f
    return split, 2 * h + 4 * h  # projection and FC2 biases, two LayerNorms


def block_shard(d: Dims, t: int) -> ShardProfile:
    s, h, hkv, f, e, q = d.s, d.h, d.h_kv, d.f, d.e, d.q
    mlp_flops = (6 if d.swiglu else 4) * s * h * f
    score_flops = 4 * s * s * q
    fwd = 2 * s * h * (q + 2 * hkv) + 2 * s * q * h + score_flops + mlp_flops
    split_p, repl_p = block_params(d)
    params = math.ceil(split_p / t) + repl_p
    replicated = 4 * e * s * h + (2 * s * h if d.dropout else 0)
    split_saved = e * (s * q + 2 * s * hkv + s * q) + e * s * f * (3 if d.swiglu else 2)
    scores = (2 * e + 1 if d.dropout else e) * d.a * s * s
    return ShardProfile(
        tp=t,
        params=params,
        param_bytes=params * e,
        fwd_flops_per_sample=fwd / t,
        bwd_flops_per_sample=2 * fwd / t,
        saved_bytes_per_sample=replicated + (split_saved + scores) / t,
        saved_replicated_bytes_per_sample=replicated,
        saved_attention_scores_bytes_per_sample=scores / t,
        attention_scores_flops_per_sample=score_flops / t,
        ops=_block_ops(d, t),
        flops_origin="derived",
        memory_origin="derived",
    )


def _mem(name: str, fwd_bytes: float, bwd_bytes: float, **kw) -> OpProfile:
    return OpProfile(name=name, kind="memory", bytes_per_sample=fwd_bytes, backward_bytes_per_sample=bwd_bytes, **kw)


def _block_ops(d: Dims, t: int) -> list[OpProfile]:
    """A block's forward kernels on one of ``t`` TP ranks, Megatron-LM's fused layout (planner.cost.kernels).

    Bytes count each kernel's HBM reads + writes of ``e``-byte elements (1-byte dropout masks): LayerNorm
    reads x, writes y (2), its backward reads x and dy, writes dx (3); fused scale-mask-softmax 2 / 3;
    dropout writes a mask (2e+1 both ways); bias-GeLU 2 / 3 (SwiGLU reads two halves: 3 / 5); the fused
    bias-dropout-add reads the output and the residual and writes the sum and mask (3e+1), its backward
    (2e+1); the context permute (``contiguous()`` in Megatron's CoreAttention) 2 / 2. Rotary (Llama) reads
    and writes q and k (2 / 2). GEMM shapes per sample of ``s`` tokens: QKV ``s x (h+2h_kv)/t x h``, scores
    ``a/t`` x ``s x s x d``, context ``a/t`` x ``s x d x s``, projection ``s x h x h/t``, MLP in ``s x f/t x h``
    (SwiGLU: gate and up, ``2f/t``), MLP out ``s x h x f/t`` (Shoeybi et al. 2019 §3 for the TP split).
    """
    s, h, e, f = d.s, d.h, d.e, d.f
    hp, ap, dh, kvp = d.q // t, d.a // t, d.q // d.a, d.h_kv // t
    drop = 1 if d.dropout else 0
    norm = "rmsnorm" if d.swiglu else "layernorm"
    ops = [
        _mem(f"{norm}1", 2 * e * s * h, 3 * e * s * h, replicated=True),
        OpProfile(name="qkv", kind="gemm", rows_per_sample=s, n=hp + 2 * kvp, k=h),
    ]
    if d.swiglu:
        ops.append(_mem("rotary", 2 * e * s * (hp + kvp), 2 * e * s * (hp + kvp)))
    core = dict(attention_core=True)
    ops += [
        OpProfile(name="scores", kind="gemm", rows_per_sample=s, n=s, k=dh, batch_per_sample=ap, scale="batch", **core),
        _mem("softmax", 2 * e * ap * s * s, 3 * e * ap * s * s, **core),
    ]
    if drop:
        ops.append(_mem("attention_dropout", (2 * e + 1) * ap * s * s, (2 * e + 1) * ap * s * s, **core))
    ops += [
        OpProfile(
            name="context", kind="gemm", rows_per_sample=s, n=dh, k=s, batch_per_sample=ap, scale="batch", **core
        ),
        _mem("context_permute", 2 * e * s * hp, 2 * e * s * hp),
        OpProfile(name="attention_out", kind="gemm", rows_per_sample=s, n=h, k=hp),
        _mem("residual_add1", (3 * e + drop) * s * h, (2 * e + drop) * s * h, replicated=True),
        _mem(f"{norm}2", 2 * e * s * h, 3 * e * s * h, replicated=True),
        OpProfile(name="mlp_in", kind="gemm", rows_per_sample=s, n=(2 if d.swiglu else 1) * f // t, k=h),
        _mem("activation", (3 if d.swiglu else 2) * e * s * f // t, (5 if d.swiglu else 3) * e * s * f // t),
        OpProfile(name="mlp_out", kind="gemm", rows_per_sample=s, n=h, k=f // t),
        _mem("residual_add2", (3 * e + drop) * s * h, (2 * e + drop) * s * h, replicated=True),
    ]
    return ops


def block_collectives(d: Dims) -> list[CollectiveNeed]:
    act = d.e * d.s * d.h
    needs = [CollectiveNeed(op="all_reduce", phase=p, bytes_per_sample=act, count=2) for p in ("forward", "backward")]
    for phase in ("forward", "backward"):
        for op in ("all_gather", "reduce_scatter"):
            needs.append(CollectiveNeed(op=op, phase=phase, bytes_per_sample=act, count=2, with_sequence_parallel=True))
    return needs


def _embed_ops(d: Dims, t: int) -> list[OpProfile]:
    """Embedding kernels: the lookup (reads rows, writes ``e s h``; with positions, an add and dropout), and
    its backward — a dense gradient of the rank's ``V/t x h`` table (written, then accumulated into the
    fp32 main gradient: 2 + 4 + 4 bytes per element, Megatron's ``main_grad``) plus the scatter of ``e s h``."""
    s, h, e = d.s, d.h, d.e
    drop = 1 if d.dropout else 0
    fwd = 2 * e * s * h + (3 * e * s * h if d.learned_positions else 0) + (2 * e + 1) * s * h * drop
    table = math.ceil(d.vocab / t) * h
    return [
        _mem(
            "embedding",
            fwd,
            2 * e * s * h,
            kernels=1 + int(d.learned_positions) + drop,
            backward_fixed_bytes=(e + 2 * FP32_BYTES) * table,
            backward_kernels=2,
        )
    ]


def embed_layer(d: Dims, tps: list[int]) -> LayerProfile:
    word = d.vocab * d.h
    pos = d.max_seq * d.h if d.learned_positions else 0
    masks = d.s * d.h if d.dropout else 0
    shards = [
        ShardProfile(
            tp=t,
            params=math.ceil(word / t) + pos,
            param_bytes=(math.ceil(word / t) + pos) * d.e,
            fwd_flops_per_sample=0,
            bwd_flops_per_sample=0,
            saved_bytes_per_sample=masks,
            saved_replicated_bytes_per_sample=masks,
            ops=_embed_ops(d, t),
            flops_origin="derived",
            memory_origin="derived",
        )
        for t in tps
    ]
    act = d.e * d.s * d.h
    needs = [
        CollectiveNeed(op="all_reduce", phase="forward", bytes_per_sample=act),
        CollectiveNeed(op="reduce_scatter", phase="forward", bytes_per_sample=act, with_sequence_parallel=True),
    ]
    return LayerProfile(
        path="embed",
        kind="embedding",
        signature=f"embed-v{d.vocab}-h{d.h}",
        tp_style="vocab_parallel",
        input_bytes_per_sample=8 * d.s,
        output_bytes_per_sample=act,
        shards=shards,
        collectives=needs,
    )


def _head_ops(d: Dims, t: int) -> list[OpProfile]:
    """LM head GEMM ``s x V/t x h`` and Megatron's vocab-parallel cross-entropy on fp32 logits
    (``_VocabParallelCrossEntropy``: cast e+4, max 4, subtract 8, exp 8, sum 4, divide 8 bytes per logit;
    backward: subtract the one-hot, multiply by the incoming gradient 8, cast to e for the GEMM 4+e)."""
    s, e, vt = d.s, d.e, math.ceil(d.vocab / t)
    return [
        OpProfile(name="lm_head", kind="gemm", rows_per_sample=s, n=vt, k=d.h),
        _mem("cross_entropy", (e + 36) * s * vt, (12 + e) * s * vt, kernels=6, backward_kernels=3),
    ]


def head_layer(d: Dims, tps: list[int]) -> LayerProfile:
    s, h, v, e = d.s, d.h, d.vocab, d.e
    shards = []
    for t in tps:
        params = 0 if d.tied else math.ceil(v * h / t)
        logits = 4 * s * v / t  # fp32 logits / softmax of the vocab-parallel cross-entropy
        shards.append(
            ShardProfile(
                tp=t,
                params=params,
                param_bytes=params * e,
                fwd_flops_per_sample=2 * s * h * v / t,
                bwd_flops_per_sample=4 * s * h * v / t,
                saved_bytes_per_sample=e * s * h + logits,
                saved_replicated_bytes_per_sample=e * s * h,
                logits_bytes_per_sample=e * s * v / t,  # the head's output, before the fp32 loss
                ops=_head_ops(d, t),
                flops_origin="derived",
                memory_origin="derived",
            )
        )
    act = e * s * h
    needs = []
    for sp in (False, True):
        needs.append(
            CollectiveNeed(op="all_reduce", phase="forward", bytes_per_sample=4 * s, count=3, with_sequence_parallel=sp)
        )
    needs += [
        CollectiveNeed(op="all_reduce", phase="backward", bytes_per_sample=act),
        CollectiveNeed(op="all_gather", phase="forward", bytes_per_sample=act, with_sequence_parallel=True),
        CollectiveNeed(op="reduce_scatter", phase="backward", bytes_per_sample=act, with_sequence_parallel=True),
    ]
    return LayerProfile(
        path="head",
        kind="head",
        signature=f"head-v{v}-h{h}-tied{int(d.tied)}",
        tp_style="vocab_parallel",
        input_bytes_per_sample=act,
        output_bytes_per_sample=4,
        shards=shards,
        collectives=needs,
    )


def norm_layer(d: Dims) -> LayerProfile:
    params = d.h if d.swiglu else 2 * d.h
    act = d.e * d.s * d.h
    norm = _mem("final_norm", 2 * act, 3 * act, replicated=True)
    shard = ShardProfile(
        tp=1,
        params=params,
        param_bytes=params * d.e,
        fwd_flops_per_sample=0,
        bwd_flops_per_sample=0,
        saved_bytes_per_sample=act,
        saved_replicated_bytes_per_sample=act,
        ops=[norm],
        flops_origin="derived",
        memory_origin="derived",
    )
    return LayerProfile(
        path="norm",
        kind="norm",
        signature=f"norm-h{d.h}",
        tp_style="none",
        input_bytes_per_sample=act,
        output_bytes_per_sample=act,
        shards=[shard],
    )


def default_tp_degrees(spec: ModelSpec) -> list[int]:
    """Powers of two up to 64 that divide the heads (and KV heads): the TP degrees a profile covers."""
    a = int(spec.dim("heads"))
    kv = int(spec.dim("kv_heads")) if spec.family in ("llama", "moe") else 0
    return [t for t in (1, 2, 4, 8, 16, 32, 64) if a % t == 0 and (kv or a) % t == 0]


def analytic_profile(
    spec: ModelSpec,
    *,
    seq: int,
    dtype: str,
    tps: list[int],
    layers: list[LayerProfile],
    total_params: int,
    created_utc: str,
    sources: list[str],
    notes: str,
) -> ModelProfile:
    """A closed-form model profile of ``layers`` (one sample of ``seq`` tokens, no timings)."""
    return ModelProfile(
        name=spec.name,
        model=spec,
        seq_len=seq,
        dtype=dtype,
        sample_shape=[seq],
        micro_batches=[1],
        tp_degrees=tps,
        total_params=total_params,
        layers=layers,
        provenance=Provenance(
            method="analytic",
            tool=f"stratagem {__version__}",
            created_utc=created_utc,
            sources=sources,
            notes=notes,
        ),
    )
