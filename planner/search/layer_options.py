"""What each layer costs under each per-layer option of a search candidate: :class:`LayerOptions`, the part of
:class:`planner.search.costs.CandidateCosts` that calls the cost model's ``layer_cost`` (and the routed experts'
``expert_time`` / ``expert_states``) and turns a :class:`planner.cost.LayerCost` into the ILP's
:class:`planner.search.tables.OptionCost`.

Layer costs are cached by (signature, node type, tp, style, recompute, sp, micro-batch, dp wrapper): candidates
that differ only in pp, dp, ZeRO or schedule reuse them; each layer's kernels, TP collectives and K/V exchange
(``planner.cost.layer_work``) by (signature, node type, tp, style, sp, micro-batch), the same for every recompute
mode and wrapper.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from planner.core import STATE_BYTES_PER_PARAM, Recompute, TPStyle
from planner.cost import (
    KVExchange,
    LayerCost,
    ParallelConfig,
    batch_sliced,
    block_unit_bytes,
    collective_time,
    combine_expert_costs,
    dp_group,
    dp_wrapper,
    expert_split,
    expert_states,
    expert_time,
    fsdp_call_latency_s,
    full_saved_bytes,
    layer_cost,
    layer_work,
    precision_kind,
    root_unit_layers,
    timings_apply,
    timings_scale,
    tp_group,
    working_set_bytes,
)
from planner.profile import ClusterProfile, LayerProfile, ModelProfile
from planner.search.config import SearchConfig
from planner.search.space import OuterChoice
from planner.search.tables import Option, OptionCost


class LayerCostCache:
    """Layer costs shared by several searches of one model on one kind of cluster (``stratagem frontier`` plans
    every device count): each search's :class:`LayerOptions` keeps its costs under a key of everything they
    depend on (:meth:`LayerOptions.context_key`: the model profile, the node types, the inter-node links and
    their fabric share, the options the search prices), so searches that differ only in the device count
    share them and any other difference keeps them apart."""

    def __init__(self) -> None:
        self._by_context: dict[str, tuple[dict[tuple, LayerCost], dict[tuple, Any]]] = {}
        self._terms: dict[str, dict[str, dict]] = {}  # context -> the searches' derived terms (CandidateCosts)
        self._profiles: dict[int, tuple[ModelProfile, str]] = {}  # id -> (profile, digest): each dumped once

    def profile_digest(self, profile: ModelProfile) -> str:
        """sha256 of a model profile's contents, computed once per profile object."""
        known = self._profiles.get(id(profile))
        if known is None or known[0] is not profile:
            digest = hashlib.sha256(profile.model_dump_json().encode()).hexdigest()
            known = self._profiles[id(profile)] = (profile, digest)
        return known[1]

    def tables(self, key: str) -> tuple[dict[tuple, LayerCost], dict[tuple, Any]]:
        """The (layer costs, tagged terms: routed experts, ZeRO-3 collectives, layer work) dictionaries of one
        context, created empty on first use."""
        return self._by_context.setdefault(key, ({}, {}))

    def terms(self, key: str) -> dict[str, dict]:
        """The terms searches derive from one context's layer costs and share across device counts (groups of
        per-layer option costs, rank models, least layer times: ``planner.search.costs.CandidateCosts``), by kind,
        created empty on first use. Each kind's keys name what its terms read beyond the context."""
        return self._terms.setdefault(key, {})


