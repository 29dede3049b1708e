"""The search's view of one outer candidate: per-layer, per-option coefficients the ILP sums and maximises.

For a fixed outer choice (degrees, schedule, micro-batching, ZeRO, sequence parallel, node type per pp
rank) ``planner.cost.estimate`` is assembled from per-layer pieces with sums, maxima and minima of affine
functions (``planner/cost/estimate.py``). :class:`Tables` holds exactly those pieces, with identical
consecutive layers aggregated into one :class:`Group`; :func:`evaluate` is the ILP's objective and memory
evaluated in closed form at a complete assignment (used by the brute force and to check every answer
against ``estimate``).

Vocabulary: a *chunk* is a pipeline stage in model order (``S = pp * v`` of them; chunk ``c`` runs on pp
rank ``c % pp``); an *option* is one (recompute, layout style) pair for a layer.

Step time (``planner/cost/pipeline.py`` (P) and (S))::

    step_s = (m - 1/v) * max_r T_r + (1/v) * sum_r T_r + max_r tail_r

``T_r``: one micro-batch through rank ``r``'s chunks (layer times, layout changes, one pipeline transfer
per boundary charged to each of its two chunks). ``tail_r``: exposed data-parallel sync, ZeRO communication, AdamW step.

Data-parallel replicas on different node types (``ParallelConfig.replica_node_types``, formula (H) of
``planner.cost.estimate``): one *lane* per replica node type ``t``, each a :class:`Tables` with every pp
rank on ``t`` and the type's own micro-batch count ``m_t``; the same layer placement runs on every lane::

    step_s = max_t [ (m_t - 1/v) * max_r T_{t,r} + (1/v) * sum_r T_{t,r} ] + max_{t,r} tail_{t,r}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from planner.core import Recompute, TPStyle
from planner.cost import SweepRun, backward_sweep


@dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """One way to run a layer: how it is recomputed and whether it is replicated or split over tp."""

    recompute: Recompute
    style: TPStyle


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionCost:
    """One layer under one option on one rank (seconds per micro-batch, bytes per rank).

    ``params_dp``/``params_dpt``: parameters synchronised over the dp group (split layers) or over the
    ``tp * dp`` group (replicated layers). ``ws_bytes``: backward working set if fully recomputed.
    ``z3_mb_s``: ZeRO-3 weight gathers (forward, backward) and gradient reduce-scatter per micro-batch;
    ``z3_gather_s``: one weight gather plus one gradient reduce-scatter (as the rank's first layer, whose
    gather and reduce-scatter are never hidden: ``planner.cost.zero3``).
    """

    time_s: float
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    act_bytes: float = 0.0
    params_dp: float = 0.0
    params_dpt: float = 0.0
    param_bytes: float = 0.0
    ws_bytes: float = 0.0
    z3_mb_s: float = 0.0
    z3_gather_s: float = 0.0
    opt_s: float = 0.0  # per step: measured optimizer host time + MoE expert sync/step (planner.cost.moe)
    state_bytes: float = 0.0  # bytes held whatever the micro-batches: MoE routed-expert states (planner.cost.moe)
    logits_bytes: float = 0.0  # the model's last layer: logits a pipeline's last stage keeps per micro-batch
    # MoE routed experts' gradients at the moments that have them (LayerCost.expert_grads_*_bytes)
    expert_grads_accumulating_bytes: float = 0.0
    expert_grads_end_bytes: float = 0.0
    root_params: float = 0.0  # parameters in FSDP2's root unit (every layer but the blocks)
    root_gathered_bytes: float = 0.0  # ZeRO-3 in the runtime: the root unit's gathered weights, always alive


@dataclass(frozen=True, kw_only=True, slots=True)
class Concave:
    """``f(x) = 0`` for ``x <= 0``, else ``min_k (alpha_k + beta_k x)``: a collective's time as a function
    of the parameters it carries — one piece through 0 when gradients go in fixed-size buckets, else the
    min over ring/tree/hierarchical (``planner.cost.collectives``)."""

    pieces: tuple[tuple[float, float], ...] = ()

    def __call__(self, x: float) -> float:
        if x <= 0 or not self.pieces:
            return 0.0
        return min(a + b * x for a, b in self.pieces)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankModel:
    """Per-rank terms of one node type: the step tail and the memory model (``planner.cost.memory``)."""

    capacity_bytes: float
    state_bytes_per_param_dp: float
    state_bytes_per_param_dpt: float
    reserve_factor: float
    reserve_const_bytes: float
    ddp_buffer: str  # "always" | "if_replicated" | "never"
    ddp_buffer_cap_bytes: float  # math.inf: the buffer is all the gradients
    grad_bytes_per_param: float
    zero3_buffer_layers: int
    # gradient bytes per parameter at a peak moment (planner.cost.memory.RuntimeStates): while micro-batches
    # accumulate, and as the last backward ends (Tables.moments says which moments a rank has)
    grads_accumulating_per_param: float = 0.0
    grads_end_per_param: float = 0.0
    root_unsharded_per_param: float = 0.0  # the root unit's gathered copy, still alive as the backward ends
    # the runtime's memory: activations, working set and gradients by the backward sweep
    # (planner.cost.memory, "The backward sweep"); False: every activation with the largest working set
    backward_sweep: bool = False
    pp_buffers: bool
    # Megatron-LM's pipeline buffers (estimate._memory_textbook): two of each chunk's output, nothing held
    pp_textbook: bool = False
    sync_dp: Concave
    sync_dpt: Concave
    last_bucket_s: float  # the last gradient bucket, exposed whatever the overlap
    gather_dp: Concave
    gather_dpt: Concave
    optimizer_s_per_param_dp: float
    optimizer_s_per_param_dpt: float
    contention: float = 0.0  # planner.cost.kernels.contention: hidden comm still costs this share


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Consecutive identical layers (``len(paths) > 1``) or a single layer.

    ``costs[node_type][i]`` is the cost of ``options[i]``; ``boundary_s[(style, src, dst)]`` the one-way
    pipeline transfer when a chunk ends in this group (charged to both chunks of the boundary: Megatron
    pairs each send with the opposite receive); ``out_buffer_bytes`` its pipeline buffer.
    """

    paths: tuple[str, ...]
    options: tuple[Option, ...]
    costs: Mapping[str, tuple[OptionCost, ...]]
    boundary_s: Mapping[tuple[str, str, str], float]
    out_buffer_bytes: float = 0.0

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def styles(self) -> tuple[TPStyle, ...]:
        return tuple(dict.fromkeys(o.style for o in self.options))


