"""Turn a :class:`planner.search.planner.SearchResult` into a versioned :class:`planner.plan.schema.Plan`.

Rank layout (``planner/plan/schema.py``): mesh axes ``pp, dp, tp`` row-major, last axis fastest, so global rank
``(p * dp + d) * tp + t`` and tp groups are contiguous ranks (inside a node when tp <= devices per node).
With dp replicas on different node types the axes are ``dp, pp, tp`` (rank ``(d * pp + p) * tp + t``):
replica ``d`` is the ``d``-th block of ``pp * tp`` ranks, i.e. on the node type the search gave it.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import replace

import pulp

from planner import __version__
from planner.core import ParallelDims
from planner.cost import with_gpus
from planner.model import ModelSpec
from planner.plan import (
    Alternative,
    ExpertLayout,
    LayerLayout,
    Mesh,
    Plan,
    SearchRecord,
    Stage,
    TrainingSettings,
    make_schedule,
)
from planner.profile import ClusterProfile, ModelProfile
from planner.search.planner import Candidate, SearchResult
from planner.search.space import OuterChoice


def stage_ranks(pp_rank: int, *, dp: int, tp: int, pp: int = 1, replicas_outer: bool = False) -> list[int]:
    """Global ranks of pp rank ``pp_rank`` on a row-major (pp, dp, tp) mesh, or (dp, pp, tp) when
    ``replicas_outer`` (:meth:`planner.core.ParallelDims.stage_ranks`).

    >>> stage_ranks(1, dp=2, tp=2)
    [4, 5, 6, 7]
    >>> stage_ranks(1, dp=2, tp=2, pp=2, replicas_outer=True)
    [2, 3, 6, 7]
    """
    axes = ("dp", "pp", "tp") if replicas_outer else ("pp", "dp", "tp")
    # pp-outermost ranks do not depend on pp (the doctest's default pp=1 names pp rank 1); replicas outermost do
    depth = pp if replicas_outer else max(pp, pp_rank + 1)
    return ParallelDims(pp=depth, dp=dp, tp=tp, axes=axes).stage_ranks(pp_rank)


def plan_dims(outer: OuterChoice) -> ParallelDims:
    """The layout record of a searched candidate, in the plan's mesh order: replicas outermost when they run on
    different node types (each replica's pp x tp ranks together), else ``pp, dp[, cp], tp``."""
    dims = outer.parallel_dims
    return replace(dims, axes=("dp", "pp", "tp")) if outer.replica_node_types else dims


def _recompute_of(config, path: str) -> str:
    if isinstance(config.recompute, str):
        return config.recompute
    return config.recompute.get(path, "none")


def build_stages(candidate: Candidate) -> list[Stage]:
    """One :class:`Stage` per pipeline chunk, with its modules, ranks, node type and recompute modes."""
    outer, config = candidate.outer, candidate.config
    stages = []
    for s, paths in enumerate(config.stage_layers or ()):
        pp_rank = s % outer.pp
        recompute = {p: _recompute_of(config, p) for p in paths if _recompute_of(config, p) != "none"}
        stages.append(
            Stage(
                index=s,
                pp_rank=pp_rank,
                module_paths=list(paths),
                ranks=plan_dims(outer).stage_ranks(pp_rank),
                node_type=(
                    "+".join(dict.fromkeys(outer.replica_node_types))
                    if outer.replica_node_types
                    else outer.rank_node_types[pp_rank]
                ),
                recompute=recompute,
            )
        )
    return stages


def build_layout(candidate: Candidate) -> dict[str, LayerLayout]:
    """Replicate-or-split of every module (explicit for all, so the runtime never guesses)."""
    config = candidate.config
    return {
        path: LayerLayout(style=style, sequence_parallel=bool(config.sequence_parallel and style == "split"))
        for path, style in config.layout.items()
    }


def _alternative(c: Candidate, best_s: float, plan: Plan | None = None) -> Alternative:
    return Alternative(
        summary=c.outer.summary(),
        step_time_s=c.step_s,
        peak_memory_bytes=float(c.estimate.to_predictions().peak_memory_bytes),
        slowdown=c.step_s / best_s,
        choices=c.outer.choices(),
        proven_optimal=c.solve.status == "optimal",
        plan=plan,
    )


def dropped_note(dropped) -> str:
    """Every candidate the cost model could not price, grouped by reason: they were not searched."""
    by_reason: dict[str, list[str]] = {}
    for summary, reason in dropped:
        by_reason.setdefault(reason, []).append(summary)
    parts = [f"{reason} ({len(names)}: {', '.join(names)})" for reason, names in by_reason.items()]
    return f"{len(dropped)} candidates dropped unsearched because the cost model could not price them: " + "; ".join(
        parts
    )


def build_search_record(result: SearchResult, runners_up: list[Plan] | None = None) -> SearchRecord:
    best_s = result.best.step_s
    # step times are >= 0, so 0 is always a valid bound: a relative gap never exceeds 1 (JSON has no inf)
    gap = min(result.gap, 1.0)
    proven = (
        "the best is proven optimal under the cost model"
        if result.status == "optimal"
        else f"NOT proven optimal ({result.status}): the best is within {gap:.2%} of the optimum"
        + (" (no bound was proven)" if not math.isfinite(result.gap) else "")
    )
    if result.dropped:
        proven += f" over the candidates searched; {dropped_note(result.dropped)}"
    return SearchRecord(
        solver=f"CBC via PuLP {pulp.__version__} (branch-and-bound over outer choices)",
        status=result.status,
        gap=gap,
        wall_time_s=result.wall_time_s,
        candidates_solved=result.candidates_solved,
        candidates_pruned=result.candidates_pruned,
        top_k=[_alternative(c, best_s, runners_up[i] if runners_up else None) for i, c in enumerate(result.ranked[1:])],
        memory_margin=result.memory_margin,
        memory_semantics=result.memory_semantics,
        notes=(
            f"{result.candidates_total} outer candidates; {result.candidates_infeasible} infeasible (memory), "
            f"{result.candidates_dominated} dominated (same time, no less memory than another candidate), "
            f"{result.candidates_cut_off} cut off inside CBC (cannot beat the best); {proven}; "
            + (
                "runners-up are proven the next best candidates (--prove-top-k). "
                if result.runners_up_proven
                else "runners-up are the best other candidates solved while proving the best. "
            )
            + (
                "CBC logged " + "; ".join(result.solver_warnings) + ", each answer re-solved without "
                "preprocessing and the second answer used. "
                if result.solver_warnings
                else ""
            )
            + result.notes
        ).strip(),
    )


def build_plan(
    result: SearchResult,
    *,
    model: ModelSpec,
    profile: ModelProfile,
    cluster: ClusterProfile,
    training: TrainingSettings,
    fallback: Candidate | None = None,
) -> Plan:
    """The plan file for the best candidate of ``result`` (predictions from ``Estimate.to_predictions``), each
    runner-up in its search record as a complete plan too (what ``stratagem launch`` moves to on an OOM);
    ``fallback`` (``planner.search.planner.fallback_candidate``) is added after the runners-up."""
    if fallback is not None:
        result = replace(result, ranked=(*result.ranked, fallback))
    runners_up = [
        candidate_plan(c, model=model, profile=profile, cluster=cluster, training=training) for c in result.ranked[1:]
    ]
    best = candidate_plan(result.best, model=model, profile=profile, cluster=cluster, training=training)
    return best.model_copy(
        update={"search": _with_calibration(build_search_record(result, runners_up), cluster, best.world_size)}
    )


def candidate_plan(
    best: Candidate,
    *,
    model: ModelSpec,
    profile: ModelProfile,
    cluster: ClusterProfile,
    training: TrainingSettings,
) -> Plan:
    """The plan of one solved candidate, without a search record."""
    outer = best.outer
    mesh = Mesh.of(plan_dims(outer))
    return Plan(
        planner_version=__version__,
        created_utc=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        model=model,
        model_profile_hash=profile.content_hash,
        cluster_name=cluster.name,
        cluster_hash=cluster.content_hash,
        training=training,
        mesh=mesh,
        context_parallel=outer.context_parallel if outer.cp > 1 else None,
        flash_attention=best.config.flash_attention,
        schedule=make_schedule(
            outer.schedule,
            micro_batch_size=outer.micro_batch,
            global_batch=training.global_batch,
            dp=outer.dp,
            num_micro_batches=outer.num_micro_batches,
            shares=list(best.config.batch_shares) if best.config.batch_shares else None,
            virtual_stages=outer.virtual_stages,
        ),
        stages=build_stages(best),
        layout=build_layout(best),
        zero_stage=outer.zero_stage,
        batch_shares=list(best.config.batch_shares) if best.config.batch_shares else None,
        replica_node_types=list(outer.replica_node_types) if outer.replica_node_types else None,
        experts=_expert_layout(profile, outer.ep, outer.etp, best.config.moe_load_imbalance),
        predictions=best.estimate.to_predictions(),
    )


def _expert_layout(profile: ModelProfile, ep: int, etp: int, load_imbalance: float) -> ExpertLayout | None:
    """The plan's expert layout: every zoo ``moe`` plan carries one (ep 1 included); None when dense, and for an
    ``hf:`` MoE at ep = etp = 1 (its fused experts then run replicated, as transformers has them)."""
    experts = next((layer.experts for layer in profile.layers if layer.experts is not None), None)
    if experts is None or (not profile.model.is_moe and ep * etp == 1):
        return None
    return ExpertLayout(ep=ep, etp=etp, capacity_factor=experts.capacity_factor, load_imbalance=load_imbalance)


def _with_calibration(record: SearchRecord, cluster: ClusterProfile, gpus: int) -> SearchRecord:
    """The record with the cluster's calibration and fabric load (at the plan's ``gpus``) named first in
    its notes (``stratagem show`` prints them)."""
    notes = [f"cluster {note}." for note in (cluster.calibration_note(),) if note]
    if cluster.fabric_load is not None:
        notes.append(with_gpus(cluster, gpus).fabric_note() + ".")
    return record.model_copy(update={"notes": " ".join([*notes, record.notes])}) if notes else record
