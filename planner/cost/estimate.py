"""``estimate``: step time and per-rank peak memory of one parallel configuration.

Composition (exact formula, reproduced by the ILP; see ``pipeline.py`` for (P) and (S)):

1. Per chunk ``c`` and micro-batch: the sum over its layers of :func:`layer_cost` terms (forward,
   backward, recompute, TP collectives), Whale layout changes between neighbours that disagree (charged
   to the chunk holding the second layer), and pipeline send/recv: each boundary costs BOTH its chunks
   one one-way transfer per micro-batch (Megatron's paired send-forward/receive-backward exchanges).
   With ``tp > 1`` each TP rank sends ``1/tp`` of the activation and the receiver all-gathers it over
   the TP group — Megatron's scatter/gather optimisation (SC21 §4.1); with sequence parallelism the
   activation is already sharded. With measured timings (``planner.cost.framework``), ``layer_cost``
   already holds the runtime's per-layer wrapper overheads (DTensor TP dispatch, FSDP2 hooks), and each
   chunk adds ONE constant per micro-batch when ``dp > 1``: its root FSDP2 unit's fixed cost
   (``framework.chunk_overhead_s``, to forward and backward).
2. ``T_r`` = sum over the chunks of pp rank ``r``; the pipeline time is (P) over ``T_r``.
3. Per rank ``r``, once per step (``W_r`` = backward + recompute time of one micro-batch over the rank's
   chunks, ``F_r`` = its forward time, ``G_r`` = gradient bytes, ``k`` = seconds per byte of
   :func:`dp_collective_time`):

   - gradient sync ``sync_r = k * G_r`` over the DP group (all-reduce at ZeRO-0, reduce-scatter at
     ZeRO-1/2; TP-replicated layers too: their TP ranks hold identical gradients); exposed
     ``max(sync_r - (1 - c) W_r, min(t(bucket), sync_r) + c sync_r)`` when ``overlap_grad_reduce`` (PyTorch
     DDP, Megatron ``--overlap-grad-reduce``: it runs under the last micro-batch's backward, but the last
     bucket only starts after it; ``c = kernels.contention(node)``: the hidden part still costs ``c`` of its
     time), else ``sync_r``;
   - ZeRO-1/2: parameter all-gather ``g = k_ag * P_r`` after the step, exposed ``max(g - (1 - c) F_r, c g)``
     when overlapping (``--overlap-param-gather``), else all of it;
   - ZeRO-3: per micro-batch and layer, two all-gathers of its weights and a reduce-scatter of its
     gradients (ZeRO §5.3: 1.5x the all-reduce volume): ``m * max(C_r - (1 - c)(F_r + W_r), c C_r) + g_first``
     when overlapping (the rank's first layer's gather cannot be prefetched), else ``m * C_r``
     (``zero3.py``; its non-default ``ParallelConfig.zero3_*`` settings model DeepSpeed's 2021 ZeRO-3);
   - the AdamW step, memory-bound: ``OPTIMIZER_BYTES_PER_PARAM * params_r / (0.85 * HBM bandwidth)``
     (``TORCH_ADAMW_BYTES_PER_PARAM`` for autocast profiles: torch's foreach AdamW on fp32 weights)
     (params after ZeRO sharding), plus the sum over the rank's layers of ``LayerCost.optimizer_s`` (the
     measured per-layer AdamW host time; 0 without measured timings).

   The step time adds the maximum over ranks of this tail (S).
4. ``ParallelConfig.replica_node_types`` (dp replicas on different node types): 1.-3. per distinct type
   with its own ``m_t``, combined by formula (H) of :func:`_estimate_replicas`.

Gradients are communicated in the 16-bit compute dtype (ZeRO paper's 2-byte gradients); for an autocast profile
(``ModelProfile.precision``) weights, gradients and their collectives are fp32 (``memory.state_dtype``). Tied embeddings
on different pipeline ranks keep a copy of the word embedding on the head's rank (SC21 eq. 2 note); its
gradient all-reduce between the two ranks (one message per step) is not modelled.
"""

from __future__ import annotations

from dataclasses import replace

from planner.core import (
    DDP_BUCKETS_IN_FLIGHT,
    STATE_BYTES_PER_PARAM,
    ZERO3_LAYERS_IN_FLIGHT,
    Recompute,
    TPStyle,
    is_gpu,
)
from planner.cost.collectives import collective_time, group_collective_s
from planner.cost.compute import batch_sliced, layer_cost, layer_working_set_bytes, layout_change_cost
from planner.cost.config import LayerCost, ParallelConfig
from planner.cost.context import fold
from planner.cost.framework import chunk_overhead_s, dp_wrapper, timings_scale
from planner.cost.kernels import contention, optimizer_step_s
from planner.cost.memory import (
    Moment,
    SweepRun,
    backward_sweep,
    block_unit_bytes,
    build_memory_breakdown,
    model_states_bytes,
    optimizer_bytes_per_param,
    peak_moments,
    precision_kind,
    runtime_breakdown,
    runtime_states,
    state_dtype,
)
from planner.cost.moe import add_expert_costs, expert_split
from planner.cost.pipeline import inflight_microbatches, pipeline_aliases_input, pipeline_step_time
from planner.cost.placement import (
    GroupShape,
    ReplicaSet,
    assign_chunks,
    dp_group,
    layer_recompute,
    layer_style,
    rank_node_types,
    replica_sends_cross_nodes,
    replica_sets,
    tp_group,
)
from planner.cost.records import BREAKDOWN_KEYS, ChunkEstimate, Estimate, RankEstimate, ReplicaTypeEstimate
from planner.cost.validate import check_config, micro_batches_per_replica, replica_micro_batches
from planner.cost.zero3 import Zero3Comm, root_unit_layers, zero3_accumulation_bytes
from planner.profile import ClusterProfile, LayerProfile, ModelProfile, NodeType


