"""The search driver: enumerate outer candidates best-first by lower bound, solve each ILP, keep the top k.

:func:`plan_search` is the entry point. Branch-and-bound over the outer choices: every candidate gets a
lower bound (:func:`planner.search.space.lower_bound_s`); candidates are solved in increasing bound order
and the loop stops once the next bound cannot beat the best plan found (the k-th with
``exhaustive_top_k``). Inside each ILP that incumbent is CBC's cutoff, so a candidate that cannot matter
is pruned inside CBC as soon as its own bound shows it; the search is optimal unless a candidate was left
with a proven floor below the best plan (then the status and gap say so). Runners-up are the best other
candidates solved on the way (proven the k best only with ``exhaustive_top_k``). Each ILP answer is
re-evaluated with ``planner.cost.estimate`` and must agree to 1e-9 relative — that is what "exact under our
cost model" means here.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

from planner.core import StratagemError
from planner.cost import (
    Estimate,
    MemorySemantics,
    ParallelConfig,
    block_count,
    check_context,
    cp_degrees,
    require_all_to_all,
    with_gpus,
)
from planner.profile import ClusterProfile, ModelProfile
from planner.search.config import SearchConfig
from planner.search.costs import CandidateCosts
from planner.search.ilp import SolveResult, build_problem, extract_assignment, solve
from planner.search.layer_options import LayerCostCache
from planner.search.pins import apply_pins, check_pins_left_some
from planner.search.space import (
    OuterChoice,
    OuterShape,
    devices_by_type,
    enumerate_outer,
    enumerate_shapes,
    replica_type_choices,
    expand_experts,
    lower_bound_s,
    memory_shortfall_bytes,
    refined_lower_bound_s,
)
from planner.search.tables import Assignment, Tables, dominates, evaluate

log = logging.getLogger(__name__)

EXACT_REL_TOL = 1e-9  # ILP objective (at its integer solution) vs planner.cost.estimate
SOLVER_REL_TOL = 1e-6  # CBC's reported objective vs the same solution evaluated exactly
# first attempt without cuts, limited by branch-and-bound nodes rather than time so that every run takes the
# same path (the same plan and status on a loaded or a fast machine); most candidates are settled well within it
QUICK_SOLVE_NODES = 200


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One solved outer candidate: its choices, the ILP's assignment and the cost model's verdict."""

    outer: OuterChoice
    assignment: Assignment
    step_s: float
    estimate: Estimate
    config: ParallelConfig
    solve: SolveResult


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """Best plan, runners-up (best first), and the search record's figures."""

    best: Candidate
    ranked: tuple[Candidate, ...]
    status: str
    gap: float
    candidates_total: int
    candidates_solved: int
    candidates_pruned: int
    candidates_infeasible: int
    candidates_dominated: int
    wall_time_s: float
    notes: str = ""
    candidates_cut_off: int = 0
    runners_up_proven: bool = False  # exhaustive_top_k and every ranked plan proven (the k best candidates)
    solver_warnings: tuple[str, ...] = ()  # "<CBC log line> (N solves)": each such answer was re-solved
    dropped: tuple[tuple[str, str], ...] = ()  # (candidate, why): the cost model could not price it; not searched
    memory_margin: float = 0.1  # 1 - SearchConfig.memory_fraction: the share of device memory kept free
    memory_semantics: MemorySemantics = "fsdp2"  # SearchConfig.memory_semantics: whose memory the plan is priced for


