"""Simulate one training step of a pipeline schedule: who computes what, when, and who waits.

The simulation is list scheduling: each pp rank runs its operations in the schedule's fixed order, and an
operation starts when its rank is free and its inputs have arrived. Orders (``p`` pp ranks, ``m``
micro-batches, ``v`` model chunks per rank, rank ``r``):

- GPipe (Huang et al. 2019): all ``m`` forwards, then all ``m`` backwards (in micro-batch order, as
  ``torch.distributed.pipelining.ScheduleGPipe`` does).
- 1F1B / PipeDream-Flush (Narayanan et al. SC21 §2.2.1): ``min(p - r - 1, m)`` warm-up forwards, then one
  forward one backward, then the remaining backwards.
- Interleaved 1F1B (SC21 §2.2.2; the order of Megatron-LM ``forward_backward_pipelining_with_interleaving``):
  virtual micro-batch ``k`` runs chunk ``(k mod pv) div p`` (reversed for backwards) on micro-batch
  ``(k div pv) * p + k mod p``; ``(p - r - 1) * 2 + (v - 1) * p`` warm-up forwards (all ``mv`` when
  ``m == p``). Chunk ``c`` of rank ``r`` is stage ``c * p + r``. Needs ``m`` divisible by ``p``.

Dependencies: the forward of stage ``s`` needs the forward of ``s - 1``; the backward of ``s`` needs the
backward of ``s + 1`` (the last stage's needs its own forward); a recompute (activation checkpointing) runs
right before its backward, once the gradient has arrived.

Cost conventions, as the cost model (``planner.cost``) writes ``StagePrediction.time_breakdown_s`` (seconds
per micro-batch, disjoint terms): ``forward``, ``backward``, ``recompute`` compute; ``tp_comm`` (plus
``layout``, tensor-layout changes between layers) exposed tensor-parallel collectives, split half into the
forward and half into the backward (Megatron's f/g operators issue equal all-reduces in each direction,
SC21 §2.3); ``pp_comm`` point-to-point time across the boundary to the *next* stage, both directions, half
for the activation going forward and half for its gradient coming back (0 on the last stage).
Two ways to place ``pp_comm`` (``pp_comm_mode``):

- ``"blocking"`` (default, the cost model's assumption): the upstream rank is busy for it, at the end of
  its forward and of its backward (drawn inside the operation); the downstream rank may start at once.
  Uniform rank times ``T`` then give exactly ``(m + (p - 1)/v) T`` as in ``planner.cost.pipeline``.
- ``"async"``: the transfer overlaps compute (``isend``), and the receiver waits for it to land; a wait is
  drawn as idle ``pp_wait``.

After its last operation each rank runs the step-level terms of ``Predictions.breakdown_s`` present in
``STEP_TAIL_TERMS`` (exposed data-parallel sync, ZeRO collectives, optimizer step).
An idle gap on a rank is ``pp_wait`` for the part spent waiting on a transfer in flight, and ``bubble``
for the rest. With uniform stages and no communication the bubble per rank is ``(p - 1) / m`` of the
ideal time ``m * (t_f + t_b)``, divided by ``v`` when interleaved (SC21 §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from planner.core import StratagemError
from planner.plan import Plan

Phase = Literal["forward", "recompute", "backward"]
PpCommMode = Literal["blocking", "async"]
COMPUTE_PHASES: tuple[Phase, ...] = ("forward", "recompute", "backward")
# step-level terms of Predictions.breakdown_s that run after a rank's last backward (planner/cost/records.py)
STEP_TAIL_TERMS = ("dp_sync_exposed", "dp_comm", "zero_comm", "expert_sync", "optimizer")
IntervalKind = str  # a phase, "tp_comm", "pp_comm", "pp_wait", "bubble", or one of STEP_TAIL_TERMS


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """Per micro-batch seconds of one stage, as the simulation uses them."""

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    ep_comm_s: float = 0.0  # Mixture-of-Experts dispatch/combine all-to-alls (half forward, half backward)


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    """A span of time on one pp rank. ``stage``/``micro_batch`` are None for idle and step-level spans."""

    pp_rank: int
    kind: IntervalKind
    start_s: float
    end_s: float
    stage: int | None = None
    micro_batch: int | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """The simulated step: every interval on every pp rank, and when the step ends."""

    kind: str
    pp: int
    num_micro_batches: int
    virtual_stages: int
    intervals: tuple[Interval, ...]
    makespan_s: float
    pp_comm_mode: PpCommMode = "blocking"
    totals_s: dict[tuple[str, int], float] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for iv in self.intervals:  # per (kind, pp rank) sums, so frames of 1,000s of ranks stay fast
            key = (iv.kind, iv.pp_rank)
            self.totals_s[key] = self.totals_s.get(key, 0.0) + iv.duration_s

    def total_s(self, kind: str, pp_rank: int | None = None) -> float:
        """Summed duration of intervals of ``kind`` (on one pp rank, or all)."""
        if pp_rank is not None:
            return self.totals_s.get((kind, pp_rank), 0.0)
        return sum(self.totals_s.get((kind, r), 0.0) for r in range(self.pp))

    def busy_s(self, pp_rank: int) -> float:
        """Compute seconds of one rank (forward, recompute, backward; tp comm is inside those ops)."""
        return sum(self.total_s(k, pp_rank) for k in COMPUTE_PHASES)

    def idle_s(self, pp_rank: int) -> float:
        """Seconds a rank waits in the step: bubble plus waiting on pp transfers."""
        return self.total_s("bubble", pp_rank) + self.total_s("pp_wait", pp_rank)

    def exposed_pp_comm_s(self, pp_rank: int | None = None) -> float:
        """Seconds of pp communication not hidden behind compute: blocking send/recv plus waits."""
        return self.total_s("pp_comm", pp_rank) + self.total_s("pp_wait", pp_rank)

    def peak_in_flight(self, pp_rank: int) -> int:
        """Most micro-batches whose forward ran on this rank before their backward (stashed activations).

        GPipe holds all ``m``; 1F1B at most ``p - r`` on rank ``r`` (SC21 §2.2.1)."""
        events = sorted(
            (iv.start_s, 1 if iv.kind == "forward" else -1)
            for iv in self.intervals
            if iv.pp_rank == pp_rank and iv.kind in ("forward", "backward")
        )
        live = peak = 0
        for _, delta in events:
            live += delta
            peak = max(peak, live)
        return peak

    def bubble_fraction(self) -> float:
        """Mean bubble seconds per rank over mean busy seconds per rank (SC21's bubble time fraction)."""
        busy = sum(self.busy_s(r) for r in range(self.pp))
        return self.total_s("bubble") / busy if busy > 0 else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class _Op:
    stage: int
    micro_batch: int
    phase: Phase


def stage_costs(plan: Plan) -> list[StageCost]:
    """Per-stage costs from the plan's predictions, in stage order."""
    if plan.predictions is None:
        raise StratagemError(
            "plan has no predictions, so there is no timeline to draw; re-plan with "
            "`stratagem plan` (or `stratagem estimate`) to fill them"
        )
    by_stage = {sp.stage: sp.time_breakdown_s for sp in plan.predictions.stages}
    missing = [st.index for st in plan.stages if st.index not in by_stage]
    if missing:
        raise StratagemError(f"plan predictions lack stages {missing}; re-plan to fill them")
    costs = []
    for index in range(len(plan.stages)):
        t = by_stage[index]
        costs.append(
            StageCost(
                forward_s=t.get("forward", 0.0),
                backward_s=t.get("backward", 0.0),
                recompute_s=t.get("recompute", 0.0),
                tp_comm_s=t.get("tp_comm", 0.0) + t.get("layout", 0.0),
                pp_comm_s=t.get("pp_comm", 0.0),
                ep_comm_s=t.get("ep_comm", 0.0),
            )
        )
    return costs


def schedule_order(
    kind: str, pp: int, num_micro_batches: int, virtual_stages: int = 1, *, recompute: tuple[bool, ...] = ()
) -> dict[int, list[_Op]]:
    """Each pp rank's operations in execution order; ``recompute[s]`` inserts a recompute before backward."""
    m, v = num_micro_batches, virtual_stages
    order: dict[int, list[_Op]] = {}
    for r in range(pp):
        pairs: list[tuple[Phase, int, int]]
        if kind == "gpipe":
            pairs = [("forward", r, i) for i in range(m)] + [("backward", r, i) for i in range(m)]
        elif kind == "1f1b":
            pairs = _one_f_one_b(m, min(pp - r - 1, m), lambda k, _fwd, r=r: (r, k))
        elif kind == "interleaved_1f1b":
            if m % pp:
                raise StratagemError(
                    f"interleaved 1F1B needs micro-batches divisible by pp, got m={m} "
                    f"and pp={pp} (Narayanan et al. SC21 §2.2.2); re-plan with a multiple"
                )
            warmup = m * v if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, m * v)
            pairs = _one_f_one_b(m * v, warmup, lambda k, fwd, r=r: _virtual(k, fwd, r, pp, v))
        else:
            raise StratagemError(f"unknown schedule kind {kind!r}; expected gpipe, 1f1b or interleaved_1f1b")
        ops: list[_Op] = []
        for phase, stage, mb in pairs:
            if phase == "backward" and stage < len(recompute) and recompute[stage]:
                ops.append(_Op(stage=stage, micro_batch=mb, phase="recompute"))
            ops.append(_Op(stage=stage, micro_batch=mb, phase=phase))
        order[r] = ops
    return order