def dp_collective_time(
    cluster: ClusterProfile, node: NodeType, op: str, nbytes: float, group: GroupShape, bucket_bytes: float | None
) -> float:
    """Seconds to move ``nbytes`` of gradients (or ZeRO-1/2 weights) over a data-parallel group.

    In buckets of ``bucket_bytes``, one collective each with the algorithm chosen at the bucket size
    (torch DDP ``bucket_cap_mb``; Megatron-Core buckets alike): ``nbytes * t(bucket) / bucket``, linear in
    the bytes — a sum of per-layer terms the ILP can carry. ``None``: one collective, ``t(nbytes)``.
    """
    if nbytes <= 0:
        return 0.0
    if bucket_bytes is None:
        return group_collective_s(cluster, node, op, nbytes, group)
    return nbytes * group_collective_s(cluster, node, op, bucket_bytes, group) / bucket_bytes


def timings_apply(model: ModelProfile, node: NodeType) -> bool:
    """Measured timings are used only on the device they were measured on."""
    measured_on = (model.provenance.device_name or "").lower()
    device = node.device.lower()
    return bool(measured_on) and (measured_on == device or ("cpu" in measured_on and "cpu" in device))


class _Assembler:
    """Builds the chunk and rank records of one configuration (one instance per ``estimate`` call, or
    per replica node type: ``replicas`` puts every pp rank on its type with its ``m_t`` and DP groups)."""

    def __init__(
        self,
        model: ModelProfile,
        cluster: ClusterProfile,
        config: ParallelConfig,
        dtype: str,
        global_batch: int,
        replicas: ReplicaSet | None = None,
    ):
        self.model, self.cluster, self.cfg, self.dtype = model, cluster, config, dtype
        self.state_dtype = state_dtype(dtype, model.precision)  # fp32 weights and gradients under autocast
        self.optimizer_bytes = optimizer_bytes_per_param(model.precision)
        self.global_batch, self.replicas = global_batch, replicas
        self.chunks = assign_chunks(model, config)
        if replicas is None:
            self.m = micro_batches_per_replica(config, global_batch)
            self.node_names = rank_node_types(cluster, config)
        else:
            self.m, self.node_names = replicas.micro_batches, [replicas.node_type] * config.pp
        self.costs: list[list[LayerCost]] = []
        self._cache: dict[tuple[str, str, str, str], LayerCost] = {}

    def node(self, pp_rank: int) -> NodeType:
        return self.cluster.node_type(self.node_names[pp_rank])

    def _cost(self, layer: LayerProfile, node: NodeType) -> LayerCost:
        """layer_cost, computed once per (signature, option, node type): equal signatures are identical."""
        cfg = self.cfg
        style, recompute = layer_style(cfg, layer), layer_recompute(cfg, layer)
        key = (layer.signature, style, recompute, node.name)
        if key not in self._cache:
            self._cache[key] = self._dense_cost(layer, node, style, recompute)
            if layer.experts is not None:  # routed experts over ep/etp (planner.cost.moe)
                self._cache[key] = add_expert_costs(
                    layer,
                    self._cache[key],
                    node=node,
                    cluster=self.cluster,
                    split=expert_split(cfg),
                    recompute=recompute,
                    dtype=self.dtype,
                    moe_recompute=cfg.moe_recompute,
                )
        return self._cache[key]

    def _dense_cost(self, layer: LayerProfile, node: NodeType, style: TPStyle, recompute: Recompute) -> LayerCost:
        """compute.layer_cost of the layer's shards (a Mixture-of-Experts block: without its routed experts)."""
        cfg = self.cfg
        return layer_cost(
            layer,
            node=node,
            cluster=self.cluster,
            tp=cfg.tp,
            style=style,
            recompute=recompute,
            sequence_parallel=cfg.sequence_parallel,
            micro_batch=cfg.micro_batch,
            flash_attention=cfg.flash_attention,
            dtype=self.dtype,
            tp_group_spans_nodes=tp_group(cfg.tp, node.devices_per_node).spans_nodes,
            use_timings=timings_apply(self.model, node),
            overlap_tp_comm=cfg.overlap_tp_comm,
            dp_wrapper=dp_wrapper(cfg.dp, cfg.zero_stage),
            timings_scale=timings_scale(self.model, node),
            context=cfg.kv_exchange,
            causal_skip=cfg.causal_skip,
            torch_tp_memory=cfg.memory_semantics == "fsdp2",
        )

    def _layout_s(self, prev: LayerProfile, nxt: LayerProfile, node: NodeType) -> float:
        cfg = self.cfg
        prev_style, next_style = layer_style(cfg, prev), layer_style(cfg, nxt)
        if cfg.tp == 1 or prev_style == next_style:  # no re-layout (layout_change_cost's own first case)
            return 0.0
        return layout_change_cost(
            prev,
            nxt,
            prev_style,
            next_style,
            node=node,
            cluster=self.cluster,
            tp=cfg.tp,
            micro_batch=cfg.micro_batch,
            sequence_parallel=cfg.sequence_parallel,
            tp_group_spans_nodes=tp_group(cfg.tp, node.devices_per_node).spans_nodes,
        )

    def _boundary_s(self, c: int) -> float:
        """One-way time of the activation crossing the boundary after chunk ``c`` (per micro-batch)."""
        cfg = self.cfg
        src, dst = c % cfg.pp, (c + 1) % cfg.pp
        node = self.node(src)
        last = self.chunks[c][-1]
        full_bytes = last.output_bytes_per_sample * cfg.micro_batch
        if self.replicas is not None and len(self.replicas.sync_node_types) > 1:  # dp, pp, tp layout
            spans = replica_sends_cross_nodes(cfg, node.devices_per_node)
        else:  # pp, dp, tp layout: a stage's dp x tp ranks (count_t x tp for one replica type)
            stage_ranks = (cfg.dp if self.replicas is None else len(self.replicas.replicas)) * cfg.tp
            spans = self.node_names[src] != self.node_names[dst] or stage_ranks >= node.devices_per_node
        one_way = collective_time(
            self.cluster, "send_recv", full_bytes / cfg.tp, 2, node_type=node, spans_nodes=spans, ranks_per_node=1
        )
        if cfg.tp > 1 and not cfg.sequence_parallel and layer_style(cfg, last) == "split":
            one_way += group_collective_s(
                self.cluster, node, "all_gather", full_bytes, tp_group(cfg.tp, node.devices_per_node)
            )
        return one_way

    def _p2p_s(self, c: int) -> float:
        """Pipeline send/recv time of chunk ``c`` per micro-batch.

        Megatron pairs each send with the opposite receive (``send_forward_recv_backward``,
        ``send_backward_recv_forward``), so a boundary costs each of its two chunks one one-way transfer
        per micro-batch: a chunk pays its inbound and its outbound boundary.
        """
        if self.cfg.pp == 1:
            return 0.0
        inbound = self._boundary_s(c - 1) if c > 0 else 0.0
        outbound = self._boundary_s(c) if c < len(self.chunks) - 1 else 0.0
        return inbound + outbound

    def _chunk_unit_s(self, node: NodeType) -> tuple[float, float]:
        """Fixed per-chunk host cost of the chunk's root FSDP2 unit (``framework.chunk_overhead_s``)."""
        if not timings_apply(self.model, node):
            return 0.0, 0.0
        return chunk_overhead_s(
            self.model, dp_wrapper(self.cfg.dp, self.cfg.zero_stage), timings_scale(self.model, node)
        )

    def build_chunks(self) -> list[ChunkEstimate]:
        out = []
        for c, layers in enumerate(self.chunks):
            node = self.node(c % self.cfg.pp)
            costs = [self._cost(layer, node) for layer in layers]
            self.costs.append(costs)
            neighbours = list(zip(layers, layers[1:]))
            if c > 0:
                neighbours.insert(0, (self.chunks[c - 1][-1], layers[0]))
            unit_fwd_s, unit_bwd_s = self._chunk_unit_s(node)
            time_s = {
                "forward": sum(k.forward_s for k in costs) + unit_fwd_s,
                "backward": sum(k.backward_s for k in costs) + unit_bwd_s,
                "recompute": sum(k.recompute_s for k in costs),
                "tp_comm": sum(k.tp_comm_s for k in costs),
                "layout": sum(self._layout_s(a, b, node) for a, b in neighbours),
                "pp_comm": self._p2p_s(c),
            }
            if any(layer.experts is not None for layer in layers):
                time_s["ep_comm"] = sum(k.ep_comm_s for k in costs)
            out.append(
                ChunkEstimate(
                    index=c,
                    pp_rank=c % self.cfg.pp,
                    node_type=node.name,
                    module_paths=tuple(layer.path for layer in layers),
                    time_s=time_s,
                    model_flops=sum(k.model_flops for k in costs),
                    hardware_flops=sum(k.hardware_flops for k in costs),
                )
            )
        return out

    def _rank_params(self, r: int) -> tuple[float, float, list[tuple[LayerProfile, LayerCost]]]:
        """(parameters of pp rank r synced over the DP group, those synced over the ``dp x tp`` group, its
        (layer, cost) pairs). A replicated layer under ``tp > 1`` is data-parallel inside the TP group
        (Whale), so its gradients average over ``dp x tp``; a split layer's shard syncs over DP alone."""
        cfg = self.cfg
        pairs = [
            (layer, cost)
            for c in range(r, len(self.chunks), cfg.pp)
            for layer, cost in zip(self.chunks[c], self.costs[c])
        ]
        wide = sum(k.params for layer, k in pairs if self._batch_split(layer))
        return sum(k.params for _, k in pairs) - wide + self._tied_copy(r), wide, pairs

    def _batch_split(self, layer: LayerProfile) -> bool:
        return batch_sliced(self.cfg.micro_batch, self.cfg.tp, layer_style(self.cfg, layer))

    def _tied_copy(self, r: int) -> float:
        """Word-embedding copy held by the head's pp rank when tied and on another rank."""
        if not bool(self.model.model.dims.get("tie_embeddings", False)) or self.cfg.pp == 1:
            return 0.0
        where = {layer.path: c % self.cfg.pp for c, chunk in enumerate(self.chunks) for layer in chunk}
        if "embed" not in where or "head" not in where or where["embed"] == where["head"] or where["head"] != r:
            return 0.0
        embed = self.model.layer("embed")
        style_tp = self.cfg.tp if layer_style(self.cfg, embed) == "split" else 1
        return float(embed.shard(style_tp).params)

    def _dp_groups(self, node: NodeType) -> tuple[GroupShape, GroupShape]:
        if self.replicas is not None:
            return self.replicas.dp_group, self.replicas.dp_tp_group
        return (
            dp_group(self.cfg.dp, self.cfg.tp, node.devices_per_node),
            dp_group(self.cfg.dp, self.cfg.tp, node.devices_per_node, include_tp=True),
        )

    def _dp_s(self, node: NodeType, op: str, nbytes: float, group: GroupShape, bucket: float | None) -> float:
        """:func:`dp_collective_time` at the slowest node type the DP group touches: a ring or tree runs at
        its slowest link (Patarasuk & Yuan 2009); ``collective_time`` takes the node's intra-node fit and its
        NIC share of the cluster's inter-node fit (``collectives._flat_link``), so evaluating it with each
        type of the group and keeping the maximum picks the slower fit. One type: the rank's own node."""
        names = self.replicas.sync_node_types if self.replicas is not None else (node.name,)
        nodes = [node if name == node.name else self.cluster.node_type(name) for name in names]
        return max(dp_collective_time(self.cluster, n, op, nbytes, group, bucket) for n in nodes)

    def build_rank(self, r: int, chunks: list[ChunkEstimate]) -> RankEstimate:
        cfg, node = self.cfg, self.node(r)
        mine = [ch for ch in chunks if ch.pp_rank == r]
        params, wide, pairs = self._rank_params(r)
        dp_g, dpt_g = self._dp_groups(node)
        grad_b = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]["grads"]
        weight_b = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]["params"]
        bwd_window = sum(ch.time_s["backward"] + ch.time_s["recompute"] for ch in mine)
        fwd_window = sum(ch.time_s["forward"] for ch in mine)
        sync_s = exposed_s = zero_s = 0.0
        kappa = contention(node)
        if cfg.zero_stage < 3:
            op = "all_reduce" if cfg.zero_stage == 0 else "reduce_scatter"
            bucket = cfg.grad_bucket_bytes
            sync_s = self._dp_s(node, op, params * grad_b, dp_g, bucket) + self._dp_s(
                node, op, wide * grad_b, dpt_g, bucket
            )
            if cfg.overlap_grad_reduce:
                # the last bucket only starts when the backward ends: it is exposed whatever the overlap;
                # the hidden part still costs kappa of its time (contention, kernels.contention)
                last_s = min(self._dp_s(node, op, bucket or 0.0, dp_g, bucket), sync_s)
                exposed_s = max(sync_s - (1 - kappa) * bwd_window, last_s + kappa * sync_s)
            else:
                exposed_s = sync_s
            if cfg.zero_stage > 0:
                gather_s = self._dp_s(node, "all_gather", params * weight_b, dp_g, bucket) + self._dp_s(
                    node, "all_gather", wide * weight_b, dpt_g, bucket
                )
                zero_s = (
                    max(gather_s - (1 - kappa) * fwd_window, kappa * gather_s) if cfg.overlap_grad_reduce else gather_s
                )
        else:
            zero_s = self._zero3_s(pairs, node, dp_g, dpt_g, weight_b, grad_b, fwd_window + bwd_window)
        return RankEstimate(
            pp_rank=r,
            node_type=node.name,
            microbatch_s=sum(ch.total_s for ch in mine),
            inflight_microbatches=inflight_microbatches(cfg.schedule, cfg.pp, r, self.m, cfg.virtual_stages),
            dp_sync_s=sync_s,
            dp_sync_exposed_s=exposed_s,
            zero_comm_s=zero_s,
            optimizer_s=(
                self._optimizer_s(node, params, cfg.dp)
                + self._optimizer_s(node, wide, cfg.dp * cfg.tp)
                + sum(k.optimizer_s for _, k in pairs)
            ),
            expert_step_s=sum(k.expert_step_s for _, k in pairs),
            memory=self._memory(r, node, params, wide, pairs),
        )

    def _zero3_s(
        self,
        pairs: list[tuple[LayerProfile, LayerCost]],
        node: NodeType,
        dp_g: GroupShape,
        dpt_g: GroupShape,
        weight_b: float,
        grad_b: float,
        window_s: float,
    ) -> float:
        """ZeRO-3 per step: per layer and micro-batch, gather the weights ``zero3_param_gathers`` times and
        reduce-scatter the gradients; with overlap only what exceeds the compute shows (``zero3.py``)."""
        spec = self.model.model
        comm = Zero3Comm(
            cfg=self.cfg,
            cluster=self.cluster,
            node=node,
            group=dp_g,
            weight_bytes=weight_b,
            grad_bytes=grad_b,
            family=spec.family,
            hidden=int(spec.dims.get("hidden", 0) or 0),
            ffn_hidden=int(spec.dims.get("ffn_hidden", 0) or 0),
            wide_group=dpt_g,
            root_layers=root_unit_layers(self.model.layers),
        )
        wide = frozenset(layer.path for layer, _ in pairs if self._batch_split(layer))
        return comm.step_s(pairs, micro_batches=self.m, window_s=window_s, wide_paths=wide)

    def _optimizer_s(self, node: NodeType, params: float, shards: int) -> float:
        """AdamW step over ``params``, sharded ``shards`` ways under ZeRO >= 1."""
        params = params / (shards if self.cfg.zero_stage >= 1 else 1)
        return optimizer_step_s(node, self.dtype, self.optimizer_bytes, params)

    def _memory_textbook(
        self, r: int, node: NodeType, params: float, wide: float, pairs: list[tuple[LayerProfile, LayerCost]]
    ):
        """Peak bytes of pp rank ``r`` as Megatron-LM and DeepSpeed hold them (``ParallelConfig.memory_semantics``
        "textbook"): ZeRO's model states (Rajbhandari et al. 2020 §5), gradients through the whole step, the
        peak's activations (Korthikanti et al. 2022), DDP gradient buckets."""
        cfg = self.cfg
        states = [
            model_states_bytes(params, cfg.zero_stage, cfg.dp, self.state_dtype),
            model_states_bytes(wide, cfg.zero_stage, cfg.dp * cfg.tp, self.state_dtype),
        ]
        act = sum(k.act_bytes for _, k in pairs)
        # the textbook working set has no measured backward growth (Korthikanti et al. count the re-materialised
        # layer of full recompute only)
        working = max((layer_working_set_bytes(cfg, layer, k) - k.backward_ws_bytes for layer, k in pairs), default=0.0)
        buffers = 0.0
        grad_bytes = (params + wide) * STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]["grads"]
        if cfg.zero_stage < 3 and (cfg.dp > 1 or wide > 0):
            buffers += min(DDP_BUCKETS_IN_FLIGHT * (cfg.grad_bucket_bytes or grad_bytes), grad_bytes)
        if cfg.zero_stage == 3:
            buffers += ZERO3_LAYERS_IN_FLIGHT * max((k.param_bytes for _, k in pairs), default=0.0)
            per = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]
            buffers += zero3_accumulation_bytes(
                cfg, micro_batches=self.m, params=params + wide, weight_bytes=per["params"], grad_bytes=per["grads"]
            )
        if cfg.pp > 1:
            buffers += 2 * sum(
                self.chunks[c][-1].output_bytes_per_sample * cfg.micro_batch / cfg.tp
                for c in range(r, len(self.chunks), cfg.pp)
            )
        inflight = inflight_microbatches(cfg.schedule, cfg.pp, r, self.m, cfg.virtual_stages)
        return build_memory_breakdown(
            states=states,
            act_bytes_per_microbatch=act,
            inflight_microbatches=inflight,
            working_set_bytes=working,
            comm_buffer_bytes=buffers,
            capacity_bytes=float(node.device_memory_bytes),
            is_gpu=is_gpu(node.device),
            expert_state_bytes=sum(k.expert_state_bytes for _, k in pairs),
        )

    def _pipeline_bytes(self, r: int) -> tuple[float, float]:
        """What ``torch.distributed.pipelining`` adds to pp rank ``r``'s memory: (receive buffers, bytes held per
        micro-batch in flight).

        - Each stage allocates one receive buffer per micro-batch at its first step and keeps them: the
          activations a chunk receives (all chunks but the first) and the gradients it receives (all but the
          last), ``m`` of each.
        - A chunk keeps its output for each micro-batch in flight until that micro-batch's backward: the
          boundary activation it sent or, on the last chunk, the logits (the schedule computes the loss
          outside the stage, :attr:`ShardProfile.logits_bytes_per_sample`).
        - A received activation is its chunk's input: where the first layer saves it for backward
          (``pipeline_aliases_input``), that much of the chunk's activations is the buffer already counted.
        """
        cfg = self.cfg
        last = len(self.chunks) - 1

        def out(c: int) -> float:
            return self.chunks[c][-1].output_bytes_per_sample * cfg.micro_batch / cfg.tp

        sent = sum(out(c) for c in range(r, last, cfg.pp))
        received = sum(out(c - 1) for c in range(r, last + 1, cfg.pp) if c > 0)
        logits = self.costs[last][-1].logits_bytes if last % cfg.pp == r else 0.0
        aliased = received if pipeline_aliases_input(self.model) else 0.0
        return self.m * (sent + received), sent + logits - aliased

    def _backward_sweep(self, pairs: list[tuple[LayerProfile, LayerCost]], later: float) -> tuple[float, float, float]:
        """One micro-batch's activations, working set and gradients at the worst point of its backward
        (``planner.cost.memory``, "The backward sweep"), as (bytes, of which gathered weights, of which
        gradients); ``later``: bytes per parameter of the gradients the layers after that point have made (0
        where the moment counts every gradient apart). Mirrored by ``planner.search.tables.backward_sweep_bytes``."""
        cfg = self.cfg
        grad_bytes = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]["grads"]
        seen: dict[int, tuple[float, float, float]] = {}

        def ws(layer: LayerProfile, k: LayerCost) -> tuple[float, float, float]:  # (total, weights, gradients)
            if id(k) not in seen:
                weights, copy = block_unit_bytes(
                    cfg.zero_stage,
                    cfg.dp,
                    layer.kind,
                    k.params + k.expert_unit_params,
                    k.param_bytes + k.expert_unit_param_bytes,
                    grad_bytes,
                )
                seen[id(k)] = (layer_working_set_bytes(cfg, layer, k) + weights + copy, weights, copy)
            return seen[id(k)]

        if cfg.virtual_stages > 1:  # several chunks per rank: every activation alive at the largest working set
            top = max((ws(layer, k) for layer, k in pairs), default=(0.0, 0.0, 0.0))
            return sum(k.act_bytes for _, k in pairs) + top[0], top[1], top[2]
        runs = [[pairs[0]]] if pairs else []
        for layer, k in pairs[1:]:
            if layer.signature == runs[-1][-1][0].signature:
                runs[-1].append((layer, k))
            else:
                runs.append([(layer, k)])

        def grads(k: LayerCost) -> float:
            return later * k.params + (k.expert_grads_accumulating_bytes if later else 0.0)

        tops = [max((ws(layer, k) for layer, k in run), key=lambda w: w[0]) for run in runs]
        total, i, later_grads = backward_sweep(
            [
                SweepRun(
                    act=sum(k.act_bytes for _, k in run),
                    grads=sum(grads(k) for _, k in run),
                    ws=top[0],
                    first=max(k.act_bytes - grads(k) for _, k in run),
                )
                for run, top in zip(runs, tops)
            ]
        )
        weights, copy = (tops[i][1], tops[i][2]) if i >= 0 else (0.0, 0.0)
        return total, weights, copy + later_grads

    def _memory(self, r: int, node: NodeType, params: float, wide: float, pairs: list[tuple[LayerProfile, LayerCost]]):
        """Peak bytes of pp rank ``r`` as the runtime holds them (``planner.cost.memory``: ``runtime_states``,
        ``peak_moments``): weights, AdamW state and the data-parallel wrapper's gathered weights always; the
        activations and gradients of the moment that needs most; the largest layer's backward working set; the
        pipeline's boundary buffers. A configuration priced for Megatron-LM or DeepSpeed
        (``memory_semantics="textbook"``) is priced as they hold it (:meth:`_memory_textbook`)."""
        cfg = self.cfg
        if cfg.memory_semantics == "textbook":
            return self._memory_textbook(r, node, params, wide, pairs)
        n = params + wide
        per = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]
        rs = runtime_states(cfg.zero_stage, cfg.dp, self.state_dtype)
        act = sum(k.act_bytes for _, k in pairs)
        unsharded = rs.unsharded * n  # less what the peak's moment has freed (below)
        if cfg.zero_stage == 3:  # the root unit, gathered from the forward to the end of the backward
            unsharded += sum(k.param_bytes for layer, k in pairs if layer.kind != "block")
            unsharded += zero3_accumulation_bytes(
                cfg, micro_batches=self.m, params=n, weight_bytes=per["params"], grad_bytes=per["grads"]
            )
        buffers, held = self._pipeline_bytes(r) if cfg.pp > 1 else (0.0, 0.0)
        inflight = inflight_microbatches(cfg.schedule, cfg.pp, r, self.m, cfg.virtual_stages)
        expert_grads = {
            "none": 0.0,
            "accumulating": sum(k.expert_grads_accumulating_bytes for _, k in pairs),
            "end": sum(k.expert_grads_end_bytes for _, k in pairs),
        }
        # ZeRO-1/2: as the last backward ends, every FSDP2 unit but the root (the layers other than blocks) has
        # resharded (runtime.executor.fsdp: each block its own unit; ZeRO-0's replicate is one unit)
        root = sum(k.params for layer, k in pairs if layer.kind != "block")
        freed = {
            "none": 0.0,
            "accumulating": 0.0,
            "end": rs.unsharded * (n - root) if cfg.zero_stage in (1, 2) else 0.0,
        }

        sweeps = {
            "none": self._backward_sweep(pairs, 0.0 if cfg.virtual_stages > 1 else rs.accumulating),
            "accumulating": self._backward_sweep(pairs, 0.0),
        }

        def live(mo: Moment) -> tuple[float, float, float]:  # the moment's backward sweep (bytes, weights, grads)
            if mo.grads == "end":
                return 0.0, 0.0, 0.0
            total, weights, grads = sweeps[mo.grads]
            return mo.inflight * held + (mo.inflight - 1) * act + total, weights, grads

        moment = max(
            peak_moments(cfg.schedule, cfg.pp, self.m, inflight),
            key=lambda mo: live(mo)[0] + rs.grads(mo.grads) * n + expert_grads[mo.grads] - freed[mo.grads],
        )
        total, weights, grads = live(moment)
        # by term: a pipeline chunk's received input counted with its buffers (_pipeline_bytes) can leave the
        # sweep's first point, which counts that layer's gradients for part of its activations, below 0
        activations = max(0.0, total - weights - grads)
        grads = total - weights - activations
        shard = cfg.dp if cfg.zero_stage >= 1 else 1
        return runtime_breakdown(
            params=per["params"] * n / shard,
            optimizer=per["optimizer"] * n / shard,
            unsharded=unsharded - freed[moment.grads] + weights,
            grads=rs.grads(moment.grads) * n + expert_grads[moment.grads] + grads,
            activations=activations,
            comm_buffers=buffers,
            capacity_bytes=float(node.device_memory_bytes),
            is_gpu=is_gpu(node.device),
            expert_state_bytes=sum(k.expert_state_bytes for _, k in pairs),
        )


