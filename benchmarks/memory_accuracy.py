"""Predicted vs measured peak tensor memory per rank, for every layout the runtime runs, on 2 CPU ranks.

    .venv/bin/python benchmarks/memory_accuracy.py [--models gpt:small,llama:tiny,moe:tiny] [--layouts dp2,tp2]
        [--json out.json]

Each layout is a hand-made plan (``fixtures.plans.make_plan``, global batch 8 x seq 64, fp32, no search) whose
prediction is :func:`planner.cost.estimate` on the model's analytic profile (meta device: FLOPs counted, bytes
saved for backward measured with ``saved_tensors_hooks``) and the shipped ``local-cpu-2core`` cluster, exactly as
the planner prices a configuration; the predicted figure is each rank's peak less its ``reserve`` term (allocator
fragmentation and CUDA context, not tensors). Measured: one ``torchrun`` of 2 ranks per model trains one step of
each plan under ``runtime.executor.tensor_memory.TensorMemory`` (live tensor storages, by kind; the optimizer state
that step creates counted in, as every later step holds it), the figure ``stratagem launch`` records.

Layouts: dp2 (ZeRO-0, FSDP2 ``replicate``), zero1 / zero2 / zero3 (FSDP2 ``fully_shard``), tp2, tp2-sp (sequence
parallel), pp2-gpipe / pp2-1f1b (4 micro-batches), pp2-interleaved (2 virtual stages per rank), recompute-selective
and recompute-full (dp2, every block), cp2 (context parallel, all-gather exchange), for MoE models ep2, and
mixed-dp2: two replicas on two node types (the same CPU under two names, ``mixed_cluster``) with batch shares 3/4
and 1/4, priced through the planner's mixed-type path.

Which rows are in sample: the memory model's mechanisms (which gradients a peak moment holds, FSDP2's gathered
copies, torch.distributed.pipelining's receive buffers and held outputs, sequence parallelism's gathered inputs,
the routed experts' states, full recompute's working set) were chosen by looking at the rows of gpt:small,
llama:tiny and moe:tiny (``IN_SAMPLE``); no constant was fitted. The other models (gpt:tiny and tiny
transformers models, ``hf-tiny:TYPE``: ``transformers.AutoConfig.for_model(TYPE)`` shrunk by
``runtime.models.fidelity.tiny_config``, run as ``hf:`` models) were run after those choices as held-out rows.
One of them, Mixtral, then changed the runtime (its fused experts measured 15x their prediction: transformers'
``batched_mm`` copies each token's expert weights; ``runtime.models.hf.use_loop_experts``), so its rows are in
sample too. gpt:tiny's tensor-parallel rows then chose a mechanism (``loss_parallel``'s backward holds one logits
shard more than plain cross-entropy: ``planner.cost.compute.layer_cost``'s ``torch_tp_memory``), so gpt:tiny is in
sample too. The backward sweep (``planner.cost.memory``: each layer's working set with only the earlier layers'
activations and the later layers' gradients; a block's reduce-scatter copy and ZeRO-3 gathered weights; the
root unit gathered at ZeRO-3) was chosen from the ZeRO-3 and full-recompute rows of gpt:tiny, gpt:small and
llama:tiny, traced op by op. Mixtral's and moe:tiny's rows then chose more (traced the same way): a block whose
attention tp cannot split counts its attention scores once (``runtime.profiling.model._fit_replicated``);
transformers' fused experts are priced by what their own forward saves and their backward's whole-weight gradients
make, both measured on small CPU copies (``ExpertProfile.fused_saved_bytes_per_token``,
``fused_backward_bytes_per_weight_byte``), and at ZeRO-3 are gathered with their block's unit; the runtime's expert
exchange for hf: models recomputes ``act(gate) * up`` as the zoo's SwiGLU does; the exchange's reorderings keep
their sources for the backward; a block's routed experts are backed through before the rest of its backward
(``planner.cost.compute.working_set_bytes``); and the backward sweep's first point no longer counts a layer's own
gradients under full recompute (which moved the held-out recompute-full rows from -1.5 % to +1.0 %).
Nothing was changed because of the others (``HELD_OUT``). The summary gives both groups apart.

Expert-parallel rows are priced at the routing load the measured step had (``_realized_imbalance``: the busiest
rank's routed rows over the ranks' mean), since the memory model is under test here, not the forecast of how a
router spreads its tokens (the plan's ``load_imbalance``, 1.5 by default, which a randomly initialised router
on 512 rows does not reach); the error at the forecast is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CLUSTER = REPO / "profiles/hardware/local-cpu-2core.json"
GLOBAL_BATCH, SEQ = 8, 64
IN_SAMPLE = ("gpt:small", "llama:tiny", "moe:tiny", "hf-tiny:mixtral", "gpt:tiny")
HELD_OUT = ("hf-tiny:llama", "hf-tiny:qwen2")
MODELS = IN_SAMPLE + HELD_OUT
LAYOUTS = (
    "dp2",
    "zero1",
    "zero2",
    "zero3",
    "tp2",
    "tp2-sp",
    "pp2-gpipe",
    "pp2-1f1b",
    "pp2-interleaved",
    "recompute-selective",
    "recompute-full",
    "cp2",
    "ep2",
    "mixed-dp2",
)
MIXED_TYPES = ("cpu-a", "cpu-b")  # the two node types of mixed_cluster()
TOLERANCE = 0.05


def layout_kwargs(spec, layout: str) -> dict | None:
    """``make_plan`` arguments of ``layout`` for ``spec``; None when the model cannot take it."""
    from runtime.models import is_splittable, layer_paths

    paths = layer_paths(spec)
    blocks = [p for p in paths if p.startswith("blocks.")]
    split = [p for p in paths if is_splittable(spec, p)]
    moe = spec.is_moe or any(
        key in (spec.config or {}) for key in ("num_local_experts", "num_experts", "n_routed_experts")
    )
    table = {
        "dp2": dict(dp=2),
        "zero1": dict(dp=2, zero_stage=1),
        "zero2": dict(dp=2, zero_stage=2),
        "zero3": dict(dp=2, zero_stage=3),
        "tp2": dict(tp=2, split=split),
        "tp2-sp": dict(tp=2, split=split, sequence_parallel=split),
        "pp2-gpipe": dict(pp=2, schedule="gpipe", num_micro_batches=4),
        "pp2-1f1b": dict(pp=2, schedule="1f1b", num_micro_batches=4),
        "pp2-interleaved": dict(pp=2, schedule="interleaved_1f1b", num_micro_batches=4, virtual_stages=2),
        "recompute-selective": dict(dp=2, recompute=dict.fromkeys(blocks, "selective")),
        "recompute-full": dict(dp=2, recompute=dict.fromkeys(blocks, "full")),
        "cp2": dict(cp=2),
        "ep2": dict(dp=2, experts={"ep": 2}) if moe else None,
        # replicas on two node types, the faster one given 3/4 of the batch (3 micro-batches against 1), laid out
        # dp-outermost as the planner lays out replicas of different types
        "mixed-dp2": dict(dp=2, batch_shares=[0.75, 0.25], axes=("dp", "pp", "tp")),
    }
    if layout not in table:
        raise SystemExit(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    kwargs = table[layout]
    if kwargs and layout == "pp2-interleaved":
        if len(blocks) % 4:
            return None
        # equal blocks per chunk, the layers before the blocks on the first, after them on the last
        per = len(blocks) // 4
        chunks = [blocks[i * per : (i + 1) * per] for i in range(4)]
        chunks[0] = paths[: paths.index(blocks[0])] + chunks[0]
        chunks[-1] = chunks[-1] + paths[paths.index(blocks[-1]) + 1 :]
        kwargs = {**kwargs, "stage_paths": chunks}
    return kwargs


def predicted_plan(model: str, layout: str, load_imbalance: float | None = None):
    """The plan of ``layout`` with the cost model's predictions written in (None: the model cannot take it);
    ``load_imbalance``: the expert-parallel routing load it is priced at (default: the plan's forecast)."""
    import dataclasses

    from fixtures.plans import make_plan
    from planner.core import StratagemError
    from planner.cost import plan_config
    from planner.export import estimate_config
    from planner.model import parse_model
    from planner.profile import load_cluster_profile
    from runtime.profiling.model import profile_model_analytic

    spec = parse_model(model)
    kwargs = layout_kwargs(spec, layout)
    if kwargs is None:
        return None
    plan = make_plan(spec, global_batch=GLOBAL_BATCH, seq_len=SEQ, **kwargs)
    cluster = load_cluster_profile(CLUSTER)
    if load_imbalance is not None and plan.experts is not None:
        experts = plan.experts.model_copy(update={"load_imbalance": load_imbalance})
        plan = plan.model_copy(update={"experts": experts})
    if layout == "mixed-dp2":
        cluster = mixed_cluster(cluster)
        plan = plan.model_copy(update={"replica_node_types": list(MIXED_TYPES)})
    tp = plan.mesh.size("tp")
    profile = profile_model_analytic(
        spec,
        seq_len=SEQ,
        dtype="fp32",
        micro_batches=(plan.schedule.micro_batch_size,),
        tp_degrees=(1, tp) if tp > 1 else (1,),
    )
    # the hand-made plan names no node type of the cluster (plan_config prices pp = 1 as one micro-batch in flight)
    config = dataclasses.replace(plan_config(plan), stage_node_types=None)
    try:
        est = estimate_config(config, profile=profile, cluster=cluster, global_batch=GLOBAL_BATCH)
    except StratagemError as exc:  # a layout the model cannot take (context parallelism of an MoE model)
        print(f"{model} {layout}: skipped ({str(exc)[:120]})", file=sys.stderr)
        return None
    return plan.model_copy(update={"predictions": est.to_predictions(), "cluster_name": cluster.name})


def mixed_cluster(base):
    """``base`` (one CPU node of 2 ranks) as two one-rank nodes of two node types (``MIXED_TYPES``): the same CPU
    under two names, so the prediction goes through the planner's mixed-type path (per-type replicas, batch shares);
    the links between them are the measured ones between the two ranks."""
    node = base.node_types[0]
    types = [node.model_copy(update={"name": name, "devices_per_node": 1}) for name in MIXED_TYPES]
    nodes = [base.nodes[0].model_copy(update={"node_type": name, "count": 1}) for name in MIXED_TYPES]
    inter = [fit.model_copy(update={"level": "inter_node"}) for fit in node.intra_node]
    return base.model_copy(
        update={"name": f"{base.name}-mixed", "node_types": types, "nodes": nodes, "inter_node": inter}
    )


def _count_routed_rows() -> list[int]:
    """From now on, append to the returned list the rows each call of this rank's routed experts receives in a
    forward (not in a recomputation): ``runtime.executor.moe_dispatch._run_experts`` wrapped."""
    import torch

    from runtime.executor import moe_dispatch

    rows: list[int] = []
    run = moe_dispatch._run_experts

    def counting(routed, counts, experts):
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            rows.append(int(routed.shape[0]))
        return run(routed, counts, experts)

    moe_dispatch._run_experts = counting
    return rows


def _realized_imbalance(rows: list[int]) -> float | None:
    """The step's routed load: the busiest rank's rows (every layer and micro-batch) over the ranks' mean; None
    when nothing was dispatched (no expert parallelism)."""
    import torch
    import torch.distributed as dist

    totals = torch.tensor([float(sum(rows))])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, totals)
    values = [float(t) for t in gathered]
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


