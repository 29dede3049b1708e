"""The plan file: what the search chose, what it predicts, and how it was found.

A plan is plain data the runtime executes as written. Vocabulary: an *axis* is a DeviceMesh axis
(``pp``, ``dp``, ``cp``, ``tp``); a *dim* is a tensor dimension. Ranks are laid out on the mesh in the order of
``mesh.axes`` (row-major, last axis fastest), so tp groups are contiguous ranks, i.e. inside a node; a
context-parallel plan uses ``pp, dp, cp, tp`` (the cp group: ``cp`` ranks ``tp`` apart).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from planner.core import (
    MESH_AXES,
    ContextMode,
    MeshAxis,
    Dtype,
    ParallelDims,
    Recompute,
    ScheduleKind,
    StratagemError,
    TPStyle,
    content_hash,
    read_json,
    save_document,
    validate_document,
)
from planner.model import ModelSpec
from planner.plan.comparison import ComparisonRecord
from planner.plan.recipe import LRSchedule
from planner.profile import StrictModel

PLAN_SCHEMA_VERSION: Final = 3
# version 2: schedule.micro_batches_per_replica (integers); version 3: it is the only micro-batch count (the
# overloaded schedule.num_micro_batches is gone; Schedule.max_micro_batches reads the busiest replica's).
# Older files are migrated on load (migrate_v1, migrate_v2).


class TrainingSettings(StrictModel):
    """The training maths the planner must not change."""

    global_batch: int = Field(ge=1, description="samples per optimizer step")
    seq_len: int = Field(ge=1, description="tokens per sample (1 for non-sequence models)")
    dtype: Dtype = Field(description="compute dtype (mixed precision keeps fp32 master weights)")
    optimizer: Literal["adamw"] = "adamw"
    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    seed: int = Field(0, ge=0)
    lr_schedule: LRSchedule | None = Field(
        None, description="Goyal et al. 2017 large-batch recipe (planner/plan/recipe.py); None = constant lr"
    )


class Mesh(StrictModel):
    """DeviceMesh axes and sizes, outermost first."""

    axes: list[MeshAxis] = Field(
        ["pp", "dp", "tp"],
        description="'sd': the spatial group of 3D CNN plans (spatial parallelism); 'cp': the context-parallel "
        "group (the sequence split, planner/cost/context.py)",
    )
    sizes: list[PositiveInt]

    @model_validator(mode="after")
    def _check(self) -> "Mesh":
        if len(self.sizes) != len(self.axes) or len(set(self.axes)) != len(self.axes):
            raise ValueError(f"mesh needs one size per distinct axis, got axes {self.axes} and sizes {self.sizes}")
        return self

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def size(self, axis: str) -> int:
        return self.sizes[self.axes.index(axis)] if axis in self.axes else 1

    @classmethod
    def of(cls, dims: ParallelDims) -> "Mesh":
        """The mesh of a layout record: its axes in its order, with their degrees."""
        return cls(axes=list(dims.axes), sizes=[dims.size(a) for a in dims.axes])

    @property
    def parallel_dims(self) -> ParallelDims:
        """The mesh's degrees and order as the one layout record (no expert split: see :attr:`Plan.parallel_dims`)."""
        return ParallelDims(**{a: self.size(a) for a in self.axes}, axes=tuple(self.axes))


class Schedule(StrictModel):
    """Pipeline schedule and micro-batching.

    ``micro_batch_size`` samples per micro-batch on every dp replica. ``micro_batches_per_replica`` holds,
    as integers, how many micro-batches each dp replica runs per step, in dp order: derived once, by
    :func:`make_schedule` (the batch split of :func:`split_counts`), carried by every plan file, never re-derived
    by its readers.
    """

    kind: ScheduleKind
    micro_batch_size: int = Field(ge=1)
    virtual_stages: int = Field(1, ge=1, description="model chunks per pp rank (interleaved 1F1B)")
    micro_batches_per_replica: list[PositiveInt] = Field(
        min_length=1, description="micro-batches each dp replica runs per step, in dp order"
    )

    @property
    def max_micro_batches(self) -> int:
        """The busiest replica's micro-batches per step: its pipeline length (all equal without batch shares)."""
        return max(self.micro_batches_per_replica)


