"""The closed-form GPT profile as torch.autocast runs it: fp32 weights, 16-bit GEMMs, fp32 element-wise ops.

``planner.profile.gpt`` describes *pure* 16-bit training (Megatron-LM, torchtitan): weights, activations and
gradients in the compute dtype, fused kernels. Stratagem's runtime trains differently (``runtime/executor``:
fp32 parameters, each micro-batch's forward, loss and backward inside ``torch.autocast(bf16)``) and runs the
zoo's GPT (``runtime/models/gpt.py``: pre-norm blocks, explicit attention QK^T * scale + mask, softmax,
dropout, @V). Under autocast (PyTorch docs, "Automatic Mixed Precision package - torch.amp", § "Autocast Op
Reference"):

- ops on the "CUDA Ops that can autocast to float32" list — ``layer_norm``, ``softmax``, ``log_softmax``,
  ``cross_entropy``/``nll_loss`` among them — cast their 16-bit inputs to fp32 and run in fp32; ops on the
  lower-precision list (``linear``, ``matmul``, ``bmm``, ``addmm``) cast fp32 inputs to 16 bits. Each cast is
  an ``aten::_to_copy`` kernel, and its backward (``ToCopyBackward0``) casts the gradient back;
- fp32 weights are cast once per autocast region: ``aten/src/ATen/autocast_mode.cpp`` ``cached_cast`` keeps
  the 16-bit copy of a leaf fp32 tensor that requires grad until the outermost region exits (its cache is
  cleared in ``torch.autocast.__exit__``). The runtime opens one region per micro-batch (``LocalRunner``) or
  per step (``PipelineRunner``); the copies are also what the GEMMs save for their input gradients;
- element-wise ops on neither list run in their input's dtype, with type promotion: the residual stream
  ``x + attn(ln(x))`` is fp32 (the embedding and LayerNorm outputs are), so LayerNorm saves fp32 inputs,
  each residual add reads an fp32 and a 16-bit operand, and autograd casts the fp32 gradient back to the
  16-bit branch;
- the CUDA softmax backward first multiplies ``grad * output`` in its own kernel, then runs the reduction
  kernel (``aten/src/ATen/native/cuda/SoftMax.cu``, ``softmax_backward_cuda_out``); ``log_softmax`` over a
  vocabulary-wide row (``cunn_SoftMaxForward``/``Backward``) reads the row three times and writes it once.

Per sample of ``s`` tokens (``h`` hidden, ``a/t`` heads and ``f/t`` FFN on a TP rank, 2-byte bf16 ``E``,
4-byte fp32 ``F``), the block's kernels in the order they run, with HBM bytes forward / backward:
LayerNorm fp32 ``8sh / 12sh``; cast to 16 bits ``6sh / 6sh`` (both LayerNorms); q, k, v made contiguous for
the batched GEMMs (three copies, ``12sh/t``; backward stacks the three gradients, ``12sh/t``); scale and
causal-mask add in 16 bits ``8as^2/t / 4as^2/t`` (plus the mask itself, ``6s^2`` per micro-batch); cast to
fp32 ``6as^2/t`` each way; softmax fp32 ``8as^2/t / 24as^2/t`` (two kernels); probabilities dropout in fp32
``9as^2/t`` each way when the model has dropout; cast to 16 bits ``6as^2/t`` each way; the context permute
``4sh/t``; residual add ``10sh`` forward, backward a cast of the gradient ``6sh`` and the accumulation of the
residual stream's two gradients ``12sh``; GELU in 16 bits ``4sf/t / 6sf/t``; the weight casts ``6`` bytes per
parameter each way, per micro-batch, one kernel per tensor; the bias gradients (a reduction over the tokens,
``E`` bytes per output element).

Saved for backward (per sample): fp32 LayerNorm inputs ``4sh`` each (and their fp32 mean and rstd, ``8s``),
the 16-bit GEMM inputs (``2sh`` after each LayerNorm, ``6sh/t`` for q, k, v, ``2sh/t`` for the context,
``2sf/t`` twice in the MLP), the fp32 softmax output ``4as^2/t`` and the 16-bit probabilities ``2as^2/t``
(with dropout: its 1-byte mask too); per micro-batch the 16-bit weight copies, ``2`` bytes per parameter.
The head saves the 16-bit input and the fp32 log-probabilities ``4sV/t``, and holds the loss's two fp32
gradients (``nll_loss`` and ``log_softmax`` backward, ``8sV/t``) when the backward starts — the step's peak,
when every layer's activations are still alive — so they are counted with its saved bytes.

Weights, gradients and AdamW moments are fp32 (4 + 4 + 8 bytes per parameter, ``ShardProfile.param_bytes``
4 per parameter) and the runtime's FSDP2 wrappers, given no mixed-precision policy, communicate them in fp32:
``planner.cost.memory.state_dtype`` makes the estimate and the search price states and gradient/weight
collectives in fp32 for autocast profiles.

Where it is used: ``build_gpt_profile(..., precision="autocast")`` (``ModelProfile.precision`` records it);
``planner.calibrate.metrics_runs`` for ``stratagem launch`` metrics of a bf16 GPT on CUDA; ``benchmarks/gpu_runs.py``
(``--from-data`` re-predicts ``benchmarks/data/h100``: step time 50 % -> 19 % mean |error|, peak memory without
the reserve 37 % -> 6 %); ``stratagem plan/estimate --precision autocast``. Those two keep "pure" as their
default: it is what the published Megatron/DeepSpeed/torchtitan rows ran (``benchmarks/cost_accuracy.py``), what
a plan exported to those frameworks runs, the only mode for Llama and MoE, and what ``stratagem launch`` runs by
default since it compiles each block on CUDA (autocast's activation casts fused; its weight casts stay, 4-7 % of
device time on an H200, ``benchmarks/data/h200``) or uses FSDP2's bf16 policy. ``--precision autocast`` prices
``launch --no-compile`` (eager autocast), and runs of earlier runtimes (``runtime_precision``).

Assumptions: the weight copies and the loss's gradients are counted per micro-batch in flight — exact at
``pp = 1`` (``LocalRunner``: one micro-batch at a time, one autocast region each) and for 1F1B's last stage,
an overcount where a pipeline stage holds several (``PipelineRunner`` opens one region per step, so one copy);
gradient accumulation across micro-batches into the fp32 ``.grad`` (an add per parameter from
the second micro-batch on) is not counted; the torch AdamW step (``foreach``, unfused, fp32) moves
``constants.TORCH_ADAMW_BYTES_PER_PARAM`` per parameter (``memory.optimizer_bytes_per_param``).
Scope: the zoo's GPT (``family == "gpt"``); tensor-parallel shards follow the same formulas, unmeasured.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.core import StratagemError
from planner.profile.schema import LayerProfile, OpProfile, ShardProfile

if TYPE_CHECKING:
    from planner.profile.transformer_layers import Dims

E, F = 2, 4  # bytes of a bf16/fp16 and of an fp32 element
CAST = E + F  # a cast reads one width and writes the other
NORM_STATS = 2 * F  # LayerNorm's fp32 mean and rstd per token
SOURCES = [
    "PyTorch docs, Automatic Mixed Precision package - torch.amp, Autocast Op Reference: "
    "CUDA Ops that can autocast to float32 (layer_norm, softmax, log_softmax, cross_entropy, nll_loss)",
    "PyTorch aten/src/ATen/autocast_mode.cpp cached_cast: 16-bit copies of fp32 leaf weights cached per region",
    "PyTorch aten/src/ATen/native/cuda/SoftMax.cu softmax_backward_cuda_out: tmp = grad * output kernel",
]


def _mem(name: str, fwd: float, bwd: float, **kw) -> OpProfile:
    return OpProfile(name=name, kind="memory", bytes_per_sample=fwd, backward_bytes_per_sample=bwd, **kw)


def _gemm(name: str, rows: int, n: int, k: int, **kw) -> OpProfile:
    return OpProfile(name=name, kind="gemm", rows_per_sample=rows, n=n, k=k, **kw)


def _layernorm(name: str, d: "Dims") -> list[OpProfile]:
    """An fp32 LayerNorm and the cast of its output to 16 bits for the next GEMM (both on every TP rank)."""
    sh = d.s * d.h
    return [
        _mem(name, 2 * F * sh, 3 * F * sh, replicated=True),
        _mem(f"{name}_cast", CAST * sh, CAST * sh, replicated=True),
    ]


def _residual_add(name: str, d: "Dims") -> OpProfile:
    """fp32 stream + 16-bit branch (after its 16-bit dropout): the add, and backward the cast of the gradient
    to the branch plus the accumulation of the stream's two gradients (the LayerNorm's and the add's)."""
    sh, drop = d.s * d.h, int(d.dropout)
    return _mem(
        name,
        (2 * F + E) * sh + (2 * E + 1) * sh * drop,
        CAST * sh + 3 * F * sh + (2 * E + 1) * sh * drop,
        kernels=1 + drop,
        backward_kernels=2 + drop,
        replicated=True,
    )


