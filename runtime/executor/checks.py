"""What the runtime cannot execute, refused before any process starts, without torch.

``stratagem launch`` runs these checks in the CLI process (``runtime.launch.check_launch``), where importing torch
would cost seconds before torchrun starts; each rank runs them again (``runtime.executor.train``). Each reads only
the plan and, for a zoo model, the model's dimensions and layer paths (``runtime.models.dims``, ``.paths``), and
raises a ``StratagemError`` naming the fix. The plan facts that the torch modules need too (:func:`is_tied`,
:func:`expert_layout`, :func:`is_moe`, :func:`is_hf_ep`) live here, so both sides read the one rule.

Models from outside the zoo still import torch here: ``hf:`` and ``py:`` models are built on meta to read their
layer paths (:func:`check_supported`), and an ``hf:`` expert layout is checked against the model's fused experts
(:func:`check_experts` -> ``runtime.executor.hf_moe.check_hf_experts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core import StratagemError
from planner.plan import BatchSplit, Plan, split_batch
from runtime.models.dims import MoEDims, resolve_dims
from runtime.models.paths import spec_layer_paths

# plan dtypes the runtime trains (runtime.executor.speed says how: fp32, autocast, FSDP2 bf16 or bf16 weights with
# fp32 masters); fp32 master weights and AdamW state in every case (the plan schema: "mixed precision keeps fp32
# master weights"); tf32 is fp32 with TF32 matmuls on CUDA.
RUN_DTYPES = ("fp32", "tf32", "bf16")
CONTEXT_FAMILIES = ("gpt", "llama")  # models whose attention takes a ContextShard (runtime/models/gpt.py, llama.py)


def check_supported(plan: Plan) -> None:
    """Reject plan features the runtime cannot execute, before any process starts."""
    if plan.training.dtype not in RUN_DTYPES:
        raise StratagemError(
            f"plan trains in {plan.training.dtype}, which the runtime does not run (it needs loss "
            f"scaling); re-plan with --dtype bf16 or fp32"
        )
    check_tied(plan)
    check_context_supported(plan)
    check_experts(plan)
    paths = spec_layer_paths(plan.model)
    placed = [p for st in sorted(plan.stages, key=lambda s: s.index) for p in st.module_paths]
    if placed != paths:
        raise StratagemError(
            f"the plan's stages hold {len(placed)} modules in model order {placed[:3]}..., but "
            f"{plan.model.name} has {len(paths)} ({paths[:3]}...); the plan is for another model, "
            f"re-plan"
        )


# ---------------------------------------------------------------------------------------------- tied embedding


def is_tied(plan: Plan) -> bool:
    """The model ties its LM head to the token embedding (``runtime.executor.tied``)."""
    return plan.model.is_language_model and bool(
        plan.model.dims.get("tie_embeddings", False) if plan.model.is_external else plan.model.dim("tie_embeddings")
    )


def check_tied(plan: Plan) -> None:
    """A tied embedding and head must be both split or both replicated."""
    if not is_tied(plan) or plan.mesh.size("tp") == 1:
        return
    split = {p: p in plan.layout and plan.layout[p].style == "split" for p in ("embed", "head")}
    if split["embed"] != split["head"]:
        raise StratagemError(
            f"{plan.model.name} ties its LM head to the token embedding but the plan splits only "
            f"{'embed' if split['embed'] else 'head'}; split both or neither, or re-plan"
        )


# ---------------------------------------------------------------------------------------------- context parallel


def check_context_supported(plan: Plan) -> None:
    """Reject a context-parallel plan the runtime cannot run (``runtime.executor.context``)."""
    cp = plan.mesh.size("cp")
    if cp == 1:
        return
    if plan.model.family not in CONTEXT_FAMILIES:
        raise StratagemError(
            f"plan splits the sequence over cp={cp} ranks but {plan.model.name} ({plan.model.family}) has no "
            f"attention the runtime can split (gpt and llama only); re-plan with --cp 1"
        )
    if plan.training.seq_len % (2 * cp):
        raise StratagemError(
            f"plan's seq_len {plan.training.seq_len} does not split into 2 x cp = {2 * cp} equal chunks; "
            f"re-plan with --seq a multiple of {2 * cp}"
        )
    if plan.batch_shares is not None:
        raise StratagemError("context parallelism with uneven batch_shares is not supported; re-plan with --cp 1")
    if plan.context_parallel == "ring" and float(plan.model.dims.get("dropout", 0.0) or 0.0) > 0:
        raise StratagemError(
            "ring context parallelism merges attention blocks without attention dropout, and "
            f"{plan.model.name} has dropout {plan.model.dims.get('dropout')}; use --dropout 0 or the all-gather "
            "exchange (plan --cp with context_parallel allgather)"
        )


# ---------------------------------------------------------------------------------------------- experts


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertLayout:
    """The plan's ``experts`` (``planner.plan.schema.ExpertLayout``), or the default for a plan without one."""

    ep: int = 1
    etp: int = 1
    capacity_factor: float | None = None  # None = the model's own (0 = dropless)


