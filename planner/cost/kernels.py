"""Shape-aware time of a layer's kernels: GEMMs with tile and wave quantization and a roofline, element-wise
kernels at HBM bandwidth, and a per-kernel device gap and host issue cost.

A layer's forward is the list of kernels in its shard's ``ops`` (:class:`planner.profile.load.OpProfile`, built
from the model's dimensions by ``planner.profile.gpt``); the device's parameters are its node type's
:class:`planner.profile.load.KernelModel` (values and sources: ``planner.profile.hardware_catalog``).

GEMM ``batch x (m x n x k)`` (2 m n k FLOPs each). A GPU computes the output in tiles of ``tm x tn``, one tile
per streaming multiprocessor at a time, so the kernel takes ``waves = ceil(tiles / SMs)`` tile-times
(wave quantization) and computes whole tiles even where the output ends mid-tile (tile quantization) —
NVIDIA "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/performance), §§ "Tile
quantization", "Wave quantization". One tile-time is ``2 tm tn k / (ceiling * rel_eff * peak / SMs)``;
the library's choice is modelled as the fastest of the profile's tile shapes, each also with split-K
(``k`` cut into 2 or 4 slices that run as separate tiles, plus a reduction of the fp32 partial outputs;
CUTLASS ``GemmSplitKParallel``). A GEMM whose operands and output take longer to stream than its arithmetic
is memory-bound (roofline, Williams, Waterman & Patterson, CACM 2009): the time is the larger of the two.
A GEMM whose ``n`` or ``k`` is not a multiple of 16 bytes (:func:`aligned`; e.g. GPT-2's unpadded vocabulary
of 50,257 in the LM head) runs its arithmetic at the node type's ``unaligned_gemm_efficiency`` (cuBLAS then
picks an older, unaligned tensor-core kernel: on the H100 measured here ``cutlass_75_tensorop_bf16_s1688gemm``,
at 0.18-0.23 of the aligned rate, ``benchmarks/data/h100``).

Element-wise kernels (norms, softmax, dropout, activations, residual adds, the cross-entropy) move their
bytes at ``memory_bw_efficiency`` x the datasheet HBM bandwidth.

Launch cost. The device idles ``kernel_gap_s`` between dependent kernels, and the host needs ``host_op_s``
to issue each operator (framework dispatch + ``cudaLaunchKernel``); the host runs ahead of the device, so a
pass takes ``max(sum of kernel times + n * gap, n * host_op_s)`` — small models are launch-bound.

The backward of a GEMM is two GEMMs (input gradient ``m x k`` from ``m x n`` and ``n x k``; weight gradient
``k x n`` over the ``m`` rows: Goodfellow et al., Deep Learning §6.5), so it runs at the efficiency of its
own shapes (a weight gradient's ``m``-long reduction is split-K friendly; its output may be only a few
tiles). Flash attention (Dao et al. 2022) replaces the attention-core kernels by one fused kernel at
``flash_attention_efficiency`` x peak; its backward does 2.5x the forward FLOPs (2x, plus recomputing
``QK^T``: FlashAttention-2, Dao 2023, §3.1.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.core import DTYPE_BYTES, MEMORY_BW_EFFICIENCY, OPTIMIZER_FLOPS_PER_PARAM
from planner.profile import KernelModel, NodeType, OpProfile

SPLIT_K = (1, 2, 4)  # split-K factors the model lets the library choose from (CUTLASS split-K parallel)
FP32_BYTES = 4  # split-K partial outputs are fp32 (CUTLASS accumulates in fp32)
FLASH_BACKWARD_FLOPS_FACTOR = 2.5  # FlashAttention-2 §3.1.2: backward = 2x forward + the QK^T recompute


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """What the kernel model needs of one device in one dtype."""

    km: KernelModel
    peak_flops_per_s: float
    # peak of the dtype fused attention runs in (None: the GEMMs' dtype); constants.ATTENTION_DTYPE
    attention_peak_flops_per_s: float | None = None
    memory_bw_bytes_per_s: float
    elem_bytes: int

    @classmethod
    def of_node(cls, node: NodeType, dtype: str = "bf16") -> "Device":
        """``node``'s GEMM and memory parameters in ``dtype`` (its kernel model, dense peak, HBM bandwidth)."""
        if node.kernel_model is None or node.memory_bw_bytes_per_s is None:
            raise ValueError(f"node type {node.name} has no kernel model or memory bandwidth")
        return cls(
            km=node.kernel_model,
            peak_flops_per_s=node.compute_for(dtype).peak_flops_per_s,
            memory_bw_bytes_per_s=node.memory_bw_bytes_per_s,
            elem_bytes=DTYPE_BYTES[dtype],
        )

    @property
    def stream_bytes_per_s(self) -> float:
        return self.memory_bw_bytes_per_s * self.km.memory_bw_efficiency

    @property
    def key(self) -> tuple:
        """Everything a GEMM's time depends on besides its shape (the cache key of :func:`gemm_s`)."""
        km = self.km
        return (
            km.sm_count,
            km.gemm_ceiling,
            km.memory_bw_efficiency,
            km.unaligned_gemm_efficiency,
            tuple((t.m, t.n, t.relative_efficiency) for t in km.tile_shapes),
            self.peak_flops_per_s,
            self.memory_bw_bytes_per_s,
            self.elem_bytes,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PassTime:
    """Device time of a pass's kernels (without gaps) and their count."""

    kernel_s: float = 0.0
    kernels: int = 0

    def __add__(self, other: "PassTime") -> "PassTime":
        return PassTime(kernel_s=self.kernel_s + other.kernel_s, kernels=self.kernels + other.kernels)

    def wall_s(self, km: KernelModel) -> float:
        """Seconds the pass takes: device-bound or launch-bound, whichever is longer."""
        return max(self.kernel_s + self.kernels * km.kernel_gap_s, self.kernels * km.host_op_s)


_GEMM_CACHE: dict[tuple, float] = {}
_GEMM_CACHE_LIMIT = 200_000  # shapes x devices; the search asks for a few thousand


def gemm_s(m: int, n: int, k: int, batch: int, dev: Device, *, lead: tuple[int, int] | None = None) -> float:
    """Seconds for ``batch`` GEMMs of ``m x n x k`` (module docstring: tiles, waves, split-K, roofline);
    cached per shape and device parameters (the search asks for the same shapes many times).

    ``lead``: the leading dimensions of the stored operands, checked for alignment (:func:`aligned`); default
    ``(n, k)``, a row-major ``A @ B``. A weight gradient ``dY^T @ X`` reduces over the tokens, which are no
    operand's leading dimension: its leading dimensions are its output's ``m`` and ``n``.
    """
    if min(m, n, k, batch) <= 0:
        return 0.0
    lead_n, lead_k = lead if lead is not None else (n, k)
    unaligned = not aligned(lead_n, lead_k, dev.elem_bytes)
    key = (m, n, k, batch, unaligned, dev.key)
    if key not in _GEMM_CACHE:
        if len(_GEMM_CACHE) > _GEMM_CACHE_LIMIT:
            _GEMM_CACHE.clear()
        _GEMM_CACHE[key] = _gemm_uncached_s(m, n, k, batch, dev, unaligned)
    return _GEMM_CACHE[key]


def aligned(n: int, k: int, elem_bytes: int) -> bool:
    """Whether a row-major ``m x k @ k x n`` GEMM's leading dimensions (``k`` of A, ``n`` of B and C) are
    multiples of 16 bytes, the alignment the fast tensor-core kernels need (NVIDIA "Matrix Multiplication
    Background User's Guide", § "Tensor Core Requirements": dimensions multiples of 16 bytes, e.g. 8 fp16
    elements, are most efficient).

    >>> aligned(50304, 768, 2), aligned(50257, 768, 2), aligned(768, 50257, 2)
    (True, False, False)
    """
    return (n * elem_bytes) % 16 == 0 and (k * elem_bytes) % 16 == 0


def _gemm_uncached_s(m: int, n: int, k: int, batch: int, dev: Device, unaligned: bool) -> float:
    km = dev.km
    best = math.inf
    slow = km.unaligned_gemm_efficiency if km.unaligned_gemm_efficiency and unaligned else 1.0
    for tile in km.tile_shapes:
        tiles = batch * math.ceil(m / tile.m) * math.ceil(n / tile.n)
        tile_rate = slow * km.gemm_ceiling * tile.relative_efficiency * dev.peak_flops_per_s / km.sm_count
        for split in SPLIT_K:
            if split > 1 and k < 512 * split:
                break
            waves = math.ceil(tiles * split / km.sm_count)
            t = waves * 2 * tile.m * tile.n * math.ceil(k / split) / tile_rate
            if split > 1:  # write and re-read the fp32 partial outputs, write the result
                t += batch * m * n * (2 * split * FP32_BYTES + dev.elem_bytes) / dev.stream_bytes_per_s
            best = min(best, t)
    stream_s = dev.elem_bytes * batch * (m * k + k * n + m * n) / dev.stream_bytes_per_s
    return max(best, stream_s)


def _gemm_dims(op: OpProfile, samples: int) -> tuple[int, int, int, int]:
    """(m, n, k, batch) of a GEMM op for ``samples`` samples: rows or batch grow with the samples."""
    if op.scale == "batch":
        return op.rows_per_sample, op.n, op.k, op.batch_per_sample * samples
    return op.rows_per_sample * samples, op.n, op.k, op.batch_per_sample


def op_forward(op: OpProfile, samples: int, dev: Device, replicated_div: int = 1) -> PassTime:
    """Forward time of one op; ``replicated_div`` divides a replicated op's bytes (sequence parallelism)."""
    if op.kind == "gemm":
        m, n, k, b = _gemm_dims(op, samples)
        return PassTime(kernel_s=gemm_s(m, n, k, b, dev), kernels=1)
    div = replicated_div if op.replicated else 1
    nbytes = op.bytes_per_sample * samples / div + op.fixed_bytes
    return PassTime(kernel_s=nbytes / dev.stream_bytes_per_s, kernels=op.kernels)


def op_backward(op: OpProfile, samples: int, dev: Device, replicated_div: int = 1) -> PassTime:
    """Backward time of one op: two GEMMs for a GEMM, the backward bytes for an element-wise kernel."""
    if op.kind == "gemm":
        m, n, k, b = _gemm_dims(op, samples)
        return PassTime(kernel_s=gemm_s(m, k, n, b, dev) + gemm_s(k, n, m, b, dev, lead=(k, n)), kernels=2)
    if op.backward_kernels == 0:
        return PassTime()
    div = replicated_div if op.replicated else 1
    nbytes = op.backward_bytes_per_sample * samples / div + op.backward_fixed_bytes
    return PassTime(kernel_s=nbytes / dev.stream_bytes_per_s, kernels=op.backward_kernels)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerKernels:
    """A layer's forward, backward and attention-core (selective recompute) passes, per micro-batch."""

    forward: PassTime
    backward: PassTime
    attention_forward: PassTime


def layer_kernels(
    ops: list[OpProfile], samples: int, dev: Device, *, sp_tp: int, flash: bool, score_flops: float
) -> LayerKernels:
    """Kernels of one layer on one rank for ``samples`` samples.

    ``sp_tp``: the TP degree when sequence parallelism shards the replicated ops, else 1. ``flash``: the
    attention-core ops become one fused kernel of ``score_flops`` forward FLOPs (``FLASH_BACKWARD_FLOPS_FACTOR``
    x backward).
    """
    fwd, bwd, core = PassTime(), PassTime(), PassTime()
    for op in ops:
        if flash and op.attention_core:
            continue
        f = op_forward(op, samples, dev, sp_tp)
        fwd, bwd = fwd + f, bwd + op_backward(op, samples, dev, sp_tp)
        if op.attention_core:
            core = core + f
    if flash and score_flops > 0:
        rate = dev.km.flash_attention_efficiency * (dev.attention_peak_flops_per_s or dev.peak_flops_per_s)
        fwd = fwd + PassTime(kernel_s=score_flops / rate, kernels=1)
        bwd = bwd + PassTime(kernel_s=FLASH_BACKWARD_FLOPS_FACTOR * score_flops / rate, kernels=1)
    return LayerKernels(forward=fwd, backward=bwd, attention_forward=core)


def contention(node) -> float:
    """The node type's communication/compute contention (0 without a kernel model): an overlapped collective
    of ``c`` seconds beside ``w`` seconds of compute costs ``max(c - (1 - k) w, k c)`` instead of
    ``max(c - w, 0)`` — the hidden part still takes ``k`` of its time from the compute it hides behind."""
    return node.kernel_model.comm_compute_contention if node.kernel_model is not None else 0.0


__all__ = [
    "aligned",
    "contention",
    "Device",
    "LayerKernels",
    "PassTime",
    "gemm_s",
    "layer_kernels",
    "op_backward",
    "op_forward",
]


def optimizer_step_s(node: NodeType, dtype: str, optimizer_bytes: float, params: float = 1.0) -> float:
    """Seconds of one AdamW step over ``params`` parameters on ``node``: ``optimizer_bytes`` of HBM traffic per
    parameter at the streaming efficiency where the node has a bandwidth figure, else ``OPTIMIZER_FLOPS_PER_PARAM``
    at its achieved FLOP/s in ``dtype``. The one rule the estimate, the search (per parameter) and the routed
    experts' step use."""
    if node.memory_bw_bytes_per_s:
        return params * optimizer_bytes / (node.memory_bw_bytes_per_s * MEMORY_BW_EFFICIENCY)
    return params * OPTIMIZER_FLOPS_PER_PARAM / node.compute_for(dtype).achieved_flops_per_s