def check_exact(
    tables: Tables,
    assignment: Assignment,
    est,
    outer: OuterChoice,
    problem_obj_s: float | None = None,
    optimal: bool = True,
) -> float:
    """The ILP's objective and memory at ``assignment`` (closed form) must equal ``planner.cost.estimate``
    to 1e-9 relative; CBC's own objective value must agree to its tolerance. Returns the step time."""
    ev = evaluate(tables, assignment)
    estimated_s = est.step_time_s
    if abs(ev.step_s - estimated_s) > EXACT_REL_TOL * estimated_s:
        raise RuntimeError(
            f"ILP tables disagree with planner.cost.estimate for {outer.summary()}: "
            f"{ev.step_s!r} vs {estimated_s!r} s; the search's cost decomposition is stale"
        )
    ranks = [rk for t in est.per_replica_type for rk in t.per_rank] if est.per_replica_type else est.per_rank
    if len(ranks) != len(ev.rank_mem_bytes):
        raise RuntimeError(
            f"ILP tables have {len(ev.rank_mem_bytes)} ranks, planner.cost.estimate {len(ranks)} for {outer.summary()}"
        )
    for r, (mine, rank) in enumerate(zip(ev.rank_mem_bytes, ranks)):
        if abs(mine - rank.memory.peak_bytes) > EXACT_REL_TOL * rank.memory.peak_bytes:
            raise RuntimeError(
                f"ILP memory of pp rank {r} ({mine!r} B) disagrees with planner.cost.estimate "
                f"({rank.memory.peak_bytes!r} B) for {outer.summary()}"
            )
    if (
        problem_obj_s is not None
        and abs(problem_obj_s - ev.step_s) > SOLVER_REL_TOL * ev.step_s
        and (problem_obj_s < ev.step_s or optimal)
    ):  # a stopped search may leave auxiliaries above their floor
        raise RuntimeError(
            f"CBC objective {problem_obj_s!r} s differs from its own solution's value "
            f"{ev.step_s!r} s for {outer.summary()}"
        )
    return estimated_s


def _solve_candidate(
    costs: CandidateCosts,
    outer: OuterChoice,
    tables: Tables,
    config: SearchConfig,
    *,
    best_s: float = math.inf,
    fill: bool = False,
) -> tuple[Candidate | None, SolveResult]:
    """Solve one candidate's program with ``best_s`` (the step time it must beat to change the answer: the
    best plan so far, or the k-th with ``exhaustive_top_k``) as CBC's cutoff, so a candidate that cannot
    matter is pruned inside CBC as soon as its bound shows it (``fill``: no cutoff in the first attempt,
    while the list of runners-up is still short). First the plain program for QUICK_SOLVE_NODES nodes;
    only if that did not settle it and its proven bound is still below ``best_s``, the program rebuilt with
    the tightening cuts (planner.search.ilp_cuts) for the remaining time limit. A candidate stopped with
    its bound at or above ``best_s`` cannot change the answer: its solution (if any) may still be a
    runner-up, marked unproven.

    Returns (candidate or None, the solver result whose ``bound_s`` is the candidate's proven floor).
    """
    problem = build_problem(tables, cuts=False)
    result = solve(problem, config, cutoff_s=math.inf if fill else best_s, max_nodes=QUICK_SOLVE_NODES)
    if result.status in ("time_limit", "feasible", "within_gap") and result.bound_s < best_s:
        second_problem = build_problem(tables, cuts=True)
        left_s = max(config.time_limit_s - result.wall_time_s, 1.0)
        second = solve(second_problem, replace(config, time_limit_s=left_s), cutoff_s=best_s)
        if second.objective_s is not None and (result.objective_s is None or second.objective_s <= result.objective_s):
            problem, result = second_problem, second
        else:  # nothing better than the best plan (or than the quick solution): keep the quick one
            bound = max(result.bound_s, second.bound_s)
            if result.objective_s is None:
                result = replace(second, bound_s=bound)
            else:
                gap = max(0.0, (result.objective_s - bound) / result.objective_s)
                result = replace(
                    result,
                    bound_s=bound,
                    gap=gap,
                    wall_time_s=result.wall_time_s + second.wall_time_s,
                    warnings=tuple(dict.fromkeys(result.warnings + second.warnings)),
                )
    if result.objective_s is None:
        return None, result
    assignment = extract_assignment(problem)
    pconfig = costs.parallel_config(outer, tables, assignment)
    est = costs.estimate(pconfig)
    step_s = check_exact(tables, assignment, est, outer, result.objective_s, result.status == "optimal")
    return Candidate(
        outer=outer, assignment=assignment, step_s=step_s, estimate=est, config=pconfig, solve=result
    ), result


