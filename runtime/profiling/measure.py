"""Measure one module on one input: FLOPs, bytes saved for backward, forward/backward wall time.

Each top-level layer is run *standalone* on a saved copy of its input (the output of the layers before it),
so its numbers exclude its neighbours. Works on CPU and on the meta device (FLOPs and memory only).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from planner.profile import TimingStats


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedBytes:
    """Bytes autograd keeps for backward after one forward (parameters excluded, storages counted once)."""

    total_bytes: int
    attention_scores_bytes: int  # saved seq x seq tensors: softmax output, dropout mask and output


def make_input(x: torch.Tensor, *, needs_grad: bool) -> torch.Tensor:
    """A leaf copy of a layer input; float inputs of non-first layers require grad like inside the model."""
    x = x.detach().clone()  # own storage: a slice would make the saved-bytes count see the whole batch
    if needs_grad and x.is_floating_point():
        x.requires_grad_(True)
    return x


def _grad_like(out: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlopCounts:
    """FLOPs of one forward and one backward call, and the forward part spent on seq x seq scores."""

    forward: float
    backward: float
    forward_scores: float  # batched matmuls (QK^T, probs @ V); every Linear lowers to mm/addmm instead


def count_flops(module: nn.Module, x: torch.Tensor) -> FlopCounts:
    """FLOPs counted by ``FlopCounterMode`` (a matmul of (m, k) by (k, n) counts 2*m*n*k)."""
    with FlopCounterMode(display=False) as fwd:
        out = module(x)
    with FlopCounterMode(display=False) as bwd:
        if out.requires_grad:
            out.backward(_grad_like(out))
    module.zero_grad(set_to_none=True)
    scores = sum(v for op, v in fwd.get_flop_counts().get("Global", {}).items() if str(op) == "aten.bmm")
    return FlopCounts(
        forward=float(fwd.get_total_flops()), backward=float(bwd.get_total_flops()), forward_scores=float(scores)
    )


_SCORE_NODES = ("SoftmaxBackward", "NativeDropoutBackward", "LogSoftmaxBackward")
_VIEW_NODES = ("ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "ExpandBackward", "AsStridedBackward")


def _is_attention_scores(t: torch.Tensor, seq_len: int) -> bool:
    """A saved (seq x seq) attention tensor: a bool dropout mask, or softmax/dropout output (through views).

    Shape alone is ambiguous when head_dim or hidden equals seq, so the producing autograd node decides. The math
    attention of grouped-query models stacks each K/V head's query heads along the rows (``runtime.models.
    attention``), so the probabilities reach their product as (..., groups * seq, seq).
    """
    if seq_len <= 1 or t.dim() < 3 or t.shape[-1] != seq_len or t.shape[-2] % seq_len:
        return False
    if t.dtype == torch.bool:  # (b, heads, s, s) attention-dropout mask; hidden masks (b, s, h) are 3-D
        return t.dim() >= 4
    node, hops = t.grad_fn, 0
    while node is not None and hops < 4:
        name = type(node).__name__
        if name.startswith(_SCORE_NODES):
            return True
        if not name.startswith(_VIEW_NODES) or not node.next_functions:
            return False
        node, hops = node.next_functions[0][0], hops + 1
    return False


def _storage_key(t: torch.Tensor) -> int:
    # meta storages all have data_ptr() == 0, so key storages by their C++ object (docs/torch-distributed-on-cpu.md §10)
    return t.untyped_storage()._cdata


def saved_bytes(module: nn.Module, x: torch.Tensor, *, seq_len: int) -> SavedBytes:
    """Bytes saved for backward by one forward of ``module`` on ``x``, via ``saved_tensors_hooks``.

    Tensors sharing a storage are counted once (whole storage); parameters (and views of them) are excluded.
    """
    param_keys = {_storage_key(p) for p in module.parameters()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in param_keys:
            scores = _is_attention_scores(t, seq_len)
            nbytes, was_scores = seen.get(key, (0, False))
            seen[key] = (max(nbytes, t.untyped_storage().nbytes()), was_scores or scores)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    hooks.__enter__()  # __enter__ returns None (docs/torch-distributed-on-cpu.md §9), so no `with ... as`
    try:
        out = module(x)
    finally:
        hooks.__exit__(None, None, None)
    del out
    total = sum(n for n, _ in seen.values())
    scores_total = sum(n for n, is_scores in seen.values() if is_scores)
    return SavedBytes(total_bytes=total, attention_scores_bytes=scores_total)


def backward_working_set(module: nn.Module, x: torch.Tensor) -> int:
    """How far one backward of ``module`` on ``x`` grows the live tensor bytes above what its forward left (its
    saved tensors, its output): the gradient it receives (allocated here, ``ones_like`` its output), activation
    gradients and its input's gradient, less the saved tensors it frees on the way; the parameters' gradients
    are left out (the memory model holds those apart). Measured with ``runtime.executor.tensor_memory.
    TensorMemory``, on the meta device too."""
    from runtime.executor.tensor_memory import TensorMemory

    with TensorMemory([module], [], meta=True) as tracker:
        out = module(x)
        if not out.requires_grad:
            return 0
        tracker.reset()
        start = tracker.now()
        out.backward(_grad_like(out))
    module.zero_grad(set_to_none=True)
    peak = tracker.peak()
    growth = peak.peak_bytes - start.peak_bytes - (peak.by_kind["grads"] - start.by_kind["grads"])
    return max(0, int(growth))


def _stats(times_s: list[float], warmup: int) -> TimingStats:
    return TimingStats(
        median_s=statistics.median(times_s), min_s=min(times_s), max_s=max(times_s), repeats=len(times_s), warmup=warmup
    )


def time_layer(module: nn.Module, x: torch.Tensor, *, warmup: int, repeats: int) -> tuple[TimingStats, TimingStats]:
    """Forward and backward wall time (perf_counter) over ``repeats`` runs after ``warmup`` runs."""
    fwd_s: list[float] = []
    bwd_s: list[float] = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = module(x)
        t1 = time.perf_counter()
        if out.requires_grad:
            out.backward(_grad_like(out))
        t2 = time.perf_counter()
        if i >= warmup:
            fwd_s.append(t1 - t0)
            bwd_s.append(t2 - t1)
        del out
    module.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None
    return _stats(fwd_s, warmup), _stats(bwd_s, warmup)


def derived_timing(flops: float, flops_per_s: float) -> TimingStats:
    """A time derived as flops / achieved throughput (one "repeat", no warm-up)."""
    t = flops / flops_per_s
    return TimingStats(median_s=t, min_s=t, max_s=t, repeats=1, warmup=0)
