"""Expert parallelism for the ``moe`` family: groups, token dispatch over all-to-all, gradient sync.

Rank layout ("MoE parallel folding", Megatron-Core; Liu et al. 2025, arXiv:2504.14960): within each
pipeline stage, the stage's ``dp x tp`` ranks in rank order are regrouped for the expert layers as
``(edp, ep, etp)``, row-major, ``etp`` fastest; ``edp = dp * tp / (ep * etp)``. Attention keeps the
plan's ``tp``. An ``ep`` group's ranks each hold ``experts / ep`` experts (global indices
``[i * E/ep, (i+1) * E/ep)`` on the group's i-th rank); with ``etp`` > 1 each of those experts' FFNs is
split over the ``etp`` group (w1, w3 by rows, w2 by columns: Megatron's MLP split inside each expert).

Each rank routes distinct tokens: with ``tp`` > 1 the TP ranks of a replica hold the same (replicated)
activation, so each takes its ``1/tp`` slice of the tokens after the router (``moe_dispatch.TokenShard``; the
router runs on all tokens, so routing and the load-balancing loss are the single process's), and the
slices' outputs are all-gathered again (Megatron-Core needs sequence parallelism for the same reason).
Under sequence parallelism each rank computes its own sequence shard and only the router's input is
gathered; in a Whale replica (a replicated block under tp > 1) each rank already holds its own batch slice.

Dispatch, dropless: assignments sorted by expert -> the per-expert counts exchanged with one
``all_to_all_single`` -> the rows exchanged with ``all_to_all_single`` using those split sizes -> local
experts on their rows (regrouped by expert) -> the reverse ``all_to_all_single`` -> unpermuted and
summed with the router weights. With a capacity factor (assignments past capacity dropped by the router,
``runtime.models.moe``), every rank sends each expert a fixed, zero-padded buffer instead (GShard), so the
all-to-alls have equal splits and no counts are exchanged. ``moe_dispatch.AllToAll``'s backward is the
reverse all-to-all (Megatron-Core ``tensor_parallel.mappings._AllToAll``).

Gradients: the objective is the mean over dp replicas of each replica's loss. Expert weights see the tokens of
every rank of their ``ep`` group, so their gradient is summed over ``edp`` (all ranks holding the same
experts) and divided by ``dp``; they are left out of the plan's FSDP/replicate wrapper. With ZeRO
(``zero_stage`` >= 1) each expert is its own FSDP unit over ``edp`` (gradients and AdamW states sharded over
edp, weights too between steps; :func:`apply_expert_dp`); with ZeRO-0 :class:`ExpertGradSync` all-reduces them
over edp. With ``tp`` > 1 each TP rank's router gradient covers its token slice only (plus ``1/tp`` of the
load-balancing loss's), so it is summed over ``tp`` (then averaged over dp by the wrapper, as every other
parameter). Shared experts are tensor-parallel like a dense MLP (``runtime.models.tp``).

``hf:`` MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) with an expert layout get the same layout, dispatch and
gradient rules through :mod:`runtime.executor.hf_moe` (their fused experts replaced by this rank's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from planner.core import ParallelDims
from planner.plan import Plan

from runtime.executor.checks import expert_layout, is_hf_ep, is_moe
from runtime.executor.hf_moe import apply_hf_ep, hf_local_experts
from runtime.executor.moe_dispatch import ExpertExchange, TokenShard, shard_expert_ffn
from runtime.models.moe import MoE, moe_layers


def _moe_dims(plan: Plan):
    from runtime.models import resolve_dims

    return resolve_dims(plan.model)


# ---------------------------------------------------------------------------------------------- groups


@dataclass(frozen=True, kw_only=True)
class ExpertGroups:
    """This rank's place in the expert layout, its expert mesh and process groups (None: a 1-rank group)."""

    ep: int
    edp: int
    dp: int
    tp: int
    ep_index: int  # this rank's position in its ep group
    tp_index: int
    mesh: object  # DeviceMesh ("pp", "edp", "ep", "etp") over the same ranks as the plan's mesh
    ep_group: object | None
    edp_group: object | None
    tp_group: object | None
    capacity_factor: float | None
    etp: int = 1
    etp_index: int = 0
    etp_group: object | None = None