def expert_layout(plan: Plan) -> ExpertLayout:
    experts = getattr(plan, "experts", None)
    if experts is None:
        return ExpertLayout()
    return ExpertLayout(ep=experts.ep, etp=experts.etp, capacity_factor=experts.capacity_factor)


def is_moe(plan: Plan) -> bool:
    """The zoo's ``moe`` family (``runtime.executor.moe``)."""
    return plan.model.family == "moe"


def is_hf_ep(plan: Plan) -> bool:
    """An ``hf:`` plan with an expert layout (the search writes one when ep x etp > 1; ``runtime.executor.hf_moe``)."""
    return plan.model.family == "hf" and getattr(plan, "experts", None) is not None


def check_experts(plan: Plan) -> None:
    """One-line errors, before any process starts, for expert layouts the runtime cannot run."""
    lay = expert_layout(plan)
    if is_hf_ep(plan):
        from runtime.executor.hf_moe import check_hf_experts  # reads the model's fused experts, built on meta: torch

        return check_hf_experts(plan)
    if not is_moe(plan):
        if getattr(plan, "experts", None) is not None:
            raise StratagemError(
                f"the plan sets experts (ep={lay.ep}) but {plan.model.name} has no experts; re-plan without them"
            )
        return
    dims = resolve_dims(plan.model)
    assert isinstance(dims, MoEDims)  # is_moe
    dp, tp = plan.mesh.size("dp"), plan.mesh.size("tp")
    if dims.experts % lay.ep:
        divisors = [d for d in range(1, dims.experts + 1) if dims.experts % d == 0]
        raise StratagemError(
            f"experts={dims.experts} of {plan.model.name} is not divisible by ep={lay.ep}; choose ep among {divisors}"
        )
    if dims.expert_ffn % lay.etp:
        raise StratagemError(
            f"etp={lay.etp} does not divide expert_ffn={dims.expert_ffn} of {plan.model.name}; "
            f"choose etp dividing {dims.expert_ffn}"
        )
    if (dp * tp) % (lay.ep * lay.etp):
        raise StratagemError(
            f"ep={lay.ep} x etp={lay.etp} does not divide a stage's dp x tp = {dp} x {tp} ranks; "
            f"choose ep dividing {dp * tp}"
        )
    if lay.capacity_factor is not None and lay.capacity_factor < 0:
        raise StratagemError(f"capacity_factor={lay.capacity_factor} must be >= 0 (or None for dropless)")
    _check_expert_tokens(plan, tp)
    spans_replicas = lay.ep * lay.etp > tp  # an ep or etp group holds ranks of different dp replicas
    if spans_replicas and plan.batch_shares is not None and len(set(plan.schedule.micro_batches_per_replica or [])) > 1:
        raise StratagemError(
            "expert all-to-alls span dp replicas whose batch shares give them different micro-batch counts, "
            "which would deadlock; use equal batch shares or ep x etp dividing tp"
        )