@dataclass(frozen=True, kw_only=True, slots=True)
class Tables:
    """All coefficients of one outer candidate.

    ``inflight[r]``: micro-batches whose activations pp rank ``r`` holds at its peak.
    ``change_s[(g, a, b, node_type)]``: layout change between group ``g`` (style ``a``) and ``g + 1``
    (style ``b``), charged to the chunk holding the first layer of ``g + 1``.
    ``tied_params[style]``: word-embedding copy (tied LM head) on the last pp rank, by the style of group
    ``tied_group`` (the embedding); empty when there is none.
    """

    groups: tuple[Group, ...]
    pp: int
    v: int
    m: int
    zero_stage: int
    rank_node_types: tuple[str, ...]
    inflight: tuple[float, ...]
    ranks: Mapping[str, RankModel]
    # per pp rank, the candidate times of its peak: (micro-batches of activations alive, gradients "none" |
    # "accumulating" | "end"), planner.cost.memory.peak_moments; empty = one moment (inflight[r], "none")
    moments: tuple[tuple[tuple[float, str], ...], ...] = ()
    change_s: Mapping[tuple[int, str, str, str], float]
    tied_params: Mapping[str, float]
    tied_group: int = 0
    chunk_unit_s: Mapping[str, tuple[float, float]] | None = None  # per chunk (forward, backward) host cost
    # dp replicas on several node types: one lane per type (each with its rank types, m and inflight; the
    # first lane equals this table's own fields); empty = one lane, this table itself
    replica_lanes: tuple["Tables", ...] = ()
    # layers per chunk when they are fixed (interleaved schedules run equal chunks:
    # planner.cost.placement.interleaved_chunk_sizes); None = the ILP chooses the boundaries
    chunk_sizes: tuple[int, ...] | None = None
    # a chunk's first layer saves the activation it receives (planner.cost.pipeline.pipeline_aliases_input)
    aliases_input: bool = False

    @property
    def chunks(self) -> int:
        return self.pp * self.v

    @property
    def lanes(self) -> tuple["Tables", ...]:
        """The lanes the placement runs on: the replica types' tables, or this table alone."""
        return self.replica_lanes or (self,)

    def node_type_of_chunk(self, c: int) -> str:
        return self.rank_node_types[c % self.pp]


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """``counts[c][g][i]``: layers of group ``g`` with option ``i`` in chunk ``c`` (chunks contiguous, so the
    counts alone fix which layer goes where)."""

    counts: tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    step_s: float
    rank_time_s: tuple[float, ...]
    rank_tail_s: tuple[float, ...]
    rank_mem_bytes: tuple[float, ...]
    fits: bool


