"""Closed-form model profile of a GPT or Llama transformer — no torch, instant for any size.

Builds the same :class:`planner.profile.load.ModelProfile` a measured profile has (layers ``embed``,
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

from planner.core import DTYPE_BYTES, Precision, StratagemError
from planner.model import ModelSpec
from planner.profile.autocast import SOURCES as AUTOCAST_SOURCES
from planner.profile.autocast import autocast_layers
from planner.profile.moe import build_moe_profile
from planner.profile.schema import LayerProfile, ModelProfile
from planner.profile.transformer_layers import (
    SOURCES,
    analytic_profile,
    block_collectives,
    block_params,
    block_shard,
    default_tp_degrees,
    dims_of,
    embed_layer,
    head_layer,
    norm_layer,
)

__all__ = ["SOURCES", "analytic_profile", "build_gpt_profile", "default_tp_degrees"]


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
    weights under ``torch.autocast`` as Stratagem's runtime trains (``planner.profile.autocast``: its cast
    kernels, fp32 LayerNorm/softmax/cross-entropy and fp32 saved activations; GPT only, 16-bit dtypes only).

    >>> from planner.model.spec import parse_model
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
        return build_moe_profile(spec, seq_len=seq_len, dtype=dtype, tp_degrees=tp_degrees, created_utc=created_utc)
    if spec.family not in ("gpt", "llama"):
        dims_of(spec, 1, dtype)  # raises the family error
    seq = int(seq_len or spec.dim("max_seq"))
    if dtype not in DTYPE_BYTES:
        raise StratagemError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    d = dims_of(spec, seq, dtype)
    tps = tp_degrees or default_tp_degrees(spec)
    bad = [t for t in tps if d.a % t or (d.h_kv * d.a // d.q) % t]
    if bad or tps[0] != 1:
        raise StratagemError(f"TP degrees {tps} must start at 1 and divide heads {d.a}; drop {bad}")
    block_shards = [block_shard(d, t) for t in tps]
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
            collectives=block_collectives(d),
        )
        for i in range(int(spec.dim("layers")))
    ]
    layers = [embed_layer(d, tps), *blocks, norm_layer(d), head_layer(d, tps)]
    sources, notes = SOURCES, "closed-form (planner.profile.gpt); no timings"
    if precision == "autocast":
        linear = {t: math.ceil(block_params(d)[0] / t) + 2 * d.h for t in tps}  # + the unsplit biases
        layers = autocast_layers(d, layers, linear)
        sources, notes = SOURCES + AUTOCAST_SOURCES, notes + "; torch.autocast (planner.profile.autocast)"
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
