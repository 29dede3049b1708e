"""Hand-made example plans for the inspection tools, tests and notebooks (no search involved).

:func:`build_example_plan` builds a valid :class:`~planner.plan.schema.Plan` for a GPT of ``layers`` blocks
(default ``4 * pp``) with the per-micro-batch seconds you choose for one pp rank's share of the model
(each of a rank's ``v`` chunks takes ``1 / v`` of it, so schedules compare on the same model). Its
predictions are *derived from those seconds* by the schedule simulation in :mod:`planner.inspect.timeline`
(blocking pp comm, the cost model's convention), and its memory from textbook counts, per device:

- parameters per block ``12 h^2`` and token embedding ``V h`` (Narayanan et al. SC21 eq. 2, biases dropped;
  the head is tied to the embedding and counted once, on the first stage);
- mixed-precision Adam state: 2 B weights + 2 B gradients + 12 B fp32 master/momentum/variance per
  parameter (Rajbhandari et al., ZeRO, §3.1, "16 bytes per parameter");
- activations per block and micro-batch ``s b h (34 + 5 a s / h)`` bytes, ``2 s b h`` with full recompute
  (Korthikanti et al. 2022, eq. 1 and §4.1), times the micro-batches in flight on the rank;
- model FLOPs ``6 N`` per token (Kaplan et al. 2020, §2.1), ``8 N`` with full recompute (SC21 §5.1).

The plans say so in their ``planner_version`` and search notes; they illustrate, they are not measurements.
"""

from __future__ import annotations

from planner.core import ScheduleKind
from planner.inspect.timeline import StageCost, simulate
from planner.model import ModelSpec
from planner.plan import (
    Alternative,
    LayerLayout,
    Mesh,
    Plan,
    Predictions,
    SearchRecord,
    Stage,
    StagePrediction,
    TrainingSettings,
    costed,
    make_schedule,
)

GIB = 2**30
A100_BF16_PEAK_FLOPS_PER_S = 312e12  # NVIDIA A100 datasheet, dense 16-bit (benchmarks/data/hardware_specs.csv)
BYTES_PER_PARAM_MIXED_ADAM = {"params": 2, "grads": 2, "optimizer": 12}  # ZeRO §3.1


def build_example_plan(
    kind: ScheduleKind = "1f1b",
    *,
    pp: int = 4,
    num_micro_batches: int = 8,
    virtual_stages: int = 1,
    dp: int = 1,
    tp: int = 1,
    layers: int | None = None,
    forward_s: float = 0.010,
    backward_s: float = 0.020,
    recompute_s: float = 0.0,
    tp_comm_s: float = 0.0,
    pp_comm_s: float = 0.0,
    dp_comm_s: float = 0.0,
    stage_scale: list[float] | None = None,
    hidden: int = 2048,
    heads: int = 16,
    seq_len: int = 2048,
    micro_batch_size: int = 1,
    memory_capacity_bytes: float = 80 * GIB,
    node_type: str = "dgx-a100-80g",
    with_alternatives: bool = True,
) -> Plan:
    """An example plan whose stage ``s`` costs ``stage_scale[s] / virtual_stages`` times the given seconds.

    >>> plan = build_example_plan("gpipe", pp=2, num_micro_batches=4, with_alternatives=False)
    >>> round(plan.predictions.step_time_s, 3)   # (m + p - 1)(t_f + t_b) = 5 * 0.030
    0.15
    """
    n_stages = pp * virtual_stages
    scale = stage_scale or [1.0] * n_stages
    if len(scale) != n_stages:
        raise ValueError(f"stage_scale needs {n_stages} entries (pp x virtual_stages), got {len(scale)}")
    layers = layers or 4 * pp
    if layers % n_stages:
        raise ValueError(f"{layers} layers do not split evenly over pp x virtual_stages = {n_stages} stages")
    spec = ModelSpec(
        family="gpt",
        dims=dict(layers=layers, hidden=hidden, heads=heads, vocab=51200, max_seq=seq_len, tie_embeddings=True),
    )
    stages = _stages(spec, pp=pp, dp=dp, tp=tp, v=virtual_stages, node_type=node_type, recompute=recompute_s > 0)
    scale = [k / virtual_stages for k in scale]
    # pp_comm: both directions across the boundary to the next stage, none after the last (planner.cost)
    costs = [
        StageCost(
            forward_s=forward_s * k,
            backward_s=backward_s * k,
            recompute_s=recompute_s * k,
            tp_comm_s=tp_comm_s * k,
            pp_comm_s=pp_comm_s * virtual_stages * k if i < n_stages - 1 else 0.0,
        )
        for i, k in enumerate(scale)
    ]
    schedule = make_schedule(
        kind,
        micro_batch_size=micro_batch_size,
        global_batch=micro_batch_size * num_micro_batches * dp,
        dp=dp,
        num_micro_batches=num_micro_batches,
        virtual_stages=virtual_stages,
    )
    timeline = simulate(
        kind,
        costs,
        pp=pp,
        num_micro_batches=num_micro_batches,
        virtual_stages=virtual_stages,
        recompute=tuple(recompute_s > 0 for _ in costs),
        step_tail_s={"dp_sync_exposed": dp_comm_s},
    )
    training = TrainingSettings(global_batch=micro_batch_size * num_micro_batches * dp, seq_len=seq_len, dtype="bf16")
    predictions = _predictions(
        spec,
        stages,
        costs,
        timeline,
        training,
        schedule,
        tp=tp,
        dp=dp,
        capacity=memory_capacity_bytes,
        dp_comm_s=dp_comm_s,
    )
    layout = {p: LayerLayout(style="split") for st in stages for p in st.module_paths if p != "norm"} if tp > 1 else {}
    plan = Plan(
        planner_version="example (hand-made by planner.inspect.examples)",
        created_utc="2026-01-01T00:00:00+00:00",
        model=spec,
        model_profile_hash=None,
        cluster_name=f"example {node_type}",
        cluster_hash=None,
        training=training,
        mesh=Mesh(sizes=[pp, dp, tp]),
        schedule=schedule,
        stages=stages,
        layout=layout,
        predictions=predictions,
    )
    if with_alternatives:
        plan = plan.model_copy(update={"search": _search_record(plan, locals())})
    return plan