def group_styles(tables: Tables, assignment: Assignment) -> list[str]:
    """The (uniform) style of each group under ``assignment``; ValueError if a group mixes styles."""
    styles: list[str] = []
    for g, group in enumerate(tables.groups):
        used = {group.options[i].style for row in assignment.counts for i, n in enumerate(row[g]) if n}
        if len(used) != 1:
            raise ValueError(f"group {g} uses styles {sorted(used)}; exactly one expected")
        styles.append(used.pop())
    return styles


def first_chunk(assignment: Assignment, g: int) -> int:
    return next(c for c, row in enumerate(assignment.counts) if sum(row[g]))


def _present(assignment: Assignment, c: int) -> list[int]:
    return [g for g, opts in enumerate(assignment.counts[c]) if sum(opts)]


def chunk_times(tables: Tables, assignment: Assignment, styles: list[str]) -> list[float]:
    """Per-micro-batch time of each chunk: layers, layout changes, pipeline exchanges."""
    times = []
    for c, row in enumerate(assignment.counts):
        nt = tables.node_type_of_chunk(c)
        unit = sum(tables.chunk_unit_s[nt]) if tables.chunk_unit_s else 0.0
        times.append(
            unit + sum(n * grp.costs[nt][i].time_s for grp, opts in zip(tables.groups, row) for i, n in enumerate(opts))
        )
    for g in range(len(tables.groups) - 1):
        c = first_chunk(assignment, g + 1)
        times[c] += tables.change_s.get((g, styles[g], styles[g + 1], tables.node_type_of_chunk(c)), 0.0)
    if tables.pp > 1:
        for c in range(tables.chunks - 1):
            last = _present(assignment, c)[-1]
            key = (styles[last], tables.node_type_of_chunk(c), tables.node_type_of_chunk(c + 1))
            times[c] += tables.groups[last].boundary_s[key]
            times[c + 1] += tables.groups[last].boundary_s[key]
    return times


def _rank_sums(tables: Tables, assignment: Assignment, r: int, styles: list[str]) -> dict[str, float]:
    nt = tables.rank_node_types[r]
    out = dict(P=0.0, Q=0.0, Wf=0.0, Wb=0.0, act=0.0, ws=0.0, mx=0.0, z3=0.0, out=0.0, opt=0.0, st=0.0, lg=0.0)
    out.update({"in": 0.0, "ega": 0.0, "ege": 0.0, "R": 0.0, "rg": 0.0, "last_out": 0.0})
    for c in range(r, tables.chunks, tables.pp):
        if tables.chunk_unit_s:
            out["Wf"] += tables.chunk_unit_s[nt][0]
            out["Wb"] += tables.chunk_unit_s[nt][1]
        for grp, opts in zip(tables.groups, assignment.counts[c]):
            for i, n in enumerate(opts):
                k = grp.costs[nt][i]
                out["P"] += n * k.params_dp
                out["Q"] += n * k.params_dpt
                out["Wf"] += n * k.fwd_s
                out["Wb"] += n * k.bwd_s
                out["act"] += n * k.act_bytes
                out["z3"] += n * k.z3_mb_s
                out["opt"] += n * k.opt_s
                out["st"] += n * k.state_bytes
                out["lg"] += n * k.logits_bytes
                out["ega"] += n * k.expert_grads_accumulating_bytes
                out["ege"] += n * k.expert_grads_end_bytes
                out["R"] += n * k.root_params
                out["rg"] += n * k.root_gathered_bytes
                if n:
                    out["ws"] = max(out["ws"], k.ws_bytes)
                    out["mx"] = max(out["mx"], k.param_bytes)
        if c < tables.chunks - 1:  # the boundary after chunk c (pipeline_bytes)
            out["out"] += tables.groups[_present(assignment, c)[-1]].out_buffer_bytes
        else:
            out["last_out"] = tables.groups[-1].out_buffer_bytes
        if c > 0:
            out["in"] += tables.groups[_present(assignment, c - 1)[-1]].out_buffer_bytes
    if r == tables.pp - 1 and tables.pp > 1 and tables.tied_params:
        out["P"] += tables.tied_params[styles[tables.tied_group]]
    rm = tables.ranks[nt]
    if rm.backward_sweep:
        for mode in ("none", "accumulating"):
            out["sweep_" + mode] = (
                backward_sweep_bytes(tables, rm, assignment.counts[r], nt, mode)
                if tables.v == 1
                else out["act"] + out["ws"]
            )
    first_g = _present(assignment, r)[0]
    first_i = next(i for i, n in enumerate(assignment.counts[r][first_g]) if n)
    out["first"] = tables.groups[first_g].costs[nt][first_i].z3_gather_s
    return out