def make_schedule(
    kind: ScheduleKind,
    *,
    micro_batch_size: int,
    global_batch: int,
    dp: int,
    num_micro_batches: int,
    shares: list[float] | None = None,
    virtual_stages: int = 1,
) -> Schedule:
    """A schedule with its per-replica counts: ``num_micro_batches`` on every replica for an even split,
    ``share_r * global_batch / micro_batch_size`` on replica ``r`` with batch shares; a split that does not
    work out keeps ``num_micro_batches`` everywhere and is rejected, with the fix, by :func:`validate`.

    >>> make_schedule("1f1b", micro_batch_size=2, global_batch=8, dp=2, num_micro_batches=3, shares=[0.75, 0.25])
    Schedule(kind='1f1b', micro_batch_size=2, virtual_stages=1, micro_batches_per_replica=[3, 1])
    """
    try:
        counts = list(
            split_counts(
                global_batch=global_batch,
                dp=dp,
                shares=shares,
                micro_batch_size=micro_batch_size,
                num_micro_batches=num_micro_batches,
            ).micro_batches
        )
    except StratagemError:
        counts = [num_micro_batches] * dp
    return Schedule(
        kind=kind, micro_batch_size=micro_batch_size, virtual_stages=virtual_stages, micro_batches_per_replica=counts
    )


class Stage(StrictModel):
    """One pipeline stage (a model chunk): its modules, where it runs, and how it is recomputed."""

    index: int = Field(ge=0, description="stage (chunk) index in model order")
    pp_rank: int = Field(ge=0, description="pp coordinate holding this chunk (index % pp for interleaving)")
    module_paths: list[str] = Field(min_length=1, description="top-level modules, in order")
    ranks: list[int] = Field(min_length=1, description="global ranks that hold this stage (dp x tp)")
    node_type: str
    recompute: dict[str, Recompute] = Field(default_factory=dict, description="per module path; absent = none")


class SpatialSplit(StrictModel):
    """A 3D CNN layer's volume split over the ``sd`` mesh axis: ``grid`` shards per (d, h, w), row-major ranks
    (``planner/cost/spatial.py``). ``dims`` lists the split dims, ``degree`` the product of the grid."""

    degree: int = Field(ge=2, description="shards (= ranks of the spatial group)")
    dims: list[Literal["d", "h", "w"]] = Field(min_length=1, description="split tensor dims of the volume")
    grid: list[PositiveInt] = Field(min_length=3, max_length=3, description="shards along d, h, w")
    reason: str = Field("", description="why the search split it (memory, or time)")

    @model_validator(mode="after")
    def _check(self) -> "SpatialSplit":
        product = self.grid[0] * self.grid[1] * self.grid[2]
        split = [d for d, g in zip("dhw", self.grid) if g > 1]
        if product != self.degree or split != list(self.dims):
            raise ValueError(f"spatial grid {self.grid} does not give degree {self.degree} over dims {self.dims}")
        return self


class LayerLayout(StrictModel):
    """Layout of one module: Whale's tensor-parallel replicate-or-split, and for 3D CNNs its spatial split."""

    style: TPStyle
    sequence_parallel: bool = False
    spatial: SpatialSplit | None = Field(None, description="volume split over the sd axis; None = unsplit")


class ExpertLayout(StrictModel):
    """How a Mixture-of-Experts model's expert layers are split ("parallel folding", Megatron-Core MoE).

    Within each pipeline stage the stage's dp x tp ranks, in rank order, are regrouped for the expert
    layers as (edp, ep, etp), row-major, etp fastest; ``edp = dp * tp / (ep * etp)``. Attention keeps
    the plan's tp. Each ep rank holds ``experts / ep`` experts, each split ``etp`` ways; expert gradients
    are all-reduced (ZeRO: reduce-scattered) over edp only. Tokens reach their experts by an all-to-all
    over the ep group, forward and backward (dispatch + combine).
    """

    ep: PositiveInt = Field(description="expert-parallel degree (experts % ep == 0)")
    etp: PositiveInt = Field(1, description="tensor parallel inside an expert (Megatron expert tensor parallel)")
    capacity_factor: PositiveFloat | None = Field(
        None, description="tokens per expert capped at cf * tokens * top_k / experts; None = dropless"
    )
    load_imbalance: float = Field(
        1.5,  # planner.core.constants.MOE_LOAD_IMBALANCE, what older plans were priced with (plan.py sits below cost)
        ge=1.0,
        description="dropless routing: the busiest ep rank's tokens over the mean the predictions assumed "
        "(plan --moe-imbalance; default the router's published fit, planner.cost.moe.default_load_imbalance); "
        "1.5 in plans written before it was recorded",
    )

    def edp(self, *, dp: int, tp: int) -> int:
        """Expert-data-parallel degree: how many copies of each expert shard a stage holds."""
        return ParallelDims(dp=dp, tp=tp, ep=self.ep, etp=self.etp).edp


def check_expert_layout(*, experts: int, ep: int, etp: int, dp: int, tp: int) -> None:
    """Reject an expert split the rank layout cannot hold, with the fix (one line).

    >>> check_expert_layout(experts=8, ep=3, etp=1, dp=6, tp=1)
    Traceback (most recent call last):
    ...
    planner.core.errors.StratagemError: 8 experts do not split over ep=3; choose ep dividing the experts (1, 2, 4, 8)
    """
    if experts % ep:
        divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        raise StratagemError(
            f"{experts} experts do not split over ep={ep}; choose ep dividing the experts ({divisors})"
        )
    ParallelDims(dp=dp, tp=tp, ep=ep, etp=etp)  # ep x etp divides dp x tp (the one place that rule is written)


