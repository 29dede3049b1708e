"""GPT (pre-norm decoder-only transformer).

Attention (:mod:`runtime.models.attention`) is fused SDPA when the plan says ``flash_attention: true`` and
explicit math (QK^T/sqrt(d), additive causal mask, softmax, dropout, @V; the tensors Korthikanti et al. 2022,
arXiv:2205.05198, §4.1 count) otherwise — the default of a model built outside a plan (profilers, references).

The fused ``qkv`` Linear orders its outputs per head as (heads, 3, head_dim), Megatron-LM's layout, so a
column split of the fused weight gives each TP rank whole heads of q, k and v.

Every layer builder takes ``tp``: ``tp=1`` is the full layer; ``tp=t`` is what ONE tensor-parallel rank
computes (heads/t, ffn/t, vocab/t) — used by the profiler to measure shards.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.attention import attend, causal_bias, dropout  # noqa: F401 - causal_bias re-exported
from runtime.models.dims import GPTDims
from runtime.models.layered import LayeredModel, LMHead, build_decoder


class Attention(nn.Module):
    """Multi-head causal self-attention with ``local_heads`` heads of ``head_dim`` (heads/tp on a TP rank)."""

    def __init__(self, hidden: int, local_heads: int, head_dim: int, p_drop: float) -> None:
        super().__init__()
        self.head_dim, self.p_drop = head_dim, p_drop
        self.qkv = nn.Linear(hidden, 3 * local_heads * head_dim)
        self.proj = nn.Linear(local_heads * head_dim, hidden)
        self.context = None  # context parallelism: a runtime.executor.context.ContextShard (apply_cp)
        self.fused_attention = False  # SDPA (the plan's flash_attention) or math (apply_attention)
        self.recompute_scores = False  # selective recompute: the math core re-runs in backward (apply_ac)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)  # -1 = local heads (works under DTensor TP)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # (b, heads, s, d)
        scale = 1.0 / math.sqrt(self.head_dim)
        how: dict[str, Any] = dict(
            fused=self.fused_attention,
            scale=scale,
            dropout_p=self.p_drop,
            training=self.training,
            recompute_scores=self.recompute_scores,
        )
        if self.context is not None:  # this rank's queries against the whole sequence's keys and values
            ctx = self.context.attend(q, k, v, **how)
        else:
            ctx = attend(q, k, v, **how)
        out = ctx.transpose(1, 2).reshape(b, s, -1)
        return dropout(self.proj(out), self.p_drop, self.training)


class MLP(nn.Module):
    """fc1 -> GELU -> fc2 -> dropout, with ``local_ffn`` hidden units (ffn/tp on a TP rank)."""

    def __init__(self, hidden: int, local_ffn: int, p_drop: float) -> None:
        super().__init__()
        self.p_drop = p_drop
        self.fc1 = nn.Linear(hidden, local_ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(local_ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(self.fc2(self.act(self.fc1(x))), self.p_drop, self.training)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)) (GPT-2, Radford et al. 2019 §2.3)."""

    def __init__(self, dims: GPTDims, tp: int = 1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dims.hidden)
        self.attn = Attention(dims.hidden, dims.heads // tp, dims.head_dim, dims.dropout)
        self.ln2 = nn.LayerNorm(dims.hidden)
        self.mlp = MLP(dims.hidden, dims.ffn_hidden // tp, dims.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def embedding_table(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding`` whose N(0, 1) init is skipped on meta (the meta ``normal_`` takes seconds at 175B)."""
    weight = torch.empty(rows, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(rows, dim, _weight=weight)


class VocabShardEmbedding(nn.Module):
    """Rows [start, start+rows) of an embedding table; ids outside give zeros (Megatron VocabParallelEmbedding).

    The full output is the sum (all-reduce) of every rank's partial output.
    """

    def __init__(self, rows: int, dim: int, start: int = 0) -> None:
        super().__init__()
        self.start = start
        self.weight = nn.Parameter(torch.empty(rows, dim))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


class Embedding(nn.Module):
    """Token + learned position embedding, then dropout."""

    def __init__(self, dims: GPTDims, tp: int = 1) -> None:
        super().__init__()
        self.p_drop = dims.dropout
        self.tok = (
            embedding_table(dims.vocab, dims.hidden) if tp == 1 else VocabShardEmbedding(dims.vocab // tp, dims.hidden)
        )
        self.pos = embedding_table(dims.max_seq, dims.hidden)
        self.context = None  # context parallelism: the rank's tokens keep their global positions (apply_cp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = (
            torch.arange(ids.shape[1], device=ids.device)
            if self.context is None
            else self.context.positions(ids.device)
        )
        return dropout(self.tok(ids) + self.pos(positions), self.p_drop, self.training)


def build_gpt_layer(dims: GPTDims, path: str, tp: int = 1) -> nn.Module:
    """One top-level layer (``embed``, ``blocks.i``, ``norm``, ``head``); ``tp`` > 1 gives one rank's shard."""
    if path == "embed":
        return Embedding(dims, tp)
    if path.startswith("blocks."):
        return Block(dims, tp)
    if path == "norm":
        return nn.LayerNorm(dims.hidden)
    if path == "head":
        return LMHead(dims.hidden, dims.vocab // tp, bias=False)
    raise KeyError(path)


def build_gpt(dims: GPTDims) -> LayeredModel:
    """The whole GPT; the head shares the token embedding's weight when ``tie_embeddings``."""
    return build_decoder(dims, build_gpt_layer)