def _weight_cast(params: int, bias_outputs: int, tensors: int, d: "Dims") -> OpProfile:
    """Per micro-batch: ``tensors`` fp32 weights cast to 16 bits (``cached_cast``) and, backward, their 16-bit
    gradients cast back to fp32, plus one token reduction per bias gradient (``bias_outputs`` output widths)."""
    biases = tensors // 2
    return _mem(
        "weight_cast",
        0,
        E * d.s * bias_outputs,
        kernels=tensors,
        fixed_bytes=CAST * params,
        backward_fixed_bytes=CAST * params,
        backward_kernels=tensors + biases,
    )


def block_ops(d: "Dims", t: int, linear_params: int) -> list[OpProfile]:
    """A GPT block's kernels on one of ``t`` TP ranks under autocast (module docstring)."""
    s, h, f = d.s, d.h, d.f
    hp, ap, dh, fp = d.q // t, d.a // t, d.q // d.a, f // t
    ss = ap * s * s
    drop = int(d.dropout)
    core = dict(attention_core=True)
    ops = [
        *_layernorm("layernorm1", d),
        _gemm("qkv", s, 3 * hp, h),
        _mem("qkv_contiguous", 3 * 2 * E * s * hp, 3 * 2 * E * s * hp, kernels=3),
        _gemm("scores", s, s, dh, batch_per_sample=ap, scale="batch", **core),
        _mem("scale_mask", 4 * E * ss, 2 * E * ss, kernels=4, fixed_bytes=3 * E * s * s, **core),
        _mem("softmax_cast", CAST * ss, CAST * ss, **core),
        _mem("softmax", 2 * F * ss, 6 * F * ss, backward_kernels=2, **core),
    ]
    if drop:
        ops.append(_mem("attention_dropout", (2 * F + 1) * ss, (2 * F + 1) * ss, **core))
    ops += [
        _mem("probs_cast", CAST * ss, CAST * ss, **core),
        _gemm("context", s, dh, s, batch_per_sample=ap, scale="batch", **core),
        _mem("context_permute", 2 * E * s * hp, 2 * E * s * hp),
        _gemm("attention_out", s, h, hp),
        _residual_add("residual_add1", d),
        *_layernorm("layernorm2", d),
        _gemm("mlp_in", s, fp, h),
        _mem("activation", 2 * E * s * fp, 3 * E * s * fp),
        _gemm("mlp_out", s, h, fp),
        _residual_add("residual_add2", d),
        _weight_cast(linear_params, 3 * hp + h + fp + h, 8, d),
    ]
    return ops