def hf_routed_experts(config: dict) -> int:
    """Routed experts of an HF MoE config.json (Mixtral ``num_local_experts``, Qwen2/Qwen3-MoE ``num_experts``,
    DeepSeek-V3 ``n_routed_experts``); 0 for a dense config."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return 0


def expert_groups(ranks: list[int], *, ep: int, etp: int) -> dict[str, list[list[int]]]:
    """The ep, etp and edp process groups of one stage's ``ranks`` (dp x tp, in rank order), folded as
    (edp, ep, etp) row-major with etp fastest.

    >>> expert_groups([0, 1, 2, 3], ep=2, etp=1)["ep"]
    [[0, 1], [2, 3]]
    >>> expert_groups([0, 1, 2, 3], ep=2, etp=1)["edp"]
    [[0, 2], [1, 3]]
    """
    edp = len(ranks) // (ep * etp)

    def at(i: int, j: int, k: int) -> int:  # (edp, ep, etp) coordinates to a rank
        return ranks[(i * ep + j) * etp + k]

    return {
        "etp": [[at(i, j, k) for k in range(etp)] for i in range(edp) for j in range(ep)],
        "ep": [[at(i, j, k) for j in range(ep)] for i in range(edp) for k in range(etp)],
        "edp": [[at(i, j, k) for i in range(edp)] for j in range(ep) for k in range(etp)],
    }


class StagePrediction(StrictModel):
    stage: int = Field(ge=0)
    # terms are finite but not all >= 0: an overlap term can be a (tiny) negative correction of the cost model
    time_breakdown_s: dict[str, float] = Field(description="per micro-batch forward, backward, ... seconds")
    memory_breakdown_bytes: dict[str, NonNegativeFloat] = Field(
        description="params, grads, optimizer, activations, ..."
    )
    peak_memory_bytes: PositiveFloat  # a stage holds at least its weights
    memory_capacity_bytes: PositiveFloat


class ReplicaTypePrediction(StrictModel):
    """dp replicas of one node type (plans with ``replica_node_types``): their pipeline and memory."""

    node_type: str
    replicas: list[int] = Field(description="dp indices of the replicas of this type")
    micro_batches: int = Field(description="micro-batches each of these replicas runs per step")
    pipeline_s: float = Field(description="their pipeline time per step (formula (P) with their count)")
    stages: list[StagePrediction] = Field(min_length=1)


class Predictions(StrictModel):
    """What the cost model predicts for this plan (``stages``: the critical replica type's when replicas run
    on several node types; every type in ``per_replica_type``)."""

    step_time_s: PositiveFloat
    tokens_per_s: NonNegativeFloat
    samples_per_s: PositiveFloat
    model_tflops_per_gpu: NonNegativeFloat
    hardware_tflops_per_gpu: NonNegativeFloat
    mfu: NonNegativeFloat
    peak_memory_bytes: PositiveFloat = Field(description="max over ranks")
    breakdown_s: dict[str, float] = Field(description="step-time terms: compute, tp_comm, pp_comm, bubble, ...")
    stages: list[StagePrediction] = Field(min_length=1, description="one per stage the cost model priced")
    per_replica_type: list[ReplicaTypePrediction] = Field(default_factory=list)


class Alternative(StrictModel):
    """A runner-up plan from the search, described by its outer choices."""

    summary: str
    step_time_s: PositiveFloat
    peak_memory_bytes: PositiveFloat
    slowdown: PositiveFloat = Field(description="step_time_s / best step_time_s")
    choices: dict[str, int | float | str | bool]
    proven_optimal: bool = Field(
        True,
        description="False when this candidate's own solve was stopped early "
        "(its bound already showed it cannot beat the best plan): a better layout "
        "for the same choices may exist",
    )
    plan: Plan | None = Field(
        None,
        description="this runner-up as a complete plan (no search record of its own): what `stratagem launch` "
        "moves to when the best plan runs out of memory",
    )


class SearchRecord(StrictModel):
    solver: str
    status: Literal["optimal", "within_gap", "feasible", "time_limit", "enumerated"]
    gap: NonNegativeFloat = Field(description="proven relative optimality gap (0 = optimal)")
    wall_time_s: NonNegativeFloat
    candidates_solved: int = Field(ge=0)
    candidates_pruned: int = Field(ge=0)
    top_k: list[Alternative] = Field(default_factory=list)
    notes: str = ""
    command: list[str] | None = Field(
        None,
        description="the `stratagem plan` arguments of this search (file paths absolute, without --out): "
        "`launch --elastic` re-plans with them for another device count",
    )
    memory_margin: float = Field(
        0.1,
        ge=0,
        lt=0.9,
        description="share of each device's memory the search kept free (plan --memory-margin): a plan fits when "
        "its predicted peak is at most (1 - margin) x the device's memory",
    )
    memory_semantics: Literal["fsdp2", "textbook"] = Field(
        "fsdp2",
        description="whose memory the search priced (plan --for): 'fsdp2' as `stratagem launch`, torchtitan and "
        "Accelerate hold it (FSDP2, torch pipelining); 'textbook' as Megatron-LM and DeepSpeed do (ZeRO's states, "
        "gradients through the step, DDP buckets)",
    )


class TuneTrial(StrictModel):
    """One trial of ``stratagem tune run``: a plan launched for a few steps."""

    number: int = Field(ge=1)
    summary: str = Field(description="the configuration, one word per choice (tp2 pp1 dp1 mb4 1f1b z0 none)")
    status: Literal["ok", "oom", "timeout", "failed"]
    measured_step_time_s: PositiveFloat | None = Field(None, description="None when the trial measured no step")
    predicted_step_time_s: PositiveFloat = Field(description="on the calibration of the round that chose it")
    uncertainty_rel: NonNegativeFloat | None = Field(
        None, description="relative uncertainty of that prediction (None before any run was measured)"
    )
    predicted_peak_memory_bytes: PositiveFloat
    detail: str = ""
    repeat_of: int | None = Field(None, description="the trial whose plan this one ran again (None: a new plan)")


class TuneRecord(StrictModel):
    """How ``stratagem tune run`` chose this plan: every trial and the calibration on the measured ones."""

    trials: list[TuneTrial] = Field(min_length=1)
    stopped: bool = Field(description="True: the loop stopped itself (reason); False: it ran out of trials")
    reason: str
    calibration: dict[str, float] = Field(description="fitted cluster parameters (planner.calibrate), by name")
    calibration_note: str
    uncertainty_rel: PositiveFloat | None = Field(
        None, description="the cross-validated relative uncertainty of a prediction after the last trial"
    )
    uncertainty_source: str = ""
    measurement_noise_rel: PositiveFloat = Field(
        0.03,
        description="run-to-run noise the loop states: the largest of 3 %, the trials' median step spread and the "
        "gap between the measured best and its confirming repeat (one pair's sd of a log)",
    )


class Plan(StrictModel):
    schema_version: Literal[3] = PLAN_SCHEMA_VERSION
    planner_version: str
    created_utc: str
    model: ModelSpec
    model_profile_hash: str | None
    cluster_name: str
    cluster_hash: str | None
    training: TrainingSettings
    mesh: Mesh
    schedule: Schedule
    stages: list[Stage]
    layout: dict[str, LayerLayout] = Field(default_factory=dict, description="per module path; absent = replicate")
    zero_stage: Literal[0, 1, 2, 3] = 0
    batch_shares: list[PositiveFloat] | None = Field(
        None, description="fraction of the global batch per dp replica (None = equal); sums to 1"
    )
    context_parallel: ContextMode | None = Field(
        None,
        description="how attention exchanges K/V over the cp axis (planner/cost/context.py): all-gather "
        "(Llama 3) or ring point-to-point (Ring Attention); None when the mesh has no cp > 1",
    )
    flash_attention: bool = Field(
        False,
        description="the predictions cost attention as a fused causal flash kernel (planner.cost ParallelConfig "
        "flash_attention and causal_skip): re-estimates of this plan (export, compare) must do the same",
    )
    replica_node_types: list[str] | None = Field(
        None,
        description="node type of each dp replica when replicas run on different GPU types (Whale's "
        "hardware-aware data parallelism; mesh axes dp, pp, tp so that replica j is the j-th "
        "block of pp x tp ranks); None = the stages' node types",
    )
    experts: ExpertLayout | None = Field(
        None,
        description="expert parallelism of a Mixture-of-Experts model (family moe); None for dense models "
        "(on an moe model: ep 1, every rank holds every expert)",
    )
    predictions: Predictions | None = None
    search: SearchRecord | None = None
    comparison: ComparisonRecord | None = Field(None, description="against the user's config (plan --compare-to)")
    tune: TuneRecord | None = Field(None, description="the measured trials that chose this plan (stratagem tune run)")
    content_hash: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "Plan":
        pp = self.mesh.size("pp")
        v = self.schedule.virtual_stages
        if len(self.stages) != pp * v:
            raise ValueError(f"{len(self.stages)} stages but pp={pp} x virtual_stages={v}")
        if sorted(st.index for st in self.stages) != list(range(pp * v)):
            raise ValueError(f"stage indices {[st.index for st in self.stages]} are not 0..{pp * v - 1}, each once")
        if any(st.pp_rank != st.index % pp for st in self.stages):
            raise ValueError("a stage's pp_rank is not its index modulo pp (the interleaved layout)")
        if self.batch_shares is not None:
            if len(self.batch_shares) != self.mesh.size("dp"):
                raise ValueError("batch_shares needs one entry per dp replica")
            if abs(sum(self.batch_shares) - 1.0) > 1e-9:
                raise ValueError("batch_shares must sum to 1")
        if self.replica_node_types is not None and len(self.replica_node_types) != self.mesh.size("dp"):
            raise ValueError("replica_node_types needs one entry per dp replica")
        self._check_experts()
        if (self.mesh.size("cp") > 1) != (self.context_parallel is not None):
            raise ValueError(
                f"mesh cp={self.mesh.size('cp')} needs context_parallel set exactly when cp > 1, "
                f"got {self.context_parallel!r}"
            )
        self._check_micro_batch_count()
        return self

    def _check_experts(self) -> None:
        if self.experts is None:  # dense, or an MoE model whose experts are replicated like a dense FFN (ep 1)
            return
        if self.model.family == "custom":
            raise ValueError(
                f"the plan sets ep={self.experts.ep} etp={self.experts.etp} for {self.model.name}, but the runtime "
                f"runs expert parallelism for hf: MoE configs and the zoo's moe family only; re-plan it"
            )
        experts = hf_routed_experts(self.model.config or {}) if self.model.family == "hf" else None
        if not self.model.is_moe and not experts:
            raise ValueError(f"{self.model.name} has no experts but the plan has an experts layout")
        try:
            check_expert_layout(
                experts=experts or int(self.model.dim("experts")),
                ep=self.experts.ep,
                etp=self.experts.etp,
                dp=self.mesh.size("dp"),
                tp=self.mesh.size("tp"),
            )
        except StratagemError as exc:
            raise ValueError(str(exc)) from None

    def _check_micro_batch_count(self) -> None:
        """One count per dp replica, equal to the split of the global batch where that split works out (where it
        does not, :func:`validate` says why, with the fix, before anything runs)."""
        dp, counts = self.mesh.size("dp"), self.schedule.micro_batches_per_replica
        if len(counts) != dp:
            raise ValueError(f"schedule.micro_batches_per_replica has {len(counts)} entries for dp={dp}; re-plan")
        try:
            expected = list(split_batch(self, derive=True).micro_batches)
        except StratagemError:
            return
        if counts != expected:
            raise ValueError(f"schedule.micro_batches_per_replica {counts} but the batch split gives {expected}")

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def parallel_dims(self) -> ParallelDims:
        """The plan's layout as the one layout record (mesh degrees and order, and the expert split)."""
        experts = self.experts
        return replace(self.mesh.parallel_dims, ep=experts.ep if experts else 1, etp=experts.etp if experts else 1)