def _quick_bounded(
    costs: CandidateCosts, outers: Sequence[OuterChoice | OuterShape], dropped: list[tuple[str, str]]
) -> list[tuple]:
    """Heap entries (bound, index, stage 0, outer or shape, None) with the cheap layer-time bound (a shape's:
    ``CandidateCosts.shape_bound_s``, its candidates bounded when it comes up); candidates the cost model rejects
    (e.g. a missing collective fit) are dropped and listed in ``dropped`` with the reason (a shape it cannot
    bound as one gets bound 0, so that each of its candidates is tried)."""
    entries: list[tuple] = []
    for idx, outer in enumerate(outers):
        if isinstance(outer, OuterShape):
            try:
                bound = costs.shape_bound_s(outer)
            except StratagemError:
                bound = 0.0
            entries.append((bound, idx, 0, outer, None))
            continue
        try:
            entries.append((costs.quick_bound_s(outer), idx, 0, outer, None))
        except StratagemError as exc:
            _drop(dropped, outer, exc)
    return entries


def _drop(dropped: list[tuple[str, str]], outer: OuterChoice, exc: StratagemError) -> None:
    log.debug("skipping %s: %s", outer.summary(), exc)
    dropped.append((outer.summary(), str(exc).splitlines()[0]))


class _State:
    """What the search has learnt: the ranked plans, counters, and floors of unsettled candidates."""

    def __init__(self, keep: int):
        self.keep = keep
        self.ranked: list[Candidate] = []
        self.tables_of: dict[int, Tables] = {}
        self.counts = dict(solved=0, infeasible=0, dominated=0, refined=0, cut_off=0)
        self.open_bounds: list[tuple[float, str]] = []  # (proven floor, status) of unsettled candidates
        self.warnings: dict[str, int] = {}  # CBC tolerance warning -> solves that logged it

    def record(self, out: Candidate | None, result: SolveResult, *, bound: float, tables: Tables) -> None:
        for w in result.warnings:
            self.warnings[w] = self.warnings.get(w, 0) + 1
        if result.status == "cut_off":
            self.counts["cut_off"] += 1
        elif result.status == "infeasible":
            self.counts["infeasible"] += 1
        elif result.status != "optimal":
            self.open_bounds.append((max(bound, result.bound_s), result.status))
        if out is None:
            return
        # keep alternatives distinct: drop a ranked plan the new one dominates and is no slower than (a
        # stopped solve may have found worse than its candidate's optimum: then the ranked plan stays)
        ranked = [c for c in self.ranked if not (out.step_s <= c.step_s and dominates(tables, self.tables_of[id(c)]))]
        self.tables_of[id(out)] = tables
        self.ranked = sorted([*ranked, out], key=lambda c: c.step_s)[: self.keep]


def _key(outer: OuterChoice) -> tuple:
    return (
        outer.tp,
        outer.pp,
        outer.dp,
        outer.micro_batch,
        outer.virtual_stages,
        outer.sequence_parallel,
        outer.rank_node_types,
        outer.replica_node_types,
        outer.replica_micro_batches,
        outer.cp,
        outer.context_parallel,
    )


def _dominated(tables: Tables, outer: OuterChoice, others: dict) -> bool:
    """True when a candidate in ``others`` (tables by :func:`_key`: built, or solved) with the same degrees and
    micro-batching has the same time terms and no more memory in every term (ZeRO-1 vs ZeRO-2, GPipe vs 1F1B): its
    optimum is at least as good."""
    key = _key(outer)
    return any(dominates(other, tables) for other in others.get(key, ()))


def _no_plan_error(shortfall_bytes: float, gpus: int) -> StratagemError:
    fix = (
        "use more GPUs, allow per-layer recompute and ZeRO-3 (--allow recompute,zero), or a smaller "
        "micro-batch / sequence length"
    )
    if not math.isfinite(shortfall_bytes):
        return StratagemError(
            f"no plan fits in memory on {gpus} devices: every candidate overflows some "
            f"pipeline rank once its layers are placed; {fix}"
        )
    gib = shortfall_bytes / 2**30
    return StratagemError(
        f"no plan fits in memory on {gpus} devices: the leanest candidate is still {gib:.2f} GiB "
        f"({shortfall_bytes:.0f} bytes) short; {fix}"
    )