def _breakdown(
    chunks: list[ChunkEstimate],
    ranks: list[RankEstimate],
    pipeline_s: float,
    m: int,
    tail_ranks: list[RankEstimate] | None = None,
) -> dict:
    """Step time by cause along the slowest rank of ``ranks`` (the bubble is the rest of ``pipeline_s``)
    plus the tail of the rank with the largest tail among ``tail_ranks`` (default ``ranks``)."""
    slow = max(ranks, key=lambda rk: rk.microbatch_s)
    tail = max(tail_ranks or ranks, key=lambda rk: rk.tail_s)
    mine = [ch for ch in chunks if ch.pp_rank == slow.pp_rank]
    out = {k: 0.0 for k in BREAKDOWN_KEYS}
    for key in ("forward", "backward", "recompute", "tp_comm", "pp_comm"):
        out[key] = m * sum(ch.time_s[key] for ch in mine)
    out["tp_comm"] += m * sum(ch.time_s["layout"] for ch in mine)
    out["bubble"] = pipeline_s - m * slow.microbatch_s
    out["dp_sync_exposed"] = tail.dp_sync_exposed_s
    out["dp_sync_overlapped"] = tail.dp_sync_s - tail.dp_sync_exposed_s
    out["zero_comm"] = tail.zero_comm_s
    out["optimizer"] = tail.optimizer_s
    if tail.expert_step_s or any("ep_comm" in ch.time_s for ch in mine):
        out["ep_comm"] = m * sum(ch.time_s.get("ep_comm", 0.0) for ch in mine)
        out["expert_sync"] = tail.expert_step_s
    return out