def measure(paths: list[Path], out: Path) -> None:
    """torchrun worker: one tracked step of each plan; rank 0 writes ``out`` (plan stem -> per-rank peaks and
    the step's realized expert-parallel load, :func:`_realized_imbalance`)."""
    import torch
    import torch.distributed as dist

    from planner.core import StratagemError
    from planner.plan import load_plan
    from runtime.executor.tensor_memory import TensorMemory
    from runtime.executor.train import build_job, train_step

    dist.init_process_group("gloo")
    results = {}
    routed = _count_routed_rows()
    for path in paths:
        plan = load_plan(path)
        torch.manual_seed(0)
        try:  # a layout the runtime refuses for this model (before any collective, so on every rank alike)
            job = build_job(plan, torch.device("cpu"), data="synthetic")
        except StratagemError as exc:
            results[path.stem] = {"refused": str(exc)}
            continue
        routed.clear()
        with TensorMemory(job.modules, job.optimizers) as tracker:
            res = train_step(job, 1, tracker)
        load = _realized_imbalance(routed) if plan.experts is not None and plan.experts.ep > 1 else None
        results[path.stem] = {
            "ranks": [{"peak": p.peak_bytes, "by_kind": p.by_kind} for p in res.tensor_peaks or []],
            "load_imbalance": load,
        }
        del job
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def resolve_model(model: str, folder: Path) -> str:
    """The model string ``make_plan`` takes: ``hf-tiny:TYPE`` becomes ``hf:`` a tiny config written into ``folder``."""
    if not model.startswith("hf-tiny:"):
        return model
    import transformers

    from runtime.models.fidelity import tiny_config

    kind = model.removeprefix("hf-tiny:")
    path = folder / kind / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tiny_config(transformers.AutoConfig.for_model(kind)).to_json_file(path)
    return f"hf:{path}"


