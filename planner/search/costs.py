"""Coefficients of the ILP from the cost model: :class:`CandidateCosts` turns an outer choice into
:class:`planner.search.tables.Tables` by calling the same ``planner.cost`` functions ``estimate`` uses
(``layer_cost``, ``layout_change_cost``, ``collective_time``, ``model_states_bytes``,
``inflight_microbatches``), and turns an ILP answer back into a :class:`ParallelConfig`. Each layer's option
costs come from :class:`planner.search.layer_options.LayerOptions` (cached across candidates).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from planner.core import (
    DDP_BUCKETS_IN_FLIGHT,
    STATE_BYTES_PER_PARAM,
    ZERO3_LAYERS_IN_FLIGHT,
    StratagemError,
    is_gpu,
)
from planner.cost import (
    Algorithm,
    GroupShape,
    KVExchange,
    ParallelConfig,
    check_config,
    chunk_overhead_s,
    collective_time,
    contention,
    dp_collective_time,
    dp_group,
    dp_wrapper,
    fold_parts,
    inflight_microbatches,
    interleaved_chunk_sizes,
    layout_change_cost,
    model_states_bytes,
    optimizer_bytes_per_param,
    optimizer_step_s,
    peak_moments,
    pipeline_aliases_input,
    precision_kind,
    replica_micro_batches,
    replica_sends_cross_nodes,
    replica_sets,
    reserve_terms,
    runtime_states,
    state_dtype,
    timings_apply,
    timings_scale,
    tp_group,
    unfold,
)
from planner.cost import estimate as estimate_fn
from planner.profile import ClusterProfile, LayerProfile, ModelProfile, NodeType
from planner.search.config import SearchConfig
from planner.search.layer_options import LayerCostCache, LayerOptions
from planner.search.space import OuterChoice, OuterShape, expand_experts, typed_slowest_floor
from planner.search.tables import Assignment, Concave, Group, RankModel, Tables

# what collective_time(algorithm="auto") minimises over
_ALGORITHMS: tuple[Algorithm, ...] = ("ring", "tree", "hierarchical")


def concave_collective(
    cluster: ClusterProfile,
    node: NodeType,
    op: str,
    group: GroupShape,
    bytes_per_param: float,
    bucket_bytes: float | None,
) -> Concave:
    """``estimate.dp_collective_time`` of ``params * bytes_per_param`` bytes as a :class:`Concave`.

    Bucketed: ``bytes * t(bucket) / bucket`` (one piece through 0). Unbucketed: ``collective_time`` with the
    best algorithm, i.e. the min over the algorithms' affine pieces (each recovered from two evaluations
    and checked at a third).
    """
    if group.n_ranks <= 1:
        return Concave()
    if bucket_bytes is not None:
        per_byte = dp_collective_time(cluster, node, op, bucket_bytes, group, bucket_bytes) / bucket_bytes
        return Concave(pieces=((0.0, per_byte * bytes_per_param),))
    pieces = []
    for alg in _ALGORITHMS:

        def t(params: float) -> float:
            return collective_time(
                cluster,
                op,
                params * bytes_per_param,
                group.n_ranks,
                node_type=node,
                spans_nodes=group.spans_nodes,
                ranks_per_node=group.ranks_per_node,
                algorithm=alg,
            )

        try:
            lo, hi = t(1e3), t(1e9)
        except StratagemError:
            continue  # algorithm does not apply to this op/group
        beta = (hi - lo) / (1e9 - 1e3)
        alpha = lo - beta * 1e3
        mid = t(3e6)
        if abs(alpha + beta * 3e6 - mid) > 1e-12 * mid:
            raise RuntimeError(f"collective_time({op}, {alg}) is not affine in bytes; the ILP needs it to be")
        pieces.append((alpha, beta))
    return Concave(pieces=tuple(pieces))


def _slowest(functions) -> Concave:
    """The pointwise maximum of collective-time functions that are each one piece through 0 (bucketed
    gradients: time linear in bytes), i.e. the steepest; the slowest link of a group spanning node types."""
    functions = list(functions)
    if len(functions) == 1:
        return functions[0]
    if any(len(f.pieces) > 1 or (f.pieces and f.pieces[0][0] != 0.0) for f in functions):
        raise RuntimeError(
            "the slowest of several unbucketed collectives is not a Concave; the search plans with bucketed gradients"
        )
    return max(functions, key=lambda f: f.pieces[0][1] if f.pieces else 0.0)


def group_layers(profile: ModelProfile) -> list[list[LayerProfile]]:
    """Consecutive layers with equal signatures (identical by the profile's contract) form one group."""
    groups: list[list[LayerProfile]] = []
    for layer in profile.layers:
        if groups and groups[-1][-1].signature == layer.signature:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


@dataclass(frozen=True, kw_only=True, slots=True)
class _Candidate:
    outer: OuterChoice
    config: ParallelConfig


class CandidateCosts:
    """Builds ILP tables for outer choices of one (model, cluster, global batch, search config)."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterProfile,
        *,
        global_batch: int,
        config: SearchConfig,
        exchange: KVExchange | None = None,
        shared: LayerCostCache | None = None,
        profile_digest: str | None = None,
    ):
        self.profile, self.cluster, self.global_batch, self._search = profile, cluster, global_batch, config
        self.shared = shared  # layer costs shared with other searches (planner.search.layer_options.LayerCostCache)
        self.exchange = exchange  # set on the per-cp costs of context parallelism (a folded view, see _folded)
        self._context: dict[tuple, CandidateCosts] = {}
        self._folded_outer: dict[OuterChoice, OuterChoice] = {}
        self.dtype = profile.dtype
        self.state_dtype = state_dtype(profile.dtype, profile.precision)  # as estimate: fp32 states under autocast
        self.optimizer_bytes = optimizer_bytes_per_param(profile.precision)
        self.groups = group_layers(profile)
        self.layers = LayerOptions(
            profile,
            cluster,
            search=config,
            exchange=exchange,
            dtype=self.dtype,
            state_dtype=self.state_dtype,
            shared=shared,
            profile_digest=profile_digest,
        )
        # terms that do not read the device count, kept across searches with ``shared`` (their keys name what they
        # read beyond the layer costs' context, the global batch through the micro-batch count); candidates with
        # replicas of several node types read the whole cluster's replica sets: theirs stay with this search
        terms = shared.terms(self.layers.key) if shared is not None else {}
        self._groups: dict[tuple, tuple[tuple[Group, ...], dict]] = terms.setdefault("groups", {})  # with changes
        self._least: dict[tuple, tuple[float, float, list[float]]] = terms.setdefault("least", {})  # layer times
        self._hidden: dict[tuple, float] = terms.setdefault("hidden", {})  # least hidden ZeRO-3 / sync time
        self._ranks: dict[tuple, RankModel] = terms.setdefault("ranks", {})  # rank models (see _rank_model)
        self._replica_groups: dict[tuple, tuple[tuple[Group, ...], dict]] = {}
        self._replica_ranks: dict[tuple, RankModel] = {}
        # per (schedule, pp, v, m): in-flight micro-batches and peak moments per rank; per (pp, v): chunk sizes; per
        # (tp, pp > 1): the tied-embedding record
        self._schedule_terms: dict[tuple, Any] = {}
        self._aliases_input = pipeline_aliases_input(profile)

    # -- context parallelism --------------------------------------------------------------------
    def _folded(self, outer: OuterChoice) -> tuple[CandidateCosts, OuterChoice]:
        """The costs and outer choice that price ``outer``: itself at cp 1; with ``cp > 1`` the folded
        ``dp * cp`` candidate on the per-rank view of the model (``planner.cost.context``, as ``estimate``
        folds it), one :class:`CandidateCosts` per (cp, K/V exchange), cached."""
        if outer.cp == 1:
            return self, outer
        key = (outer.cp, outer.context_parallel)
        if key not in self._context:
            views = [c.profile for (cp, _), c in self._context.items() if cp == outer.cp]  # one view per cp
            view, exchange, batch = fold_parts(
                self.profile, outer.cp, outer.context_parallel, self.global_batch, view=views[0] if views else None
            )
            self._context[key] = CandidateCosts(
                view,
                self.cluster,
                global_batch=batch,
                config=self.search,
                exchange=exchange,
                shared=self.shared,
                # the per-rank view is a function of the model and cp alone (planner.cost.context.fold_parts)
                profile_digest=f"{self.layers.key}/cp{outer.cp}" if self.shared is not None else None,
            )
        sub = self._context[key]
        sub.search = self.search  # the same limits (a caller may change them between solves)
        if outer not in self._folded_outer:
            self._folded_outer[outer] = OuterChoice(  # replace(outer, dp=dp cp, cp=1, context_parallel=None), faster
                tp=outer.tp,
                pp=outer.pp,
                dp=outer.dp * outer.cp,
                schedule=outer.schedule,
                virtual_stages=outer.virtual_stages,
                micro_batch=outer.micro_batch,
                num_micro_batches=outer.num_micro_batches,
                zero_stage=outer.zero_stage,
                sequence_parallel=outer.sequence_parallel,
                rank_node_types=outer.rank_node_types,
                replica_node_types=outer.replica_node_types,
                replica_micro_batches=outer.replica_micro_batches,
                ep=outer.ep,
                etp=outer.etp,
                expert_family=outer.expert_family,
            )
        return sub, self._folded_outer[outer]

    # -- configuration ------------------------------------------------------------------------
    @property
    def search(self) -> SearchConfig:
        """The search's limits and choices (a caller may replace them between solves; the layer costs follow)."""
        return self._search

    @search.setter
    def search(self, config: SearchConfig) -> None:
        self._search = self.layers.search = config

    @property
    def runtime_memory(self) -> bool:
        return self.layers.runtime_memory

    def base_config(self, outer: OuterChoice, **extra) -> ParallelConfig:
        """The cost model's configuration of a (folded: ``cp == 1``, see :meth:`_folded`) candidate; ``extra``
        adds the per-layer choices of an ILP answer."""
        if outer.cp != 1:
            raise StratagemError(
                f"internal error: candidate {outer.summary()} reached the cost model unfolded (cp {outer.cp}); "
                f"please report it with the command line"
            )
        if outer.replica_node_types:  # batch share of replica j: its micro-batches x micro-batch size
            extra.update(
                replica_node_types=outer.replica_node_types,
                batch_shares=tuple(
                    m * outer.micro_batch / self.global_batch for m in outer.replica_micro_batches or ()
                ),
            )
        return ParallelConfig(
            **outer.parallel_dims.degrees(),
            micro_batch=outer.micro_batch,
            num_micro_batches=outer.num_micro_batches,
            schedule=outer.schedule,
            virtual_stages=outer.virtual_stages,
            zero_stage=outer.zero_stage,
            sequence_parallel=outer.sequence_parallel,
            stage_node_types=None if outer.replica_node_types else outer.rank_node_types,
            flash_attention=self.search.flash_attention,
            causal_skip=self.search.flash_attention,
            kv_exchange=self.exchange,
            moe_load_imbalance=self.search.moe_load_imbalance,
            memory_semantics=self.search.memory_semantics,
            **extra,
        )

    def _group(self, layers: list[LayerProfile], outer: OuterChoice, types: list[str]) -> Group:
        options = self.layers.options(layers, outer.tp)
        costs = {nt: tuple(self.layers.option_cost(layers[0], nt, outer, o) for o in options) for nt in types}
        keep = [
            i
            for i, o in enumerate(options)  # drop an option identical to an earlier one everywhere
            if not any(
                options[j].style == o.style and all(costs[nt][j] == costs[nt][i] for nt in types) for j in range(i)
            )
        ]
        last = layers[-1]
        return Group(
            paths=tuple(layer.path for layer in layers),
            options=tuple(options[i] for i in keep),
            costs={nt: tuple(costs[nt][i] for i in keep) for nt in types},
            boundary_s={
                (sty, a, b): self._boundary_s(last, sty, a, b, outer)
                for sty in dict.fromkeys(options[i].style for i in keep)
                for a in types
                for b in types
            }
            if outer.pp > 1
            else {},
            out_buffer_bytes=last.output_bytes_per_sample * outer.micro_batch / outer.tp,
        )

    def _boundary_s(self, last: LayerProfile, style: str, src: str, dst: str, outer: OuterChoice) -> float:
        """One-way transfer after a chunk ending in ``last`` (``estimate._Assembler._boundary_s``)."""
        node = self.cluster.node_type(src)
        full_bytes = last.output_bytes_per_sample * outer.micro_batch
        if outer.replica_node_types:  # dp, pp, tp layout (estimate._Assembler._boundary_s)
            spans = src != dst or replica_sends_cross_nodes(self.base_config(outer), node.devices_per_node)
        else:
            spans = src != dst or outer.dp * outer.tp >= node.devices_per_node
        one_way = collective_time(
            self.cluster, "send_recv", full_bytes / outer.tp, 2, node_type=node, spans_nodes=spans, ranks_per_node=1
        )
        if outer.tp > 1 and not outer.sequence_parallel and style == "split":
            g = tp_group(outer.tp, node.devices_per_node)
            one_way += collective_time(
                self.cluster,
                "all_gather",
                full_bytes,
                g.n_ranks,
                node_type=node,
                spans_nodes=g.spans_nodes,
                ranks_per_node=g.ranks_per_node,
            )
        return one_way

    def _changes(self, groups: list[Group], outer: OuterChoice, types: list[str]) -> dict:
        out = {}
        for g in range(len(groups) - 1):
            prev, nxt = self.groups[g][-1], self.groups[g + 1][0]
            for a in groups[g].styles:
                for b in groups[g + 1].styles:
                    for nt in types:
                        node = self.cluster.node_type(nt)
                        out[g, a, b, nt] = layout_change_cost(
                            prev,
                            nxt,
                            a,
                            b,
                            node=node,
                            cluster=self.cluster,
                            tp=outer.tp,
                            micro_batch=outer.micro_batch,
                            sequence_parallel=outer.sequence_parallel,
                            tp_group_spans_nodes=tp_group(outer.tp, node.devices_per_node).spans_nodes,
                        )
        return out

    def _rank_model(self, nt: str, outer: OuterChoice) -> RankModel:
        """Tail and memory terms of a pp rank on node type ``nt`` (``estimate._Assembler.build_rank``); cached
        by what they read of ``outer`` (with differing replicas also their types and shares: the dp groups span
        the replicas)."""
        fraction = self.search.memory_fraction  # a field callers may change between tables
        key: tuple = (nt, fraction, outer.tp, outer.dp, outer.zero_stage, outer.pp > 1, outer.num_micro_batches > 1)
        if outer.replica_node_types:  # + what replica_sets reads: the replicas' types and batch shares
            key += (
                outer.pp,
                outer.micro_batch,
                outer.num_micro_batches,
                outer.replica_node_types,
                outer.replica_micro_batches,
            )
        store = self._replica_ranks if outer.replica_node_types else self._ranks
        if key not in store:
            store[key] = self._build_rank_model(nt, outer)
        return store[key]

    def _build_rank_model(self, nt: str, outer: OuterChoice) -> RankModel:
        node = self.cluster.node_type(nt)
        tp, dp, zero = outer.tp, outer.dp, outer.zero_stage
        per = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]
        dp_g = dp_group(dp, tp, node.devices_per_node)
        dpt_g = dp_group(dp, tp, node.devices_per_node, include_tp=True)
        sync_nodes = [node]
        if outer.replica_node_types:  # the dp groups span every replica, timed at the slowest type's link
            config = self.base_config(outer)
            rs = replica_sets(self.cluster, config, replica_micro_batches(config, self.global_batch))[0]
            dp_g, dpt_g = rs.dp_group, rs.dp_tp_group
            sync_nodes = [self.cluster.node_type(t) for t in rs.sync_node_types]
        op = "all_reduce" if zero == 0 else "reduce_scatter"
        bucket = ParallelConfig().grad_bucket_bytes  # the search plans with the default DDP bucket
        last_bucket_s = max(dp_collective_time(self.cluster, n, op, bucket or 0.0, dp_g, bucket) for n in sync_nodes)

        def coll(op: str, group: GroupShape, bytes_per_param: float) -> Concave:
            return _slowest(concave_collective(self.cluster, n, op, group, bytes_per_param, bucket) for n in sync_nodes)

        opt_per_param = optimizer_step_s(node, self.dtype, self.optimizer_bytes)
        reserve_factor, reserve_const = reserve_terms(is_gpu=is_gpu(node.device))
        # ZeRO-3 accumulating over m > 1 micro-batches holds unsharded weights + gradients (zero3_accumulation_bytes)
        held = per["params"] + per["grads"] if zero == 3 and outer.pp > 1 and outer.num_micro_batches > 1 else 0.0
        memory: dict[str, Any]
        if self.runtime_memory:  # the runtime's FSDP2 data parallelism (estimate._memory)
            held_states = runtime_states(zero, dp, self.state_dtype)
            memory = dict(
                state_bytes_per_param_dp=held_states.always + held,
                state_bytes_per_param_dpt=held_states.always + held,
                ddp_buffer="never",  # FSDP2's replicate and fully_shard reduce in place: no DDP bucket copies
                ddp_buffer_cap_bytes=math.inf,
                grads_accumulating_per_param=held_states.accumulating,
                # ZeRO-1/2: as the last backward ends, every unit but the root has freed its gathered copy
                # (ZeRO-0's replicate is one unit)
                grads_end_per_param=held_states.end - (held_states.unsharded if zero in (1, 2) else 0.0),
                root_unsharded_per_param=held_states.unsharded if zero in (1, 2) else 0.0,
            )
        else:  # Megatron-LM's and DeepSpeed's (estimate._memory_textbook): ZeRO's states, gradients through the
            # step, DDP bucket copies of the gradients when they are reduced
            memory = dict(
                state_bytes_per_param_dp=model_states_bytes(1.0, zero, dp, self.state_dtype).total_bytes + held,
                state_bytes_per_param_dpt=model_states_bytes(1.0, zero, dp * tp, self.state_dtype).total_bytes + held,
                ddp_buffer="always" if zero < 3 and dp > 1 else ("if_replicated" if zero < 3 and tp > 1 else "never"),
                ddp_buffer_cap_bytes=DDP_BUCKETS_IN_FLIGHT * bucket if bucket else math.inf,
                pp_textbook=True,
            )
        return RankModel(
            capacity_bytes=node.device_memory_bytes * self.search.memory_fraction,
            reserve_factor=reserve_factor,
            reserve_const_bytes=reserve_const,
            grad_bytes_per_param=per["grads"],
            # the runtime's ZeRO-3 weights in flight are the root unit and the sweep's block unit (OptionCost)
            zero3_buffer_layers=ZERO3_LAYERS_IN_FLIGHT if zero == 3 and not self.runtime_memory else 0,
            backward_sweep=self.runtime_memory,
            pp_buffers=outer.pp > 1,
            **memory,
            sync_dp=coll(op, dp_g, per["grads"]),
            sync_dpt=coll(op, dpt_g, per["grads"]),
            last_bucket_s=last_bucket_s,
            gather_dp=coll("all_gather", dp_g, per["params"]),
            gather_dpt=coll("all_gather", dpt_g, per["params"]),
            contention=contention(node),
            optimizer_s_per_param_dp=opt_per_param / (dp if zero >= 1 else 1),
            optimizer_s_per_param_dpt=opt_per_param / (dp * tp if zero >= 1 else 1),
        )

    def _tied(self, outer: OuterChoice) -> dict[str, float]:
        """Embedding copy on the LM head's rank when tied and pp > 1 (``estimate._Assembler._tied_copy``); cached
        by tp and pp > 1 (the tables share the record)."""
        key = ("tied", outer.tp, outer.pp > 1)
        if key not in self._schedule_terms:
            self._schedule_terms[key] = self._tied_uncached(outer)
        return self._schedule_terms[key]

    def _tied_uncached(self, outer: OuterChoice) -> dict[str, float]:
        paths = [layer.path for layer in self.profile.layers]
        if not bool(self.profile.model.dims.get("tie_embeddings", False)) or outer.pp == 1:
            return {}
        if "embed" not in paths or "head" not in paths:
            return {}
        if paths[0] != "embed" or paths[-1] != "head":
            raise StratagemError(
                "tied embeddings need 'embed' first and 'head' last in the model profile; re-profile the model"
            )
        embed = self.profile.layer("embed")
        return {sty: float(embed.shard(outer.tp if sty == "split" else 1).params) for sty in ("split", "replicate")}

    # -- public ---------------------------------------------------------------------------------
    def shape_bound_s(self, shape: OuterShape) -> float:
        """A lower bound of :meth:`quick_bound_s` over every candidate of ``shape``: the layer-time part alone
        (the hidden gradient-sync and ZeRO-3 terms are >= 0), least over its ZeRO stages and sp, at its most
        interleaving: with s <= t (the slowest rank's layers are some of all layers), (m - 1/v) s + t / v =
        m s + (t - s) / v falls with v, and the layer times do not depend on the schedule."""
        return min(self.quick_bound_s(rep, hidden=False) for rep in shape.representatives())

    def quick_bound_s(self, outer: OuterChoice, *, hidden: bool = True) -> float:
        """A cheap lower bound from layer times alone (``space.lower_bound_s`` without sends, optimizer
        or memory): (m - 1/v) max(sum t_min / pp, max t_min) + sum t_min / v; with replica types the
        largest over the types (each with its own node type and m_t). ``hidden``: add the gradient sync and
        ZeRO-3 gathers no overlap can hide (below); without, the layer-time part alone."""
        if outer.cp > 1:
            costs, folded = self._folded(outer)
            return costs.quick_bound_s(folded, hidden=hidden)
        lanes = (
            [((t,), m) for t, _, m in outer.replica_types()]
            if outer.replica_node_types
            else [(tuple(sorted(set(outer.rank_node_types))), outer.num_micro_batches)]
        )
        bound, v = 0.0, outer.virtual_stages
        for types, m in lanes:
            total, largest = (
                self._least_family_times(outer, types) if outer.expert_family else self._least_layer_times(outer, types)
            )
            slowest = max(total / outer.pp, largest)
            if len(types) > 1:  # ranks of several node types: the slower ones hold less (space.typed_slowest_floor)
                per_type = {nt: self._least_layer_times(outer, (nt,), per_layer=True) for nt in types}
                slowest = max(
                    slowest,
                    typed_slowest_floor(
                        per_type, [len(layers) for layers in self.groups], Counter(outer.rank_node_types)
                    ),
                )
            bound = max(bound, (m - 1 / v) * slowest + total / v)
        if outer.replica_node_types or not hidden:
            return bound
        if outer.zero_stage == 3:
            # the slowest rank's ZeRO-3 tail >= m kappa z3_r (tables.rank_tail_s) >= m kappa sum_r z3_r / pp
            bound += outer.num_micro_batches * self._least_hidden_z3_s(outer, lanes[0][0]) / outer.pp
        elif outer.dp > 1:
            # exposed sync >= kappa sync_r (tables.rank_tail_s), bucketed sync linear in the bytes
            bound += self._least_hidden_sync_s(outer, lanes[0][0]) / outer.pp
        return bound

    def _least_hidden_sync_s(self, outer: OuterChoice, types: tuple[str, ...]) -> float:
        """kappa x the data-parallel gradient sync of the least parameters of every layer (cached)."""
        key = ("sync", types, outer.tp, outer.dp, outer.zero_stage)
        if key not in self._hidden:
            total = 0.0
            for nt in types:
                node = self.cluster.node_type(nt)
                kappa = contention(node)
                params = sum(
                    len(layers)
                    * min(
                        self.layers.outer_layer_cost(layers[0], nt, outer, o).params
                        for o in self.layers.options(layers, outer.tp)
                    )
                    for layers in self.groups
                )
                op = "all_reduce" if outer.zero_stage == 0 else "reduce_scatter"
                per = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]["grads"]
                group = dp_group(outer.dp, outer.tp, node.devices_per_node)
                sync = dp_collective_time(
                    self.cluster, node, op, params * per, group, ParallelConfig().grad_bucket_bytes
                )
                total = kappa * sync if not total else min(total, kappa * sync)
            self._hidden[key] = total
        return self._hidden[key]

    def _least_hidden_z3_s(self, outer: OuterChoice, types: tuple[str, ...]) -> float:
        """kappa x the least ZeRO-3 communication of all layers per micro-batch (cached by what it reads)."""
        # option_cost's z3_mb_s reads the micro-batch (batch-split replicas sync over dp x tp) and, with pp > 1,
        # the micro-batch count (the gathers of accumulation, zero3.py)
        key = (
            "z3",
            types,
            outer.tp,
            outer.dp,
            outer.zero_stage,
            outer.micro_batch,
            outer.num_micro_batches if outer.pp > 1 else 0,
        )
        if key not in self._hidden:
            kappa = min(contention(self.cluster.node_type(nt)) for nt in types)
            self._hidden[key] = (
                kappa
                * sum(
                    len(layers)
                    * min(
                        self.layers.option_cost(layers[0], nt, outer, o).z3_mb_s
                        for nt in types
                        for o in self.layers.options(layers, outer.tp)
                    )
                    for layers in self.groups
                )
                if kappa
                else 0.0
            )
        return self._hidden[key]

    def _least_family_times(self, outer: OuterChoice, types: tuple[str, ...]) -> tuple[float, float]:
        """(least total, least largest) over a family's expert layouts (``space.expand_experts``): each is <=
        that of every member, so the quick bound built on them bounds the whole family (cached)."""
        wrapper = dp_wrapper(outer.dp, outer.zero_stage)
        key = ("family", types, outer.tp, outer.sequence_parallel, outer.micro_batch, outer.expert_family, wrapper)
        if key not in self._least:
            times = [self._least_layer_times(child, types) for child in expand_experts(outer)]
            self._least[key] = (min(t[0] for t in times), min(t[1] for t in times), [])
        total, largest, _ = self._least[key]
        return total, largest

    def _least_layer_times(self, outer: OuterChoice, types: tuple[str, ...], per_layer: bool = False) -> Any:
        """(sum over layers, max over layers) of each layer's fastest option on ``types`` (``per_layer``:
        the list of each group's fastest time instead); cached, as it depends only on tp, sequence
        parallel, micro-batch and the dp wrapper."""
        key = (
            types,
            outer.tp,
            outer.sequence_parallel,
            outer.micro_batch,
            dp_wrapper(outer.dp, outer.zero_stage),
            (outer.ep, outer.etp),  # expert time terms (planner.cost.moe.expert_time)
        )
        if key not in self._least:
            t_min = []
            for layers in self.groups:
                costs = [
                    self.layers.outer_layer_cost(layers[0], nt, outer, o)
                    for nt in types
                    for o in self.layers.options(layers, outer.tp)
                ]
                t_min.append(min(k.forward_s + k.backward_s + k.recompute_s + k.tp_comm_s + k.ep_comm_s for k in costs))
            sizes = [len(layers) for layers in self.groups]
            self._least[key] = (sum(t * n for t, n in zip(t_min, sizes)), max(t_min), t_min)
        total, largest, t_min = self._least[key]
        return t_min if per_layer else (total, largest)

    def tables(self, outer: OuterChoice) -> Tables:
        """All ILP coefficients of ``outer`` (one lane per replica node type when replicas differ)."""
        if outer.cp > 1:
            costs, folded = self._folded(outer)
            return costs.tables(folded)
        if outer.replica_node_types:
            check_config(
                self.profile, self.cluster, self.base_config(outer), global_batch=self.global_batch, dtype=self.dtype
            )
            reps = outer.replica_types()
            first = self._tables(outer, [t for t, _, _ in reps], (reps[0][0],) * outer.pp, reps[0][2])
            lanes = tuple(
                replace(
                    first,
                    rank_node_types=(t,) * outer.pp,
                    m=m,
                    inflight=self._inflight(outer, m),
                    moments=self._moments(outer, m) if self.runtime_memory else (),
                )
                for t, _, m in reps
            )
            return replace(lanes[0], replica_lanes=lanes)
        return self._tables(outer, sorted(set(outer.rank_node_types)), outer.rank_node_types, outer.num_micro_batches)

    def _inflight(self, outer: OuterChoice, m: int) -> tuple[float, ...]:
        key = ("inflight", outer.schedule, outer.pp, outer.virtual_stages, m)
        if key not in self._schedule_terms:
            self._schedule_terms[key] = tuple(
                inflight_microbatches(outer.schedule, outer.pp, r, m, outer.virtual_stages) for r in range(outer.pp)
            )
        return self._schedule_terms[key]

    def _moments(self, outer: OuterChoice, m: int) -> tuple[tuple[tuple[float, str], ...], ...]:
        """Each pp rank's candidate peak moments (``planner.cost.memory.peak_moments``, as the estimate)."""
        key = ("moments", outer.schedule, outer.pp, outer.virtual_stages, m)
        if key not in self._schedule_terms:
            self._schedule_terms[key] = tuple(
                tuple((mo.inflight, mo.grads) for mo in peak_moments(outer.schedule, outer.pp, m, k))
                for k in self._inflight(outer, m)
            )
        return self._schedule_terms[key]

    def _chunk_sizes(self, outer: OuterChoice) -> tuple[int, ...] | None:
        """Layers per chunk of an interleaved schedule (fixed by pp and v: placement.interleaved_chunk_sizes)."""
        if outer.virtual_stages < 2:
            return None
        key = ("chunks", outer.pp, outer.virtual_stages)
        if key not in self._schedule_terms:
            self._schedule_terms[key] = interleaved_chunk_sizes(self.profile, self.base_config(outer))
        return self._schedule_terms[key]

    def _tables(self, outer: OuterChoice, types: list[str], rank_types: tuple[str, ...], m: int) -> Tables:
        # groups and layout changes do not depend on the schedule, the micro-batch count (but for ZeRO-3 over pp
        # ranks) or the order of the node types over the pp ranks: candidates that differ only there share them
        key = (
            tuple(types),
            outer.tp,
            outer.dp,
            outer.zero_stage,
            outer.sequence_parallel,
            outer.micro_batch,
            outer.ep,
            outer.etp,
            outer.pp > 1,
            outer.num_micro_batches if outer.pp > 1 and outer.zero_stage == 3 else 0,  # option_cost's z3_mb_s
            (outer.pp, outer.replica_node_types) if outer.replica_node_types else None,
        )
        store = self._replica_groups if outer.replica_node_types else self._groups
        if key not in store:
            groups = tuple(self._group(layers, outer, types) for layers in self.groups)
            store[key] = (groups, self._changes(list(groups), outer, types))
        groups, changes = store[key]
        return Tables(
            groups=groups,
            pp=outer.pp,
            v=outer.virtual_stages,
            m=m,
            zero_stage=outer.zero_stage,
            rank_node_types=rank_types,
            inflight=self._inflight(outer, m),
            moments=self._moments(outer, m) if self.runtime_memory else (),
            ranks={nt: self._rank_model(nt, outer) for nt in types},
            change_s=changes,
            tied_params=self._tied(outer),
            tied_group=0,
            chunk_unit_s={nt: self._chunk_unit_s(nt, outer) for nt in types},
            chunk_sizes=self._chunk_sizes(outer),
            aliases_input=self._aliases_input,
        )

    def _chunk_unit_s(self, nt: str, outer: OuterChoice) -> tuple[float, float]:
        """Per-chunk (forward, backward) host cost of its root FSDP2 unit (``estimate._chunk_unit_s``)."""
        node = self.cluster.node_type(nt)
        if not timings_apply(self.profile, node):
            return 0.0, 0.0
        return chunk_overhead_s(self.profile, dp_wrapper(outer.dp, outer.zero_stage), timings_scale(self.profile, node))

    def parallel_config(self, outer: OuterChoice, tables: Tables, assignment: Assignment) -> ParallelConfig:
        """The :class:`ParallelConfig` an assignment stands for: explicit chunks, per-layer recompute and
        layout (identical layers of a chunk take their options in option order)."""
        if outer.cp > 1:
            costs, folded = self._folded(outer)
            return unfold(costs.parallel_config(folded, tables, assignment), outer.cp, outer.context_parallel)
        stage_layers, recompute, layout = [], {}, {}
        taken = [0] * len(tables.groups)
        for row in assignment.counts:
            chunk = []
            for g, (grp, opts) in enumerate(zip(tables.groups, row)):
                for i, n in enumerate(opts):
                    for path in grp.paths[taken[g] : taken[g] + n]:
                        chunk.append(path)
                        recompute[path] = grp.options[i].recompute
                        layout[path] = grp.options[i].style
                    taken[g] += n
            stage_layers.append(tuple(chunk))
        return self.base_config(outer, stage_layers=tuple(stage_layers), recompute=recompute, layout=layout)

    def estimate(self, config: ParallelConfig):
        """``planner.cost.estimate`` of ``config`` for this model, cluster and global batch."""
        return estimate_fn(self.profile, self.cluster, config, global_batch=self.global_batch, dtype=self.dtype)
