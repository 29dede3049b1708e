"""From a plan to the nearest configuration a framework can express, with the list of what changed.

A plan may choose things no framework config can state: per-layer recompute, Whale's replicate-or-split
per layer, stage boundaries anywhere, per-replica batch shares and node types. :func:`nearest_candidates`
maps each to the closest setting the framework has (stated per framework in :data:`CAPABILITIES`) and
records a :class:`Change` for it; the exporter prints them next to the cost model's estimate of the
exported configuration, so the user sees the price of each compromise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from planner.core import ScheduleKind, StratagemError
from planner.export.settings import FrameworkSettings
from planner.plan import Plan
from planner.profile import ModelProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """What one framework's config can express (sources in each exporter module)."""

    schedules: tuple[str, ...]
    zero_stages: tuple[int, ...]
    recompute: tuple[str, ...]
    recompute_block_count: bool = False  # Megatron's --recompute-method block --recompute-num-layers N
    uneven_first_last: bool = False  # Megatron's --decoder-first/last-pipeline-num-layers
    sequence_parallel: bool = True
    max_tp: int | None = None  # 1 = no tensor parallelism (Accelerate's FSDP config)
    max_pp: int | None = None
    zero_with_pp: tuple[int, ...] | None = None  # ZeRO stages allowed together with pp > 1
    decays: tuple[str, ...] = ("cosine", "constant")
    warmup_start: bool = True  # a non-zero rate at step 0
    context_parallel: tuple[str, ...] = ()  # K/V exchanges of its context parallelism (none: no cp)