def block_shard(pure: ShardProfile, d: "Dims", t: int, linear_params: int) -> ShardProfile:
    """``pure``'s FLOPs and parameters with autocast's kernels and saved bytes (module docstring)."""
    s, h = d.s, d.h
    drop = int(d.dropout)
    replicated = 2 * (F * s * h + NORM_STATS * s + E * s * h) + 2 * s * h * drop
    split = E * (4 * s * d.q + 2 * s * d.f) / t
    scores = (F + E + drop) * d.a * s * s / t
    return pure.model_copy(
        update=dict(
            ops=block_ops(d, t, linear_params),
            saved_bytes_per_sample=replicated + split + scores,
            saved_replicated_bytes_per_sample=replicated,
            saved_attention_scores_bytes_per_sample=scores,
            saved_fixed_bytes=E * linear_params,
        )
    )


def embed_shard(pure: ShardProfile, d: "Dims", t: int) -> ShardProfile:
    """fp32 token and position lookups and their add (and fp32 dropout); backward each table's dense fp32
    gradient (zero-filled, then scattered) and, with tied weights, the add of the head's gradient of the
    word table (``AccumulateGrad``: read two, write one)."""
    sh, drop = d.s * d.h, int(d.dropout)
    table = math.ceil(d.vocab / t) * d.h
    positions = d.max_seq * d.h
    tied = int(d.tied)
    op = _mem(
        "embedding",
        2 * 2 * F * sh + 3 * F * sh + (2 * F + 1) * sh * drop,
        2 * 2 * F * sh + (2 * F + 1) * sh * drop,
        kernels=4 + drop,
        backward_fixed_bytes=F * (table + positions) + 3 * F * table * tied,
        backward_kernels=4 + tied + drop,
    )
    saved = 2 * 8 * d.s + sh * drop  # int64 token and position ids, the dropout mask
    return pure.model_copy(update=dict(ops=[op], saved_bytes_per_sample=saved, saved_replicated_bytes_per_sample=saved))