class LayerOptions:
    """Per-layer option costs of one (model, cluster, search config), cached across candidates (and across
    searches with a :class:`LayerCostCache`)."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterProfile,
        *,
        search: SearchConfig,
        exchange: KVExchange | None,
        dtype: str,
        state_dtype: str,
        shared: LayerCostCache | None = None,
        profile_digest: str | None = None,
    ):
        self.profile, self.cluster, self.search, self.exchange = profile, cluster, search, exchange
        self.dtype, self.state_dtype = dtype, state_dtype
        self._cache: dict[tuple, LayerCost]
        # tagged terms beside the layer costs: routed experts' time and states (planner.cost.moe), ZeRO-3
        # collectives, and each layer's recompute- and wrapper-free work (planner.cost.layer_work)
        self._terms: dict[tuple, Any]
        self._cache, self._terms, self.key = {}, {}, ""
        if shared is not None:
            self.key = self.context_key(profile_digest or shared.profile_digest(profile))
            self._cache, self._terms = shared.tables(self.key)

    def context_key(self, profile_digest: str) -> str:
        """A digest of everything the cached costs depend on besides their own keys: the model profile (its
        ``profile_digest``), the node types and inter-node links with their fabric share at this cluster's size,
        the K/V exchange, the dtypes and the search settings the costs read. Not the device count, which the
        costs never read."""
        search = self.search
        parts = [
            profile_digest,
            [nt.model_dump(mode="json") for nt in self.cluster.node_types],
            [fit.model_dump(mode="json") for fit in self.cluster.inter_node],
            self.cluster.inter_node_fraction(),
            repr(self.exchange),
            self.dtype,
            self.state_dtype,
            search.flash_attention,
            search.memory_semantics,
            search.moe_load_imbalance,
            sorted(search.allow),
            repr(search.pins),
        ]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()

    @property
    def runtime_memory(self) -> bool:
        """Memory priced as the runtime holds it, else as Megatron-LM and DeepSpeed do (``SearchConfig``)."""
        return self.search.memory_semantics == "fsdp2"

    def options(self, layers: list[LayerProfile], tp: int) -> tuple[Option, ...]:
        """Recompute modes x styles allowed for this group (see the module docstring)."""
        layer = layers[0]
        modes: tuple[Recompute, ...] = ("none", "selective", "full") if self.search.allows("recompute") else ("none",)
        pinned = dict(self.search.pins).get("recompute")
        if pinned is not None and layer.kind == "block":  # plan --recompute MODE (planner/search/pins.py)
            modes = (pinned,)  # type: ignore[assignment]
        styles: tuple[TPStyle, ...]
        if tp == 1 or layer.tp_style == "none":
            styles = ("replicate",)
        elif layer.kind == "block" or not self.search.allows("layout"):
            styles = ("split",)
        else:
            styles = ("split", "replicate")
        return tuple(Option(recompute=r, style=s) for s in styles for r in modes)

    def outer_layer_cost(self, layer: LayerProfile, nt: str, outer: OuterChoice, option: Option) -> LayerCost:
        """:meth:`layer_cost` of ``layer`` on node type ``nt`` under ``outer`` with one per-layer option."""
        o = outer
        return self.layer_cost(
            layer,
            nt,
            o.tp,
            option.style,
            option.recompute,
            o.sequence_parallel,
            o.micro_batch,
            o.dp,
            o.zero_stage,
            o.ep,
            o.etp,
        )

    def layer_cost(
        self,
        layer: LayerProfile,
        nt: str,
        tp: int,
        style: TPStyle,
        recompute: Recompute,
        sp: bool,
        mb: int,
        dp: int,
        zero: int,
        ep: int = 1,
        etp: int = 1,
    ) -> LayerCost:
        key = (layer.signature, nt, tp, style, recompute, sp, mb, dp_wrapper(dp, zero))
        if key not in self._cache:
            self._cache[key] = self._layer_cost_uncached(layer, nt, tp, style, recompute, sp, mb, dp, zero)
        if layer.experts is None:
            return self._cache[key]
        # routed experts over ep/etp, as estimate adds them (planner.cost.moe); their time depends on the
        # micro-batch and ep/etp only, their states and per-step terms on dp, ZeRO and ep/etp only
        full = (key, dp, zero, ep, etp)
        if full not in self._cache:
            split = expert_split(
                ParallelConfig(
                    tp=tp,
                    dp=dp,
                    zero_stage=zero,
                    sequence_parallel=sp,
                    ep=ep,
                    etp=etp,
                    moe_load_imbalance=self.search.moe_load_imbalance,
                    memory_semantics=self.search.memory_semantics,
                ),
                micro_batch=mb,
            )
            node = self.cluster.node_type(nt)
            t_key = ("moe-time", layer.signature, nt, tp, sp, mb, ep, etp)
            if t_key not in self._terms:
                self._terms[t_key] = expert_time(layer, node=node, cluster=self.cluster, split=split, dtype=self.dtype)
            s_key = ("moe-states", layer.signature, nt, tp, dp, zero, ep, etp)
            if s_key not in self._terms:
                self._terms[s_key] = expert_states(
                    layer, node=node, cluster=self.cluster, split=split, dtype=self.dtype
                )
            self._cache[full] = combine_expert_costs(
                self._cache[key], self._terms[t_key], self._terms[s_key], recompute
            )
        return self._cache[full]

    def _layer_cost_uncached(
        self,
        layer: LayerProfile,
        nt: str,
        tp: int,
        style: TPStyle,
        recompute: Recompute,
        sp: bool,
        mb: int,
        dp: int,
        zero: int,
    ) -> LayerCost:
        node = self.cluster.node_type(nt)
        common: dict[str, Any] = dict(
            node=node,
            cluster=self.cluster,
            tp=tp,
            style=style,
            sequence_parallel=sp,
            micro_batch=mb,
            flash_attention=self.search.flash_attention,
            dtype=self.dtype,
            tp_group_spans_nodes=tp_group(tp, node.devices_per_node).spans_nodes,
            use_timings=timings_apply(self.profile, node),
            context=self.exchange,
            causal_skip=self.search.flash_attention,
        )
        # the kernels, TP collectives and K/V exchange are the same for every recompute mode and dp wrapper
        work_key = ("work", layer.signature, nt, tp, style, sp, mb)
        if work_key not in self._terms:
            self._terms[work_key] = layer_work(layer, **common)
        return layer_cost(
            layer,
            **common,
            recompute=recompute,
            dp_wrapper=dp_wrapper(dp, zero),
            timings_scale=timings_scale(self.profile, node),
            torch_tp_memory=self.runtime_memory,  # ParallelConfig.memory_semantics, as the estimate
            work=self._terms[work_key],
        )

    def _zero3_collectives_s(
        self, layer: LayerProfile, nt: str, params: float, dp: int, tp: int, wide: bool
    ) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of one layer's ZeRO-3 parameters over its dp (or dp x tp) group,
        per call latency included; the same for every recompute option of the layer, so cached."""
        key = ("z3", layer.signature, nt, params, dp, tp, wide)
        if key not in self._terms:
            node = self.cluster.node_type(nt)
            group = dp_group(dp, tp, node.devices_per_node, include_tp=wide)
            per = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]
            gather = collective_time(
                self.cluster,
                "all_gather",
                params * per["params"],
                group.n_ranks,
                node_type=node,
                spans_nodes=group.spans_nodes,
                ranks_per_node=group.ranks_per_node,
            )
            scatter = collective_time(
                self.cluster,
                "reduce_scatter",
                params * per["grads"],
                group.n_ranks,
                node_type=node,
                spans_nodes=group.spans_nodes,
                ranks_per_node=group.ranks_per_node,
            )
            roots = root_unit_layers(self.profile.layers)  # CPU ranks: per-call latency (zero3.fsdp_call_latency_s)
            gather += fsdp_call_latency_s(self.cluster, node, "all_gather", group, layer, roots)
            scatter += fsdp_call_latency_s(self.cluster, node, "reduce_scatter", group, layer, roots)
            self._terms[key] = (gather, scatter)
        return self._terms[key]

    def option_cost(self, layer: LayerProfile, nt: str, outer: OuterChoice, opt: Option) -> OptionCost:
        k = self.outer_layer_cost(layer, nt, outer, opt)
        wide = batch_sliced(outer.micro_batch, outer.tp, opt.style)  # batch-split replica: syncs over dp x tp
        z3_mb = z3_gather = 0.0
        if outer.zero_stage == 3:  # over the dp (or dp x tp) group (estimate._zero3_s)
            gather, scatter = self._zero3_collectives_s(layer, nt, k.params, outer.dp, outer.tp, wide)
            z3_mb, z3_gather = 2 * gather + scatter, gather + scatter  # z3_gather_s: never hidden (zero3.py)
            if outer.pp > 1:  # zero3_grad_sync "step" (zero3.py, "Accumulation"): m * z3_mb = (m + 1) g + s
                z3_mb = gather + (gather + scatter) / outer.num_micro_batches
        recomputed = (
            full_saved_bytes(
                layer,
                tp=outer.tp,
                style=opt.style,
                sequence_parallel=outer.sequence_parallel,
                micro_batch=outer.micro_batch,
                flash_attention=self.search.flash_attention,
                less_input=self.runtime_memory,  # compute.layer_working_set_bytes
            )
            if opt.recompute == "full"
            else 0.0
        )
        # compute.layer_working_set_bytes; the textbook has no measured backward growth
        ws = working_set_bytes(recomputed, k.moe_ws_bytes, k.backward_ws_bytes if self.runtime_memory else 0.0)
        unit = 0.0
        if self.runtime_memory:  # the backward sweep's block unit (estimate._Assembler._backward_sweep)
            grad_bytes = STATE_BYTES_PER_PARAM[precision_kind(self.state_dtype)]["grads"]
            params, param_bytes = k.params + k.expert_unit_params, k.param_bytes + k.expert_unit_param_bytes
            unit = sum(block_unit_bytes(outer.zero_stage, outer.dp, layer.kind, params, param_bytes, grad_bytes))
        # ZeRO-3 in the runtime: FSDP2's root unit (every layer but the blocks) stays gathered (estimate._memory)
        root_gathered = self.runtime_memory and outer.zero_stage == 3 and layer.kind != "block"
        return OptionCost(
            time_s=k.forward_s + k.backward_s + k.recompute_s + k.tp_comm_s + k.ep_comm_s,
            fwd_s=k.forward_s,
            bwd_s=k.backward_s + k.recompute_s,
            act_bytes=k.act_bytes,
            params_dp=0.0 if wide else k.params,
            params_dpt=k.params if wide else 0.0,
            param_bytes=k.param_bytes,
            ws_bytes=ws + unit,
            z3_mb_s=z3_mb,
            z3_gather_s=z3_gather,
            opt_s=k.optimizer_s + k.expert_step_s,
            state_bytes=k.expert_state_bytes,
            expert_grads_accumulating_bytes=k.expert_grads_accumulating_bytes,
            expert_grads_end_bytes=k.expert_grads_end_bytes,
            logits_bytes=k.logits_bytes if self.runtime_memory else 0.0,
            root_params=0.0 if layer.kind == "block" else k.params,
            root_gathered_bytes=k.param_bytes if root_gathered else 0.0,
        )
