"""Closed-form model profile of a GPT or Llama transformer — no torch, instant for any size.

Builds the same :class:`planner.profiles.ModelProfile` a measured profile has (layers ``embed``,
``blocks.i``, ``norm``, ``head``; identical blocks share a signature; one shard per TP degree; the TP
collectives each layout issues), from the model's dimensions alone. Used for models too big to profile
here (the published Megatron cases) and by ``stratagem estimate``.

Formulas (per sample of ``s`` tokens, hidden ``h``, ``a`` heads, FFN width ``f``, vocab ``V``, element
size ``e`` bytes, TP degree ``t``):

- FLOPs: Narayanan et al. SC21 eq. 3 counts a GPT block forward as ``24 s h^2 + 4 s^2 h`` (QKV ``6sh^2``,
  scores and probs x V ``4 s^2 h``, projection ``2sh^2``, MLP ``16sh^2``) and the LM head as ``2 s h V``;
  backward is twice the forward. Generalised here to grouped-query attention (``h_kv``) and SwiGLU
  (three ``2shf`` matrices). Everything tensor-parallel divides by ``t``.
- Saved activations: Korthikanti et al. 2022 §4.1 (``sbh(34 + 5as/h)`` bytes per block with 16-bit
  activations and dropout): replicated part ``4e sh`` (two LayerNorm inputs, QKV and FC1 inputs) plus the
  1-byte dropout masks ``2 sh``; tensor-split part ``Q, K, V, projection input, GeLU input, FC2 input``;
  attention scores ``(2e + 1) a s^2`` (softmax output, dropout mask, dropout output), ``e a s^2``
  without dropout. With ``e = 2`` and dropout this is ``10 + 24/t + 5as/(ht)`` exactly (Table 2).
- Collectives (Megatron-LM, Shoeybi et al. 2019 §3; Korthikanti §4.2.2 for SP): per block two all-reduces
  of ``e sh`` forward and two backward; with sequence parallelism two all-gathers and two reduce-scatters
  each way. Vocab-parallel embedding: one forward all-reduce (SP: reduce-scatter). Vocab-parallel
  cross-entropy: three ``4s``-byte all-reduces (max, sum, target logit) forward, the input gradient
  all-reduce backward (SP: all-gather forward, reduce-scatter backward).
- Parameters: Megatron block ``12h^2 + 13h`` for ``f = 4h``; learned positions ``max_seq h`` (GPT);
  the head holds no parameters when tied to the embedding (SC21 eq. 2).

Dropout follows the spec (``dims['dropout'] > 0``); the Megatron runs used 0.1 (examples/pretrain_gpt.sh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import __version__
from planner.cost.constants import DTYPE_BYTES
from planner.errors import StratagemError
from planner.modelspec import ModelSpec, ffn_width
from planner.profiles import (
    CollectiveNeed,
    LayerProfile,
    ModelProfile,
    OpProfile,
    Precision,
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
class _Dims:
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
    q: int  # attention width, heads x head dim (= h unless a head dim is given: planner.moe_profile)


def _dims(spec: ModelSpec, seq_len: int, dtype: str) -> _Dims:
    if spec.family not in ("gpt", "llama", "moe"):
        raise StratagemError(
            f"closed-form profiles cover gpt and llama models, not {spec.family}; profile it "
            f"with `stratagem profile model` and pass --model-profile"
        )
    h, a = int(spec.dim("hidden")), int(spec.dim("heads"))
    if h % a:
        raise StratagemError(f"hidden {h} is not divisible by heads {a}; choose --hidden a multiple of --heads")
    llama_like = spec.family in ("llama", "moe")  # moe: a Llama decoder whose FFNs are experts (planner.moe_profile)
    kv = int(spec.dim("kv_heads")) if llama_like else 0
    kv = kv or a
    f = ffn_width(spec)
    dropout = spec.family == "gpt" and float(spec.dim("dropout")) > 0
    return _Dims(
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


def _block_params(d: _Dims) -> tuple[int, int]:
    """(tensor-split, replicated) parameters of one block at tp=1."""
    h, hkv, f, q = d.h, d.h_kv, d.f, d.q
    if d.swiglu:
        return h * (q + 2 * hkv) + q * h + 3 * h * f, 2 * h
    split = h * (q + 2 * hkv) + (q + 2 * hkv) + q * h + 2 * h * f + f
    return split, 2 * h + 4 * h  # projection and FC2 biases, two LayerNorms


def _block_shard(d: _Dims, t: int) -> ShardProfile:
    s, h, hkv, f, e, q = d.s, d.h, d.h_kv, d.f, d.e, d.q
    mlp_flops = (6 if d.swiglu else 4) * s * h * f
    score_flops = 4 * s * s * q
    fwd = 2 * s * h * (q + 2 * hkv) + 2 * s * q * h + score_flops + mlp_flops
    split_p, repl_p = _block_params(d)
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


def _block_ops(d: _Dims, t: int) -> list[OpProfile]:
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


def _block_collectives(d: _Dims) -> list[CollectiveNeed]:
    act = d.e * d.s * d.h
    needs = [CollectiveNeed(op="all_reduce", phase=p, bytes_per_sample=act, count=2) for p in ("forward", "backward")]
    for phase in ("forward", "backward"):
        for op in ("all_gather", "reduce_scatter"):
            needs.append(CollectiveNeed(op=op, phase=phase, bytes_per_sample=act, count=2, with_sequence_parallel=True))
    return needs


def _embed_ops(d: _Dims, t: int) -> list[OpProfile]:
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


def _embed_layer(d: _Dims, tps: list[int]) -> LayerProfile:
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


def _head_ops(d: _Dims, t: int) -> list[OpProfile]:
    """LM head GEMM ``s x V/t x h`` and Megatron's vocab-parallel cross-entropy on fp32 logits
    (``_VocabParallelCrossEntropy``: cast e+4, max 4, subtract 8, exp 8, sum 4, divide 8 bytes per logit;
    backward: subtract the one-hot, multiply by the incoming gradient 8, cast to e for the GEMM 4+e)."""
    s, e, vt = d.s, d.e, math.ceil(d.vocab / t)
    return [
        OpProfile(name="lm_head", kind="gemm", rows_per_sample=s, n=vt, k=d.h),
        _mem("cross_entropy", (e + 36) * s * vt, (12 + e) * s * vt, kernels=6, backward_kernels=3),
    ]


def _head_layer(d: _Dims, tps: list[int]) -> LayerProfile:
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


def _norm_layer(d: _Dims) -> LayerProfile:
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


def build_gpt_profile(
    spec: ModelSpec,
    *,
    seq_len: int | None = None,
    dtype: str = "bf16",
    tp_degrees: list[int] | None = None,
    created_utc: str = "",
    precision: Precision = "pure",
) -> ModelProfile:
    """The closed-form :class:`ModelProfile` of a GPT/Llama ``spec`` at ``seq_len`` tokens per sample.

    ``precision``: "pure" 16-bit training (Megatron-LM, torchtitan; the published rows), or "autocast", fp32
    weights under ``torch.autocast`` as Stratagem's runtime trains (``planner.autocast_profile``: its cast
    kernels, fp32 LayerNorm/softmax/cross-entropy and fp32 saved activations; GPT only, 16-bit dtypes only).

    >>> from planner.modelspec import parse_model
    >>> build_gpt_profile(parse_model("gpt:gpt3-175b")).total_params   # SC21 Table 1: 174.6B
    174615846912
    """
    if precision not in ("pure", "autocast"):
        raise StratagemError(f"unknown precision {precision!r}; use 'pure' or 'autocast'")
    if precision == "autocast" and DTYPE_BYTES.get(dtype) != 2:
        raise StratagemError(f"autocast runs 16-bit compute, not {dtype}; use --dtype bf16 or precision 'pure'")
    if spec.is_moe:
        if precision != "pure":
            raise StratagemError("autocast op lists cover the zoo's GPT; use precision 'pure' for MoE models")
        from planner.moe_profile import build_moe_profile  # the MoE blocks reuse this module's pieces

        return build_moe_profile(spec, seq_len=seq_len, dtype=dtype, tp_degrees=tp_degrees, created_utc=created_utc)
    if spec.family not in ("gpt", "llama"):
        _dims(spec, 1, dtype)  # raises the family error
    seq = int(seq_len or spec.dim("max_seq"))
    if dtype not in DTYPE_BYTES:
        raise StratagemError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    d = _dims(spec, seq, dtype)
    tps = tp_degrees or default_tp_degrees(spec)
    bad = [t for t in tps if d.a % t or (d.h_kv * d.a // d.q) % t]
    if bad or tps[0] != 1:
        raise StratagemError(f"TP degrees {tps} must start at 1 and divide heads {d.a}; drop {bad}")
    block_shards = [_block_shard(d, t) for t in tps]
    sig = f"{spec.family}-block-h{d.h}-a{d.a}-kv{d.h_kv}-f{d.f}-s{d.s}-drop{int(d.dropout)}"
    act = d.e * d.s * d.h
    blocks = [
        LayerProfile(
            path=f"blocks.{i}",
            kind="block",
            signature=sig,
            tp_style="megatron_block",
            input_bytes_per_sample=act,
            output_bytes_per_sample=act,
            shards=block_shards,
            collectives=_block_collectives(d),
        )
        for i in range(int(spec.dim("layers")))
    ]
    layers = [_embed_layer(d, tps), *blocks, _norm_layer(d), _head_layer(d, tps)]
    sources, notes = SOURCES, "closed-form (planner.gpt_profile); no timings"
    if precision == "autocast":
        from planner.autocast_profile import SOURCES as AUTOCAST_SOURCES, autocast_layers

        linear = {t: math.ceil(_block_params(d)[0] / t) + 2 * d.h for t in tps}  # + the unsplit biases
        layers = autocast_layers(d, layers, linear)
        sources, notes = SOURCES + AUTOCAST_SOURCES, notes + "; torch.autocast (planner.autocast_profile)"
    profile = analytic_profile(
        spec,
        seq=seq,
        dtype=dtype,
        tps=tps,
        layers=layers,
        total_params=sum(layer.params for layer in layers),
        created_utc=created_utc,
        sources=sources,
        notes=notes,
    )
    return profile if precision == "pure" else profile.model_copy(update={"precision": precision})


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