def _evaluate(asm: _Assembler) -> tuple[list[ChunkEstimate], list[RankEstimate], float]:
    """Chunk and rank records of one assembler and its pipeline time, formula (P)."""
    chunks = asm.build_chunks()
    ranks = [asm.build_rank(r, chunks) for r in range(asm.cfg.pp)]
    return (
        chunks,
        ranks,
        pipeline_step_time([rk.microbatch_s for rk in ranks], asm.m, asm.cfg.virtual_stages, asm.cfg.schedule),
    )


def _finish(
    model: ModelProfile,
    config: ParallelConfig,
    global_batch: int,
    *,
    step_s: float,
    chunks: list[ChunkEstimate],
    ranks: list[RankEstimate],
    all_ranks: list[RankEstimate],
    peak_flops: float,
    breakdown_s: dict,
    **extra,
) -> Estimate:
    """The :class:`Estimate`: FLOPs from ``chunks`` (per micro-batch, the same on every node type), memory
    over ``all_ranks``, records ``chunks``/``ranks``."""
    micro_batches_total = global_batch / config.micro_batch
    model_flops = micro_batches_total * config.tp * sum(ch.model_flops for ch in chunks)
    hardware_flops = micro_batches_total * config.tp * sum(ch.hardware_flops for ch in chunks)
    world = config.world_size
    return Estimate(
        step_time_s=step_s,
        tokens_per_s=global_batch * model.seq_len / step_s,
        samples_per_s=global_batch / step_s,
        model_tflops_per_gpu=model_flops / step_s / world / 1e12,
        hardware_tflops_per_gpu=hardware_flops / step_s / world / 1e12,
        mfu=model_flops / step_s / peak_flops,
        hfu=hardware_flops / step_s / peak_flops,
        peak_memory_bytes=max(rk.memory.peak_bytes for rk in all_ranks),
        fits_in_memory=all(rk.memory.peak_bytes <= rk.memory.capacity for rk in all_ranks),
        breakdown_s=breakdown_s,
        per_stage=tuple(chunks),
        per_rank=tuple(ranks),
        **extra,
    )