def rank_tail_s(tables: Tables, rm: RankModel, x: dict[str, float]) -> float:
    """Exposed dp sync + ZeRO communication + optimizer (``estimate._Assembler.build_rank``)."""
    opt = rm.optimizer_s_per_param_dp * x["P"] + rm.optimizer_s_per_param_dpt * x["Q"] + x["opt"]
    kappa = rm.contention
    if tables.zero_stage == 3:
        return tables.m * max(x["z3"] - (1 - kappa) * (x["Wf"] + x["Wb"]), kappa * x["z3"]) + x["first"] + opt
    sync = rm.sync_dp(x["P"]) + rm.sync_dpt(x["Q"])
    exposed = max(sync - (1 - kappa) * x["Wb"], min(sync, rm.last_bucket_s) + kappa * sync)
    zero_s = 0.0
    if tables.zero_stage > 0:
        gather = rm.gather_dp(x["P"]) + rm.gather_dpt(x["Q"])
        zero_s = max(gather - (1 - kappa) * x["Wf"], kappa * gather)
    return exposed + zero_s + opt


def rank_moments(tables: Tables, r: int) -> tuple[tuple[float, str], ...]:
    """The candidate peak moments of pp rank ``r`` (:attr:`Tables.moments`)."""
    return tables.moments[r] if tables.moments else ((tables.inflight[r], "none"),)


def moment_grad_bytes(rm: RankModel, mode: str) -> float:
    """Gradient bytes per parameter at a moment whose gradients are ``mode``."""
    return {"none": 0.0, "accumulating": rm.grads_accumulating_per_param, "end": rm.grads_end_per_param}[mode]


def moment_grads(rm: RankModel, mode: str, x: dict) -> Any:
    """What a moment whose gradients are ``mode`` adds to a rank whose sums are ``x``: the layers' gradients
    (per parameter) and the routed experts' (``ega`` / ``ege``); as the last backward ends, less the gathered
    weights every unit but the root (``R`` its parameters) has freed. Linear in ``x``."""
    per = moment_grad_bytes(rm, mode)
    dense = per * (x["P"] + x["Q"]) if per else 0.0
    experts = {"none": 0.0, "accumulating": x["ega"], "end": x["ege"]}[mode]
    root = rm.root_unsharded_per_param * x["R"] if mode == "end" and rm.root_unsharded_per_param else 0.0
    return dense + experts + root


def pipeline_bytes(tables: Tables, rm: RankModel, x: dict) -> tuple[Any, Any]:
    """(receive buffers, bytes held per micro-batch in flight) of a pp rank whose sums are ``x``: ``out`` the
    boundary activations its chunks send, ``in`` those they receive (the first layers' saved inputs where
    :attr:`Tables.aliases_input`), ``lg`` the logits of the last chunk (``estimate._Assembler._pipeline_bytes``).
    Linear in ``x``, so the ILP uses it too."""
    if not rm.pp_buffers:
        return 0.0, 0.0
    if rm.pp_textbook:
        return 2 * (x["out"] + x["last_out"]), 0.0
    held = x["out"] + x["lg"] - (x["in"] if tables.aliases_input else 0.0)
    return tables.m * (x["out"] + x["in"]), held