def fold_stage_ranks(stage_ranks: list[int], ep: int, etp: int = 1) -> list[tuple[int, int, int]]:
    """(edp, ep, etp) coordinates of a stage's ranks in rank order (row-major, etp fastest).

    >>> fold_stage_ranks([4, 5, 6, 7], ep=2)
    [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    """
    return [(i // (ep * etp), (i // etp) % ep, i % etp) for i, _ in enumerate(sorted(stage_ranks))]


def expert_mesh_ranks(dims: ParallelDims, ep: int, etp: int = 1) -> torch.Tensor:
    """Global ranks as a (pp, edp, ep, etp) tensor: each pp stage's ranks in rank order, folded."""
    edp = dims.dp * dims.tp // (ep * etp)
    stages = [sorted(r for r in range(dims.world_size) if dims.coords(r)["pp"] == p) for p in range(dims.pp)]
    return torch.tensor(stages).view(dims.pp, edp, ep, etp)


def build_expert_groups(plan: Plan, dims: ParallelDims, rank: int, tp_group, device_type: str) -> ExpertGroups | None:
    """Collective over the world (every rank creates every group): the expert DeviceMesh and this rank's groups."""
    if not is_moe(plan) and not is_hf_ep(plan):
        return None
    from torch.distributed.device_mesh import DeviceMesh

    lay = expert_layout(plan)
    ranks = expert_mesh_ranks(dims, lay.ep, lay.etp)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "etp"))
    where = (ranks == rank).nonzero()[0].tolist()
    edp = ranks.shape[1]
    return ExpertGroups(
        ep=lay.ep,
        edp=edp,
        dp=dims.dp,
        tp=dims.tp,
        ep_index=where[2],
        tp_index=dims.coords(rank)["tp"],
        mesh=mesh,
        ep_group=mesh["ep"].get_group() if lay.ep > 1 else None,
        edp_group=mesh["edp"].get_group() if edp > 1 else None,
        tp_group=tp_group if dims.tp > 1 else None,
        capacity_factor=lay.capacity_factor,
        etp=lay.etp,
        etp_index=where[3],
        etp_group=mesh["etp"].get_group() if lay.etp > 1 else None,
    )


# ---------------------------------------------------------------------------------------------- apply


def keep_local_experts(moe: MoE, ep: int, ep_index: int) -> list[int]:
    """Delete the experts other ep ranks hold; returns this rank's global expert indices."""
    per_rank = moe.num_experts // ep
    mine = list(range(ep_index * per_rank, (ep_index + 1) * per_rank))
    for key in list(moe.experts.keys()):
        if int(key) not in mine:
            del moe.experts[key]
    return mine


def apply_capacity(model: nn.Module, capacity_factor: float | None) -> None:
    """The plan's capacity factor overrides the model's (``None`` keeps the model's)."""
    if capacity_factor is None:
        return
    for moe in moe_layers(model).values():
        moe.capacity_factor = capacity_factor


def apply_ep(
    model: nn.Module, groups: ExpertGroups, *, sequence_parallel: Iterable[str] = (), replicas: Iterable[str] = ()
) -> dict[str, list[int]]:
    """Shard ``model``'s experts over the ep group and set up dispatch; returns MoE path -> global experts held.

    ``sequence_parallel``: the blocks running sequence-parallel (their expert layer takes a sequence shard);
    ``replicas``: the blocks run as Whale replicas under tp > 1 (each TP rank already holds its own batch
    slice, so its expert layer computes all of its tokens)."""
    sp_blocks, replica_blocks = set(sequence_parallel), set(replicas)
    held = apply_hf_ep(model, groups)  # an hf: model's fused experts ({} for the zoo's)
    apply_capacity(model, groups.capacity_factor)
    for path, moe in moe_layers(model).items():
        held[path] = keep_local_experts(moe, groups.ep, groups.ep_index)
        if groups.etp > 1:
            shard_expert_ffn(moe, groups.etp, groups.etp_index)
        if groups.ep > 1 or groups.etp > 1:
            moe.exchange = ExpertExchange(
                group=groups.ep_group, ep=groups.ep, etp_group=groups.etp_group, etp=groups.etp
            )
        if groups.tp > 1 and path.rpartition(".moe")[0] not in replica_blocks:
            moe.token_shard = TokenShard(
                group=groups.tp_group,
                size=groups.tp,
                index=groups.tp_index,
                sequence_parallel=path.rpartition(".moe")[0] in sp_blocks,
            )
    return held


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The routed experts' parameters (kept out of the dp wrapper: :func:`apply_expert_dp` or
    :class:`ExpertGradSync` reduces them over edp)."""
    zoo = {p for moe in moe_layers(model).values() for p in moe.experts.parameters()}
    return zoo | {p for experts in hf_local_experts(model) for p in experts.parameters()}


def apply_expert_dp(model: nn.Module, groups: ExpertGroups, *, zero_stage: int) -> str:
    """ZeRO for the experts over edp: each local expert its own ``fully_shard`` unit on the ``edp`` axis of
    the expert mesh (torchtitan shards MoE experts over its ``dp_mod_ep`` mesh the same way). FSDP averages
    the gradients over edp; :class:`ExpertGradSync` rescales the shards by ``edp / dp`` to the sum over edp
    divided by dp (``set_gradient_divide_factor`` would need ``PREMUL_SUM``, which gloo lacks). The experts
    stay gathered from forward to backward at every ZeRO stage (``reshard_after_forward=False``): ZeRO-3
    shards the dense weights only, as Megatron-Core's distributed optimizer does over the expert-data-parallel
    group and as ``planner.cost.moe`` prices it. ZeRO-0, or a 1-rank edp group: nothing here (returns "none";
    :class:`ExpertGradSync` all-reduces them)."""
    if zero_stage == 0 or groups.edp == 1:
        return "none"
    from torch.distributed.fsdp import fully_shard

    edp_mesh = groups.mesh["edp"]  # type: ignore[index]
    for moe in moe_layers(model).values():
        for expert in moe.experts.values():
            fully_shard(expert, mesh=edp_mesh, reshard_after_forward=False)
    for experts in hf_local_experts(model):  # an hf: layer's local experts: one unit
        fully_shard(experts, mesh=edp_mesh, reshard_after_forward=False)
    return f"fully_shard over edp={groups.edp} (reshard_after_forward=False)"


def take_aux_loss(modules: Iterable[nn.Module]) -> tuple[float, int]:
    """(sum, count) of the load-balancing losses the MoE layers of ``modules`` computed since the last call;
    resets them."""
    total, count = 0.0, 0
    for module in modules:
        for moe in moe_layers(module).values():
            total, count = total + float(moe.aux_loss_sum), count + moe.aux_loss_count
            moe.aux_loss_sum, moe.aux_loss_count = 0.0, 0
    return total, count


def exclude_shape_probes(stage) -> None:
    """Keep a pipeline stage's metadata inference out of its MoE layers' load-balancing metric.

    torch.distributed.pipelining 2.13 runs each stage once before the first step to learn its shapes (the
    first stage on the first micro-batch, later ones on uninitialised tensors of the right shape); that
    probe is no training forward. Its two private methods are wrapped; with another torch they may be
    absent, and then nothing is wrapped.
    """
    for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
        probe = getattr(stage, name, None)
        if probe is None:
            continue

        def muted(*args, _probe=probe, **kwargs):
            layers = list(moe_layers(stage.submod).values())
            for moe in layers:
                moe.count_aux_loss = False
            try:
                return _probe(*args, **kwargs)
            finally:
                for moe in layers:
                    moe.count_aux_loss = True

        setattr(stage, name, muted)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Scale of the load-balancing loss's gradient: the factor the runtime puts on each micro-batch's loss."""
    for moe in moe_layers(model).values():
        moe.aux_loss_scale = scale


