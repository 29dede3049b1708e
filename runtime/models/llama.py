"""Llama (Touvron et al. 2023): RMSNorm, rotary position embedding, grouped-query attention, SwiGLU.

Attention is fused SDPA or explicit math as the plan says, like :mod:`runtime.models.gpt`.
Rotary tables are computed in ``forward`` (no buffers), so a model
materialized from meta with ``to_empty`` needs no buffer re-initialisation.

RMSNorm and the SwiGLU product keep only their inputs for backward and re-run their element-wise ops there, as
the fused kernels do (Megatron-LM's fused SwiGLU, Apex / Transformer Engine RMSNorm): a block then saves what
the cost model counts (``planner.profile.gpt``: two norm inputs, the GEMM inputs, gate and up of the MLP), not
the extra normalised tensor and SiLU output that eager autograd would keep (``tests/test_saved_bytes.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.models.attention import attend
from runtime.models.dims import LlamaDims
from runtime.models.gpt import VocabShardEmbedding, embedding_table
from runtime.models.layered import LayeredModel, LMHead, build_decoder

RMS_EPS = 1e-5  # Meta llama ModelArgs.norm_eps


def recompute_in_backward(fn, *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)``, keeping only ``args`` for backward and re-running ``fn`` there (element-wise ``fn`` only:
    its RNG state is not replayed)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = RMS_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recompute_in_backward(self._normalize, x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (s, head_dim/2): angle = pos * theta^(-2i/d) (Su et al. 2021, RoFormer eq. 34)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x (b, s, heads, d) by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal GQA attention with ``local_heads`` query heads sharing ``local_kv`` key/value heads."""

    def __init__(self, dims: LlamaDims, tp: int = 1) -> None:
        super().__init__()
        self.head_dim, self.theta = dims.head_dim, dims.rope_theta
        local_heads, local_kv = dims.heads // tp, dims.kv_heads // tp
        self.wq = nn.Linear(dims.hidden, local_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dims.hidden, local_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(dims.hidden, local_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(local_heads * self.head_dim, dims.hidden, bias=False)
        self.context = None  # context parallelism: a runtime.executor.context.ContextShard (apply_cp)
        self.fused_attention = False  # SDPA (the plan's flash_attention) or math (apply_attention)
        self.recompute_scores = False  # selective recompute: the math core re-runs in backward (apply_ac)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        ctx = self.context
        if ctx is None:
            cos, sin = rotary_tables(s, self.head_dim, self.theta, device=x.device, dtype=x.dtype)
        else:  # the angles of the rank's tokens' global positions
            pos = ctx.positions(x.device)
            cos, sin = (
                t[pos] for t in rotary_tables(ctx.seq_len, self.head_dim, self.theta, device=x.device, dtype=x.dtype)
            )
        q = apply_rotary(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d); k, v with the kv heads
        scale = 1.0 / math.sqrt(self.head_dim)
        fused, recompute = self.fused_attention, self.recompute_scores
        if ctx is not None:  # the whole sequence's few K/V heads, repeated for the query heads inside
            out = ctx.attend(q, k, v, fused=fused, scale=scale, recompute_scores=recompute)
        else:
            out = attend(q, k, v, fused=fused, scale=scale, recompute_scores=recompute)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Shazeer 2020)."""

    def __init__(self, hidden: int, local_ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, local_ffn, bias=False)
        self.w3 = nn.Linear(hidden, local_ffn, bias=False)
        self.w2 = nn.Linear(local_ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(recompute_in_backward(_silu_product, self.w1(x), self.w3(x)))


def _silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Block(nn.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x)) with RMSNorms."""

    def __init__(self, dims: LlamaDims, tp: int = 1) -> None:
        super().__init__()
        self.ln1 = RMSNorm(dims.hidden)
        self.attn = Attention(dims, tp)
        self.ln2 = RMSNorm(dims.hidden)
        self.mlp = FeedForward(dims.hidden, dims.ffn_hidden // tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token embedding only (positions enter through rotary attention)."""

    def __init__(self, dims: LlamaDims, tp: int = 1) -> None:
        super().__init__()
        self.tok = (
            embedding_table(dims.vocab, dims.hidden) if tp == 1 else VocabShardEmbedding(dims.vocab // tp, dims.hidden)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)


def build_llama_layer(dims: LlamaDims, path: str, tp: int = 1) -> nn.Module:
    """One top-level layer (``embed``, ``blocks.i``, ``norm``, ``head``); ``tp`` > 1 gives one rank's shard."""
    if path == "embed":
        return Embedding(dims, tp)
    if path.startswith("blocks."):
        return Block(dims, tp)
    if path == "norm":
        return RMSNorm(dims.hidden)
    if path == "head":
        return LMHead(dims.hidden, dims.vocab // tp, bias=False)
    raise KeyError(path)


def build_llama(dims: LlamaDims) -> LayeredModel:
    """The whole Llama; the head shares the token embedding's weight when ``tie_embeddings``."""
    return build_decoder(dims, build_llama_layer)