def run(models: list[str], layouts: list[str]) -> list[dict]:
    """Every (model, layout, rank) row of every model and layout (:func:`run_pairs`)."""
    return run_pairs([(model, layout) for model in models for layout in layouts])


def run_pairs(pairs: list[tuple[str, str]]) -> list[dict]:
    """Each (model, layout) pair's rows, one per rank: predicted and measured peak tensor bytes, the error, both
    breakdowns. One ``torchrun`` of 2 ranks measures every plan."""
    from planner.plan import predicted_tensor_bytes, save_plan

    rows = []
    with tempfile.TemporaryDirectory(prefix="mem-acc-") as tmp:
        folder = Path(tmp)
        plans = {}
        specs: dict[str, str] = {}
        for model, layout in pairs:
            if model not in specs:
                specs[model] = resolve_model(model, folder)
            spec = specs[model]
            plan = predicted_plan(spec, layout)
            if plan is not None:
                name = f"{model.replace(':', '-')}_{layout}"
                plans[model, layout] = (plan, save_plan(plan, folder / f"{name}.json"))
        out = folder / "measured.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += [__file__, "--worker", str(out), *[str(p) for _, p in plans.values()]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"the measuring launch failed:\n{proc.stderr[-3000:]}")
        measured = json.loads(out.read_text())
        for (model, layout), (plan, path) in plans.items():
            if "refused" in measured[path.stem]:
                print(
                    f"{model} {layout}: the runtime refuses it ({measured[path.stem]['refused'][:120]})",
                    file=sys.stderr,
                )
                continue
            load = measured[path.stem]["load_imbalance"]
            forecast = predicted_tensor_bytes(plan) or []
            if load is not None:  # priced at the load the step routed (module docstring)
                plan = predicted_plan(specs[model], layout, load_imbalance=load)
            predicted = predicted_tensor_bytes(plan) or []
            stages = {sp.stage: sp for sp in plan.predictions.stages}
            for rank, (m, p) in enumerate(zip(measured[path.stem]["ranks"], predicted)):
                stage = next(s.index for s in plan.stages if rank in s.ranks)
                terms = stages[stage].memory_breakdown_bytes
                rows.append(
                    dict(
                        model=model,
                        layout=layout,
                        rank=rank,
                        in_sample=model in IN_SAMPLE,
                        predicted_bytes=p,
                        measured_bytes=m["peak"],
                        error=m["peak"] / p - 1.0,
                        measured_by_kind=m["by_kind"],
                        predicted_by_term={k: v for k, v in terms.items() if k not in ("capacity", "reserve")},
                        load_imbalance=load,
                        error_at_forecast=m["peak"] / forecast[rank] - 1.0 if load is not None else None,
                    )
                )
    return rows