def _estimate_replicas(
    model: ModelProfile, cluster: ClusterProfile, config: ParallelConfig, *, global_batch: int, dtype: str
) -> Estimate:
    """``estimate`` with ``config.replica_node_types``: each distinct type ``t`` runs the whole pipeline on
    its node type with its own ``m_t`` (the most micro-batches of its replicas), and

        step_s = max_t pipeline_t + max_{t, r} tail_{t, r}                                        (H)

    ``pipeline_t`` is (P) over type ``t``'s ``T_r`` with ``m_t``; ``tail_{t, r}`` is (3.) of the module
    docstring with the DP collectives timed over the whole DP group (all replicas, every type) at the
    slowest node type's link, its overlap taken against type ``t``'s own backward window. (H) is
    conservative: every replica must finish its backward before the all-reduce completes, so the step is
    at least ``max_t (pipeline_t + tail_t)``; (H) also charges the largest tail after the slowest pipeline
    although a faster type's exposed sync may already run while the slower type computes. With one type
    and equal shares (H) is (S). Memory: every (type, pp rank) with that type's capacity and ``m_t``.
    """
    per_type = []
    for rs in replica_sets(cluster, config, replica_micro_batches(config, global_batch)):
        chunks, ranks, pipeline_s = _evaluate(_Assembler(model, cluster, config, dtype, global_batch, rs))
        per_type.append(
            ReplicaTypeEstimate(
                node_type=rs.node_type,
                replicas=rs.replicas,
                micro_batches=rs.micro_batches,
                batch_share_total=rs.batch_share_total,
                pipeline_s=pipeline_s,
                per_rank=tuple(ranks),
                per_stage=tuple(chunks),
            )
        )
    critical = max(per_type, key=lambda t: t.pipeline_s + t.tail_s)
    all_ranks = [rk for t in per_type for rk in t.per_rank]
    pipeline_s = max(t.pipeline_s for t in per_type)
    step_s = pipeline_s + max(rk.tail_s for rk in all_ranks)
    assert config.replica_node_types is not None  # this estimate runs only for replicas on several node types
    peak_flops = sum(cluster.node_type(t).compute_for(dtype).peak_flops_per_s for t in config.replica_node_types)
    peak_flops *= config.pp * config.tp
    note = (
        f"replica node types: step = max over types of pipeline + max tail (H); per_rank/per_stage are "
        f"{critical.node_type}'s (critical); the bubble includes waiting for slower types"
    )
    return _finish(
        model,
        config,
        global_batch,
        step_s=step_s,
        chunks=list(critical.per_stage),
        ranks=list(critical.per_rank),
        all_ranks=all_ranks,
        peak_flops=peak_flops,
        breakdown_s=_breakdown(
            list(critical.per_stage), list(critical.per_rank), pipeline_s, critical.micro_batches, all_ranks
        ),
        per_replica_type=tuple(per_type),
        notes=(note,),
    )