def sweep_grad_bytes(rm: RankModel, k: OptionCost, mode: str) -> float:
    """The gradients one layer has made once its backward has run, as the backward sweep of a moment whose
    gradients are ``mode`` counts them (the later layers' during the first backward; none at a later one,
    whose moment counts every gradient apart)."""
    if mode != "none":
        return 0.0
    return rm.grads_accumulating_per_param * (k.params_dp + k.params_dpt) + k.expert_grads_accumulating_bytes


def backward_sweep_bytes(tables: Tables, rm: RankModel, row: tuple[tuple[int, ...], ...], nt: str, mode: str) -> float:
    """One micro-batch's activations, working set (with the block unit) and later layers' gradients at the worst
    point of its backward (:func:`planner.cost.memory.backward_sweep` over the groups), for a rank of one chunk
    whose counts are ``row``; ``estimate._Assembler._backward_sweep`` over the same runs."""
    runs = []
    for grp, opts in zip(tables.groups, row):
        here = [(n, grp.costs[nt][i]) for i, n in enumerate(opts) if n]
        if here:
            runs.append(
                SweepRun(
                    act=sum(n * k.act_bytes for n, k in here),
                    grads=sum(n * sweep_grad_bytes(rm, k, mode) for n, k in here),
                    ws=max(k.ws_bytes for _, k in here),
                    first=max(k.act_bytes - sweep_grad_bytes(rm, k, mode) for _, k in here),
                )
            )
    return backward_sweep(runs)[0]


def rank_memory_bytes(tables: Tables, rm: RankModel, x: dict[str, float], r: int) -> float:
    """Peak bytes of pp rank ``r`` (``estimate._Assembler._memory`` and ``memory.build_memory_breakdown``)."""
    if rm.backward_sweep:  # the runtime's memory: the moments' backward sweeps
        states = rm.state_bytes_per_param_dp * x["P"] + rm.state_bytes_per_param_dpt * x["Q"] + x["st"] + x["rg"]
        buffers, held = pipeline_bytes(tables, rm, x)
        live = max(
            (k * held + (k - 1) * x["act"] + x["sweep_" + mode] if mode != "end" else 0.0) + moment_grads(rm, mode, x)
            for k, mode in rank_moments(tables, r)
        )
        return rm.reserve_factor * (states + live + buffers) + rm.reserve_const_bytes
    states = rm.state_bytes_per_param_dp * x["P"] + rm.state_bytes_per_param_dpt * x["Q"] + x["st"]
    buffers, held = pipeline_bytes(tables, rm, x)
    activations = (
        max(k * (x["act"] + held) + moment_grads(rm, mode, x) for k, mode in rank_moments(tables, r)) + x["ws"]
    )
    if rm.ddp_buffer == "always" or (rm.ddp_buffer == "if_replicated" and x["Q"] > 0):
        buffers += min(rm.ddp_buffer_cap_bytes, rm.grad_bytes_per_param * (x["P"] + x["Q"]))
    buffers += rm.zero3_buffer_layers * x["mx"]
    return rm.reserve_factor * (states + activations + buffers) + rm.reserve_const_bytes


def _evaluate_lane(tables: Tables, assignment: Assignment, styles: list[str]) -> tuple[float, list, list, list]:
    """(pipeline time (P), rank times, rank tails, rank memory) of one lane."""
    times = chunk_times(tables, assignment, styles)
    pp, v, m = tables.pp, tables.v, tables.m
    rank_time = [sum(times[c] for c in range(r, tables.chunks, pp)) for r in range(pp)]
    tails, mems = [], []
    for r in range(pp):
        rm = tables.ranks[tables.rank_node_types[r]]
        x = _rank_sums(tables, assignment, r, styles)
        tails.append(rank_tail_s(tables, rm, x))
        mems.append(rank_memory_bytes(tables, rm, x, r))
    return (m - 1 / v) * max(rank_time) + sum(rank_time) / v, rank_time, tails, mems