def summary(rows: list[dict]) -> str:
    """One line: how many rows, mean and max |error|, the worst row, how many within the tolerance."""
    if not rows:
        return "no rows"
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    return (
        f"{len(rows)} rank rows ({len({(r['model'], r['layout']) for r in rows})} plans): mean |error| "
        f"{sum(abs(r['error']) for r in rows) / len(rows):.1%}, max |error| {abs(worst['error']):.1%} "
        f"({worst['model']} {worst['layout']} rank {worst['rank']}); {within} within {TOLERANCE:.0%}"
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        measure([Path(p) for p in sys.argv[3:]], Path(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--json", type=Path, help="also write every row (with both breakdowns) here")
    args = p.parse_args()
    rows = run(args.models.split(","), args.layouts.split(","))
    mib = 2**20
    print(f"{'model':15s} {'layout':20s} {'rank':>4s} {'predicted MiB':>13s} {'measured MiB':>12s} {'error':>8s}")
    for r in rows:
        flag = "" if abs(r["error"]) <= TOLERANCE else "  > 5 %"
        print(
            f"{r['model']:15s} {r['layout']:20s} {r['rank']:4d} {r['predicted_bytes'] / mib:13.3f} "
            f"{r['measured_bytes'] / mib:12.3f} {r['error']:+8.1%}{flag}"
        )
    for r in rows:
        if r["load_imbalance"] is not None:
            print(
                f"{r['model']} {r['layout']} rank {r['rank']}: priced at the step's routed load "
                f"x{r['load_imbalance']:.3f}; at the plan's forecast {r['error_at_forecast']:+.1%}"
            )
    held = [r for r in rows if not r["in_sample"]]
    print(f"\nheld out ({', '.join(sorted({r['model'] for r in held}))}): {summary(held)}")
    print(
        f"in sample ({', '.join(sorted({r['model'] for r in rows if r['in_sample']}))}): "
        f"{summary([r for r in rows if r['in_sample']])}"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