def _global_status(best_s: float, open_bounds: list[tuple[float, str]]) -> tuple[str, float]:
    """Optimal unless some unsettled candidate's proven floor is below the best plan's step time; then the
    status of the weakest such candidate and the gap of the best plan to the lowest floor."""
    below = [(b, st) for b, st in open_bounds if b < best_s * (1 - 1e-12)]
    if not below:
        return "optimal", 0.0
    floor, status = min(below, key=lambda x: x[0])
    return status, (best_s - floor) / best_s if math.isfinite(floor) else math.inf


def plan_search(
    profile: ModelProfile,
    cluster: ClusterProfile,
    *,
    gpus: int,
    global_batch: int,
    config: SearchConfig,
    progress: Callable[[int, int], None] | None = None,
    shared: LayerCostCache | None = None,
) -> SearchResult:
    """Find the fastest plan under the cost model for ``gpus`` devices and a fixed global batch.

    ``progress(done, total)`` is called as candidates are bounded and solved (for a CLI progress bar).
    ``shared``: layer costs kept across searches (several device counts of one model and cluster); the answer
    does not depend on it.
    Raises :class:`StratagemError` when nothing fits, naming the smallest memory shortfall.

    Steps: enumerate the outer candidates (:func:`_enumerate`), branch and bound over them best-first
    (:class:`_BranchAndBound`: build and bound, refine, solve), then the result and its proof status
    (:meth:`_BranchAndBound.result`).
    """
    start = time.perf_counter()
    cluster = with_gpus(cluster, gpus)
    costs = CandidateCosts(profile, cluster, global_batch=global_batch, config=config, shared=shared)
    outers = _enumerate(profile, cluster, gpus=gpus, global_batch=global_batch, config=config)
    search = _BranchAndBound(costs, outers, config, start=start, progress=progress)
    search.run()
    result = search.result(gpus)
    if config.cp is None and config.allows("cp") and 1 < profile.seq_len < config.cp_min_seq_len:
        note = (
            f"context parallelism not searched: {profile.seq_len} tokens < {config.cp_min_seq_len} "
            f"(--cp N plans a fixed degree, --cp-min-seq lowers the threshold)"
        )
        result = replace(result, notes=f"{result.notes} {note}.".strip())
    return result


def searched_cp_degrees(profile: ModelProfile, gpus: int, config: SearchConfig) -> tuple[int, ...]:
    """The cp degrees the search tries: ``config.cp`` alone when fixed (checked against the model and the
    sequence), else 1 and, for sequences of at least ``config.cp_min_seq_len`` tokens, every cp the model,
    sequence and device count allow (``planner.cost.context.cp_degrees``)."""
    if config.cp is not None:
        check_context(profile, config.cp, "allgather")
        return (config.cp,)
    if not config.allows("cp") or profile.seq_len < config.cp_min_seq_len:
        return (1,)
    return cp_degrees(profile, gpus)


def _cp_degrees(profile: ModelProfile, gpus: int, config: SearchConfig, experts: int) -> tuple[int, ...]:
    """:func:`searched_cp_degrees`; 1 for Mixture-of-Experts models, whose context parallelism neither the cost
    model (planner.cost.moe prices a whole sequence per rank) nor the runtime implements yet."""
    if not experts:
        return searched_cp_degrees(profile, gpus, config)
    if config.cp not in (None, 1):
        raise StratagemError(
            f"context parallelism (cp={config.cp}) is not supported for Mixture-of-Experts models yet; drop --cp"
        )
    return (1,)


