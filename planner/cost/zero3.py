"""ZeRO-3 communication of one rank per step: the FSDP-like default and DeepSpeed's early-2021 ZeRO-3.

Per layer and micro-batch a rank all-gathers the layer's 16-bit weights ``G`` times and reduce-scatters its
gradients once, over the flat data-parallel group (ZeRO, Rajbhandari et al. 2020 §5.3: with ``G = 2`` that
is 1.5x data parallelism's all-reduce volume). Every collective is a flat NCCL ring over the whole group:
NCCL 2.x implements all-gather and reduce-scatter with the ring algorithm only (``collectives.py``; the
hierarchical and tree algorithms there apply to all-reduce). With ``C`` the per-micro-batch sum of these
collectives, ``m`` micro-batches and ``W`` the rank's forward + backward + recompute time of one micro-batch,
the step pays ``m * max(C - (1 - k) W, k C) + g_first + r_first`` when overlapping and ``m * C`` when not.
``k`` = the node type's communication/compute contention (``kernels.contention``: the hidden part still
costs ``k`` of its time). Nothing hides the first layer's gather ``g_first`` (no compute precedes it) nor
its gradient reduce-scatter ``r_first``: it is the backward's last, and FSDP2's root post-backward callback
waits for it before the optimizer step (torch ``_fsdp_state._root_post_backward_final_callback``;
torchtitan keeps the last blocks unsharded after forward for the same reason, Liang et al. 2024 §2.2.1).

Accumulation (``m > 1``). ``zero3_grad_sync="micro_batch"``: gradients are reduce-scattered every
micro-batch, FSDP2's default, so ``C`` as above; Stratagem's runtime does this at ``pp = 1``
(``runtime/executor/schedule.py`` ``LocalRunner``). ``"step"``: what torch.distributed.pipelining's stages
do, so the runtime at ``pp > 1`` (``set_requires_gradient_sync`` and ``set_reshard_after_backward`` False
but on the last micro-batch): one reduce-scatter per layer per step, and the weights a backward gathered
stay unsharded until the next micro-batch's forward has used them, so the step gathers ``m (G - 1) + 1``
times instead of ``m G`` (torch docs, ``FSDPModule.set_reshard_after_backward``: "the unsharded
parameters do not need to be re-all-gathered before the next forward"). The price is memory: the rank holds
its layers' unsharded weights and unsharded gradients between micro-batches (``estimate``'s memory,
``zero3_accumulation_bytes``). The step then pays ``max(C_step - (1 - k) m W, k C_step) + g_first + r_first``
(the same form with per-step totals). The defaults of the five ``ParallelConfig.zero3_*`` fields give exactly
that (the ILP in ``planner.search`` mirrors it); the other values describe DeepSpeed ZeRO-3 as the SC21 Table 2
runs used it ("We integrated ZeRO into our codebase using the DeepSpeed Python library", Narayanan et al. SC21 §5.2;
arXiv v1 of April 2021, i.e. DeepSpeed before the June-2021 stage-3 fixes):

1. ``zero3_overlap=False`` — nothing overlaps. Prefetching never ran: a sub-module pre-forward hook fired
   before the module hook that resets the step counter, so every step id was off by one against the
   recorded trace "which was causing the prefetches to be skipped" (DeepSpeed issue #1069, 2021-05-27;
   fixed by PR #1170, June 2021). And each on-demand gather called ``torch.cuda.synchronize()`` first:
   "the async version is not async at all, because each all_gather calls torch.cuda.synchronize()"
   (PR #1188, 2021-06-25), so compute and communication alternate.
2. ``zero3_param_gathers=3`` (with full recompute) — the same off-by-one made the reuse test
   (``get_reuse_distance_in_numel``: "Tracing failed. Cannot tell if the sub_module is reused") report no
   reuse, so a module's weights were released after every use and gathered again for the forward, the
   recompute forward and the backward (2021 ``stage3.py``, ``release_sub_module`` / ``_keep_for_later``).
3. ``zero3_granularity="tensor"`` — one collective per parameter tensor: ``_allgather_param`` per tensor
   and ``_reduce_scatter_gradient`` per tensor (2021 ``partition_parameters.py``), so the ring latency is
   paid per tensor, not per layer. Tensors under ``DEEPSPEED_PERSISTENCE_THRESHOLD_ELEMENTS`` (biases,
   LayerNorms) stay replicated and are not gathered, but their gradients are reduce-scattered like the rest.
   A GPT block (Megatron layout, Shoeybi et al. 2019) has 12 tensors: QKV 3h^2 and 3h, projection h^2 and
   h, two LayerNorms 2 x (h, h), FC1 h f and f, FC2 f h and h; other layers count as one tensor.
4. ``zero3_list_collectives=True`` — torch 1.8 list-based collectives (``_all_gather_base`` came later,
   PR #1188 "Notes"). Per all-gather (``_allgather_param``, DeepSpeed v0.3.13-v0.3.15, March-April 2021):
   the GPU zero-fills the ``S``-byte buffer, ``torch.cuda.synchronize()`` waits for it, the host makes one
   ``narrow`` per rank (GPU idle), then ``ProcessGroupNCCL::allgather`` enqueues the NCCL kernel and launches
   its ``n`` output ``copy_`` calls (``S`` read + ``S`` written) while the kernel runs: ``hbm(S) + n c +
   max(t_nccl + hbm(2 S), n c)``. Per reduce-scatter: DeepSpeed slices the gradient per rank (``view`` +
   ``narrow``: 2 calls per rank), then ``ProcessGroupNCCL::reduce_scatter`` flattens the ``n`` inputs
   (``n`` ``copy_``, ``2 S`` bytes, the longer of host and HBM) before the kernel. ``c`` =
   ``EAGER_OP_OVERHEAD_S`` per host call; HBM at ``MEMORY_BW_EFFICIENCY`` of the datasheet bandwidth.
   With ``zero3_granularity="tensor"`` (DeepSpeed's persistence threshold) the step also re-gathers the
   persistent tensors after the optimizer step: ``_post_step`` calls the synchronous ``_allgather_params``
   on them (they were partitioned with everything else at the end of the backward,
   ``_partition_all_parameters``): one list all-gather of their concatenated partitions, then a Python
   loop over every tensor and every rank (``narrow``, ``view``, ``narrow``, ``copy_``: ``4 c`` each).
5. ``zero3_grad_reduce="all_reduce"`` — the gradients are all-reduced, not reduce-scattered. Stage 3's
   ``contiguous_gradients`` defaulted to False (``ZERO3_OPTIMIZATION_CONTIGUOUS_GRADIENTS_DEFAULT`` in
   v0.3.13-v0.3.15) until DeepSpeed PR #1199 (2021-07-01, "contiguous gradients should be set to True by default ...
   Features such as reduce_scatter depends on contiguous gradients being True"); without it ``reduce_ipg_grads``
   takes ``buffered_reduce_fallback``: the gradients, in backward order, fill buckets of ``reduce_bucket_size``
   (``DEEPSPEED_REDUCE_BUCKET_ELEMENTS``) elements; each bucket is flattened (``S`` read + written), divided by
   ``n`` (``S`` + ``S``), all-reduced in one NCCL call (ring or tree, ``collectives.py``) and copied back (``S`` +
   ``S``). Twice the bytes of a reduce-scatter on the wire, but one collective per bucket, not ``n`` host calls per
   tensor. The SC21 runs' DeepSpeed configuration is not published: this is the default of their time, an assumption
   (DeepSpeedExamples' Megatron ZeRO-3 example set ``contiguous_gradients: true``; ``benchmarks/cost_accuracy.py``
   prints both).

On CPU ranks (a node type whose :class:`~planner.profile.load.BlockingLatency` has ``plain_collective_s``) each
FSDP2 all-gather and reduce-scatter is a plain c10d call that the rank waits on right after compute: gloo's
worker thread runs it while the rank blocks, so each call pays the after-compute latency measured by
``runtime/profiling/sync_latency.py`` instead of the fit's back-to-back alpha (torch.profiler, 2 gloo ranks,
gpt:tiny ZeRO-3, one micro-batch: 6 ``c10d::_allgather_base_`` and 3 ``c10d::_reduce_scatter_base_`` per step,
each inside its ``FSDP::all_gather`` / ``FSDP::post_backward_reduce`` range on the main thread; replacing
them by local copies, ``benchmarks/zero3_cpu_comm.py``, they cost 5.3 ms per step on a quiet host and
7.7-9.0 ms at load 3-5, vs 4.44 ms at the fits' alpha per layer and 5.0 / 8.1 ms with this at the latency
measured at each load). The call
count is the runtime's: FSDP2 makes every block its own unit and gathers the chunk's other layers
(embedding, final norm, head) in one root unit (``runtime/executor/fsdp.py``), so a block's calls each pay
the latency once and the root's calls are shared by the model's non-block layers with parameters, which
the per-layer fits would otherwise charge one alpha each (:func:`fsdp_call_latency_s`; exact at ``pp = 1``;
at ``pp > 1`` the first and the last chunk each have a root and one root's latency per call is left out). GPU node types have no such figure: nothing changes there.

Not modelled: the allocator work of the per-gather ``torch.zeros`` / flat buffers, the Python overhead of
DeepSpeed's hooks per sub-module, the per-tensor ``.item()`` syncs of the overflow check and gradient norm
(a few ms per step), and NCCL's slower unaligned copies when ``S / n`` is not a multiple of 16 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.core import (
    DEEPSPEED_PERSISTENCE_THRESHOLD_ELEMENTS,
    DEEPSPEED_REDUCE_BUCKET_ELEMENTS,
    EAGER_OP_OVERHEAD_S,
    MEMORY_BW_EFFICIENCY,
)
from planner.cost.collectives import group_collective_s
from planner.cost.compute import SYNC_PROBE_BYTES
from planner.cost.config import LayerCost, ParallelConfig
from planner.cost.kernels import contention
from planner.cost.placement import GroupShape
from planner.profile import ClusterProfile, LayerProfile, NodeType


def parameter_tensors(layer: LayerProfile, family: str, hidden: int, ffn_hidden: int) -> list[int]:
    """Element counts of the layer's parameter tensors at tp=1 (see the module docstring, 3.).

    A GPT ``megatron_block`` is split into its 12 tensors when they add up to the profile's parameter
    count (h = 4, f = 16: 48, 12, 16, 4, 4, 4, 4, 4, 64, 16, 64, 4); every other layer is one tensor.
    """
    if family == "gpt" and layer.tp_style == "megatron_block" and hidden > 0:
        h, f = hidden, ffn_hidden or 4 * hidden
        tensors = [3 * h * h, 3 * h, h * h, h, h, h, h, h, h * f, f, f * h, h]
        if sum(tensors) == layer.params:
            return tensors
    return [layer.params]


def root_unit_layers(layers: Sequence[LayerProfile]) -> int:
    """How many of the model's layers FSDP2's root unit holds: the non-block layers with parameters."""
    return sum(1 for layer in layers if layer.kind != "block" and layer.params > 0)


def fsdp_call_latency_s(
    cluster: ClusterProfile, node: NodeType, op: str, group: GroupShape, layer: LayerProfile, root_layers: int
) -> float:
    """Seconds to add to the fit time of ``layer``'s ZeRO-3 ``op`` on CPU ranks (module docstring).

    Each FSDP2 unit's call pays ``L = max(plain_collective_s, a)``, ``a`` the fit's time at the probe's
    1 KiB (a measured latency under the fit's own is no discount, as for TP in ``planner.cost.compute``)
    plus its bandwidth term. A block is its own unit: ``L - a``. A non-block layer with parameters is one of
    ``root_layers`` in the root unit, whose one call they share: ``L / root_layers - a`` (negative when the
    per-layer fits charge more alphas than the one call pays). 0 for a layer without parameters, a group
    across nodes, and a node type without ``plain_collective_s`` (GPUs). The search prices each layer's
    ZeRO-3 collectives with this too (``planner.search.costs``).
    """
    latency = node.blocking_latency
    if latency is None or latency.plain_collective_s is None or group.spans_nodes or group.n_ranks <= 1:
        return 0.0
    if layer.params <= 0:
        return 0.0
    share = 1.0 if layer.kind == "block" else 1.0 / max(1, root_layers)
    probe_s = group_collective_s(cluster, node, op, SYNC_PROBE_BYTES, group)
    return share * max(latency.plain_collective_s, probe_s) - probe_s


def list_collective_s(op: str, nccl_s: float, nbytes: float, n_ranks: int, hbm_bytes_per_s: float | None) -> float:
    """Seconds of one torch-1.8 list-based ``op`` of ``nbytes`` as DeepSpeed 2021 issued it, the NCCL kernel
    taking ``nccl_s`` (module docstring, 4.).

    all_gather: the zero-fill runs on the GPU, ``torch.cuda.synchronize()`` waits for it, the host then makes
    ``n`` views (GPU idle); the PG enqueues NCCL and launches its ``n`` output copies while the kernel runs.
    reduce_scatter: ``n`` x (view, narrow) on the host, the PG's ``n`` flatten copies (host || HBM), then NCCL.

    >>> round(list_collective_s("all_gather", 0.01, 0.0, 1000, None), 6)  # 3.3 ms of views, then the kernel
    0.0133
    """
    if n_ranks <= 1:
        return nccl_s
    host_s = n_ranks * EAGER_OP_OVERHEAD_S  # one call per rank
    bw = hbm_bytes_per_s * MEMORY_BW_EFFICIENCY if hbm_bytes_per_s else None

    def hbm(traffic_bytes: float) -> float:
        return traffic_bytes / bw if bw else 0.0

    if op == "all_gather":  # zero-fill S, sync; narrow per rank; NCCL then copies (r + w S) || copy_ launches
        return hbm(nbytes) + host_s + max(nccl_s + hbm(2 * nbytes), host_s)
    # reduce_scatter: view + narrow per rank; then copy_ per rank || read + write S; then NCCL
    return 2 * host_s + max(host_s, hbm(2 * nbytes)) + nccl_s


def deepspeed_buckets(sizes: Sequence[float], bucket: float = DEEPSPEED_REDUCE_BUCKET_ELEMENTS) -> list[float]:
    """Elements per gradient bucket, gradients arriving in the order ``sizes``: DeepSpeed's
    ``reduce_independent_p_g_buckets_and_remove_grads`` reduces the bucket when the next gradient would take
    it past ``bucket`` elements (an empty bucket reduces nothing), so a larger tensor forms its own.

    >>> deepspeed_buckets([3, 4, 2, 9, 1], bucket=8)
    [7.0, 2.0, 9.0, 1.0]
    """
    out: list[float] = []
    fill = 0.0
    for numel in sizes:
        if fill and fill + numel > bucket:
            out.append(fill)
            fill = 0.0
        fill += numel
    if fill:
        out.append(fill)
    return out


class Zero3Comm:
    """ZeRO-3 collectives of one rank (one instance per rank and ``estimate`` call)."""

    def __init__(
        self,
        *,
        cfg: ParallelConfig,
        cluster: ClusterProfile,
        node: NodeType,
        group: GroupShape,
        weight_bytes: float,
        grad_bytes: float,
        family: str,
        hidden: int,
        ffn_hidden: int,
        wide_group: GroupShape | None = None,
        root_layers: int = 1,
    ):
        """``wide_group``: the ``dp x tp`` group over which batch-split replicated layers shard (Whale);
        ``root_layers``: :func:`root_unit_layers` of the model (CPU ranks' per-call latency)."""
        self.cfg, self.cluster, self.node, self.group = cfg, cluster, node, group
        self.root_layers = root_layers
        self.wide_group = wide_group or group
        self.weight_bytes, self.grad_bytes = weight_bytes, grad_bytes
        self.family, self.hidden, self.ffn_hidden = family, hidden, ffn_hidden

    def _one_s(self, op: str, nbytes: float, group: GroupShape | None = None) -> float:
        group = group or self.group
        t = group_collective_s(self.cluster, self.node, op, nbytes, group)
        if self.cfg.zero3_list_collectives and t > 0:
            return list_collective_s(op, t, nbytes, group.n_ranks, self.node.memory_bw_bytes_per_s)
        return t

    def _hbm_s(self, traffic_bytes: float) -> float:
        bw = self.node.memory_bw_bytes_per_s
        return traffic_bytes / (bw * MEMORY_BW_EFFICIENCY) if bw else 0.0

    def persistent_gather_s(self, pairs: Sequence[tuple[LayerProfile, LayerCost]]) -> float:
        """After the optimizer step, DeepSpeed re-gathers the persistent (replicated, under-threshold) tensors
        with its synchronous ``_allgather_params``: one list all-gather of their concatenated partitions, then
        a Python loop over every tensor and every rank (``narrow``, ``view``, ``narrow``, ``copy_``: 4 host
        calls) that copies each rank's part into place (module docstring, 4.)."""
        n = self.group.n_ranks
        if n <= 1:
            return 0.0
        small: list[float] = []
        for layer, cost in pairs:
            share = cost.params / layer.params if layer.params else 0.0
            small += [
                t * share
                for t in parameter_tensors(layer, self.family, self.hidden, self.ffn_hidden)
                if 0 < t < DEEPSPEED_PERSISTENCE_THRESHOLD_ELEMENTS
            ]
        if not small:
            return 0.0
        nbytes = sum(small) * self.weight_bytes
        return self._one_s("all_gather", nbytes) + len(small) * n * 4 * EAGER_OP_OVERHEAD_S

    def bucketed_all_reduce_s(self, pairs: Sequence[tuple[LayerProfile, LayerCost]]) -> float:
        """One backward's gradient reduction as DeepSpeed's ``buffered_reduce_fallback`` does it (module
        docstring, 5.): gradients in backward order fill buckets of ``DEEPSPEED_REDUCE_BUCKET_ELEMENTS``;
        each bucket is flattened, divided, all-reduced over the group and copied back (6 bytes of HBM traffic
        per gradient byte)."""
        sizes: list[float] = []
        for layer, cost in reversed(pairs):
            share = cost.params / layer.params if layer.params else 0.0
            sizes += [t * share for t in reversed(parameter_tensors(layer, self.family, self.hidden, self.ffn_hidden))]
        buckets = deepspeed_buckets(sizes)
        return sum(
            group_collective_s(self.cluster, self.node, "all_reduce", b * self.grad_bytes, self.group)
            + self._hbm_s(6 * b * self.grad_bytes)
            for b in buckets
        )

    def layer_s(self, layer: LayerProfile, cost: LayerCost, wide: bool = False) -> tuple[float, float]:
        """(one gather of the layer's weights, its gradient reduce-scatter), seconds per micro-batch;
        ``wide``: over the ``dp x tp`` group (a batch-split replicated layer). Under
        ``zero3_grad_reduce="all_reduce"`` the second is 0: :meth:`bucketed_all_reduce_s` prices it per step."""
        g = self.wide_group if wide else self.group
        if self.cfg.zero3_grad_reduce == "all_reduce":
            if self.cfg.zero3_granularity == "layer":
                return self._one_s("all_gather", cost.params * self.weight_bytes, g), 0.0
            tensors = parameter_tensors(layer, self.family, self.hidden, self.ffn_hidden)
            share = cost.params / layer.params if layer.params else 0.0
            gather = sum(
                self._one_s("all_gather", t * share * self.weight_bytes, g)
                for t in tensors
                if t >= DEEPSPEED_PERSISTENCE_THRESHOLD_ELEMENTS
            )
            return gather, 0.0
        if self.cfg.zero3_granularity == "layer":  # FSDP2: one call per unit (CPU ranks: + its latency)
            return (
                self._one_s("all_gather", cost.params * self.weight_bytes, g)
                + fsdp_call_latency_s(self.cluster, self.node, "all_gather", g, layer, self.root_layers),
                self._one_s("reduce_scatter", cost.params * self.grad_bytes, g)
                + fsdp_call_latency_s(self.cluster, self.node, "reduce_scatter", g, layer, self.root_layers),
            )
        tensors = parameter_tensors(layer, self.family, self.hidden, self.ffn_hidden)
        share = cost.params / layer.params if layer.params else 0.0  # this rank's part (TP shards)
        gather = sum(
            self._one_s("all_gather", t * share * self.weight_bytes, g)
            for t in tensors
            if t >= DEEPSPEED_PERSISTENCE_THRESHOLD_ELEMENTS
        )
        scatter = sum(self._one_s("reduce_scatter", t * share * self.grad_bytes, g) for t in tensors)
        return gather, scatter

    def step_s(
        self,
        pairs: Sequence[tuple[LayerProfile, LayerCost]],
        *,
        micro_batches: int,
        window_s: float,
        wide_paths: frozenset[str] = frozenset(),
    ) -> float:
        """Seconds of ZeRO-3 communication the step pays on this rank (module docstring)."""
        cfg, m = self.cfg, micro_batches
        gathers, scatters = m * cfg.zero3_param_gathers, m
        if cfg.zero3_grad_sync_mode == "step":  # module docstring, "Accumulation"
            gathers, scatters = m * (cfg.zero3_param_gathers - 1) + 1, 1
        per_step, exposed = 0.0, None
        for layer, k in pairs:
            gather, scatter = self.layer_s(layer, k, layer.path in wide_paths)
            exposed = gather + scatter if exposed is None else exposed  # the first layer's: never hidden
            per_step += gathers * gather + scatters * scatter
        if cfg.zero3_granularity == "tensor" and cfg.zero3_list_collectives:
            per_step += self.persistent_gather_s(pairs)
        if cfg.zero3_grad_reduce == "all_reduce":
            reduce = self.bucketed_all_reduce_s(pairs)
            per_step += scatters * reduce
            # overlapped (not DeepSpeed-2021's case): the first layer's share of the reduction stays exposed
            exposed = (exposed or 0.0) + reduce / max(1, len(pairs))
        overlap = cfg.overlap_grad_reduce if cfg.zero3_overlap is None else cfg.zero3_overlap
        if not overlap:
            return per_step
        kappa = contention(self.node)  # the hidden part still costs kappa of its time (kernels.contention)
        return max(per_step - (1 - kappa) * m * window_s, kappa * per_step) + (exposed or 0.0)


def zero3_accumulation_bytes(
    cfg: ParallelConfig, *, micro_batches: int, params: float, weight_bytes: float, grad_bytes: float
) -> float:
    """Extra bytes a rank holds under ``zero3_grad_sync="step"`` with ``micro_batches > 1``: its ``params``
    unsharded weights and unsharded gradients between micro-batches (module docstring, "Accumulation").

    >>> zero3_accumulation_bytes(ParallelConfig(zero_stage=3, zero3_grad_sync="step"), micro_batches=4,
    ...                          params=1e9, weight_bytes=2, grad_bytes=4)
    6000000000.0
    """
    if cfg.zero_stage < 3 or cfg.zero3_grad_sync_mode != "step" or micro_batches <= 1:
        return 0.0
    return params * (weight_bytes + grad_bytes)


__all__ = [
    "Zero3Comm",
    "deepspeed_buckets",
    "fsdp_call_latency_s",
    "list_collective_s",
    "parameter_tensors",
    "root_unit_layers",
    "zero3_accumulation_bytes",
]