Alternative.model_rebuild()
SearchRecord.model_rebuild()


def costed(plan: Plan) -> tuple[Predictions, SearchRecord | None]:
    """The plan's predictions (and search record), or an error for a plan that was never costed."""
    if plan.predictions is None:
        raise StratagemError("the plan has no predictions (it was not costed); re-plan with `stratagem plan`")
    return plan.predictions, plan.search


def strategy_label(
    *,
    tp: int,
    pp: int,
    dp: int,
    schedule: str,
    virtual_stages: int,
    micro_batch: int,
    num_micro_batches: int,
    zero_stage: int,
    sequence_parallel: bool = False,
    recompute: dict[str, int] | None = None,
    cp: int = 1,
    context_parallel: str | None = None,
    ep: int = 1,
    etp: int = 1,
) -> str:
    """The one short name of a strategy, used by every command, table, picture and notebook.

    ``recompute`` counts modules per recompute mode (modes ``none`` left out). Context parallelism shows as
    ``cp4(ring)`` after the dp degree; ``ep``/``etp``, the expert layout of a Mixture-of-Experts plan, after
    that (when either is > 1). The search's runner-ups use the same words
    (``planner.search.space.OuterChoice.summary``).

    >>> strategy_label(tp=2, pp=2, dp=16, schedule="1f1b", virtual_stages=1, micro_batch=1,
    ...                num_micro_batches=16, zero_stage=2, sequence_parallel=True, ep=8)
    'tp2 pp2 dp16 ep8 1f1b mb1x16 zero2 sp'

    >>> strategy_label(tp=4, pp=1, dp=256, schedule="1f1b", virtual_stages=1, micro_batch=1,
    ...                num_micro_batches=6, zero_stage=3, sequence_parallel=True, recompute={"selective": 86})
    'tp4 pp1 dp256 1f1b mb1x6 zero3 sp recompute selective x86'
    """
    sched = schedule if virtual_stages == 1 else f"{schedule}(v={virtual_stages})"
    modes = "+".join(f"{mode} x{n}" for mode, n in sorted((recompute or {}).items()) if mode != "none" and n)
    cp_part = f" cp{cp}({context_parallel})" if cp > 1 else ""
    experts = (f" ep{ep}" + (f" etp{etp}" if etp > 1 else "")) if ep * etp > 1 else ""
    return (
        f"tp{tp} pp{pp} dp{dp}{cp_part}{experts} {sched} mb{micro_batch}x{num_micro_batches} zero{zero_stage}"
        f"{' sp' if sequence_parallel else ''}{' recompute ' + modes if modes else ''}"
    )


