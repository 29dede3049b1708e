"""The outer search space (the non-linear choices) and lower bounds that prune whole branches.

An :class:`OuterChoice` fixes everything the ILP cannot express linearly: the degrees ``tp x pp x dp``,
the schedule and its virtual stages, micro-batch size and count, ZeRO stage, sequence parallelism and the
node type of every pp rank. The global batch is fixed: ``dp * micro_batch * num_micro_batches`` equals it
(the planner never changes the training maths).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from planner.core import ParallelDims, ScheduleKind
from planner.profile import ClusterProfile
from planner.search.config import SearchConfig
from planner.search.ilp_cuts import block_time_floors, blocks_worth_cutting, pipeline_floor
from planner.search.tables import Tables


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterChoice:
    """One outer candidate. ``rank_node_types[r]`` is the node type of pp rank ``r``.

    Replicas on several node types (Whale's hardware-aware data parallelism): ``replica_node_types[j]`` is
    the node type of dp replica ``j`` (all its ranks) and ``replica_micro_batches[j]`` its micro-batch count
    (its batch share is ``replica_micro_batches[j] * micro_batch / global_batch``); then
    ``num_micro_batches`` is the largest count and ``rank_node_types`` names the first replica's type.
    """

    tp: int
    pp: int
    dp: int
    schedule: ScheduleKind
    virtual_stages: int
    micro_batch: int
    num_micro_batches: int
    zero_stage: int
    sequence_parallel: bool
    rank_node_types: tuple[str, ...]
    replica_node_types: tuple[str, ...] | None = None
    replica_micro_batches: tuple[int, ...] | None = None
    # context parallelism (planner/cost/context.py): the sequence split over cp ranks, and the K/V exchange
    cp: int = 1
    context_parallel: str | None = None
    ep: int = (
        1  # Mixture-of-Experts: expert-parallel degree and expert tensor parallel (planner.plan.schema.ExpertLayout)
    )
    etp: int = 1
    # A *family*: this choice under each of these (ep, etp) layouts, bounded as one entry and expanded
    # (:func:`expand_experts`) only when its bound comes up in the search; () = one concrete candidate.
    expert_family: tuple[tuple[int, int], ...] = ()

    @property
    def parallel_dims(self) -> ParallelDims:
        """The candidate's degrees as the one layout record (:class:`planner.core.ParallelDims`)."""
        return ParallelDims.with_axes(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep, etp=self.etp)

    def replica_types(self) -> list[tuple[str, int, int]]:
        """(node type, replicas, micro-batches per replica) in order of first use; [] without replica types."""
        if not self.replica_node_types:
            return []
        out: dict[str, tuple[int, int]] = {}
        for t, m in zip(self.replica_node_types, self.replica_micro_batches or ()):
            count, most = out.get(t, (0, 0))
            out[t] = (count + 1, max(most, m))
        return [(t, count, m) for t, (count, m) in out.items()]

    def summary(self) -> str:
        """Short human form, e.g. ``tp8 pp16 dp8 1f1b mb1x192 zero1 sp``."""
        sched = self.schedule if self.virtual_stages == 1 else f"{self.schedule}(v={self.virtual_stages})"
        types = sorted(set(self.rank_node_types))
        where = "" if len(types) == 1 else " on " + "/".join(self.rank_node_types)
        if self.replica_node_types:
            where = " replicas " + " + ".join(f"{k}x{t}(mb{self.micro_batch}x{m})" for t, k, m in self.replica_types())
        cp = f" cp{self.cp}({self.context_parallel})" if self.cp > 1 else ""
        experts = f" ep{self.ep}" + (f" etp{self.etp}" if self.etp > 1 else "") if self.ep * self.etp > 1 else ""
        return (
            f"tp{self.tp} pp{self.pp} dp{self.dp}{cp}{experts} {sched} mb{self.micro_batch}x{self.num_micro_batches} "
            f"zero{self.zero_stage}{' sp' if self.sequence_parallel else ''}{where}"
        )

    def choices(self) -> dict[str, int | str | bool]:
        out: dict[str, int | str | bool] = dict(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            micro_batch=self.micro_batch,
            num_micro_batches=self.num_micro_batches,
            zero_stage=self.zero_stage,
            sequence_parallel=self.sequence_parallel,
            node_types="/".join(self.rank_node_types),
        )
        if self.cp > 1:
            out["cp"], out["context_parallel"] = self.cp, self.context_parallel or ""
        if self.ep * self.etp > 1:
            out.update(ep=self.ep, etp=self.etp)
        if self.replica_node_types:
            out["replica_node_types"] = "/".join(self.replica_node_types)
            out["replica_micro_batches"] = "/".join(map(str, self.replica_micro_batches or ()))
        return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def devices_by_type(cluster: ClusterProfile, gpus: int) -> dict[str, int]:
    """Devices of each node type used when the plan takes the first ``gpus`` of the cluster."""
    left, used = gpus, dict[str, int]()
    for group in cluster.nodes:
        per_node = cluster.node_type(group.node_type).devices_per_node
        take = min(left, group.count * per_node)
        if take:
            used[group.node_type] = used.get(group.node_type, 0) + take
        left -= take
    return used


def _tp_degrees(cluster: ClusterProfile, profiled: list[int], config: SearchConfig) -> list[int]:
    """tp degrees: profiled ones that fit inside one node (or span whole nodes, if allowed)."""
    if not config.allows("tp"):
        return [1]
    per_node = min(nt.devices_per_node for nt in cluster.node_types)
    out = []
    for tp in sorted(set(profiled)):
        inside = tp <= per_node and per_node % tp == 0
        across = tp > per_node and tp % per_node == 0 and config.allows("cross_node_tp")
        if inside or across:
            out.append(tp)
    return out


def _rank_type_orders(by_type: dict[str, int], pp: int, per_rank: int, limit: int = 8) -> list[tuple[str, ...]]:
    """Node type per pp rank: every arrangement when few, else the contiguous ones (each type in a block)."""
    if any(n % per_rank for n in by_type.values()):
        return []
    counts = {t: n // per_rank for t, n in by_type.items()}
    if sum(counts.values()) != pp:
        return []
    if len(counts) == 1:
        return [tuple(next(iter(counts)) for _ in range(pp))]
    base = [t for t, k in counts.items() for _ in range(k)]
    orders = sorted(set(itertools.permutations(base))) if math.comb(pp, min(counts.values())) <= limit else []
    if not orders:
        orders = [tuple(t for t in perm for _ in range(counts[t])) for perm in itertools.permutations(counts)]
    return orders


def _schedules(
    pp: int, m: int, n_blocks: int, config: SearchConfig, m_min: int | None = None
) -> Iterator[tuple[ScheduleKind, int]]:
    """(schedule, virtual stages): 1F1B when every replica has at least pp micro-batches (``m_min``, default
    ``m``; torch.distributed.pipelining's 1F1B needs one per stage, runtime/executor/schedule.py); GPipe
    when allowed; interleaved when m % pp == 0 (Megatron-LM's requirement for its interleaved schedule)
    and the blocks split into pp * v equal chunks (Megatron-LM's layers per virtual stage)."""
    if pp == 1 or (m if m_min is None else m_min) >= pp:
        yield "1f1b", 1
    if pp == 1:
        return
    if config.allows("gpipe"):
        yield "gpipe", 1
    if config.allows("interleave") and m % pp == 0:
        for v in range(2, config.max_virtual_stages + 1):
            if n_blocks % (pp * v) == 0:  # equal chunks (placement.interleaved_chunk_sizes)
                yield "interleaved_1f1b", v


def _tp_pp(
    cluster: ClusterProfile, gpus: int, n_layers: int, tp_degrees: list[int], config: SearchConfig
) -> Iterator[tuple[int, int]]:
    """(tp, pp) pairs allowed by ``config`` whose product divides ``gpus``."""
    for tp in _tp_degrees(cluster, tp_degrees, config):
        for pp in divisors(gpus // tp) if gpus % tp == 0 else []:
            if not (pp > 1 and not config.allows("pp") or pp > n_layers):
                yield tp, pp


def _tp_pp_cp(
    cluster: ClusterProfile,
    gpus: int,
    n_layers: int,
    tp_degrees: list[int],
    config: SearchConfig,
    cp_degrees: Sequence[int],
    by_type: Mapping[str, int],
) -> Iterator[tuple[int, int, int, str | None]]:
    """(tp, pp, cp, K/V exchange): :func:`_tp_pp` with each cp degree dividing the devices left (uniform
    clusters only: per-replica node types are not combined with cp)."""
    for tp, pp in _tp_pp(cluster, gpus, n_layers, tp_degrees, config):
        if 1 in cp_degrees:
            yield tp, pp, 1, None
        for cp in cp_degrees:
            if cp > 1 and (gpus // (tp * pp)) % cp == 0 and len(by_type) == 1:
                yield tp, pp, cp, "allgather"
                yield tp, pp, cp, "ring"


def _micro_batch_sizes(samples: int, config: SearchConfig) -> list[int]:
    """Micro-batch sizes dividing ``samples``, up to ``config.max_micro_batch``."""
    return [mb for mb in divisors(samples) if mb <= config.max_micro_batch]


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterShape:
    """The outer candidates that share tp, pp, cp (with its K/V exchange), dp and the micro-batch: they differ in the
    schedule, the ZeRO stage, sequence parallelism and the node-type order over the pp ranks. The search bounds them
    as one (``CandidateCosts.shape_bound_s``: their layer times do not depend on the schedule, and the largest
    interleaving bounds them all) and creates them (:meth:`members`) only when that bound comes up."""

    tp: int
    pp: int
    dp: int
    cp: int
    context_parallel: str | None
    micro_batch: int
    num_micro_batches: int
    schedules: tuple[tuple[ScheduleKind, int], ...]
    zero_stages: tuple[int, ...]
    sequence_parallel: tuple[bool, ...]
    orders: tuple[tuple[str, ...], ...]
    expert_family: tuple[tuple[int, int], ...] = ()
    skip_gpipe: bool = False  # MoE: GPipe where 1F1B runs is dominated (enumerate_outer)

    def members(self, *, families: bool = False) -> Iterator[OuterChoice]:
        """The candidates, in enumeration order (schedule, ZeRO, sp, node-type order)."""
        for schedule, v in self.schedules:
            if self.skip_gpipe and schedule == "gpipe" and self.num_micro_batches >= self.pp:
                continue
            for zero in self.zero_stages:
                for sp in self.sequence_parallel:
                    for order in self.orders:
                        choice = self._choice(schedule, v, zero, sp, order)
                        if families and len(choice.expert_family) > 1:
                            yield choice
                        else:
                            yield from expand_experts(choice)

    def representatives(self) -> list[OuterChoice]:
        """One candidate per (ZeRO stage, sp) with the most interleaving: what bounds the shape's layer times."""
        schedule, v = max(self.schedules, key=lambda sv: sv[1])
        return [
            self._choice(schedule, v, z, sp, self.orders[0]) for z in self.zero_stages for sp in self.sequence_parallel
        ]

    def _choice(self, schedule: ScheduleKind, v: int, zero: int, sp: bool, order: tuple[str, ...]) -> OuterChoice:
        family: tuple[tuple[int, int], ...] = self.expert_family
        ep, etp = 1, 1
        if len(family) == 1:  # one layout: the concrete candidate (what expand_experts makes of it)
            ep, etp = family[0]
            family = ()
        return OuterChoice(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            schedule=schedule,
            virtual_stages=v,
            micro_batch=self.micro_batch,
            num_micro_batches=self.num_micro_batches,
            zero_stage=zero,
            sequence_parallel=sp,
            rank_node_types=order,
            cp=self.cp,
            context_parallel=self.context_parallel,
            ep=ep,
            etp=etp,
            expert_family=family,
        )

    @property
    def size(self) -> int:
        """How many candidates the shape holds (expert layouts counted): what :meth:`members` yields, counted
        without making them."""
        schedules = sum(
            1
            for schedule, _ in self.schedules
            if not (self.skip_gpipe and schedule == "gpipe" and self.num_micro_batches >= self.pp)
        )
        layouts = len(self.expert_family) if len(self.expert_family) > 1 else 1
        return schedules * len(self.zero_stages) * len(self.sequence_parallel) * len(self.orders) * layouts


def enumerate_shapes(
    *,
    cluster: ClusterProfile,
    gpus: int,
    global_batch: int,
    n_layers: int,
    tp_degrees: list[int],
    config: SearchConfig,
    n_blocks: int | None = None,
    cp_degrees: Sequence[int] = (1,),
    experts: int = 0,
) -> Iterator[OuterShape]:
    """The candidates of :func:`enumerate_outer` on one node type's devices (and, on a mixed cluster, the ones that
    place the pp ranks by type), grouped into :class:`OuterShape`; not the per-replica node-type choices."""
    n_blocks = n_layers if n_blocks is None else n_blocks
    by_type = devices_by_type(cluster, gpus)
    if len(by_type) > 1 and not config.allows("mixed"):
        by_type = {next(iter(by_type)): gpus}  # treat as uniform (the 'ignore the difference' plan)
    for tp, pp, cp, mode in _tp_pp_cp(cluster, gpus, n_layers, tp_degrees, config, cp_degrees, by_type):
        dp = gpus // (tp * pp * cp)
        if dp > 1 and not config.allows("dp") or global_batch % dp:
            continue
        orders = tuple(_rank_type_orders(by_type, pp, tp * dp * cp))
        per_replica = global_batch // dp
        if not orders:
            continue
        for mb in _micro_batch_sizes(per_replica, config):
            m = per_replica // mb
            schedules = tuple(_schedules(pp, m, n_blocks, config))
            if not schedules:
                continue
            yield OuterShape(
                tp=tp,
                pp=pp,
                dp=dp,
                cp=cp,
                context_parallel=mode,
                micro_batch=mb,
                num_micro_batches=m,
                schedules=schedules,
                zero_stages=_zero_stages(dp * cp, experts, config),  # ZeRO over dp x cp
                sequence_parallel=(False, True) if tp > 1 and config.allows("sp") else (False,),
                orders=orders,
                expert_family=tuple(expert_layouts(experts, tp=tp, dp=dp, config=config)),
                skip_gpipe=bool(experts),
            )


def enumerate_outer(
    *,
    cluster: ClusterProfile,
    gpus: int,
    global_batch: int,
    n_layers: int,
    tp_degrees: list[int],
    config: SearchConfig,
    n_blocks: int | None = None,
    cp_degrees: Sequence[int] = (1,),
    experts: int = 0,
    families: bool = False,
) -> Iterator[OuterChoice]:
    """Every outer candidate allowed by ``config`` for ``gpus`` devices and a fixed global batch.
    ``n_blocks``: the model's repeated blocks (``placement.block_count``; default ``n_layers``), which
    interleaved schedules split into equal chunks. ``cp_degrees``: the context-parallel degrees the model
    and sequence allow (``planner.cost.context.cp_degrees``); each ``cp > 1`` is tried with both K/V
    exchanges, on ``dp = devices / (tp pp cp)`` replicas. ``experts``: routed experts of a Mixture-of-Experts
    model (0: dense), whose expert layouts (:func:`expert_layouts`) multiply the candidates; with
    ``families`` each choice comes once with its layouts in ``expert_family`` (:func:`expand_experts`).
    For MoE models two dominated kinds are not enumerated (exactly as the solve-time dominance check of
    ``tables.dominates`` would skip them, only before they cost a bound): GPipe where 1F1B runs (the same
    step time, formula (P), with no more micro-batches in flight) and ZeRO-1 (ZeRO-2 has the same time
    terms and shards the gradients too)."""
    n_blocks = n_layers if n_blocks is None else n_blocks
    for shape in enumerate_shapes(
        cluster=cluster,
        gpus=gpus,
        global_batch=global_batch,
        n_layers=n_layers,
        tp_degrees=tp_degrees,
        config=config,
        n_blocks=n_blocks,
        cp_degrees=cp_degrees,
        experts=experts,
    ):
        yield from shape.members(families=families)
    yield from replica_type_choices(
        cluster=cluster, gpus=gpus, global_batch=global_batch, n_layers=n_layers, n_blocks=n_blocks,
        tp_degrees=tp_degrees, config=config, experts=experts,
    )  # fmt: skip


def replica_type_choices(
    *,
    cluster: ClusterProfile,
    gpus: int,
    global_batch: int,
    n_layers: int,
    n_blocks: int,
    tp_degrees: list[int],
    config: SearchConfig,
    experts: int = 0,
) -> Iterator[OuterChoice]:
    """On a mixed cluster, the candidates with dp replicas on several node types (none elsewhere)."""
    by_type = devices_by_type(cluster, gpus)
    if len(by_type) > 1 and config.allows("mixed") and config.allows("dp") and _types_contiguous(cluster, gpus):
        if not experts:
            yield from _replica_type_choices(cluster, by_type, global_batch, n_layers, n_blocks, tp_degrees, config)


def _zero_stages(dp: int, experts: int, config: SearchConfig) -> tuple[int, ...]:
    """ZeRO stages to try: 0-3 with dp > 1; for MoE models without the dominated ZeRO-1 (enumerate_outer)."""
    if dp == 1 or not config.allows("zero"):
        return (0,)
    return (0, 2, 3) if experts else (0, 1, 2, 3)


def expand_experts(outer: OuterChoice) -> list[OuterChoice]:
    """The concrete candidates of a family (one per expert layout); a concrete candidate itself."""
    if not outer.expert_family:
        return [outer]
    return [replace(outer, ep=ep, etp=etp, expert_family=()) for ep, etp in outer.expert_family]


def expert_layouts(experts: int, *, tp: int, dp: int, config: SearchConfig) -> list[tuple[int, int]]:
    """(ep, etp) pairs of a Mixture-of-Experts model on a stage of ``dp x tp`` ranks; [(1, 1)] when dense.

    Rules (``planner.plan.schema.check_expert_layout``): ep divides the experts and ep x etp divides dp x tp.
    etp (with ``--allow ...,etp``; 1 otherwise) ranges over the divisors of the attention tp (expert TP no
    wider than the attention's: it stays inside the node, and Megatron-Core's folding is used to narrow it,
    Liu et al. 2025 §3).
    """
    if not experts or not config.allows("ep"):
        return [(1, 1)]
    etps = divisors(tp) if config.allows("etp") else [1]
    return [(ep, etp) for etp in etps for ep in divisors(experts) if (dp * tp) % (ep * etp) == 0]


def _types_contiguous(cluster: ClusterProfile, gpus: int) -> bool:
    """True when the used nodes of each type form one block in cluster order (replica j = j-th block)."""
    seen: list[str] = []
    left = gpus
    for group in cluster.nodes:
        if left <= 0:
            break
        if not seen or seen[-1] != group.node_type:
            if group.node_type in seen:
                return False
            seen.append(group.node_type)
        left -= group.count * cluster.node_type(group.node_type).devices_per_node
    return True


def _type_splits(counts: list[int], total: int) -> Iterator[tuple[int, ...]]:
    """Micro-batch counts m_t >= 1 per replica type with sum_t counts[t] * m_t == total."""
    if len(counts) == 1:
        if total % counts[0] == 0 and total >= counts[0]:
            yield (total // counts[0],)
        return
    rest = sum(counts[1:])
    for m in range(1, (total - rest) // counts[0] + 1):
        for tail in _type_splits(counts[1:], total - counts[0] * m):
            yield (m, *tail)


def _replica_type_choices(
    cluster: ClusterProfile,
    by_type: dict[str, int],
    global_batch: int,
    n_layers: int,
    n_blocks: int,
    tp_degrees: list[int],
    config: SearchConfig,
) -> Iterator[OuterChoice]:
    """Whale's hardware-aware data parallelism: whole dp replicas (tp x pp devices each) on each node type
    (in cluster order, so replica j's ranks are the j-th block of tp * pp devices), every split of the
    micro-batches over the types (replicas of one type get the same count). ZeRO-3 is left out (its
    per-layer collectives would tie replicas of different speeds together; planner.cost.validate)."""
    gpus = sum(by_type.values())
    for tp, pp in _tp_pp(cluster, gpus, n_layers, tp_degrees, config):
        per_replica = tp * pp
        if any(n % per_replica for n in by_type.values()):
            continue
        counts = [n // per_replica for n in by_type.values()]
        types = tuple(t for t, k in zip(by_type, counts) for _ in range(k))
        for mb in _micro_batch_sizes(global_batch, config):
            for split in _type_splits(counts, global_batch // mb):
                per_rep = tuple(m for m, k in zip(split, counts) for _ in range(k))
                for schedule, v in _schedules(pp, math.gcd(*split), n_blocks, config, m_min=min(split)):
                    for zero in (0, 1, 2) if config.allows("zero") else (0,):
                        for sp in (False, True) if tp > 1 and config.allows("sp") else (False,):
                            yield OuterChoice(
                                tp=tp,
                                pp=pp,
                                dp=len(types),
                                schedule=schedule,
                                virtual_stages=v,
                                micro_batch=mb,
                                num_micro_batches=max(split),
                                zero_stage=zero,
                                sequence_parallel=sp,
                                rank_node_types=(types[0],) * pp,
                                replica_node_types=types,
                                replica_micro_batches=per_rep,
                            )


def _rank_sends(tables: Tables) -> list[float]:
    """Least pipeline-transfer time of each pp rank per micro-batch: chunk s pays the transfer of each of
    its boundaries, whose node types are fixed (chunk s runs on rank s mod pp); at the cheapest group and
    style that could end the earlier chunk (not the model's last layer: later chunks are non-empty)."""
    sends = [0.0] * tables.pp
    if tables.pp == 1:
        return sends
    last = tables.groups[-1]
    enders = tables.groups[:-1] if last.size == 1 else tables.groups  # a single last layer ends only chunk S-1
    cheapest: dict[tuple[str, str], float] = {}  # (from, to) node types -> the cheapest boundary between them
    for grp in enders:
        for (_, a, b), c in grp.boundary_s.items():
            cheapest[a, b] = min(cheapest.get((a, b), math.inf), c)
    for s in range(tables.chunks - 1):
        cost = cheapest.get((tables.node_type_of_chunk(s), tables.node_type_of_chunk(s + 1)), 0.0)
        sends[s % tables.pp] += cost
        sends[(s + 1) % tables.pp] += cost
    return sends


def _least_times(tables: Tables, sends: list[float]) -> tuple[float, float]:
    """(least sum_r T_r, least time of one layer): every layer at its fastest option on the fastest node
    type in use, plus ``sends`` (:func:`_rank_sends`), the cheapest transfer of each boundary."""
    types = set(tables.rank_node_types)
    t_min = [min(min(k.time_s for k in grp.costs[nt]) for nt in types) for grp in tables.groups]
    total = sum(t * grp.size for t, grp in zip(t_min, tables.groups)) + sum(sends)
    return total, max(t_min)


def _lower_bound_s_lane(tables: Tables) -> float:
    """One lane's bound (:func:`lower_bound_s`)."""
    sends = _rank_sends(tables)
    total, _ = _least_times(tables, sends)
    v, m = tables.v, tables.m
    return (m - 1 / v) * _slowest_bound(tables, sends) + total / v + _tail_floor_average(tables)


def _optimizer_floor(tables: Tables) -> float:
    types = set(tables.rank_node_types)
    opt_coef = min(min(rm.optimizer_s_per_param_dp, rm.optimizer_s_per_param_dpt) for rm in tables.ranks.values())
    params = sum(
        grp.size * min(k.params_dp + k.params_dpt for nt in types for k in grp.costs[nt]) for grp in tables.groups
    )
    return opt_coef * params / tables.pp


def _tail_floor_average(tables: Tables) -> float:
    """A floor of the slowest tail from the average over pp ranks (max_r tail_r >= mean_r tail_r).

    Per rank (``tables.rank_tail_s``): exposed sync >= max(0, S_r - Wb_r), ZeRO-1/2 gathers >= max(0, G_r -
    Wf_r), ZeRO-3 >= m max(0, C_r - Wf_r - Wb_r), plus the optimizer and the per-layer per-step terms
    (``opt_s``: measured optimizer host time, MoE expert sync), each layer at its least. Summed over ranks,
    sum max(0, x_r) >= max(0, sum x_r); the collectives' times are concave with f(0) = 0, hence
    subadditive, so sum_r S_r >= S_min(total parameters) (S_min: the cheapest of the ranks' sync
    functions); the windows W are at most every layer at its slowest option plus the per-chunk host costs.
    Catches candidates whose gradient sync cannot hide behind their compute (e.g. wide dp over slow
    links), which layer times alone miss.
    """
    types = sorted(set(tables.rank_node_types))
    groups = tables.groups
    params = sum(grp.size * min(k.params_dp + k.params_dpt for nt in types for k in grp.costs[nt]) for grp in groups)

    def most(attr: str) -> float:
        return sum(grp.size * max(getattr(k, attr) for nt in types for k in grp.costs[nt]) for grp in groups)

    units = [tables.chunk_unit_s[nt] for nt in types] if tables.chunk_unit_s else [(0.0, 0.0)]
    w_f = most("fwd_s") + tables.chunks * max(u[0] for u in units)
    w_b = most("bwd_s") + tables.chunks * max(u[1] for u in units)
    ranks = [tables.ranks[nt] for nt in types]

    def cheapest(fields: tuple[str, str]) -> float:
        return min(min(getattr(rm, f)(params) for f in fields) for rm in ranks)

    if tables.zero_stage == 3:
        z3 = sum(grp.size * min(k.z3_mb_s for nt in types for k in grp.costs[nt]) for grp in groups)
        comm = tables.m * max(0.0, z3 - w_f - w_b)
    else:
        comm = max(0.0, cheapest(("sync_dp", "sync_dpt")) - w_b)
        if tables.zero_stage > 0:
            comm += max(0.0, cheapest(("gather_dp", "gather_dpt")) - w_f)
    per_step = sum(grp.size * min(k.opt_s for nt in types for k in grp.costs[nt]) for grp in groups)
    return (comm + per_step) / tables.pp + _optimizer_floor(tables)


def _memory_shortfall_bytes_lane(tables: Tables) -> float:
    """One lane's shortfall (:func:`memory_shortfall_bytes`)."""
    types = set(tables.rank_node_types)
    least_inflight = min(tables.inflight)
    need = 0.0
    for grp in tables.groups:
        need += grp.size * min(
            min(
                tables.ranks[nt].reserve_factor
                * (
                    min(tables.ranks[nt].state_bytes_per_param_dp, tables.ranks[nt].state_bytes_per_param_dpt)
                    * (k.params_dp + k.params_dpt)
                    + least_inflight * k.act_bytes
                    + k.state_bytes
                )
                for k in grp.costs[nt]
            )
            for nt in types
        )
    # torch pipelining's receive buffers, at their least (ilp_cuts.pipeline_floor with nothing in flight)
    need += sum(
        tables.ranks[nt].reserve_factor * pipeline_floor(tables, r, 0.0) for r, nt in enumerate(tables.rank_node_types)
    )
    free = sum(tables.ranks[nt].capacity_bytes - tables.ranks[nt].reserve_const_bytes for nt in tables.rank_node_types)
    return need - free


def _end_groups(tables: Tables, g: int) -> dict[int, tuple[float, float]]:
    """(least time, least bytes) of the first and last groups, which always sit on rank 0 and rank
    pp - 1 (chunk 0 and chunk S - 1), when they are not the block group ``g`` itself."""
    out: dict[int, tuple[float, float]] = {}
    for h, r in ((0, 0), (len(tables.groups) - 1, tables.pp - 1)):
        if h == g:
            continue
        nt = tables.rank_node_types[r]
        rm = tables.ranks[nt]
        costs = tables.groups[h].costs[nt]
        t_h = min(k.time_s for k in costs)
        b_h = min(
            rm.state_bytes_per_param_dp * k.params_dp
            + rm.state_bytes_per_param_dpt * k.params_dpt
            + tables.inflight[r] * k.act_bytes
            + k.state_bytes
            for k in costs
        )
        prev = out.get(r, (0.0, 0.0))
        out[r] = (prev[0] + t_h, prev[1] + b_h)
    return out


def _tail_floor(tables: Tables, g: int, k_star: int) -> float:
    """A lower bound on the slowest tail: the rank holding >= k_star blocks of group g pays at least the
    optimizer step of its blocks, min(their sync, the last bucket), and under ZeRO-3 m times what its
    blocks' gathers exceed their compute by (other layers counted at their most favourable)."""
    best = float("inf")
    for nt in set(tables.rank_node_types):
        rm, costs = tables.ranks[nt], tables.groups[g].costs[nt]
        params = min(k.params_dp for k in costs)
        opt = min(rm.optimizer_s_per_param_dp, rm.optimizer_s_per_param_dpt or rm.optimizer_s_per_param_dp)
        tail = opt * k_star * params
        kappa = rm.contention  # hidden communication still costs kappa of its time (tables.rank_tail_s)
        others = sum(
            min(min(0.0, c.z3_mb_s - (1 - kappa) * (c.fwd_s + c.bwd_s)) for c in grp.costs[nt]) * grp.size
            for h, grp in enumerate(tables.groups)
            if h != g
        )
        if tables.zero_stage == 3:
            per_block = min(c.z3_mb_s - (1 - kappa) * (c.fwd_s + c.bwd_s) for c in costs)
            hidden = kappa * k_star * min(c.z3_mb_s for c in costs)
            tail += tables.m * max(0.0, k_star * per_block + others, hidden)
        else:
            sync = rm.sync_dp(k_star * params)
            tail += min(sync, rm.last_bucket_s) + kappa * sync
        best = min(best, tail)
    return best


MAX_FLOOR_LEVELS = 8  # distinct in-flight counts whose block floors are computed per lane


def _floor_inflight(tables: Tables) -> list[float]:
    """In-flight micro-batches each rank's block floor is computed with: its own when the ranks have at
    most MAX_FLOOR_LEVELS distinct counts, else rounded down to one of that many levels (1F1B on 128 ranks
    has 128). Fewer micro-batches in flight leave more memory, so the floor is lower: still a bound."""
    values = sorted(set(tables.inflight))
    if len(values) <= MAX_FLOOR_LEVELS:
        return list(tables.inflight)
    levels = [values[len(values) * i // MAX_FLOOR_LEVELS] for i in range(MAX_FLOOR_LEVELS)]
    return [max(level for level in levels if level <= x) for x in tables.inflight]


def _refined_lower_bound_s_lane(tables: Tables, base: float | None = None) -> float:
    """One lane's refined bound (:func:`refined_lower_bound_s`); ``base``: its :func:`_lower_bound_s_lane` when
    known."""
    base = _lower_bound_s_lane(tables) if base is None else base
    cut = blocks_worth_cutting(tables)
    if not cut:
        return base
    g = max(cut, key=lambda h: tables.groups[h].size)
    ends = _end_groups(tables, g)
    # ranks with equal (node type, in-flight count, fixed bytes) share a floor; each node type's are one numpy pass
    keys = []
    for r, inflight in enumerate(_floor_inflight(tables)):
        extra_b = ends.get(r, (0.0, 0.0))[1]
        keys.append((tables.rank_node_types[r], (inflight, extra_b + pipeline_floor(tables, r, inflight))))
    memo = {}
    for nt in dict.fromkeys(nt for nt, _ in keys):
        rows = list(dict.fromkeys(row for t, row in keys if t == nt))
        computed = block_time_floors(tables, g, nt, rows, max_count=_floor_counts(tables.groups[g].size, tables.pp))
        if computed is None:
            return base
        memo.update({(nt, row): computed[i] for i, row in enumerate(rows)})
    floors = np.stack([memo[key] + ends.get(r, (0.0, 0.0))[0] for r, key in enumerate(keys)])
    size = tables.groups[g].size
    slowest_floor = _least_slowest_time(floors, size)
    if not math.isfinite(slowest_floor):
        return float("inf")
    v, m = tables.v, tables.m
    tail = _tail_floor(tables, g, -(-size // tables.pp))
    old_tail = _tail_floor_average(tables)
    slowest = _slowest_bound(tables, _rank_sends(tables))
    return base + (m - 1 / v) * max(0.0, slowest_floor - slowest) + max(0.0, tail - old_tail)


def _floor_counts(size: int, pp: int) -> int:
    """Layer counts whose block floor is enumerated exactly for a group of ``size`` on ``pp`` ranks: twice the
    even share and two more (beyond, :func:`ilp_cuts.block_time_floors` extends it by a valid lower bound; the
    slowest rank's count lies in this range unless memory crowds the other ranks' share onto it)."""
    return min(size, 2 * -(-size // pp) + 2)


def _least_slowest_time(floors: np.ndarray, size: int) -> float:
    """The least T for which the ranks can hold ``size`` blocks, each rank r at most the most blocks k with
    ``floors[r, k] <= T`` (inf when no T does).

    With each row made monotone by its suffix minimum (which keeps "the most k with floor <= T" unchanged,
    so no floor needs to be monotone), rank r holds #{k >= 1 : floor[r, k] <= T} blocks once its
    ``floor[r, 0] <= T``: the answer is the larger of the largest ``floor[r, 0]`` and the ``size``-th
    smallest of all ``floor[r, k >= 1]``.
    """
    monotone = np.minimum.accumulate(floors[:, ::-1], axis=1)[:, ::-1]
    counts = monotone[:, 1:].ravel()
    if counts.size < size:
        return math.inf
    kth = float(np.partition(counts, size - 1)[size - 1]) if size > 0 else 0.0
    return max(float(monotone[:, 0].max()), kth)


def typed_slowest_floor(
    per_type: Mapping[str, Sequence[float]],
    sizes: Sequence[int],
    ranks_of_type: Mapping[str, int],
    sends_of_type: Mapping[str, float] | None = None,
) -> float:
    """A floor of the slowest pp rank's time when ranks are of several node types (0 for one type).

    With t_l^k the least time of layer l on type k, f_l = min_k t_l^k and rho_k = min_l t_l^k / f_l (how
    much slower type k is, at best): the ranks of type k hold layers whose f-time is at most
    n_k T / rho_k, so sum_l f_l <= T sum_k n_k / rho_k, i.e. T >= sum_l f_l / sum_k (n_k / rho_k). With
    one type this is sum / pp; with 4 A100 and 4 V100 ranks (rho ~2.4) the denominator is ~5.7, not 8.
    ``sends_of_type[k]``: pipeline transfers the type's ranks pay in any case (they leave n_k T - sends_k
    for layers): T >= (sum_l f_l + sum_k sends_k / rho_k) / sum_k (n_k / rho_k).
    """
    if len(per_type) < 2:
        return 0.0
    fast = [min(times[g] for times in per_type.values()) for g in range(len(sizes))]
    capacity = work = 0.0
    for nt, times in per_type.items():
        ratios = [t / f for t, f in zip(times, fast) if f > 0]
        rho = min(ratios) if ratios else 1.0
        capacity += ranks_of_type[nt] / rho
        work += (sends_of_type or {}).get(nt, 0.0) / rho
    return (sum(f * n for f, n in zip(fast, sizes)) + work) / capacity


def _slowest_bound(tables: Tables, sends: list[float]) -> float:
    """A floor of the slowest pp rank's time per micro-batch; ``sends`` from :func:`_rank_sends`."""
    total, largest = _least_times(tables, sends)
    types = sorted(set(tables.rank_node_types))
    per_type = {nt: [min(k.time_s for k in grp.costs[nt]) for grp in tables.groups] for nt in types}
    sends_of_type = {nt: sum(x for x, t in zip(sends, tables.rank_node_types) if t == nt) for nt in types}
    typed = typed_slowest_floor(
        per_type, [grp.size for grp in tables.groups], Counter(tables.rank_node_types), sends_of_type
    )
    return max(total / tables.pp, largest + min(sends), max(sends), typed)


def lower_bound_s(tables: Tables) -> float:
    """A step time no assignment of ``tables`` can beat (valid whatever the memory limits); with replica
    types the largest lane bound (each lane's pipeline is part of the step, formula (H)).

    Per lane: with t_min a layer's fastest option on the fastest node type in use and b_min the cheapest
    pipeline transfer: sum_r T_r >= sum_l t_min + 2 (S - 1) b_min (each boundary is paid by both its
    chunks) and max_r T_r >= max(that sum / pp, max_l t_min, :func:`typed_slowest_floor`); the slowest
    tail is >= the mean tail, bounded by :func:`_tail_floor_average` (optimizer step, and the gradient
    sync / ZeRO communication that the ranks' compute windows cannot hide). Layout changes and other
    terms are >= 0.
    """
    return max(_lower_bound_s_lane(lane) for lane in tables.lanes)


def memory_shortfall_bytes(tables: Tables) -> float:
    """Bytes by which even the leanest assignment overflows some lane (<= 0: may fit), from a relaxation:
    the cheapest per-layer states and activations summed over the model against the ranks' total capacity."""
    return max(_memory_shortfall_bytes_lane(lane) for lane in tables.lanes)


def refined_lower_bound_s(tables: Tables, base_s: float | None = None) -> float:
    """:func:`lower_bound_s` tightened by memory (per lane, the largest): each rank's repeated blocks take at
    least the exact least time of their count under its most generous memory (``ilp_cuts.block_time_floor``;
    the first and last groups, whose ranks are known, added), so the slowest rank is at least the smallest
    T for which the ranks' largest block counts with time <= T add up to the group's size; plus a tail
    floor (:func:`_tail_floor`). Returns inf when no split of the blocks can fit. ``base_s``: the tables'
    :func:`lower_bound_s` when the caller has it (one lane only; it is recomputed otherwise)."""
    lanes = tables.lanes
    if len(lanes) == 1 and base_s is not None:
        return _refined_lower_bound_s_lane(lanes[0], base_s)
    return max(_refined_lower_bound_s_lane(lane) for lane in lanes)