def evaluate(tables: Tables, assignment: Assignment) -> Evaluation:
    """Step time and per-rank memory of ``assignment`` (see the module docstring); with replica lanes the
    ranks of every lane in lane order."""
    styles = group_styles(tables, assignment)
    pipeline_s, rank_time, tails, mems, fits = 0.0, [], [], [], True
    for lane in tables.lanes:
        pipe, times, lane_tails, lane_mems = _evaluate_lane(lane, assignment, styles)
        pipeline_s = max(pipeline_s, pipe)
        rank_time += times
        tails += lane_tails
        mems += lane_mems
        fits = fits and all(mem <= lane.ranks[nt].capacity_bytes for mem, nt in zip(lane_mems, lane.rank_node_types))
    return Evaluation(
        step_s=pipeline_s + max(tails),
        rank_time_s=tuple(rank_time),
        rank_tail_s=tuple(tails),
        rank_mem_bytes=tuple(mems),
        fits=fits,
    )


_TIME_FIELDS = ("time_s", "fwd_s", "bwd_s", "params_dp", "params_dpt", "z3_mb_s", "z3_gather_s", "opt_s")
_MEMORY_FIELDS = (
    "act_bytes",
    "param_bytes",
    "ws_bytes",
    "state_bytes",
    "root_gathered_bytes",
    "expert_grads_accumulating_bytes",
)
_RANK_TIME_FIELDS = (
    "contention",
    "sync_dp",
    "sync_dpt",
    "last_bucket_s",
    "gather_dp",
    "gather_dpt",
    "optimizer_s_per_param_dp",
    "optimizer_s_per_param_dpt",
)
_RANK_MEMORY_FIELDS = (
    "state_bytes_per_param_dp",
    "state_bytes_per_param_dpt",
    "reserve_const_bytes",
    "ddp_buffer_cap_bytes",
    "grad_bytes_per_param",
    "zero3_buffer_layers",
    "grads_accumulating_per_param",
)


def dominates(a: Tables, b: Tables) -> bool:
    """True when every assignment costs the same time under ``a`` and ``b`` and needs no more memory
    under ``a`` (each coefficient equal or smaller), so ``a``'s optimum is at least as good as ``b``'s."""
    if a.replica_lanes or b.replica_lanes:
        return False
    same = (
        a.pp,
        a.v,
        a.m,
        a.rank_node_types,
        len(a.groups),
        a.change_s,
        a.tied_params,
        a.zero_stage == 3,
        a.chunk_unit_s,
    ) == (
        b.pp,
        b.v,
        b.m,
        b.rank_node_types,
        len(b.groups),
        b.change_s,
        b.tied_params,
        b.zero_stage == 3,
        b.chunk_unit_s,
    )
    if not same or a.moments != b.moments or any(x > y for x, y in zip(a.inflight, b.inflight)):
        return False
    for ga, gb in zip(a.groups, b.groups):
        if (ga.paths, ga.options, ga.boundary_s) != (
            gb.paths,
            gb.options,
            gb.boundary_s,
        ) or ga.out_buffer_bytes > gb.out_buffer_bytes:
            return False
        for nt in ga.costs:
            for ka, kb in zip(ga.costs[nt], gb.costs[nt]):
                if any(getattr(ka, f) != getattr(kb, f) for f in _TIME_FIELDS) or any(
                    getattr(ka, f) > getattr(kb, f) for f in _MEMORY_FIELDS
                ):
                    return False
    for nt, ra in a.ranks.items():
        rb = b.ranks[nt]
        if (
            any(getattr(ra, f) != getattr(rb, f) for f in _RANK_TIME_FIELDS)
            or any(getattr(ra, f) > getattr(rb, f) for f in _RANK_MEMORY_FIELDS)
            or (ra.capacity_bytes, ra.reserve_factor, ra.pp_buffers, ra.backward_sweep)
            != (rb.capacity_bytes, rb.reserve_factor, rb.pp_buffers, rb.backward_sweep)
        ):
            return False
        if ra.ddp_buffer != rb.ddp_buffer and ra.ddp_buffer != "never":
            return False
    return True