def plan_label(plan: Plan) -> str:
    """:func:`strategy_label` of a plan file, with its sequence parallelism and recompute per module."""
    counts: dict[str, int] = {}
    for stage in plan.stages:
        for mode in stage.recompute.values():
            counts[mode] = counts.get(mode, 0) + 1
    s = plan.schedule
    if plan.mesh.size("sd") > 1:  # 3D CNN: hybrid data + spatial (planner/search/spatial.py)
        split = sum(1 for lay in plan.layout.values() if lay.spatial is not None)
        mesh = f"dp{plan.mesh.size('dp')} sd{plan.mesh.size('sd')}"
        return f"{mesh} mb{s.micro_batch_size}x{s.max_micro_batches} spatial x{split}"
    return strategy_label(
        tp=plan.mesh.size("tp"),
        pp=plan.mesh.size("pp"),
        dp=plan.mesh.size("dp"),
        schedule=s.kind,
        virtual_stages=s.virtual_stages,
        micro_batch=s.micro_batch_size,
        num_micro_batches=s.max_micro_batches,
        zero_stage=plan.zero_stage,
        sequence_parallel=any(lay.sequence_parallel for lay in plan.layout.values()),
        recompute=counts,
        cp=plan.mesh.size("cp"),
        context_parallel=plan.context_parallel,
        ep=plan.experts.ep if plan.experts else 1,
        etp=plan.experts.etp if plan.experts else 1,
    )