def _enumerate(
    profile: ModelProfile, cluster: ClusterProfile, *, gpus: int, global_batch: int, config: SearchConfig
) -> list[OuterChoice | OuterShape]:
    """Every outer candidate, grouped into shapes (``space.OuterShape``) unless choices are pinned; a one-line
    error when the batch cannot be split at all (or, for a Mixture-of-Experts model, when the cluster profile has
    no all-to-all figures)."""
    experts = next((layer.experts.experts for layer in profile.layers if layer.experts is not None), 0)
    if experts and config.allows("ep"):
        require_all_to_all(cluster, sorted(devices_by_type(cluster, gpus)))
    where: dict[str, Any] = dict(
        cluster=cluster,
        gpus=gpus,
        global_batch=global_batch,
        n_layers=len(profile.layers),
        n_blocks=block_count(profile),
        tp_degrees=profile.tp_degrees,
        config=config,
        experts=experts,
    )
    outers: list[OuterChoice | OuterShape]
    if config.pins:
        every = list(enumerate_outer(**where, cp_degrees=_cp_degrees(profile, gpus, config, experts), families=True))
        outers = list(apply_pins(every, dict(config.pins))) if every else []
        if every:
            check_pins_left_some(every, outers, dict(config.pins))  # type: ignore[arg-type]
    else:
        outers = [*enumerate_shapes(**where, cp_degrees=_cp_degrees(profile, gpus, config, experts))]
        outers += replica_type_choices(**where)
    if not outers:
        raise StratagemError(
            f"no way to split global batch {global_batch} over {gpus} devices with "
            f"the allowed dimensions; pick a global batch divisible by a dp degree or "
            f"allow more (--allow tp,pp,dp)"
        )
    return outers