def _stages(spec: ModelSpec, *, pp: int, dp: int, tp: int, v: int, node_type: str, recompute: bool) -> list[Stage]:
    """Equal blocks per stage; the embedding joins the first stage, final norm and head the last."""
    n_stages = pp * v
    per_stage = int(spec.dim("layers")) // n_stages
    stages = []
    for index in range(n_stages):
        blocks = [f"blocks.{per_stage * index + i}" for i in range(per_stage)]
        paths = (["embed"] if index == 0 else []) + blocks + (["norm", "head"] if index == n_stages - 1 else [])
        r = index % pp
        stages.append(
            Stage(
                index=index,
                pp_rank=r,
                module_paths=paths,
                ranks=list(range(r * dp * tp, (r + 1) * dp * tp)),
                node_type=node_type,
                recompute={b: "full" for b in blocks} if recompute else {},
            )
        )
    return stages


def _stage_params(spec: ModelSpec, stage: Stage, tp: int) -> float:
    """Parameters one rank of the stage holds: 12 h^2 per block, V h for the (tied) embedding (SC21 eq. 2)."""
    h, vocab = int(spec.dim("hidden")), int(spec.dim("vocab"))
    n = sum(12 * h * h for p in stage.module_paths if p.startswith("blocks."))
    n += vocab * h if "embed" in stage.module_paths else 0
    return n / tp


def _stage_memory(
    spec: ModelSpec, stage: Stage, *, tp: int, in_flight: int, micro_batch: int, seq_len: int, recompute: bool
) -> dict[str, float]:
    params = _stage_params(spec, stage, tp)
    memory = {kind: params * b for kind, b in BYTES_PER_PARAM_MIXED_ADAM.items()}
    h, a = int(spec.dim("hidden")), int(spec.dim("heads"))
    per_block = (
        2 * seq_len * micro_batch * h if recompute else seq_len * micro_batch * h * (34 + 5 * a * seq_len / h) / tp
    )  # Korthikanti eq. 1 / Table 2
    blocks = sum(p.startswith("blocks.") for p in stage.module_paths)
    memory["activations"] = per_block * blocks * in_flight
    return memory


def _device_memory(spec, stages, costs, timeline, training, schedule, *, tp) -> dict[int, dict[str, float]]:
    """Memory by kind of one device of each pp rank: the sum over the chunks it holds."""
    per_rank: dict[int, dict[str, float]] = {}
    for st, cost in zip(stages, costs):
        memory = _stage_memory(
            spec,
            st,
            tp=tp,
            in_flight=timeline.peak_in_flight(st.pp_rank),
            micro_batch=schedule.micro_batch_size,
            seq_len=training.seq_len,
            recompute=cost.recompute_s > 0,
        )
        device = per_rank.setdefault(st.pp_rank, {})
        for kind, value in memory.items():
            device[kind] = device.get(kind, 0.0) + value
    return per_rank