def validate(plan: Plan, world_size: int) -> None:
    """Reject a plan that cannot run on ``world_size`` ranks, with the fix in the message."""
    if plan.world_size != world_size:
        raise StratagemError(
            f"plan needs {plan.world_size} ranks but the launch has {world_size}: start with "
            f"--nproc-per-node/--nnodes giving {plan.world_size}, or re-plan with --gpus {world_size}"
        )
    seen: set[int] = set()
    per_pp: dict[int, set[int]] = {}
    for st in plan.stages:
        bad = [r for r in st.ranks if not 0 <= r < world_size]
        if bad:
            raise StratagemError(f"stage {st.index} names ranks {bad} outside 0..{world_size - 1}; re-plan")
        per_pp.setdefault(st.pp_rank, set()).update(st.ranks)
    for ranks in per_pp.values():
        if ranks & seen:
            raise StratagemError("two pipeline ranks share a device rank; the plan file is corrupt, re-plan")
        seen |= ranks
    if seen != set(range(world_size)):
        raise StratagemError(f"plan leaves ranks {sorted(set(range(world_size)) - seen)} idle; re-plan")
    _check_batch(plan)
    max_seq = plan.model.dims.get("max_seq") if plan.model.family in ("gpt", "llama", "moe") else None
    if max_seq is not None and plan.training.seq_len > max_seq:
        raise StratagemError(
            f"plan trains seq_len {plan.training.seq_len} but {plan.model.name} has max_seq "
            f"{max_seq}; re-plan with --seq <= {max_seq}"
        )
    paths = [p for st in sorted(plan.stages, key=lambda s: s.index) for p in st.module_paths]
    if len(paths) != len(set(paths)):
        raise StratagemError("a module is placed on two stages; the plan file is corrupt, re-plan")


def _check_batch(plan: Plan) -> None:
    """The stored per-replica counts must be the split of the global batch (:func:`split_counts`)."""
    s, dp = plan.schedule, plan.mesh.size("dp")
    counts = s.micro_batches_per_replica
    expected = list(split_batch(plan, derive=True).micro_batches)
    if counts != expected:
        raise StratagemError(
            f"plan runs {counts} micro-batches of {s.micro_batch_size} samples on its {dp} dp replicas, but global "
            f"batch {plan.training.global_batch} splits into {expected}; the file is inconsistent, re-plan"
        )