class ExpertGradSync:
    """After backward, before the optimizer: expert gradients summed over edp and divided by dp; with tp > 1
    the MoE layers' router gradients summed over tp (see the module docstring)."""

    def __init__(self, model: nn.Module, groups: ExpertGroups, *, experts_sharded: bool):
        self.groups = groups
        names = {p: n for n, p in model.named_parameters()}
        # the same order on every rank of an edp group; FSDP-sharded experts are already averaged over edp
        self.experts = sorted(expert_params(model), key=lambda p: names[p])
        self.experts_sharded = experts_sharded
        self.token_sliced = self._token_sliced(model, names) if groups.tp > 1 else []

    @staticmethod
    def _token_sliced(model: nn.Module, names: dict) -> list[nn.Parameter]:
        """The routers of token-sliced layers: they see every token, but each TP rank's combine weights only
        its own slice's (a Whale replica's router is summed over TP by ``ReplicaGradSync`` instead)."""
        layers = [moe for moe in moe_layers(model).values() if moe.token_shard is not None]
        out = [p for moe in layers for p in moe.router.parameters()]
        return sorted(out, key=lambda p: names[p])

    def sync(self) -> None:
        g = self.groups
        for p in self.experts:
            if self.experts_sharded:  # FSDP's mean over edp -> sum over edp / dp
                if p.grad is not None and g.edp != g.dp:
                    assert isinstance(p.grad, DTensor), "FSDP over edp leaves DTensor gradients"
                    p.grad.to_local().mul_(g.edp / g.dp)
                continue
            if p.grad is None:  # an expert no token reached on any micro-batch still joins the reduction
                p.grad = torch.zeros_like(p)
            if g.edp_group is not None:
                dist.all_reduce(p.grad, group=g.edp_group)
            if g.dp > 1:
                p.grad.div_(g.dp)
        for p in self.token_sliced:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=g.tp_group)


def describe_experts(plan: Plan, dims: ParallelDims, rank: int) -> str:
    """``--dry-run`` text for one rank: the experts it holds and its folded coordinates ("" for dense)."""
    if not is_moe(plan) and not is_hf_ep(plan):
        return ""
    lay, n = expert_layout(plan), _expert_count(plan)
    ranks = sorted(r for r in range(dims.world_size) if dims.coords(r)["pp"] == dims.coords(rank)["pp"])
    edp_index, ep_index, _ = dict(zip(ranks, fold_stage_ranks(ranks, lay.ep, lay.etp)))[rank]
    per = n // lay.ep
    edp = dims.dp * dims.tp // (lay.ep * lay.etp)
    ffn = f", 1/{lay.etp} of each FFN" if lay.etp > 1 else ""
    return f"; experts {ep_index * per}..{(ep_index + 1) * per - 1} of {n}{ffn} (ep {lay.ep}, edp {edp_index} of {edp})"


def _expert_count(plan: Plan) -> int:
    if is_hf_ep(plan):
        from runtime.executor.hf_moe import fused_experts, fused_weight
        from runtime.models.external import external

        fused = next(iter(fused_experts(external(plan.model).template).values()))
        return int(fused_weight(fused, "gate_up_proj").shape[0])
    return _moe_dims(plan).experts