class _BranchAndBound:
    """Best-first branch and bound over outer candidates. Heap entries (bound, index, stage, outer, tables):
    stage 0 has the quick bound, stage 1 the bound with tables (sends, tail, memory), stage 2 the refined
    bound; a stage-2 entry at the top is solved. The loop ends when the top bound cannot beat the best plan
    (the k-th with ``exhaustive_top_k``), or the budget runs out."""

    def __init__(
        self,
        costs: CandidateCosts,
        outers: Sequence[OuterChoice | OuterShape],
        config: SearchConfig,
        *,
        start: float,
        progress: Callable[[int, int], None] | None,
    ):
        self.costs, self.outers, self.config, self.start, self.progress = costs, outers, config, start, progress
        # families and shapes count their members
        self.n_candidates = sum(o.size if isinstance(o, OuterShape) else len(o.expert_family) or 1 for o in outers)
        self.next_idx = len(outers)  # heap tie-breakers of expanded family members
        self.dropped: list[tuple[str, str]] = []  # candidates the cost model could not price (never searched)
        self.heap = _quick_bounded(costs, outers, self.dropped)
        heapq.heapify(self.heap)
        self.total = len(self.heap)
        self.keep = max(1, config.top_k)
        self.need = self.keep if config.exhaustive_top_k else 1
        self.state = _State(keep=self.keep)
        self.solved_tables: dict[tuple, list[Tables]] = {}
        self.built_tables: dict[tuple, list[Tables]] = {}  # tables of candidates that fit, by _key
        self.base_s: dict[int, float] = {}  # heap index -> lower_bound_s of its tables (stage 1 to stage 2)
        self.shortfall, self.notes = math.inf, ""
        self.pool = ThreadPoolExecutor(max_workers=config.jobs) if config.jobs > 1 else None
        self.pending: dict[Future, tuple[float, OuterChoice, Tables]] = {}

    def must_beat(self) -> float:
        """What a candidate must beat to change the proven answer: the best plan, or with exhaustive_top_k
        the k-th (then the runners-up are proven too)."""
        ranked = self.state.ranked
        return ranked[self.need - 1].step_s if len(ranked) >= self.need else math.inf

    def run(self) -> None:
        try:
            while self.heap:
                entry = heapq.heappop(self.heap)
                if self.progress:
                    self.progress(self.total - len(self.heap), self.total)
                if entry[0] >= self.must_beat():
                    break  # best-first: nothing left can beat the best (or enter the top k)
                step = (self._build, self._refine, self._solve)[entry[2]]
                if not step(*entry):
                    break
            while self.pending:
                self._settle(block=True)
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)

    def _build(self, bound: float, idx: int, _stage: int, outer: OuterChoice, _tables: None) -> bool:
        """Stage 0: build the coefficients, bound with sends, tail and memory (a shape, or a family of expert
        layouts, is expanded into its members first, each with its own quick bound)."""
        if isinstance(outer, OuterShape) or outer.expert_family:
            members = outer.members(families=True) if isinstance(outer, OuterShape) else expand_experts(outer)
            for child in members:
                try:
                    child_bound = self.costs.quick_bound_s(child)
                except StratagemError as exc:
                    _drop(self.dropped, child, exc)
                    continue
                self.next_idx += 1
                heapq.heappush(self.heap, (max(bound, child_bound), self.next_idx, 0, child, None))
            return True
        try:
            tables = self.costs.tables(outer)
        except StratagemError as exc:
            _drop(self.dropped, outer, exc)
            return True
        short = memory_shortfall_bytes(tables)
        if short > 0:
            self.shortfall = min(self.shortfall, short)
            self.state.counts["infeasible"] += 1
            return True
        # a candidate whose tables an earlier one's dominate (same time terms, no less memory: ZeRO-2 after an
        # equal ZeRO-1) cannot beat it: its optimum is no lower than that one's, and however that one is settled
        # (solved, stopped with a proven floor, pruned by its bound, cut off, found not to fit) the floor it leaves
        # is no higher than this one's optimum
        if _dominated(tables, outer, self.built_tables):
            self.state.counts["dominated"] += 1
            return True
        self.built_tables.setdefault(_key(outer), []).append(tables)
        base = lower_bound_s(tables)
        self.base_s[idx] = base  # the refined bound adds to it (refined_lower_bound_s)
        heapq.heappush(self.heap, (max(bound, base), idx, 1, outer, tables))
        return True

    def _refine(self, bound: float, idx: int, _stage: int, outer: OuterChoice, tables: Tables) -> bool:
        """Stage 1: tighten with the memory-aware block floor."""
        self.state.counts["refined"] += 1
        tighter = refined_lower_bound_s(tables, self.base_s.pop(idx, None))
        if math.isfinite(tighter):
            heapq.heappush(self.heap, (max(bound, tighter), idx, 2, outer, tables))
        else:
            self.state.counts["infeasible"] += 1
        return True

    def _solve(self, bound: float, _idx: int, _stage: int, outer: OuterChoice, tables: Tables) -> bool:
        """Stage 2: solve the candidate's ILP (in the pool with ``--jobs``); False ends the search."""
        if self.pool is not None:
            self._settle(block=len(self.pending) >= self.config.jobs)
            if bound >= self.must_beat():
                return False
        if _dominated(tables, outer, self.solved_tables):
            self.state.counts["dominated"] += 1
            return True
        if time.perf_counter() - self.start > self.config.budget_s:
            # every unexplored candidate is >= bound: the best found is within this gap of the optimum
            self.notes = (
                f"the search budget of {self.config.budget_s:g} s ran out: the plan is the best found so "
                f"far, within the stated gap of the optimum (raise --budget-s to prove more)"
            )
            self.state.open_bounds.append((bound, "feasible"))
            return False
        self.state.counts["solved"] += 1
        self.solved_tables.setdefault(_key(outer), []).append(tables)
        best_s, fill = self.must_beat(), len(self.state.ranked) < self.keep
        # a solve may not outlive the budget by more than a second: its time limit is what is left of it (a
        # stopped solve keeps its proven bound, so the stated gap stays valid)
        left_s = self.config.budget_s - (time.perf_counter() - self.start)
        config = replace(self.config, time_limit_s=min(self.config.time_limit_s, max(left_s, 1.0)))
        if self.pool is None:
            out = _solve_candidate(self.costs, outer, tables, config, best_s=best_s, fill=fill)
            self.state.record(*out, bound=bound, tables=tables)
        else:
            future = self.pool.submit(_solve_candidate, self.costs, outer, tables, config, best_s=best_s, fill=fill)
            self.pending[future] = (bound, outer, tables)
        return True

    def _settle(self, block: bool) -> None:
        """Record finished parallel solves (wait for one when ``block``)."""
        if block:
            done = wait(list(self.pending), return_when=FIRST_COMPLETED).done
        else:
            done = {f for f in self.pending if f.done()}
        for fut in done:
            bound, _outer, tables = self.pending.pop(fut)
            self.state.record(*fut.result(), bound=bound, tables=tables)

    def result(self, gpus: int) -> SearchResult:
        """The ranked plans with the proof status; one-line errors when nothing was found."""
        state, config = self.state, self.config
        ranked, counts, open_bounds = state.ranked, state.counts, state.open_bounds
        if self.progress:
            self.progress(self.total, self.total)
        if not ranked and self.notes:
            raise StratagemError(
                f"the search budget of {config.budget_s:g} s ran out before any candidate was "
                f"solved ({counts['refined']} of {self.n_candidates} candidates bounded); raise "
                f"--budget-s (e.g. --budget-s {max(60.0, 10 * config.budget_s):g})"
            )
        if not ranked and self.dropped:  # the candidates the cost model could not price are the likelier cause
            raise StratagemError(
                f"no plan on {gpus} devices: {len(self.dropped)} candidate(s) could not be priced and were not "
                f"searched ({self.dropped[0][1]}); no candidate that could be priced fits in memory"
            )
        if not ranked:
            raise _no_plan_error(self.shortfall, gpus)
        status, gap = _global_status(ranked[0].step_s, open_bounds)
        runners_up_proven = (
            config.exhaustive_top_k
            and status == "optimal"
            and all(c.solve.status == "optimal" for c in ranked)
            and _global_status(ranked[-1].step_s, open_bounds)[0] == "optimal"
        )
        log.info("search: %d candidates, %s", self.n_candidates, counts)
        return SearchResult(
            best=ranked[0],
            ranked=tuple(ranked),
            status=status,
            gap=gap,
            candidates_total=self.n_candidates,
            candidates_solved=counts["solved"],
            candidates_pruned=self.n_candidates - counts["solved"],
            candidates_infeasible=counts["infeasible"],
            candidates_dominated=counts["dominated"],
            wall_time_s=time.perf_counter() - self.start,
            notes=self.notes,
            dropped=tuple(self.dropped),
            candidates_cut_off=counts["cut_off"],
            runners_up_proven=runners_up_proven,
            solver_warnings=tuple(f"{w} ({k} solves)" for w, k in state.warnings.items()),
            memory_margin=round(1.0 - config.memory_fraction, 12),
            memory_semantics=config.memory_semantics,
        )


