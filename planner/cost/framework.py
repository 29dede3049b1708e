"""Host overhead of the runtime's torch.distributed wrappers, from measured per-layer figures.

``stratagem launch`` runs a tensor-split layer on DTensors, a data-parallel chunk under FSDP2's
``replicate`` (ZeRO-0) or ``fully_shard`` (ZeRO-1/2/3; ``runtime/executor/fsdp.py``), and AdamW over
DTensor parameters whenever a layer is split or data-parallel. Each adds host time that the plain
layer timings do not hold; on CPU ranks it exceeds the arithmetic of small models. The model profiler
measures it per layer (:class:`planner.profile.load.RuntimeOverhead`, ``runtime/profiling/overhead.py``);
this module turns it into per-layer and per-chunk terms. Like the timings, the figures apply only on
the device they were measured on (``use_timings``), so GPU estimates from analytic profiles are
unchanged.

Terms (all additive; fixed per call, not scaled with the micro-batch):

- per layer and micro-batch, forward and backward: the DTensor TP dispatch when the layer is split at
  ``tp > 1``; the layer's marginal cost inside an FSDP2 unit when ``dp > 1``; with ``fully_shard`` a
  block is its own unit (the runtime wraps each ``blocks.*`` module), so it also pays a unit's fixed cost;
- per chunk and micro-batch, forward and backward (``dp > 1``): one unit's fixed cost for the chunk's
  root unit (``replicate`` wraps the chunk; ``fully_shard`` wraps the chunk's non-block remainder);
- per layer and step: the AdamW step over its parameters, on DTensors when split or data-parallel.

Measurement conditions (:func:`timings_scale`). The model profiler times layers in one process; the
cluster profiler times its matmul benchmark with every rank of the node running it, at another moment.
On a shared host the two differ (this 2-vCPU VM: 137 GFLOP/s alone vs 63-72 GFLOP/s per process with two
running, at the same minute). The model profile therefore records the same benchmark run in its own
process (``ModelProfile.reference_matmul``), and measured timings are multiplied by
``reference / cluster`` achieved FLOP/s — both measured, nothing fitted. Re-profile the cluster when the
host's load changes.
"""

from __future__ import annotations

import statistics
from typing import Literal

from planner.profile import LayerProfile, ModelProfile, NodeType, RuntimeOverhead

DPWrapper = Literal["none", "replicate", "fully_shard"]


def dp_wrapper(dp: int, zero_stage: int) -> DPWrapper:
    """The FSDP2 wrapper the runtime applies (``runtime/executor/fsdp.py``): none at dp 1, ``replicate``
    at ZeRO-0, ``fully_shard`` at ZeRO-1/2/3."""
    if dp <= 1:
        return "none"
    return "replicate" if zero_stage == 0 else "fully_shard"


def _unit_s(o: RuntimeOverhead, wrapper: DPWrapper) -> tuple[float, float]:
    if wrapper == "replicate":
        return o.replicate_unit_forward_s, o.replicate_unit_backward_s
    if wrapper == "fully_shard":
        return o.fully_shard_unit_forward_s, o.fully_shard_unit_backward_s
    return 0.0, 0.0


def layer_overhead_s(layer: LayerProfile, *, split_tp: bool, wrapper: DPWrapper) -> tuple[float, float, float]:
    """(forward_s, backward_s per micro-batch, optimizer_s per step) the wrappers add to ``layer``.

    ``split_tp``: the layer runs tensor-split at ``tp > 1``. Zero when the profile has no measurement.
    """
    o = layer.runtime_overhead
    if o is None:
        return 0.0, 0.0, 0.0
    fwd = o.tp_forward_s if split_tp else 0.0
    bwd = o.tp_backward_s if split_tp else 0.0
    if wrapper == "replicate":
        fwd, bwd = fwd + o.replicate_forward_s, bwd + o.replicate_backward_s
    elif wrapper == "fully_shard":
        fwd, bwd = fwd + o.fully_shard_forward_s, bwd + o.fully_shard_backward_s
        if layer.kind == "block":
            unit_f, unit_b = _unit_s(o, wrapper)
            fwd, bwd = fwd + unit_f, bwd + unit_b
    dtensor = split_tp or wrapper != "none"
    return fwd, bwd, o.optimizer_step_dtensor_s if dtensor else o.optimizer_step_s


def chunk_overhead_s(model: ModelProfile, wrapper: DPWrapper, scale: float = 1.0) -> tuple[float, float]:
    """(forward_s, backward_s) per micro-batch of one chunk's root FSDP2 unit: the median over the
    profile's layers of the measured unit cost (the same probe, measured once per layer), times
    ``scale`` (:func:`timings_scale`); 0 at dp 1."""
    measured = [layer.runtime_overhead for layer in model.layers if layer.runtime_overhead is not None]
    if wrapper == "none" or not measured:
        return 0.0, 0.0
    units = [_unit_s(o, wrapper) for o in measured]
    return scale * statistics.median(u[0] for u in units), scale * statistics.median(u[1] for u in units)


def timings_scale(model: ModelProfile, node: NodeType) -> float:
    """Factor for the model profile's measured times on ``node``: the reference matmul rate measured in
    the model profiler's process over the cluster profile's achieved rate in that dtype (1.0 when either
    is missing). Example: 137e9 / 68e9 = 2.0 -- the ranks run at half the profiler's speed."""
    ref = model.reference_matmul
    if ref is None:
        return 1.0
    for figure in node.compute:
        if figure.dtype == ref.dtype:
            return ref.achieved_flops_per_s / figure.achieved_flops_per_s
    return 1.0
