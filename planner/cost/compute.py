"""Per-layer costs: one layer, one option (tp degree, replicate/split, recompute), one micro-batch.

Compute time. When the layer's shard carries measured timings on this device, they are used (linear
interpolation in the micro-batch, proportional extrapolation outside the measured range). Otherwise a
two-term roofline, summed (kernels run one after another on a GPU stream):

    forward_s  = fwd_flops / achieved_flops_per_s  +  traffic_bytes / (memory_bw * MEMORY_BW_EFFICIENCY)
    backward_s = bwd_flops / achieved_flops_per_s  +  BACKWARD_TRAFFIC_FACTOR * traffic time

``achieved_flops_per_s`` = GEMM efficiency x datasheet peak (``constants.GEMM_EFFICIENCY``); the traffic of
memory-bound kernels is estimated from the saved-activation bytes by category (``TRAFFIC_PER_SAVED_BYTE``,
derived from Megatron-LM's fused kernels). Sequence parallelism divides the replicated (LayerNorm/dropout)
part by ``tp``; that reproduces the forward-time gain Korthikanti et al. 2022 Table 4 report (7.7 -> 7.2 ms).

Recompute (Korthikanti et al. 2022 §5): *full* re-runs the layer's forward, its TP collectives included;
*selective* re-runs only the attention-score part (its FLOPs ``attention_scores_flops_per_sample`` and
its score traffic); with flash attention there are no stored scores, selective costs nothing, and the
flash backward recomputes QK^T itself (half of the score FLOPs, Dao et al. 2022 Alg. 4).

Whale styles (Jia et al., ATC'22): ``split`` shards the layer over the TP group (Megatron layout, the
shard at ``tp``); ``replicate`` keeps the full layer on every TP rank and, as Whale's replica does, data-
parallelises it INSIDE the TP group: each of the ``tp`` ranks computes (and saves activations for) a
batch slice of ``micro_batch / tp`` samples, with no TP collectives; its gradients are averaged over the
``dp x tp`` group (``estimate``). Where tp does not divide the micro-batch, every TP rank runs the layer on the whole
micro-batch instead (Megatron-LM's unsplit layers; gradients equal over TP, synced over dp). Between a replicated
and a split neighbour, the activation is re-laid-out (``layout_change_cost``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.core import (
    ATTENTION_DTYPE,
    BACKWARD_TRAFFIC_FACTOR,
    CAUSAL_FLASH_WORK_FRACTION,
    DTYPE_BYTES,
    FP8_GEMM_PEAK_FRACTION,
    LONG_CAUSAL_FLASH_EFFICIENCY,
    MEMORY_BW_EFFICIENCY,
    TRAFFIC_PER_SAVED_BYTE,
    Recompute,
    StratagemError,
    TPStyle,
    gpu_family,
)
from planner.cost.collectives import collective_time
from planner.cost.config import LayerCost
from planner.cost.context import ExchangeCost, KVExchange, exchange_cost
from planner.cost.framework import DPWrapper, layer_overhead_s
from planner.cost.kernels import FLASH_BACKWARD_FLOPS_FACTOR, Device, contention, layer_kernels
from planner.cost.placement import layer_recompute, layer_style
from planner.profile import ClusterProfile, ComputeFigure, LayerProfile, LayerTiming, NodeType, ShardProfile

# message size of the after-compute latency probe (runtime/profiling/sync_latency.py: 256 fp32 elements)
SYNC_PROBE_BYTES = 1024.0


def _shard_for(layer: LayerProfile, tp: int, style: TPStyle) -> tuple[ShardProfile, bool]:
    """The shard the rank runs and whether the layer is tensor-split at this option."""
    if tp == 1 or style == "replicate":
        return layer.shards[0], False
    if style != "split":
        raise StratagemError(f"layer {layer.path}: unknown TP style {style!r}; use 'split' or 'replicate'")
    if layer.tp_style == "none":
        raise StratagemError(f"layer {layer.path} ({layer.kind}) cannot be tensor-split; set its layout to 'replicate'")
    try:
        return layer.shard(tp), True
    except KeyError:
        have = ", ".join(str(s.tp) for s in layer.shards)
        raise StratagemError(
            f"layer {layer.path} was profiled at tp in {{{have}}}, not tp={tp}; choose one "
            f"of those or re-profile with --tp {tp}"
        ) from None


def sp_gathered_bytes(layer: LayerProfile, tp: int) -> float:
    """Per sample, what saving the forward all-gathers' whole-sequence outputs adds under sequence parallelism
    to the ``1/tp`` of them the replicated part already counts."""
    gathered = sum(
        c.bytes_per_sample * c.count
        for c in layer.collectives
        if c.op == "all_gather" and c.phase == "forward" and c.with_sequence_parallel
    )
    return gathered * (1 - 1 / tp)


def batch_sliced(micro_batch: int, tp: int, style: TPStyle) -> bool:
    """A replicated layer under ``tp > 1`` runs on a batch slice (Whale's replica, data parallel inside the TP
    group) when the micro-batch splits evenly over tp; otherwise (one sample over two ranks) every TP rank runs
    it on the whole micro-batch, its gradients equal over TP (``runtime.executor.tp``)."""
    return style == "replicate" and tp > 1 and micro_batch % tp == 0


def replica_samples(micro_batch: int, tp: int, style: TPStyle) -> int:
    """Samples one rank computes: a batch slice of a batch-sliced replica (:func:`batch_sliced`), else all."""
    return micro_batch // tp if batch_sliced(micro_batch, tp, style) else micro_batch


def _interpolate(timings: list[LayerTiming], samples: float) -> tuple[float, float]:
    """(forward_s, backward_s) at ``samples`` from measured medians: piecewise-linear, proportional outside."""
    pts = sorted(timings, key=lambda t: t.micro_batch)
    if samples <= pts[0].micro_batch or len(pts) == 1:
        nearest = pts[0] if samples <= pts[0].micro_batch else pts[-1]
        scale = samples / nearest.micro_batch
        return nearest.forward.median_s * scale, nearest.backward.median_s * scale
    if samples >= pts[-1].micro_batch:
        scale = samples / pts[-1].micro_batch
        return pts[-1].forward.median_s * scale, pts[-1].backward.median_s * scale
    for lo, hi in zip(pts, pts[1:]):
        if lo.micro_batch <= samples <= hi.micro_batch:
            w = (samples - lo.micro_batch) / (hi.micro_batch - lo.micro_batch)
            fwd = lo.forward.median_s + w * (hi.forward.median_s - lo.forward.median_s)
            bwd = lo.backward.median_s + w * (hi.backward.median_s - lo.backward.median_s)
            return fwd, bwd
    raise AssertionError("unreachable")


def _saved_parts(shard: ShardProfile, samples: int, tp: int, sp: bool) -> tuple[float, float, float]:
    """(replicated, scores, rest) saved bytes for ``samples`` samples; SP divides the replicated part."""
    replicated = shard.saved_replicated_bytes_per_sample * samples / (tp if sp else 1)
    scores = shard.saved_attention_scores_bytes_per_sample * samples
    rest = (
        max(
            0.0,
            shard.saved_bytes_per_sample
            - shard.saved_replicated_bytes_per_sample
            - shard.saved_attention_scores_bytes_per_sample,
        )
        * samples
    )
    return replicated, scores, rest


def _flash_efficiency(node: NodeType, causal_skip: bool) -> float:
    """Fused attention's fraction of peak: the long-sequence causal figure where one is known
    (``constants.LONG_CAUSAL_FLASH_EFFICIENCY``, with ``causal_skip``), else the node's kernel model's."""
    assert node.kernel_model is not None
    family = gpu_family(node.device)
    if causal_skip and family in LONG_CAUSAL_FLASH_EFFICIENCY:
        return LONG_CAUSAL_FLASH_EFFICIENCY[family]
    return node.kernel_model.flash_attention_efficiency


def _kernel_device(node: NodeType, shard: ShardProfile, dtype: str, causal_skip: bool = False) -> Device | None:
    """The per-kernel model's view of ``node`` when both the node and the shard support it, else None."""
    if node.kernel_model is None or not shard.ops or not node.memory_bw_bytes_per_s:
        return None
    km = node.kernel_model
    if causal_skip and (eff := _flash_efficiency(node, causal_skip)) != km.flash_attention_efficiency:
        km = km.model_copy(update={"flash_attention_efficiency": eff})
    peak = _compute_figure(node, dtype).peak_flops_per_s
    if dtype == "fp8":
        peak *= FP8_GEMM_PEAK_FRACTION.get(gpu_family(node.device) or "", 1.0)
    return Device(
        km=km,
        peak_flops_per_s=peak,
        memory_bw_bytes_per_s=node.memory_bw_bytes_per_s,
        elem_bytes=DTYPE_BYTES[dtype],
        attention_peak_flops_per_s=_compute_figure(node, ATTENTION_DTYPE.get(dtype, dtype)).peak_flops_per_s,
    )