FALLBACK_PEAK_SHRINK = 0.8  # a fallback plan's fullest device holds at most this share of the best plan's
FALLBACK_MIN_BUDGET_S = 2.0  # the fallback search's budget: half the main search's time, at least this


def _fullest(est) -> float:
    """The largest predicted peak / device memory over every rank of an estimate."""
    ranks = [rk for t in est.per_replica_type for rk in t.per_rank] if est.per_replica_type else est.per_rank
    return max(rk.memory.peak_bytes / rk.memory.capacity for rk in ranks)


def fallback_candidate(
    profile: ModelProfile,
    cluster: ClusterProfile,
    result: SearchResult,
    *,
    gpus: int,
    global_batch: int,
    config: SearchConfig,
    shrink: float = FALLBACK_PEAK_SHRINK,
) -> Candidate | None:
    """The fastest plan whose fullest device is predicted at most ``shrink`` x as full as the best plan's: what
    ``stratagem launch`` moves to if the best plan runs out of memory. None when a runner-up of ``result``
    already has that headroom, or when no plan has it (a second search, with that memory budget, given half as long
    as the main search took and at least ``FALLBACK_MIN_BUDGET_S``: past it, the fastest found so far)."""
    limit = shrink * _fullest(result.best.estimate)
    if any(_fullest(c.estimate) <= limit for c in result.ranked[1:]):
        return None
    try:
        found = plan_search(
            profile,
            cluster,
            gpus=gpus,
            global_batch=global_batch,
            config=replace(
                config,
                memory_fraction=min(limit, config.memory_fraction),
                top_k=1,
                exhaustive_top_k=False,
                budget_s=min(config.budget_s, max(FALLBACK_MIN_BUDGET_S, result.wall_time_s / 2)),
            ),
        )
    except StratagemError:
        return None
    return found.best