def _check_expert_tokens(plan: Plan, tp: int) -> None:
    """Each TP rank routes its ``1/tp`` of a micro-batch's tokens (``runtime.executor.moe_dispatch.TokenShard``)."""
    if tp == 1:
        return
    tokens = plan.schedule.micro_batch_size * plan.training.seq_len
    if tokens % tp:
        raise StratagemError(
            f"a micro-batch's {tokens} tokens do not split over tp={tp} for the expert layers; "
            f"choose a sequence length or micro-batch size divisible by {tp}"
        )


# ---------------------------------------------------------------------------------------------- pipeline schedule


def micro_batch_problem(kind: str, *, pp: int, num_micro_batches: int) -> str | None:
    """Why a ``pp``-stage ``kind`` schedule cannot run ``num_micro_batches`` micro-batches (None if it can).

    Rules of torch 2.13 (pipelining/schedules.py): 1F1B needs at least one micro-batch per stage;
    interleaved 1F1B runs ``rounds = max(1, m // pp)`` rounds and needs ``m % rounds == 0``.
    """
    if pp == 1:
        return None
    if kind == "1f1b" and num_micro_batches < pp:
        return f"1f1b needs at least one micro-batch per stage ({pp}) but gets {num_micro_batches}"
    rounds = max(1, num_micro_batches // pp)
    if kind == "interleaved_1f1b" and num_micro_batches % rounds:
        return (
            f"interleaved_1f1b with pp={pp} runs {rounds} rounds, which {num_micro_batches} micro-batches do not divide"
        )
    return None


def _check_virtual_stages(kind: str, virtual_stages: int) -> None:
    if virtual_stages > 1 and kind != "interleaved_1f1b":
        raise StratagemError(
            f"schedule {kind} runs one stage per pp rank but the plan has virtual_stages="
            f"{virtual_stages}; use interleaved_1f1b or virtual_stages=1"
        )


def check_schedule(kind: str, *, pp: int, virtual_stages: int, num_micro_batches: int) -> None:
    """Reject a schedule torch.distributed.pipelining cannot build, before any process starts."""
    if pp == 1:
        return
    _check_virtual_stages(kind, virtual_stages)
    problem = micro_batch_problem(kind, pp=pp, num_micro_batches=num_micro_batches)
    if problem:
        fix = (
            f"use a multiple of {pp} micro-batches"
            if kind == "interleaved_1f1b"
            else "raise num_micro_batches or use gpipe"
        )
        raise StratagemError(f"{problem} (the plan's schedule.micro_batches_per_replica); {fix}")


def check_replica_schedules(plan: Plan) -> BatchSplit:
    """Split ``plan``'s global batch over its dp replicas (``planner.plan.split_batch``) and check that each
    replica's pipeline can run its own micro-batch count; returns the split.

    Each dp replica's pipeline is independent (its pp group holds only its own ranks), so replicas with
    uneven ``batch_shares`` run schedules of different lengths. Only the dp gradient reduction, once per
    step after each replica's last micro-batch, ties them together — except ZeRO-3, which all-gathers
    weights over dp in every micro-batch's forward, so its replicas must run equal counts.
    """
    pp, kind, sched = plan.mesh.size("pp"), plan.schedule.kind, plan.schedule
    split = split_batch(plan)
    if plan.batch_shares is None:
        check_schedule(kind, pp=pp, virtual_stages=sched.virtual_stages, num_micro_batches=sched.max_micro_batches)
        return split
    if pp > 1:
        _check_virtual_stages(kind, sched.virtual_stages)
    for r, (n, m) in enumerate(zip(split.rows, split.micro_batches)):
        problem = micro_batch_problem(kind, pp=pp, num_micro_batches=m)
        if problem:
            raise StratagemError(
                f"dp replica {r} trains {n} rows = {m} micro-batches of {sched.micro_batch_size} "
                f"samples: {problem}; give it a larger batch share, re-plan with a smaller "
                f"micro_batch_size, or use gpipe"
            )
    if plan.zero_stage == 3 and len(set(split.micro_batches)) > 1:
        raise StratagemError(
            f"ZeRO-3 all-gathers weights over dp in every micro-batch, so dp replicas running "
            f"{list(split.micro_batches)} micro-batches would deadlock; use zero_stage 0, 1 or 2, "
            f"or batch shares giving every replica the same count"
        )
    return split