def estimate(
    model: ModelProfile, cluster: ClusterProfile, config: ParallelConfig, *, global_batch: int, dtype: str = "bf16"
) -> Estimate:
    """Predict one training step of ``model`` on ``cluster`` under ``config`` (pure function).

    Raises :class:`StratagemError` naming the fix for impossible configurations. Peak memory over the
    device capacity is reported (``fits_in_memory=False``), not raised: the search needs the number.
    With ``config.replica_node_types`` the step is formula (H) of :func:`_estimate_replicas`.
    """
    if config.cp > 1:  # context parallelism: the folded dp x cp configuration (planner/cost/context.py)
        return estimate_context_parallel(model, cluster, config, global_batch=global_batch, dtype=dtype)
    check_config(model, cluster, config, global_batch=global_batch, dtype=dtype)
    if config.replica_node_types is not None:
        return _estimate_replicas(model, cluster, config, global_batch=global_batch, dtype=dtype)
    asm = _Assembler(model, cluster, config, dtype, global_batch)
    chunks, ranks, pipeline_s = _evaluate(asm)
    step_s = pipeline_s + max(rk.tail_s for rk in ranks)
    peak_flops = sum(asm.node(r).compute_for(dtype).peak_flops_per_s for r in range(config.pp))
    peak_flops *= config.dp * config.tp
    return _finish(
        model,
        config,
        global_batch,
        step_s=step_s,
        chunks=chunks,
        ranks=ranks,
        all_ranks=ranks,
        peak_flops=peak_flops,
        breakdown_s=_breakdown(chunks, ranks, pipeline_s, asm.m),
    )


def estimate_context_parallel(
    model: ModelProfile, cluster: ClusterProfile, config: ParallelConfig, *, global_batch: int, dtype: str
) -> Estimate:
    """``planner.cost.estimate`` of a ``cp > 1`` configuration (module docstring): the folded estimate, with
    samples per second counted in whole sequences."""
    view, folded, folded_batch = fold(config, model, global_batch)
    est = estimate(view, cluster, folded, global_batch=folded_batch, dtype=dtype)
    note = (
        f"context parallel cp={config.cp} ({config.context_parallel or 'allgather'} K/V exchange): "
        f"costed as dp x cp = {folded.dp} ranks on {view.seq_len}-token sequence shares"
    )
    return replace(est, samples_per_s=global_batch / est.step_time_s, notes=(*est.notes, note))


__all__ = ["estimate", "Estimate"]
