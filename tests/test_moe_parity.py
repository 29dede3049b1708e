"""Expert parallelism against a single process: losses of 3 AdamW steps and step-1 gradients, fp32.

Two torchrun launches (2 ranks, then 4) of ``tests/moe_grad_worker.py`` run every configuration; the
model is ``moe:tiny`` with a dense first block (3 blocks, ``dense_layers=1``) and a load-balancing
coefficient of 0.1, so the aux loss's share of the gradient is large enough to be seen. Routing is
deterministic (no jitter; the seeded init gives no ties). The reference is ``reference_losses`` and
the same model's gradients on one process with the whole global batch. Gradients are compared too
because AdamW is invariant to a parameter's gradient scale: a wrong factor (expert gradients not
divided by dp) leaves the losses unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import REPO, spawn_ranks

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.model import parse_model
from planner.plan import Plan, save_plan
from runtime.executor.data import build_data_source
from runtime.executor.metrics import final_step_losses, read_metrics
from runtime.executor.checks import expert_layout
from runtime.executor.moe import apply_capacity, take_aux_loss

pytestmark = pytest.mark.slow
STEPS = 3
REL_TOL = 1e-5  # fp32
GRAD_TOL = 1e-5  # max |difference| relative to the largest reference entry of the tensor
SPEC = parse_model("moe:tiny", layers=3, dense_layers=1, aux_loss_coef=0.1)
SPLIT = ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]  # norm too: no Whale replica
SP = ["blocks.0", "blocks.1", "blocks.2", "norm"]

PLANS_2 = {
    "ep2": dict(dp=2, experts={"ep": 2}),  # ep group = the two dp replicas (edp 1)
    "ep2_tp2": dict(tp=2, split=SPLIT, experts={"ep": 2}),  # ep group = the two TP ranks' token slices
    "ep2_capacity": dict(dp=2, num_micro_batches=2, experts={"ep": 2, "capacity_factor": 1.0}),
    "pp2_ep1": dict(pp=2, schedule="1f1b", num_micro_batches=2),
    "ep1_zero3": dict(dp=2, zero_stage=3),  # every expert on both ranks, sharded over edp = 2 (ZeRO-3 plan)
    "etp2": dict(dp=2, experts={"ep": 1, "etp": 2}),  # each expert's FFN split over the two ranks
    # sequence parallel: each TP rank's expert layer computes its own sequence shard
    "ep2_tp2_sp": dict(tp=2, split=["embed", "head"], sequence_parallel=SP, experts={"ep": 2}),
    # dense, not MoE: a Whale replica (the final norm, replicated under tp 2 on batch slices) gets the whole
    # gradient (its TP ranks' slices summed; the mean halved it, which AdamW's scale invariance hid)
    # the blocks as Whale replicas under tp 2: each TP rank routes its own batch slice
    "ep2_tp2_whale": dict(tp=2, split=["embed", "head"], experts={"ep": 2}),
    "dense_whale_norm_tp2": dict(tp=2, split=["embed", "blocks.0", "blocks.1", "head"], spec="llama:tiny"),
    # one sample per micro-batch over tp 2: the MoE blocks run on the whole micro-batch on both TP ranks, each
    # routing its token shard (as a split block's expert layer does)
    "ep2_tp2_whole_replica_mb1": dict(tp=2, split=["embed", "head"], num_micro_batches=8, experts={"ep": 2}),
}
PLANS_4 = {
    # edp 2: experts ZeRO-2 sharded over 2 ranks, 2 micro-batches (one gradient reduction per step)
    "ep2_dp2": dict(dp=4, zero_stage=2, num_micro_batches=2, experts={"ep": 2}),
    # fixed-capacity dispatch (padded buffers) from token-sliced TP ranks
    "ep2_tp2_dp2_capacity": dict(dp=2, tp=2, split=SPLIT, experts={"ep": 2, "capacity_factor": 1.5}),
    "ep2_pp2": dict(pp=2, dp=2, schedule="1f1b", num_micro_batches=2, experts={"ep": 2}),
    "ep4_tp2_dp2_zero3": dict(dp=2, tp=2, split=SPLIT, zero_stage=3, experts={"ep": 4}),
    "ep2_etp2": dict(dp=4, num_micro_batches=2, experts={"ep": 2, "etp": 2}),
    "etp2_tp2_dp2_zero2": dict(dp=2, tp=2, split=SPLIT, zero_stage=2, experts={"ep": 1, "etp": 2}),
    "ep2_pp2_tp2_sp": dict(
        pp=2,
        tp=2,
        schedule="gpipe",
        num_micro_batches=2,
        split=["embed", "head"],
        sequence_parallel=SP,
        experts={"ep": 2},
    ),
}


def _run(tmp_path_factory, plans: dict, nproc: int) -> dict:
    root = tmp_path_factory.mktemp(f"moe{nproc}")
    out, paths = {}, []
    for name, cfg in plans.items():
        cfg = dict(cfg)
        spec = parse_model(cfg.pop("spec")) if "spec" in cfg else SPEC
        plan = make_plan(spec, global_batch=8, seq_len=16, **cfg)
        paths.append(str(save_plan(plan, root / f"{name}.json")))
        out[name] = (plan, root, name)
    argv = [str(REPO / "tests" / "moe_grad_worker.py"), str(root), str(STEPS), *paths]
    proc = spawn_ranks(nproc, argv, timeout_s=240, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return out


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    return _run(tmp_path_factory, PLANS_2, 2)


@pytest.fixture(scope="module")
def job4(tmp_path_factory):
    return _run(tmp_path_factory, PLANS_4, 4)


def _reference_step1(plan: Plan):
    """The single process's model at init (the plan's capacity factor applied) and the step-1 global batch."""
    from runtime.models import build_model, init_weights

    model = build_model(plan.model, device="meta").to_empty(device="cpu")
    init_weights(model, seed=plan.training.seed)
    apply_capacity(model, expert_layout(plan).capacity_factor)
    tr = plan.training
    source = build_data_source(plan.model, "synthetic", global_batch=tr.global_batch, seq_len=tr.seq_len, seed=tr.seed)
    return model, source(1)


def reference_grads(plan: Plan) -> dict[str, torch.Tensor]:
    """Step-1 gradients of the whole model on one process (the aux loss included, as in training)."""
    from runtime.models import loss_fn

    model, batch = _reference_step1(plan)
    loss_fn(plan.model)(model(batch.inputs), batch.targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def reference_aux_loss(plan: Plan) -> float:
    """The step-1 load-balancing loss on one process: the mean over MoE layers on the whole global batch."""
    model, batch = _reference_step1(plan)
    model(batch.inputs)
    total, count = take_aux_loss([model])
    return total / count


def _check(entry, nproc: int) -> None:
    plan, root, name = entry
    records = read_metrics(root / f"{name}.jsonl")
    if plan.model.family == "moe":  # the logged load-balancing loss is the single process's at step 1
        first = next(r for r in records if r.get("event") == "step" and r["step"] == 1)
        assert first["moe_aux_loss"] == pytest.approx(reference_aux_loss(plan), rel=1e-5)
    measured = final_step_losses(records)
    expected = reference_losses(plan, STEPS)
    assert sorted(measured) == list(range(1, STEPS + 1))
    for step, ref in enumerate(expected, start=1):
        assert measured[step] == pytest.approx(ref, rel=REL_TOL), (step, measured, expected)
    ref_grads, seen = reference_grads(plan), set()
    for rank in range(nproc):
        for param, grad in torch.load(root / f"{name}.rank{rank}.pt").items():
            ref = ref_grads[param]
            err = float((grad - ref).abs().max() / ref.abs().max())
            assert err <= GRAD_TOL, (name, rank, param, err)
            seen.add(param)
    assert seen == set(ref_grads), sorted(set(ref_grads) - seen)  # every parameter is held somewhere


@pytest.mark.parametrize("name", list(PLANS_2))
def test_two_rank_expert_layouts_match_single_process(job2, name):
    _check(job2[name], 2)


@pytest.mark.parametrize("name", list(PLANS_4))
def test_four_rank_expert_layouts_match_single_process(job4, name):
    _check(job4[name], 4)


def _report(entry, rank: int) -> dict:
    _, root, name = entry
    return json.loads((root / name / f"rank{rank}.json").read_text())


def test_experts_are_sharded_over_the_ep_group(job2, job4):
    # ep 2 over dp 2: rank 0 holds experts 0, 1 of each MoE block, rank 1 experts 2, 3 (plain tensors,
    # outside the data-parallel wrapper)
    for rank, held in ((0, [0, 1]), (1, [2, 3])):
        chunk = _report(job2["ep2"], rank)["chunks"][0]
        assert chunk["experts_held"] == {"blocks.1.moe": held, "blocks.2.moe": held}
        params = chunk["params"]
        assert f"blocks.1.moe.experts.{held[0]}.w1.weight" in params
        assert not any(f"moe.experts.{other}." in p for p in params for other in {0, 1, 2, 3} - set(held))
        assert params[f"blocks.1.moe.experts.{held[0]}.w1.weight"]["type"] == "Tensor"
        assert params["blocks.1.moe.router.weight"]["mesh_dims"] == ["dp"]  # non-expert: replicated over dp
    # TP2 attention: the shared expert is tensor-parallel like a dense MLP, the router replicated
    params = _report(job2["ep2_tp2"], 1)["chunks"][0]["params"]
    assert params["blocks.1.moe.shared.w1.weight"]["placements"] == ["S(0)"]
    assert params["blocks.1.moe.shared.w2.weight"]["placements"] == ["S(1)"]
    assert params["blocks.1.moe.router.weight"]["type"] == "Tensor"
    # folding, dp 2 x tp 2 = 4 stage ranks as (edp 2, ep 2): ranks 0, 2 hold experts 0-1; 1, 3 experts 2-3
    held = [_report(job4["ep2_tp2_dp2_capacity"], r)["chunks"][0]["experts_held"]["blocks.1.moe"] for r in range(4)]
    assert held == [[0, 1], [2, 3], [0, 1], [2, 3]]
    # ZeRO over edp: expert weights are FSDP shards on the expert mesh's edp axis (64 rows / 2 ranks)
    chunk = _report(job4["ep2_dp2"], 1)["chunks"][0]
    w1 = chunk["params"]["blocks.1.moe.experts.2.w1.weight"]
    assert w1["mesh_dims"] == ["edp"] and w1["placements"] == ["S(0)"] and w1["local_shape"] == [32, 64]
    assert chunk["expert_dp_mode"].startswith("fully_shard over edp=2")
    assert _report(job2["ep2"], 0)["chunks"][0]["expert_dp_mode"] == "none"  # edp 1: nothing to shard over
    # ep 4 with ZeRO-3: one expert per rank
    held = [_report(job4["ep4_tp2_dp2_zero3"], r)["chunks"][0]["experts_held"]["blocks.2.moe"] for r in range(4)]
    assert held == [[0], [1], [2], [3]]
    # ep 2 x etp 2 over 4 ranks: ranks 0, 1 hold experts 0-1, ranks 2, 3 experts 2-3, each half of the FFN
    reports = [_report(job4["ep2_etp2"], r)["chunks"][0] for r in range(4)]
    assert [c["experts_held"]["blocks.1.moe"] for c in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    w2 = reports[3]["params"]["blocks.1.moe.experts.3.w2.weight"]
    assert w2["local_shape"] == [64, 32] and reports[3]["params"]["blocks.1.moe.experts.3.w1.weight"][
        "local_shape"
    ] == [32, 64]
    # ep 2 inside pp 2: the second stage (ranks 2, 3) holds blocks.2's experts, split over its two dp ranks
    last = [_report(job4["ep2_pp2"], r)["chunks"][0] for r in (2, 3)]
    assert [c["experts_held"] for c in last] == [{"blocks.2.moe": [0, 1]}, {"blocks.2.moe": [2, 3]}]