def rows_per_replica(global_batch: int, shares: list[float] | None, dp: int) -> list[int]:
    """Samples each dp replica processes per step: ``share_r * global_batch`` (whole, >= 1), or an even
    ``global_batch / dp`` when ``shares`` is None.

    >>> rows_per_replica(8, [0.75, 0.25], 2)
    [6, 2]
    """
    shares = shares or [1.0 / dp] * dp
    rows = [round(s * global_batch) for s in shares]
    for r, (share, n) in enumerate(zip(shares, rows)):
        if abs(share * global_batch - n) > 1e-6 or n < 1:
            raise StratagemError(
                f"batch share {share} of dp replica {r} is {share * global_batch:g} of the {global_batch}-sample "
                f"global batch, not a whole number >= 1; choose shares that are multiples of 1/{global_batch}"
            )
    if sum(rows) != global_batch:
        raise StratagemError(f"batch shares give {sum(rows)} rows, not the global batch {global_batch}; re-plan")
    return rows


def micro_batches_per_replica(rows: list[int], *, micro_batch_size: int | None, num_micro_batches: int) -> list[int]:
    """Micro-batches each dp replica runs per step.

    ``micro_batch_size`` given (uneven ``batch_shares``): ``m_r = rows_r / micro_batch_size``, every
    micro-batch the same size. ``None`` (even split): ``num_micro_batches`` for every replica, whose rows
    must divide by it.

    >>> micro_batches_per_replica([6, 2], micro_batch_size=2, num_micro_batches=3)
    [3, 1]
    """
    if micro_batch_size is None:
        for r, n in enumerate(rows):
            if n % num_micro_batches:
                raise StratagemError(
                    f"dp replica {r} gets {n} samples, which do not split into {num_micro_batches} micro-batches; "
                    f"choose a global batch or micro-batch count so that each replica's rows divide by it"
                )
        return [num_micro_batches] * len(rows)
    for r, n in enumerate(rows):
        if n % micro_batch_size:
            raise StratagemError(
                f"dp replica {r} gets {n} samples, not a multiple of the plan's {micro_batch_size}-sample "
                f"micro-batch (schedule.micro_batch_size); choose batch shares whose rows are multiples of "
                f"{micro_batch_size}, or re-plan with a micro-batch size dividing every replica's rows"
            )
    return [n // micro_batch_size for n in rows]


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSplit:
    """How one step's global batch is spread over the dp replicas."""

    rows: tuple[int, ...]  # samples of each dp replica per step
    micro_batches: tuple[int, ...]  # micro-batches each dp replica runs per step


def split_batch(plan: Plan, *, derive: bool = False) -> BatchSplit:
    """Rows and micro-batch counts of every dp replica of ``plan``, the counts as the file carries them
    (``derive=True``: as :func:`split_counts` derives them, to check the file).

    Uneven ``batch_shares`` (mixed clusters): replica ``r`` gets ``n_r = share_r * B`` rows and runs
    ``m_r = n_r / micro_batch_size`` micro-batches of the one ``schedule.micro_batch_size`` (a fast replica
    runs more micro-batches, not bigger ones). Without shares every replica runs the same count of ``B / dp``
    rows.
    """
    rows = rows_per_replica(plan.training.global_batch, plan.batch_shares, plan.mesh.size("dp"))
    if not derive:
        return BatchSplit(rows=tuple(rows), micro_batches=tuple(plan.schedule.micro_batches_per_replica))
    return split_counts(
        global_batch=plan.training.global_batch,
        dp=plan.mesh.size("dp"),
        shares=plan.batch_shares,
        micro_batch_size=plan.schedule.micro_batch_size,
        num_micro_batches=plan.schedule.max_micro_batches,
    )


def split_counts(
    *, global_batch: int, dp: int, shares: list[float] | None, micro_batch_size: int, num_micro_batches: int
) -> BatchSplit:
    """The one derivation of the batch split: rows per replica, then micro-batches per replica."""
    rows = rows_per_replica(global_batch, shares, dp)
    size = micro_batch_size if shares is not None else None
    counts = micro_batches_per_replica(rows, micro_batch_size=size, num_micro_batches=num_micro_batches)
    return BatchSplit(rows=tuple(rows), micro_batches=tuple(counts))


def load_plan(path: str | Path) -> Plan:
    """Load and validate a plan file; an older file is checked against its own hash, then migrated."""
    data = read_json(path, what="plan")
    if data.get("schema_version") == 1:
        data = migrate_v1(data, source=str(path))
    if data.get("schema_version") == 2:
        data = migrate_v2(data, source=str(path))
    return validate_document(Plan, data, source=str(path), what="plan", schema_version=PLAN_SCHEMA_VERSION)


def _check_old_hash(data: dict[str, Any], source: str) -> None:
    stored = data.get("content_hash")
    if stored is not None and stored != content_hash(data):
        raise StratagemError(
            f"plan {source} was modified after it was written (content_hash mismatch); "
            f"regenerate it, or delete its content_hash field if the edit was deliberate"
        )


def migrate_v1(data: dict[str, Any], *, source: str) -> dict[str, Any]:
    """A version-1 plan as version 2 (then 3, :func:`migrate_v2`): the same plan; version 2 filled in its
    per-replica micro-batch counts on load, which :func:`migrate_v2` does. Its content hash is checked
    first (over the version-1 body) and dropped: the new body has no hash until it is saved again.
    """
    _check_old_hash(data, source)
    migrated = {**data, "schema_version": 2, "content_hash": None}
    schedule = migrated.get("schedule")
    if isinstance(schedule, dict):
        migrated["schedule"] = {k: v for k, v in schedule.items() if k != "micro_batches_per_replica"}
    return migrated


def migrate_v2(data: dict[str, Any], *, source: str) -> dict[str, Any]:
    """A version-2 plan as version 3: ``schedule.num_micro_batches`` (the busiest replica's count) gives way to
    ``micro_batches_per_replica``, which version-2 files carry (else derived here as version 2 did)."""
    _check_old_hash(data, source)
    migrated = {**data, "schema_version": PLAN_SCHEMA_VERSION, "content_hash": None}
    schedule, training, mesh = data.get("schedule"), data.get("training"), data.get("mesh")
    if not (isinstance(schedule, dict) and isinstance(training, dict) and isinstance(mesh, dict)):
        return migrated  # validation names what is missing
    counts = schedule.get("micro_batches_per_replica")
    if counts is None:
        try:
            dp = dict(zip(mesh.get("axes", ["pp", "dp", "tp"]), mesh["sizes"])).get("dp", 1)
            counts = list(
                split_counts(
                    global_batch=training["global_batch"],
                    dp=dp,
                    shares=data.get("batch_shares"),
                    micro_batch_size=schedule["micro_batch_size"],
                    num_micro_batches=schedule["num_micro_batches"],
                ).micro_batches
            )
        except (StratagemError, KeyError, TypeError, ValueError) as exc:
            raise StratagemError(
                f"plan {source} (schema version 2) has a batch split that does not work out ({exc}); re-plan"
            ) from None
    migrated["schedule"] = {
        **{k: v for k, v in schedule.items() if k != "num_micro_batches"},
        "micro_batches_per_replica": counts,
    }
    return migrated


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write a plan atomically with its content hash."""
    return save_document(plan, path)


def fullest_share(plan: Plan) -> float:
    """The largest predicted peak / device memory over the plan's stages (inf when it was not costed)."""
    if plan.predictions is None or not plan.predictions.stages:
        return float("inf")
    return max(sp.peak_memory_bytes / sp.memory_capacity_bytes for sp in plan.predictions.stages)


def predicted_tensor_bytes(plan: Plan) -> list[float] | None:
    """Each rank's predicted peak of live tensor bytes: its stage's predicted peak less the ``reserve`` term;
    None when the plan has no predictions."""
    pred = plan.predictions
    if pred is None or not pred.stages:
        return None
    by_stage = {sp.stage: sp for sp in pred.stages}
    # replicas on several node types: each replica's own type's prediction (``stages`` is the critical type's)
    by_replica = {d: {sp.stage: sp for sp in t.stages} for t in pred.per_replica_type or [] for d in t.replicas}
    out = []
    for rank in range(plan.mesh.world_size):
        stage = next((s.index for s in plan.stages if rank in s.ranks), None)
        sp = by_replica.get(mesh_coords(plan.mesh, rank)["dp"], by_stage).get(stage) if stage is not None else None
        if sp is None:
            return None
        out.append(sp.peak_memory_bytes - sp.memory_breakdown_bytes.get("reserve", 0.0))
    return out


def stage_memory_predictions(pred: Predictions, plan: Plan) -> list[tuple[StagePrediction, str | None]]:
    """Every (stage prediction, node type) of ``pred``: the stages' and, for replicas on several node types, each
    type's own (``pred.stages`` holds the critical type's only; another type may be the fuller one)."""
    if pred.per_replica_type:
        return [(sp, t.node_type) for t in pred.per_replica_type for sp in t.stages]
    types = {st.index: st.node_type for st in plan.stages}
    return [(sp, types.get(sp.stage)) for sp in pred.stages]


def mesh_coords(mesh: Mesh, rank: int) -> dict[str, int]:
    """``rank``'s index along each axis of ``mesh`` (row-major, the first axis outermost; 0 on an absent axis).

    >>> mesh_coords(Mesh(axes=["dp", "pp", "tp"], sizes=[2, 2, 2]), 5)
    {'pp': 0, 'dp': 1, 'sd': 0, 'cp': 0, 'tp': 1}
    """
    return {**dict.fromkeys(MESH_AXES, 0), **mesh.parallel_dims.coords(rank)}