def norm_shard(pure: ShardProfile, d: "Dims") -> ShardProfile:
    """The final fp32 LayerNorm (its 16-bit cast belongs to the head's input)."""
    sh = d.s * d.h
    saved = F * sh + NORM_STATS * d.s
    op = _mem("final_norm", 2 * F * sh, 3 * F * sh, replicated=True)
    return pure.model_copy(update=dict(ops=[op], saved_bytes_per_sample=saved, saved_replicated_bytes_per_sample=saved))


def head_shard(pure: ShardProfile, d: "Dims", t: int) -> ShardProfile:
    """Cast of the normed input and of the (tied) fp32 weight, the LM head GEMM, ``logits.float()`` and the
    fp32 cross-entropy (``log_softmax`` 3 reads + 1 write, ``nll_loss``; backward ``nll_loss``'s zero-filled
    gradient, then ``log_softmax``'s)."""
    sh, vt = d.s * d.h, math.ceil(d.vocab / t)
    sv = d.s * vt
    weight = vt * d.h
    ops = [
        _mem("head_cast", CAST * sh, CAST * sh, replicated=True),
        _mem("head_weight_cast", 0, 0, fixed_bytes=CAST * weight, backward_fixed_bytes=CAST * weight),
        _gemm("lm_head", d.s, vt, d.h),
        _mem("logits_cast", CAST * sv, CAST * sv),
        _mem("cross_entropy", 4 * F * sv, F * sv + 4 * F * sv, kernels=2, backward_kernels=3),
    ]
    saved = E * sh + F * sv + 2 * F * sv  # 16-bit input, fp32 log-probabilities, the loss's two gradients
    return pure.model_copy(
        update=dict(
            ops=ops,
            saved_bytes_per_sample=saved,
            saved_replicated_bytes_per_sample=E * sh,
            saved_fixed_bytes=E * weight,
        )
    )


def autocast_layers(d: "Dims", layers: list[LayerProfile], linear_params: dict[int, int]) -> list[LayerProfile]:
    """``layers`` (a pure GPT profile's) re-described as torch.autocast runs them; ``linear_params[t]`` are
    the linear weights and biases of one block's shard at TP degree ``t`` (what autocast casts)."""
    if not d.learned_positions or d.swiglu:
        raise StratagemError(
            "autocast op lists cover the zoo's GPT (runtime/models/gpt.py); use precision 'pure' for Llama and MoE"
        )
    out = []
    for layer in layers:
        if layer.kind == "block":
            shards = [block_shard(sh, d, sh.tp, linear_params[sh.tp]) for sh in layer.shards]
        elif layer.kind == "embedding":
            shards = [embed_shard(sh, d, sh.tp) for sh in layer.shards]
        elif layer.kind == "norm":
            shards = [norm_shard(sh, d) for sh in layer.shards]
        else:
            shards = [head_shard(sh, d, sh.tp) for sh in layer.shards]
        shards = [sh.model_copy(update=dict(param_bytes=F * sh.params)) for sh in shards]  # fp32 weights
        out.append(layer.model_copy(update=dict(shards=shards, signature=f"{layer.signature}-autocast")))
    return out