CAPABILITIES: dict[str, Capabilities] = {
    # Megatron-LM: 1F1B and interleaved 1F1B only (no GPipe); --use-distributed-optimizer (ZeRO-1),
    # --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads / optim_grads_params (ZeRO-2/3).
    "megatron": Capabilities(
        schedules=("1f1b", "interleaved_1f1b"),
        zero_stages=(0, 1, 2, 3),
        recompute=("none", "selective", "full"),
        recompute_block_count=True,
        uneven_first_last=True,
        context_parallel=("allgather", "ring"),  # --context-parallel-size, --cp-comm-type all_gather / p2p
    ),
    # torchtitan: DDP (zero 0), FSDP2 reshard_after_forward never (ZeRO-2-like) / always (ZeRO-3).
    "torchtitan": Capabilities(
        schedules=("gpipe", "1f1b", "interleaved_1f1b"),
        zero_stages=(0, 2, 3),
        recompute=("none", "selective", "full"),
        warmup_start=False,
        context_parallel=("allgather",),  # context_parallel_degree; torch's CP rotates K/V by all-gather (default)
    ),
    # DeepSpeed: PipelineModule runs its own 1F1B-like TrainSchedule; ZeRO-2/3 refuse pipeline parallelism;
    # AutoTP has no sequence parallelism; activation checkpointing recomputes whole layers.
    "deepspeed": Capabilities(
        schedules=("1f1b",),
        zero_stages=(0, 1, 2, 3),
        recompute=("none", "full"),
        sequence_parallel=False,
        zero_with_pp=(0, 1),
    ),
    # Accelerate's FSDP/DDP launch config: data parallelism only.
    "accelerate": Capabilities(
        schedules=("1f1b",),
        zero_stages=(0, 2, 3),
        recompute=("none", "full"),
        sequence_parallel=False,
        max_tp=1,
        max_pp=1,
        decays=(),
        warmup_start=False,
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """One plan feature the framework cannot state, and what the export uses instead."""

    what: str
    plan: str
    exported: str
    why: str

    def line(self) -> str:
        return f"{self.what}: {self.plan} -> {self.exported} ({self.why})"


def _block_modes(plan: Plan, kinds: dict[str, str]) -> list[list[str]]:
    """Recompute mode of every block, per chunk in model order."""
    return [
        [st.recompute.get(p, "none") for p in st.module_paths if kinds.get(p) == "block"]
        for st in sorted(plan.stages, key=lambda s: s.index)
    ]


def _recompute(
    plan: Plan, kinds: dict[str, str], caps: Capabilities, changes: list[Change]
) -> list[tuple[dict, Change | None]]:
    """Recompute settings the framework can state, each with the change it makes (None = exact).

    One candidate when the plan's choice is expressible (a uniform mode, or Megatron's 'full on the first N
    blocks of every chunk'); otherwise every uniform mode (and, for Megatron, full on the first N blocks for the
    per-chunk counts of full / recomputed blocks): the exporter keeps the fastest that fits in memory.
    """
    per_chunk = _block_modes(plan, kinds)
    modes = Counter(m for chunk in per_chunk for m in chunk)
    others = sorted(
        {p for st in plan.stages for p, m in st.recompute.items() if m != "none" and kinds.get(p) != "block"}
    )
    if others:
        changes.append(
            Change(
                what="recompute of non-block layers",
                plan=", ".join(others),
                exported="none",
                why="frameworks recompute transformer layers only",
            )
        )
    if len(modes) <= 1:
        mode = next(iter(modes), "none")
        exported = mode if mode in caps.recompute else ("full" if mode == "selective" else "none")
        change = (
            None
            if exported == mode
            else Change(
                what="recompute",
                plan=f"{mode} on every block",
                exported=f"{exported} on every block",
                why=f"the framework has no '{mode}' mode",
            )
        )
        return [({"recompute": exported}, change)]
    text = f"per layer ({', '.join(f'{n} {m}' for m, n in sorted(modes.items()))})"
    counts = [sum(m != "none" for m in chunk) for chunk in per_chunk]
    firsts = all(all(m != "none" for m in chunk[:k]) for chunk, k in zip(per_chunk, counts))
    if caps.recompute_block_count and firsts and len(set(counts)) == 1 and "selective" not in modes:
        return [({"recompute": "full", "recompute_blocks_per_chunk": counts[0]}, None)]
    candidates: list[tuple[dict, Change | None]] = [
        (
            {"recompute": mode},
            Change(
                what="recompute",
                plan=text,
                exported=f"{mode} on every block",
                why="one recompute mode for all transformer layers (the fastest that fits)",
            ),
        )
        for mode in caps.recompute
    ]
    if caps.recompute_block_count:
        full_counts = {max(sum(m == "full" for m in chunk) for chunk in per_chunk), max(counts)}
        for k in sorted(full_counts - {0}):
            candidates.append(
                (
                    {"recompute": "full", "recompute_blocks_per_chunk": k},
                    Change(
                        what="recompute",
                        plan=text,
                        exported=f"full on the first {k} blocks of every chunk",
                        why="the framework recomputes the same number of leading layers per chunk "
                        "(the fastest that fits)",
                    ),
                )
            )
    return candidates


def runs(counts: list[int]) -> str:
    """``[0, 1, 1, 1, 2]`` -> ``"0, 1 x3, 2"`` (a long list of chunk sizes, readable).

    >>> runs([0, 1, 1, 1, 2])
    '0, 1 x3, 2'
    """
    out: list[list[int]] = []
    for c in counts:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return ", ".join(f"{c} x{n}" if n > 1 else str(c) for c, n in out)


def _stage_split(plan: Plan, kinds: dict[str, str], caps: Capabilities, changes: list[Change]) -> dict:
    """Blocks per chunk: even, or (Megatron, no interleaving) equal middle chunks with own first/last counts."""
    counts = [
        len([p for p in st.module_paths if kinds.get(p) == "block"])
        for st in sorted(plan.stages, key=lambda s: s.index)
    ]
    n, total = len(counts), sum(counts)
    base, extra = divmod(total, n)
    even = [base + (1 if c < extra else 0) for c in range(n)]
    if caps.uneven_first_last and plan.schedule.virtual_stages == 1 and n > 1:
        if len(set(counts)) == 1:
            return {}
        if n == 2:
            return {"first_chunk_blocks": counts[0]}
        if len(set(counts[1:-1])) == 1:
            mid = counts[1]
            return {
                "first_chunk_blocks": counts[0] if counts[0] != mid else None,
                "last_chunk_blocks": counts[-1] if counts[-1] != mid else None,
            }
        out = {"first_chunk_blocks": base + extra} if extra else {}
        exported = [base + extra] + [base] * (n - 1)
    elif counts == even:
        return {}
    else:
        out, exported = {}, even
    changes.append(
        Change(
            what="blocks per pipeline chunk",
            plan=runs(counts),
            exported=runs(exported),
            why="the framework splits layers evenly" + (" except the first/last chunk" if out else ""),
        )
    )
    return out


def _experts(plan: Plan, framework: str, changes: list[Change]) -> dict:
    """ep and etp of a Mixture-of-Experts plan: Megatron-LM states them (``--expert-model-parallel-size``,
    ``--expert-tensor-parallel-size``); the other exporters write no expert layout (experts replicated)."""
    if plan.experts is None:
        return {}
    if framework == "megatron":
        return {"ep": plan.experts.ep, "etp": plan.experts.etp}
    if plan.experts.ep * plan.experts.etp > 1:
        changes.append(
            Change(
                what="expert parallelism",
                plan=f"ep {plan.experts.ep}, etp {plan.experts.etp}",
                exported="ep 1 (every rank holds every expert)",
                why=f"the {framework} exporter writes no expert-parallel layout",
            )
        )
    return {}


def _degrees(plan: Plan, caps: Capabilities, changes: list[Change], framework: str) -> dict:
    tp, pp, dp = plan.mesh.size("tp"), plan.mesh.size("pp"), plan.mesh.size("dp")
    world, gb = plan.world_size, plan.training.global_batch
    mb, v, kind = plan.schedule.micro_batch_size, plan.schedule.virtual_stages, plan.schedule.kind
    if (caps.max_tp is not None and tp > caps.max_tp) or (caps.max_pp is not None and pp > caps.max_pp):
        new_dp = world
        if gb % new_dp:
            raise StratagemError(
                f"{framework}'s config is data-parallel only, but global batch {gb} does not split "
                f"over the plan's {world} ranks; export to megatron/torchtitan/deepspeed, or re-plan "
                f"with a global batch that is a multiple of {world}"
            )
        new_mb = max(d for d in range(1, gb // new_dp + 1) if (gb // new_dp) % d == 0 and d <= max(mb, 1))
        changes.append(
            Change(
                what="degrees",
                plan=f"tp {tp} x pp {pp} x dp {dp}",
                exported=f"dp {new_dp}",
                why="the config describes data parallelism only (FSDP/DDP)",
            )
        )
        return {"tp": 1, "pp": 1, "dp": new_dp, "micro_batch": new_mb, "schedule": "1f1b", "virtual_stages": 1}
    out = {"tp": tp, "pp": pp, "dp": dp, "micro_batch": mb, "schedule": kind, "virtual_stages": v}
    out.update(_context(plan, caps, changes, framework))
    if pp > 1 and kind not in caps.schedules:
        new: ScheduleKind = (
            "interleaved_1f1b" if kind == "interleaved_1f1b" and "interleaved_1f1b" in caps.schedules else "1f1b"
        )
        changes.append(
            Change(
                what="pipeline schedule",
                plan=f"{kind} v={v}",
                exported=f"{new} v=1" if new == "1f1b" else new,
                why=f"the framework runs {', '.join(caps.schedules)}",
            )
        )
        out.update(schedule=new, virtual_stages=1 if new == "1f1b" else v)
    if pp == 1:
        out.update(schedule="1f1b", virtual_stages=1)
    return out


def _context(plan: Plan, caps: Capabilities, changes: list[Change], framework: str) -> dict:
    """cp and its K/V exchange: as planned, the framework's exchange, or folded into dp without cp."""
    cp, mode = plan.mesh.size("cp"), plan.context_parallel
    if cp == 1:
        return {}
    if not caps.context_parallel:
        changes.append(
            Change(
                what="context parallelism",
                plan=f"cp {cp} ({mode})",
                exported=f"dp x {cp}",
                why=f"{framework} has no context parallelism: each rank holds whole sequences",
            )
        )
        return {"dp": plan.mesh.size("dp") * cp}
    if mode not in caps.context_parallel:
        changes.append(
            Change(
                what="context-parallel K/V exchange",
                plan=str(mode),
                exported=caps.context_parallel[0],
                why=f"{framework} exchanges K/V by {' or '.join(caps.context_parallel)}",
            )
        )
        mode = caps.context_parallel[0]  # type: ignore[assignment]
    return {"cp": cp, "context_parallel": mode}


def _divisible_virtual_stages(degrees: dict, kinds: dict[str, str], changes: list[Change]) -> bool:
    """Interleaving needs an equal number of layers per virtual stage (Megatron's
    --num-layers-per-virtual-pipeline-stage, torchtitan's pipeline_parallel_layers_per_stage): the nearest count
    of virtual stages that divides the layers. Updates ``degrees``; True when it changed them."""
    pp, v = degrees["pp"], degrees["virtual_stages"]
    blocks = sum(kind == "block" for kind in kinds.values())
    if v == 1 or blocks % (pp * v) == 0:
        return False
    options = [w for w in range(2, blocks // pp + 1) if blocks % (pp * w) == 0]
    new_v = min(options, key=lambda w: (abs(w - v), w)) if options else 1
    changes.append(
        Change(
            what="virtual stages per pipeline rank",
            plan=str(v),
            exported=str(new_v),
            why=f"{blocks} layers must split evenly over pp {pp} x virtual stages",
        )
    )
    degrees.update(virtual_stages=new_v, schedule="interleaved_1f1b" if new_v > 1 else "1f1b")
    return True


def _zero(plan: Plan, pp: int, caps: Capabilities, changes: list[Change]) -> int:
    zero = plan.zero_stage
    allowed = caps.zero_stages if pp == 1 or caps.zero_with_pp is None else caps.zero_with_pp
    if zero in allowed:
        return zero
    new = min((z for z in allowed if z >= zero), default=max(allowed))
    changes.append(
        Change(
            what="ZeRO stage",
            plan=str(zero),
            exported=str(new),
            why=f"the framework offers stages {', '.join(map(str, allowed))}"
            + (" with pipeline parallelism" if pp > 1 and caps.zero_with_pp else ""),
        )
    )
    return new


def _layout(plan: Plan, profile: ModelProfile, tp: int, caps: Capabilities, changes: list[Change]) -> bool:
    """Sequence parallel flag; Whale 'replicate' on a TP-capable layer becomes 'split'."""
    capable = {layer.path for layer in profile.layers if layer.tp_style != "none"}
    replicated = sorted(p for p, lay in plan.layout.items() if lay.style == "replicate" and p in capable)
    if tp > 1 and replicated:
        changes.append(
            Change(
                what="tensor-parallel layout",
                plan=f"replicated: {', '.join(replicated[:4])}" + (" ..." if len(replicated) > 4 else ""),
                exported="split",
                why="the framework shards every tensor-parallel layer",
            )
        )
    sp = any(lay.sequence_parallel for lay in plan.layout.values())
    if sp and (not caps.sequence_parallel or tp == 1):
        changes.append(
            Change(
                what="sequence parallelism",
                plan="on",
                exported="off",
                why="the framework's config has no Megatron-style sequence parallelism",
            )
        )
        return False
    return sp


def _recipe(plan: Plan, caps: Capabilities, changes: list[Change]):
    schedule = plan.training.lr_schedule
    if schedule is None:
        return None
    if not caps.decays:
        changes.append(
            Change(
                what="learning-rate recipe",
                plan=schedule.decay,
                exported="comments only",
                why="the config has no scheduler; set it in the training script",
            )
        )
        return schedule
    if schedule.decay not in caps.decays:
        changes.append(
            Change(
                what="learning-rate decay",
                plan=schedule.decay,
                exported="cosine",
                why=f"the framework's decays are {', '.join(caps.decays)}",
            )
        )
        schedule = schedule.model_copy(update={"decay": "cosine", "step_milestones": []})
    if not caps.warmup_start and schedule.warmup_steps and schedule.warmup_start_lr > 0:
        changes.append(
            Change(
                what="warm-up start",
                plan=f"{schedule.warmup_start_lr:g}",
                exported="0",
                why="the framework's warm-up starts from zero",
            )
        )
        schedule = schedule.model_copy(update={"warmup_start_lr": 0.0})
    return schedule


def nearest_candidates(
    plan: Plan, profile: ModelProfile, framework: str
) -> list[tuple[FrameworkSettings, list[Change]]]:
    """The framework's configurations nearest to ``plan``, each with what had to change (empty when exact).
    More than one only when the plan's per-layer recompute has no equal; ``export_plan`` picks among them."""
    caps = CAPABILITIES[framework]
    kinds = {layer.path: layer.kind for layer in profile.layers}
    changes: list[Change] = []
    if plan.replica_node_types or plan.batch_shares or len({st.node_type for st in plan.stages}) > 1:
        changes.append(
            Change(
                what="heterogeneous GPUs",
                plan="per-stage / per-replica node types and batch shares",
                exported="one node type, equal batch shares",
                why="frameworks assume identical ranks",
            )
        )
    degrees = {**_degrees(plan, caps, changes, framework), **_experts(plan, framework, changes)}
    data_parallel_only = degrees["pp"] == 1 and plan.mesh.size("pp") > 1
    revirtualised = _divisible_virtual_stages(degrees, kinds, changes)
    split = {} if degrees["pp"] == 1 or revirtualised else _stage_split(plan, kinds, caps, changes)
    common = dict(
        **degrees,
        **split,
        global_batch=plan.training.global_batch,
        zero_stage=_zero(plan, degrees["pp"], caps, changes),
        sequence_parallel=_layout(plan, profile, degrees["tp"], caps, changes),
        seq_len=plan.training.seq_len,
        dtype=plan.training.dtype,
        model=plan.model,
        lr_schedule=_recipe(plan, caps, changes),
        weight_decay=plan.training.weight_decay,
        flash_attention=plan.flash_attention,
    )
    out = []
    for recompute, change in _recompute(plan, kinds, caps, changes):
        if data_parallel_only and recompute.get("recompute_blocks_per_chunk") is not None:
            continue
        out.append((FrameworkSettings(**common, **recompute), changes + ([change] if change else [])))
    return out


def nearest_settings(plan: Plan, profile: ModelProfile, framework: str) -> tuple[FrameworkSettings, list[Change]]:
    """The first of :func:`nearest_candidates` (the exact one when the plan is expressible)."""
    return nearest_candidates(plan, profile, framework)[0]