def _predictions(spec, stages, costs, timeline, training, schedule, *, tp, dp, capacity, dp_comm_s):
    """Predictions as the cost model writes them: each stage carries its own per-micro-batch seconds and
    the memory of the device that holds it (shared by the chunks of one pp rank)."""
    pp = len({st.pp_rank for st in stages})
    device = _device_memory(spec, stages, costs, timeline, training, schedule, tp=tp)
    stage_preds = []
    for st, cost in zip(stages, costs):
        memory = device[st.pp_rank]
        stage_preds.append(
            StagePrediction(
                stage=st.index,
                memory_breakdown_bytes=memory,
                peak_memory_bytes=sum(memory.values()),
                memory_capacity_bytes=capacity,
                time_breakdown_s={
                    "forward": cost.forward_s,
                    "backward": cost.backward_s,
                    "recompute": cost.recompute_s,
                    "tp_comm": cost.tp_comm_s,
                    "pp_comm": cost.pp_comm_s,
                },
            )
        )
    step = timeline.makespan_s
    m = schedule.max_micro_batches
    mine = [c for st, c in zip(stages, costs) if st.pp_rank == 0]  # rank 0 ends the step (1F1B drains last)
    breakdown = {
        key: m * sum(getattr(c, f"{key}_s") for c in mine)
        for key in ("forward", "backward", "recompute", "tp_comm", "pp_comm")
    }
    breakdown.update(bubble=timeline.total_s("bubble", 0) + timeline.total_s("pp_wait", 0), dp_sync_exposed=dp_comm_s)
    tokens_per_s = training.global_batch * training.seq_len / step
    n_params = sum(_stage_params(spec, st, 1) for st in stages)
    model_tflops = 6 * n_params * tokens_per_s / (pp * dp * tp) / 1e12  # Kaplan et al. 6N per token
    recompute = any(c.recompute_s > 0 for c in costs)
    return Predictions(
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        samples_per_s=training.global_batch / step,
        model_tflops_per_gpu=model_tflops,
        hardware_tflops_per_gpu=model_tflops * (8 / 6 if recompute else 1.0),
        mfu=model_tflops * 1e12 / A100_BF16_PEAK_FLOPS_PER_S,
        peak_memory_bytes=max(sp.peak_memory_bytes for sp in stage_preds),
        breakdown_s=breakdown,
        stages=stage_preds,
    )


def _search_record(plan: Plan, args: dict) -> SearchRecord:
    """Runner-ups: the same example under the other schedules, costed by the same simulation."""
    kwargs = {
        k: args[k]
        for k in (
            "pp",
            "num_micro_batches",
            "dp",
            "tp",
            "forward_s",
            "backward_s",
            "recompute_s",
            "tp_comm_s",
            "pp_comm_s",
            "dp_comm_s",
            "hidden",
            "heads",
            "seq_len",
            "micro_batch_size",
            "memory_capacity_bytes",
            "node_type",
        )
    }
    variants: list[tuple[ScheduleKind, int]] = [("gpipe", 1), ("1f1b", 1)]
    if kwargs["num_micro_batches"] % kwargs["pp"] == 0:
        variants.append(("interleaved_1f1b", 2))
    kwargs["layers"] = int(plan.model.dim("layers"))
    best = costed(plan)[0].step_time_s
    alternatives = []
    for kind, v in variants:
        if kind == plan.schedule.kind and v == plan.schedule.virtual_stages:
            continue
        alt, _ = costed(build_example_plan(kind, virtual_stages=v, with_alternatives=False, **kwargs))
        alternatives.append(
            Alternative(
                summary=f"{kind} pp{kwargs['pp']} v{v} m{kwargs['num_micro_batches']}",
                step_time_s=alt.step_time_s,
                peak_memory_bytes=alt.peak_memory_bytes,
                slowdown=alt.step_time_s / best,
                choices={"schedule": kind, "virtual_stages": v},
            )
        )
    return SearchRecord(
        solver="none (hand-made example)",
        status="enumerated",
        gap=0.0,
        wall_time_s=0.0,
        candidates_solved=len(alternatives) + 1,
        candidates_pruned=0,
        top_k=alternatives,
        notes="example plan: costs chosen by hand, alternatives = other schedules",
    )