def _one_f_one_b(total: int, warmup: int, locate) -> list[tuple[Phase, int, int]]:
    """Warm-up forwards, then forward/backward pairs, then cool-down backwards; ``locate(k, fwd)``
    maps the k-th forward or backward to (stage, micro-batch)."""
    seq: list[tuple[Phase, int]] = [("forward", k) for k in range(warmup)]
    for k in range(total - warmup):
        seq += [("forward", warmup + k), ("backward", k)]
    seq += [("backward", k) for k in range(total - warmup, total)]
    return [(phase, *locate(k, phase == "forward")) for phase, k in seq]


def _virtual(k: int, forward: bool, r: int, pp: int, v: int) -> tuple[int, int]:
    """(stage, micro-batch) of the k-th forward/backward on rank r in Megatron's interleaved order."""
    chunk = (k % (pp * v)) // pp
    if not forward:
        chunk = v - 1 - chunk
    micro_batch = (k // (pp * v)) * pp + k % pp
    return chunk * pp + r, micro_batch


def simulate_plan(plan: Plan, *, pp_comm_mode: PpCommMode = "blocking") -> Timeline:
    """Simulate one step of ``plan`` from its predicted per-stage costs (see the module docstring)."""
    costs = stage_costs(plan)
    recompute = tuple(
        any(m != "none" for m in st.recompute.values()) for st in sorted(plan.stages, key=lambda s: s.index)
    )
    tail = {}
    if plan.predictions is not None:
        tail = {k: plan.predictions.breakdown_s.get(k, 0.0) for k in STEP_TAIL_TERMS}
    return simulate(
        plan.schedule.kind,
        costs,
        pp=plan.mesh.size("pp"),
        num_micro_batches=plan.schedule.max_micro_batches,
        virtual_stages=plan.schedule.virtual_stages,
        recompute=recompute,
        step_tail_s=tail,
        pp_comm_mode=pp_comm_mode,
    )


def simulate(
    kind: str,
    costs: list[StageCost],
    *,
    pp: int,
    num_micro_batches: int,
    virtual_stages: int = 1,
    recompute: tuple[bool, ...] = (),
    step_tail_s: dict[str, float] | None = None,
    pp_comm_mode: PpCommMode = "blocking",
) -> Timeline:
    """Simulate a schedule with ``costs[s]`` for stage ``s`` (stage s on pp rank s mod pp).

    >>> t = simulate("gpipe", [StageCost(forward_s=1, backward_s=2)] * 2, pp=2, num_micro_batches=2)
    >>> t.makespan_s, t.total_s("bubble")   # (m + p - 1)(t_f + t_b); (p - 1)(t_f + t_b) per rank
    (9.0, 6.0)
    """
    if len(costs) != pp * virtual_stages:
        raise StratagemError(
            f"{len(costs)} stage costs for pp={pp} x virtual_stages={virtual_stages}; give one cost per stage"
        )
    recompute = tuple(recompute) + (False,) * (len(costs) - len(recompute))
    recompute = tuple(r and costs[i].recompute_s > 0 for i, r in enumerate(recompute))
    if pp_comm_mode not in ("blocking", "async"):
        raise StratagemError(f"unknown pp_comm_mode {pp_comm_mode!r}; use 'blocking' or 'async'")
    order = schedule_order(kind, pp, num_micro_batches, virtual_stages, recompute=recompute)
    sim = _Sim(costs=tuple(costs), pp=pp, recompute=recompute, blocking=pp_comm_mode == "blocking")
    intervals = _run(order, sim)
    intervals += _tail(intervals, pp, step_tail_s or {})
    makespan = max(iv.end_s for iv in intervals)
    intervals += _trailing_bubbles(intervals, pp, makespan)
    intervals.sort(key=lambda iv: (iv.pp_rank, iv.start_s, iv.kind))
    return Timeline(
        kind=kind,
        pp=pp,
        num_micro_batches=num_micro_batches,
        virtual_stages=virtual_stages,
        intervals=tuple(intervals),
        makespan_s=makespan,
        pp_comm_mode=pp_comm_mode,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Sim:
    costs: tuple[StageCost, ...]
    pp: int
    recompute: tuple[bool, ...]
    blocking: bool

    def pieces_s(self, op: _Op) -> tuple[float, float, float, float]:
        """(compute, tp comm, MoE all-to-all, blocking pp comm) seconds of one operation."""
        cost = self.costs[op.stage]
        if op.phase == "recompute":
            return cost.recompute_s, 0.0, 0.0, 0.0
        compute = cost.forward_s if op.phase == "forward" else cost.backward_s
        return compute, cost.tp_comm_s / 2, cost.ep_comm_s / 2, cost.pp_comm_s / 2 if self.blocking else 0.0

    def transfer_s(self, upstream: int, downstream: int) -> float:
        """Async mode: one direction across (upstream, downstream) is half the upstream stage's pp_comm."""
        if self.blocking or upstream % self.pp == downstream % self.pp:
            return 0.0
        return self.costs[upstream].pp_comm_s / 2

    def inputs(self, op: _Op) -> list[tuple[tuple, float]]:
        """(key of an operation this one waits for, transfer seconds) pairs."""
        s, mb = op.stage, op.micro_batch
        if op.phase == "forward":
            return [] if s == 0 else [((s - 1, mb, "forward"), self.transfer_s(s - 1, s))]
        if op.phase == "backward" and self.recompute[s]:
            return [((s, mb, "recompute"), 0.0)]
        if s == len(self.costs) - 1:
            return [((s, mb, "forward"), 0.0)]
        return [((s + 1, mb, "backward"), self.transfer_s(s, s + 1)), ((s, mb, "forward"), 0.0)]


def _run(order: dict[int, list[_Op]], sim: _Sim) -> list[Interval]:
    """List-schedule every rank's ops in order; record compute, comm strips, bubbles and waits."""
    done: dict[tuple, float] = {}
    next_index = {r: 0 for r in order}
    free_s = {r: 0.0 for r in order}
    out: list[Interval] = []
    remaining = sum(len(ops) for ops in order.values())
    while remaining:
        progressed = False
        for r, ops in order.items():
            while next_index[r] < len(ops):
                op = ops[next_index[r]]
                deps = sim.inputs(op)
                if any(key not in done for key, _ in deps):
                    break
                out += _place(op, r, free_s[r], deps, done, sim)
                free_s[r] = done[(op.stage, op.micro_batch, op.phase)]
                next_index[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise StratagemError(
                "the schedule deadlocks (an operation waits on one that never runs); "
                "this is a bug in the schedule order, please report it"
            )
    return out


def _place(
    op: _Op, r: int, free_s: float, deps: list[tuple[tuple, float]], done: dict[tuple, float], sim: _Sim
) -> list[Interval]:
    """Start ``op`` when its rank is free and its inputs arrived; split any wait into bubble / pp wait."""
    produced_s = max([done[key] for key, _ in deps], default=0.0)
    arrived_s = max([done[key] + comm for key, comm in deps], default=0.0)
    start = max(free_s, arrived_s)
    where = dict(pp_rank=r, stage=op.stage, micro_batch=op.micro_batch)
    out = []
    bubble_end = min(start, max(free_s, produced_s))
    if bubble_end > free_s:
        out.append(Interval(pp_rank=r, kind="bubble", start_s=free_s, end_s=bubble_end))
    if start > bubble_end:
        out.append(Interval(kind="pp_wait", start_s=bubble_end, end_s=start, **where))
    compute_s, tp_s, ep_s, pp_s = sim.pieces_s(op)
    end = start + compute_s + tp_s + ep_s + pp_s
    out.append(Interval(kind=op.phase, start_s=start, end_s=end, **where))
    if ep_s > 0:  # strips inside the operation: MoE all-to-alls, tp collectives, then the blocking send/recv
        out.append(Interval(kind="ep_comm", start_s=end - pp_s - tp_s - ep_s, end_s=end - pp_s - tp_s, **where))
    if tp_s > 0:
        out.append(Interval(kind="tp_comm", start_s=end - pp_s - tp_s, end_s=end - pp_s, **where))
    if pp_s > 0:
        out.append(Interval(kind="pp_comm", start_s=end - pp_s, end_s=end, **where))
    done[(op.stage, op.micro_batch, op.phase)] = end
    return out


def _tail(intervals: list[Interval], pp: int, step_tail_s: dict[str, float]) -> list[Interval]:
    """Step-level terms (dp sync, optimizer) after each rank's last operation."""
    out = []
    for r in range(pp):
        t = max((iv.end_s for iv in intervals if iv.pp_rank == r), default=0.0)
        for kind in STEP_TAIL_TERMS:
            seconds = step_tail_s.get(kind, 0.0)
            if seconds > 0:
                out.append(Interval(pp_rank=r, kind=kind, start_s=t, end_s=t + seconds))
                t += seconds
    return out


def _trailing_bubbles(intervals: list[Interval], pp: int, makespan_s: float) -> list[Interval]:
    """Idle time at the end of ranks that finish before the slowest one (the cool-down bubble)."""
    out = []
    for r in range(pp):
        end = max((iv.end_s for iv in intervals if iv.pp_rank == r), default=0.0)
        if makespan_s - end > 1e-15:
            out.append(Interval(pp_rank=r, kind="bubble", start_s=end, end_s=makespan_s))
    return out