def _traffic_s(node: NodeType, nbytes: float) -> float:
    if node.memory_bw_bytes_per_s is None or nbytes <= 0:
        return 0.0
    return nbytes / (node.memory_bw_bytes_per_s * MEMORY_BW_EFFICIENCY)


def _achieved_flops(node: NodeType, dtype: str) -> float:
    return _compute_figure(node, dtype).achieved_flops_per_s


def _compute_figure(node: NodeType, dtype: str) -> ComputeFigure:
    try:
        return node.compute_for(dtype)
    except KeyError:
        have = ", ".join(c.dtype for c in node.compute)
        raise StratagemError(
            f"node type {node.name} has no {dtype} compute figure (has {have}); use --dtype with one of those"
        ) from None


def _tp_comm_s(
    layer: LayerProfile, cluster: ClusterProfile, node: NodeType, tp: int, samples: int, sp: bool, spans_nodes: bool
) -> tuple[float, float]:
    """(forward_s, backward_s) of the layer's TP collectives for one micro-batch.

    On a node with a measured :class:`~planner.profile.load.BlockingLatency` (CPU ranks) each call's latency
    is the one measured after compute instead of the fit's back-to-back alpha: the fit's time at the
    probe's message size (``SYNC_PROBE_BYTES``) is swapped for the measured per-call figure, so the
    bandwidth term stays the fit's.
    """
    times = {"forward": 0.0, "backward": 0.0}
    coll: dict[str, Any] = dict(
        node_type=node, spans_nodes=spans_nodes, ranks_per_node=node.devices_per_node if spans_nodes else tp
    )
    blocking = node.blocking_latency if not spans_nodes else None
    for need in layer.collectives:
        if need.axis != "tp" or need.with_sequence_parallel != sp:
            continue
        t = collective_time(cluster, need.op, need.bytes_per_sample * samples, tp, **coll)
        if blocking is not None:
            probe_s = collective_time(cluster, need.op, SYNC_PROBE_BYTES, tp, **coll)
            t = max(t, t - probe_s + blocking.functional_collective_s)
        times[need.phase] += need.count * t
    return times["forward"], times["backward"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerWork:
    """What :func:`layer_cost` computes of one layer at one (tp, style, sequence parallel, micro-batch) before the
    recompute mode and the data-parallel wrapper enter: the shard, its kernel or roofline times, its TP
    collectives and K/V exchange. The same for every recompute mode and wrapper, so a caller pricing many of them
    (``planner.search.layer_options``) computes it once. ``forward_s``/``backward_s``: the measured timings before
    the wrapper's overheads and ``timings_scale`` when ``timed``, else the kernel or roofline times (neither with
    the K/V exchange, nor the flash backward's recomputed scores outside the kernel model)."""

    shard: ShardProfile
    split: bool
    samples: int
    sp: bool
    rate: float
    replicated: float
    scores: float
    rest: float
    scores_traffic_s: float
    score_flops: float
    skipped: float
    flash_bwd_flops: float
    timed: bool
    forward_s: float
    backward_s: float
    kernels: Any
    dev: Device | None
    comm_fwd_s: float
    comm_bwd_s: float
    model_flops: float
    cp: ExchangeCost


def layer_work(
    layer: LayerProfile,
    *,
    node: NodeType,
    cluster: ClusterProfile,
    tp: int,
    style: TPStyle,
    sequence_parallel: bool,
    micro_batch: int,
    flash_attention: bool,
    dtype: str,
    tp_group_spans_nodes: bool = False,
    use_timings: bool = True,
    context: KVExchange | None = None,
    causal_skip: bool = False,
) -> LayerWork:
    """:class:`LayerWork` of ``layer`` (the arguments as :func:`layer_cost`'s)."""
    shard, split = _shard_for(layer, tp, style)
    samples = replica_samples(micro_batch, tp, style)
    sp = sequence_parallel and split and tp > 1
    rate = _achieved_flops(node, dtype)
    replicated, scores, rest = _saved_parts(shard, samples, tp, sp)
    scores_traffic_s = 0.0 if flash_attention else _traffic_s(node, TRAFFIC_PER_SAVED_BYTE["scores"] * scores)
    score_flops = shard.attention_scores_flops_per_sample * samples
    flash_flops = score_flops * (CAUSAL_FLASH_WORK_FRACTION if causal_skip else 1.0)  # what the flash kernel computes
    skipped = score_flops - flash_flops if flash_attention else 0.0  # masked blocks a causal flash kernel skips
    kernels, dev = None, None
    timed = bool(use_timings and shard.timings)
    if timed:
        forward_s, backward_s = _interpolate(shard.timings, samples)  # the wrapper's overheads: layer_cost
    elif (dev := _kernel_device(node, shard, dtype, causal_skip)) is not None:
        kernels = layer_kernels(
            shard.ops, samples, dev, sp_tp=tp if sp else 1, flash=flash_attention, score_flops=flash_flops
        )
        forward_s, backward_s = kernels.forward.wall_s(dev.km), kernels.backward.wall_s(dev.km)
    else:
        fwd_traffic_s = (
            _traffic_s(node, TRAFFIC_PER_SAVED_BYTE["replicated"] * replicated + TRAFFIC_PER_SAVED_BYTE["split"] * rest)
            + scores_traffic_s
        )
        forward_s = (shard.fwd_flops_per_sample * samples - skipped) / rate + fwd_traffic_s
        backward_s = (
            shard.bwd_flops_per_sample * samples - 2 * skipped
        ) / rate + BACKWARD_TRAFFIC_FACTOR * fwd_traffic_s
    comm_fwd_s, comm_bwd_s = (
        _tp_comm_s(layer, cluster, node, tp, samples, sp, tp_group_spans_nodes) if (split and tp > 1) else (0.0, 0.0)
    )
    cp = _context_cost(
        context,
        cluster,
        node,
        dtype,
        tp if split else 1,
        samples,
        flash_flops if flash_attention else score_flops,
        causal_skip,
    )
    return LayerWork(
        shard=shard,
        split=split,
        samples=samples,
        sp=sp,
        rate=rate,
        replicated=replicated,
        scores=scores,
        rest=rest,
        scores_traffic_s=scores_traffic_s,
        score_flops=score_flops,
        skipped=skipped,
        flash_bwd_flops=flash_flops / 2 if flash_attention else 0.0,
        timed=timed,
        forward_s=forward_s,
        backward_s=backward_s,
        kernels=kernels,
        dev=dev,
        comm_fwd_s=comm_fwd_s,
        comm_bwd_s=comm_bwd_s,
        # causal skipping: the model's FLOPs are the causal ones too (forward, and the backward's two products)
        model_flops=(shard.fwd_flops_per_sample + shard.bwd_flops_per_sample) * samples - 3 * skipped,
        cp=cp,
    )


def layer_cost(
    layer: LayerProfile,
    *,
    node: NodeType,
    cluster: ClusterProfile,
    tp: int,
    style: TPStyle,
    recompute: Recompute,
    sequence_parallel: bool,
    micro_batch: int,
    flash_attention: bool,
    dtype: str,
    tp_group_spans_nodes: bool = False,
    use_timings: bool = True,
    overlap_tp_comm: bool = False,
    dp_wrapper: DPWrapper = "none",
    timings_scale: float = 1.0,
    context: KVExchange | None = None,
    causal_skip: bool = False,
    torch_tp_memory: bool = False,
    work: LayerWork | None = None,
) -> LayerCost:
    """Per-micro-batch cost of ``layer`` on one rank of a TP group of ``tp`` (see the module docstring).

    ``torch_tp_memory`` (memory semantics "fsdp2"): memory as torch's tensor parallelism (DTensor) holds it.
    Under sequence parallelism the GEMM after each forward all-gather saves the gathered, whole-sequence input
    for its backward; Megatron-LM saves the shard and gathers again in the backward (Korthikanti et al. 2022).
    A split classifier's loss runs under ``loss_parallel``, whose backward holds one logits shard more than
    plain cross-entropy's (``zeros_like``, ``exp`` and their sum alive together:
    ``torch.distributed.tensor.parallel.loss._nll_loss_and_log_softmax_backward``); Megatron-LM's vocab-parallel
    cross-entropy works in place. A replicated classifier under ``tp > 1`` (Whale's replica, a batch slice each)
    has its output gathered to the whole micro-batch, so the loss runs on every row on every TP rank: the
    log-probabilities it saves and the two logits-sized gradients of its backward (``nll_loss`` and
    ``log_softmax``) count the other ranks' rows too.

    ``use_timings=False`` ignores measured timings (e.g. timings from another device than ``node``).
    ``overlap_tp_comm``: TP collectives run under the layer's GEMMs (Transformer Engine userbuffers,
    Megatron-Core ``--tp-comm-overlap``); only the part longer than the GEMM time stays exposed.
    ``dp_wrapper`` (``framework.dp_wrapper(dp, zero_stage)``): with measured timings, the runtime's
    measured wrapper overheads (``framework.layer_overhead_s``) are added to the forward and backward,
    and the layer's AdamW step time is returned in ``optimizer_s``. ``timings_scale``
    (``framework.timings_scale``) multiplies every measured time (timings and overheads).
    ``context``: the K/V exchange of context parallelism (``planner.cost.context``; ``layer`` is then the
    per-rank view): added to an attention layer's forward and backward, and its saved bytes to ``act_bytes``.
    ``causal_skip``: a flash kernel does ``CAUSAL_FLASH_WORK_FRACTION`` of the score FLOPs (causal block
    skipping; ``ParallelConfig.causal_skip``), and the model FLOPs count that fraction too (so MFU at long
    sequence counts the causal attention a model needs, not the full ``s^2`` square).
    ``work``: :func:`layer_work` of the same arguments when the caller keeps it (it depends on neither
    ``recompute`` nor ``dp_wrapper``, ``timings_scale``, ``overlap_tp_comm`` or ``torch_tp_memory``).
    """
    if work is None:
        work = layer_work(
            layer,
            node=node,
            cluster=cluster,
            tp=tp,
            style=style,
            sequence_parallel=sequence_parallel,
            micro_batch=micro_batch,
            flash_attention=flash_attention,
            dtype=dtype,
            tp_group_spans_nodes=tp_group_spans_nodes,
            use_timings=use_timings,
            context=context,
            causal_skip=causal_skip,
        )
    shard, split, samples, sp, rate = work.shard, work.split, work.samples, work.sp, work.rate
    replicated, scores, rest = work.replicated, work.scores, work.rest
    scores_traffic_s, score_flops, skipped = work.scores_traffic_s, work.score_flops, work.skipped
    kernels, dev, cp = work.kernels, work.dev, work.cp
    forward_s, backward_s = work.forward_s, work.backward_s
    optimizer_s = 0.0
    if work.timed:
        extra_fwd_s, extra_bwd_s, optimizer_s = layer_overhead_s(layer, split_tp=split and tp > 1, wrapper=dp_wrapper)
        forward_s = (forward_s + extra_fwd_s) * timings_scale
        backward_s = (backward_s + extra_bwd_s) * timings_scale
        optimizer_s *= timings_scale
    flash_bwd_flops = work.flash_bwd_flops
    if kernels is None:
        backward_s += flash_bwd_flops / rate
    comm_fwd_s, comm_bwd_s = work.comm_fwd_s, work.comm_bwd_s
    model_flops = work.model_flops
    forward_s, backward_s = forward_s + cp.forward_s, backward_s + cp.backward_s
    if overlap_tp_comm:
        comm_fwd_s = max(0.0, comm_fwd_s - shard.fwd_flops_per_sample * samples / rate)
        comm_bwd_s = max(0.0, comm_bwd_s - shard.bwd_flops_per_sample * samples / rate)
    if recompute == "full":
        recompute_s, recompute_flops = forward_s + comm_fwd_s, shard.fwd_flops_per_sample * samples - skipped
    elif recompute == "selective" and not flash_attention:
        recompute_s = (
            score_flops / rate + scores_traffic_s
            if kernels is None or dev is None
            else kernels.attention_forward.wall_s(dev.km)
        )
        recompute_flops = score_flops
    elif recompute in ("none", "selective"):
        recompute_s, recompute_flops = 0.0, 0.0
    else:
        raise StratagemError(f"unknown recompute mode {recompute!r}; use none, selective or full")
    if recompute == "full":
        act_bytes = layer.input_bytes_per_sample * samples / (tp if sp else 1)
    elif recompute == "selective" or flash_attention:
        act_bytes = replicated + rest + cp.saved_bytes
    else:
        act_bytes = replicated + scores + rest + cp.saved_bytes
    if sp and torch_tp_memory and recompute != "full":
        act_bytes += sp_gathered_bytes(layer, tp) * samples
    # torch.autocast's cached 16-bit weight copies live until the region ends, whatever is recomputed
    # (planner.profile.autocast; 0 for pure 16-bit profiles)
    act_bytes += shard.saved_fixed_bytes
    backward_ws = shard.backward_ws_bytes_per_sample * samples
    if torch_tp_memory and split and tp > 1:  # loss_parallel's extra logits shard (docstring)
        backward_ws += shard.logits_bytes_per_sample * samples
    if torch_tp_memory and not split and tp > 1 and shard.logits_bytes_per_sample:
        # a replicated classifier's output is gathered to the whole micro-batch for the loss (the runtime's
        # gather_batch_output): the loss saves log-probabilities and its backward makes two logits-sized
        # gradients for the other TP ranks' rows too (docstring)
        whole = shard.logits_bytes_per_sample * (micro_batch - samples)
        act_bytes += whole
        backward_ws += 2 * whole
    return LayerCost(
        backward_ws_bytes=backward_ws,
        logits_bytes=shard.logits_bytes_per_sample * samples,
        forward_s=forward_s,
        backward_s=backward_s,
        recompute_s=recompute_s,
        tp_comm_s=comm_fwd_s + comm_bwd_s,
        act_bytes=act_bytes,
        param_bytes=float(shard.param_bytes),
        params=float(shard.params),
        output_bytes=layer.output_bytes_per_sample * micro_batch,
        model_flops=model_flops,
        hardware_flops=model_flops + recompute_flops + flash_bwd_flops,
        optimizer_s=optimizer_s,
        cp_comm_s=cp.forward_s + cp.backward_s,
    )


def _context_cost(
    context: KVExchange | None,
    cluster: ClusterProfile,
    node: NodeType,
    dtype: str,
    kv_shards: int,
    samples: int,
    attention_flops: float,
    causal_skip: bool = False,
) -> ExchangeCost:
    """The K/V exchange of an attention layer under context parallelism (zero without it, or for layers
    without attention). The ring hides its steps behind the attention kernel's time at the GEMM rate
    (flash: the kernel model's flash efficiency; backward 2.5x, ``kernels.FLASH_BACKWARD_FLOPS_FACTOR``)."""
    if context is None or attention_flops <= 0:
        return ExchangeCost(forward_s=0.0, backward_s=0.0, saved_bytes=0.0)
    rate = _achieved_flops(node, dtype)
    if node.kernel_model is not None:
        peak = _compute_figure(node, ATTENTION_DTYPE.get(dtype, dtype)).peak_flops_per_s
        rate = _flash_efficiency(node, causal_skip) * peak
    attention_s = attention_flops / rate
    return exchange_cost(
        context,
        cluster=cluster,
        node=node,
        tp=kv_shards,
        samples=samples,
        attention_forward_s=attention_s,
        attention_backward_s=FLASH_BACKWARD_FLOPS_FACTOR * attention_s,
        contention=contention(node),
    )


def full_saved_bytes(
    layer: LayerProfile,
    *,
    tp: int,
    style: TPStyle,
    sequence_parallel: bool,
    micro_batch: int,
    flash_attention: bool,
    less_input: bool = False,
) -> float:
    """Bytes the layer saves for one micro-batch with no recompute (the backward working set of full
    recompute, which re-materialises them). ``less_input``: without the layer's input, which the recompute
    does not allocate again (the checkpoint keeps it; memory semantics "fsdp2")."""
    shard, split = _shard_for(layer, tp, style)
    samples = replica_samples(micro_batch, tp, style)
    sp = sequence_parallel and split and tp > 1
    replicated, scores, rest = _saved_parts(shard, samples, tp, sp)
    saved = replicated + rest + (0.0 if flash_attention else scores)
    if less_input:
        saved = max(0.0, saved - layer.input_bytes_per_sample * samples / (tp if sp else 1))
    return saved


def working_set_bytes(recomputed: float, moe_ws: float, backward_ws: float) -> float:
    """A layer's backward working set from its parts: ``recomputed`` (full recompute's re-made activations of the
    layer's shard), ``moe_ws`` (an MoE block's routed experts: the exchange's buffers and, under full recompute,
    their re-made activations; ``LayerCost.moe_ws_bytes``) and ``backward_ws`` (the transient gradients the
    shard's backward makes, ``LayerCost.backward_ws_bytes``). The routed experts come last in a block's forward, so
    their backward runs first and has freed its part before the rest of the block's backward grows: the larger of
    the two is alive, not both (traced on moe:tiny and transformers' Mixtral with full recompute,
    benchmarks/memory_accuracy.py)."""
    return recomputed + max(moe_ws, backward_ws)


def layer_working_set_bytes(config, layer: LayerProfile, cost: LayerCost) -> float:
    """Bytes the layer's backward needs beyond what is saved (:func:`working_set_bytes`): under full recompute
    the re-materialised activations (:func:`full_saved_bytes`), an MoE block's dispatch buffers, and the transient
    gradients its backward creates (``LayerCost.backward_ws_bytes``). ``config``: the ``ParallelConfig``."""
    full = (
        full_saved_bytes(
            layer,
            tp=config.tp,
            style=layer_style(config, layer),
            sequence_parallel=config.sequence_parallel,
            micro_batch=config.micro_batch,
            flash_attention=config.flash_attention,
            less_input=config.memory_semantics == "fsdp2",
        )
        if layer_recompute(config, layer) == "full"
        else 0.0
    )
    return working_set_bytes(full, cost.moe_ws_bytes, cost.backward_ws_bytes)


def layout_change_cost(
    prev: LayerProfile,
    next: LayerProfile,  # noqa: A002
    prev_style: TPStyle,
    next_style: TPStyle,
    *,
    node: NodeType,
    cluster: ClusterProfile,
    tp: int,
    micro_batch: int,
    sequence_parallel: bool = False,
    tp_group_spans_nodes: bool = False,
) -> float:
    """Seconds per micro-batch to re-lay-out ``prev``'s output for ``next`` (Whale, Jia et al. ATC'22 §4).

    0 when the styles agree or ``tp == 1``. A replicated layer under ``tp > 1`` holds a batch slice of the
    activation (Whale's replica), a split layer the whole micro-batch:

    * replicate -> split: all-gather the boundary activation along the batch (forward) and reduce-scatter
      its gradient (backward);
    * split -> replicate: a local slice forward — preceded by an all-gather when the split side is
      sharded (sequence parallelism, or a column-parallel ``prev`` such as a split classifier) — and an
      all-gather of the batch-sliced gradient backward.

    Where tp does not divide the micro-batch the replica holds the whole activation (R, as the split side does
    without sequence parallelism): only a split block or norm under sequence parallelism, whose side is a
    sequence shard, costs one all-gather (forward from it, or of the gradient into it); an embedding or a head
    keeps whole activations under sequence parallelism (``runtime.executor.tp``).
    """
    if tp == 1 or prev_style == next_style:
        return 0.0
    whole = not batch_sliced(micro_batch, tp, "replicate")  # the replica holds the whole micro-batch (R)
    nbytes = prev.output_bytes_per_sample * micro_batch
    coll: dict[str, Any] = dict(
        node_type=node,
        spans_nodes=tp_group_spans_nodes,
        ranks_per_node=node.devices_per_node if tp_group_spans_nodes else tp,
    )
    gather = collective_time(cluster, "all_gather", nbytes, tp, **coll)
    if whole:
        split_side = prev if prev_style == "split" else next
        sharded = sequence_parallel and split_side.kind in ("block", "norm")
        return gather if sharded else 0.0
    if prev_style == "replicate":
        return gather + collective_time(cluster, "reduce_scatter", nbytes, tp, **coll)
    sharded_output = sequence_parallel or prev.tp_style == "column"
    return gather * (2 if sharded_output else 1)
