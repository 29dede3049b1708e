"""Expert parallelism for hf: MoE models (runtime/executor/hf_moe.py) against a single process.

Tiny transformers Mixtral, Qwen2-MoE (routed experts plus the sigmoid-gated shared expert, ``norm_topk_prob``
off) and Qwen3-MoE (``norm_topk_prob`` on): 4 experts, top-2, seeded random routers (no ties, no jitter), so
routing is deterministic. Two torchrun launches (2 ranks, then 4) of ``tests/moe_grad_worker.py`` run every
configuration: the losses of 3 AdamW steps (fp32) within 1e-5 of ``reference_losses`` and every parameter's
step-1 gradient on every rank within 1e-5 (relative to the tensor's largest entry) of one process's. The HF
model's fused expert tensors (``experts.gate_up_proj``, E x 2I x H) are held per expert under expert
parallelism (``experts.gate_up_proj.<global index>``), so the reference gradient of expert j is row j of the
fused one; under expert tensor parallelism the etp peers' slices are put back together first.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import write_moe_config
from runtime_helpers import REPO, resume_runs, spawn_ranks

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.model import parse_model
from planner.plan import Plan, save_plan
from runtime.executor.data import build_data_source
from runtime.executor.metrics import final_step_losses, read_metrics

STEPS = 3
REL_TOL = 1e-5  # fp32
GRAD_TOL = 1e-5  # max |difference| relative to the largest reference entry of the tensor
KIND_OVERRIDES = {"mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {"norm_topk_prob": True}}

PLANS_2 = {
    # ep group = the two dp replicas (edp 1): each rank holds experts 0-1 or 2-3 of both blocks
    "mixtral_ep2": dict(kind="mixtral", dp=2, experts={"ep": 2}),
    # the shared expert and its gate stay replicated (ZeRO-2 over dp), two micro-batches
    "qwen2_ep2_zero2": dict(kind="qwen2_moe", dp=2, zero_stage=2, num_micro_batches=2, experts={"ep": 2}),
    "qwen3_ep2_zero3": dict(kind="qwen3_moe", dp=2, zero_stage=3, experts={"ep": 2}),
    # each expert's FFN width split over the two ranks (expert tensor parallelism), Qwen3's norm_topk_prob on
    "qwen3_etp2": dict(kind="qwen3_moe", dp=2, experts={"ep": 1, "etp": 2}),
    # Qwen2-MoE with a dense first block (decoder_sparse_step 2): only blocks.1 has experts to shard
    "qwen2_sparse_step2_ep2": dict(kind="qwen2_moe", config={"decoder_sparse_step": 2}, dp=2, experts={"ep": 2}),
    # recompute re-runs the dispatch and combine in the backward (full block; selective: matmuls kept)
    "mixtral_ep2_recompute": dict(
        kind="mixtral", dp=2, recompute={"blocks.0": "full", "blocks.1": "selective"}, experts={"ep": 2}
    ),
}
PLANS_4 = {
    # edp 2: each layer's local experts one FSDP unit over edp (ZeRO-2), 2 micro-batches
    "mixtral_ep2_dp2_zero2": dict(kind="mixtral", dp=4, zero_stage=2, num_micro_batches=2, experts={"ep": 2}),
    # edp 2 without ZeRO: expert gradients all-reduced over edp and divided by dp (ExpertGradSync)
    "qwen3_ep2_dp2": dict(kind="qwen3_moe", dp=4, experts={"ep": 2}),
    # ep 2 x etp 2: experts 0-1 on ranks 0, 1 (half an FFN each), 2-3 on ranks 2, 3; two micro-batches
    "mixtral_ep2_etp2": dict(kind="mixtral", dp=4, num_micro_batches=2, experts={"ep": 2, "etp": 2}),
    # etp 2 with edp 2: each rank's FFN halves ZeRO-2 sharded over its edp pair; the shared expert replicated
    "qwen2_etp2_zero2": dict(kind="qwen2_moe", dp=4, zero_stage=2, experts={"ep": 1, "etp": 2}),
    # ep 2 inside each of 2 pipeline stages (1F1B)
    "qwen2_ep2_pp2": dict(
        kind="qwen2_moe",
        pp=2,
        dp=2,
        schedule="1f1b",
        num_micro_batches=2,
        stage_paths=[["embed", "blocks.0"], ["blocks.1", "norm", "head"]],
        experts={"ep": 2},
    ),
}


def _spec(folder, kind: str, config: dict | None = None):
    """A tiny ``kind`` config (``config``: keys changed) written into its own folder under ``folder``."""
    overrides = {**KIND_OVERRIDES[kind], **(config or {})}
    name = kind + "".join(f"-{k}{v}" for k, v in sorted((config or {}).items()))
    return parse_model("hf:" + str(write_moe_config(folder / name, kind, **overrides)))


def _run(tmp_path_factory, plans: dict, nproc: int, broken: str = "") -> dict:
    """Every plan of ``plans`` in one launch of ``nproc`` ranks (``broken``: the variant of
    ``tests/hf_moe_broken_worker.py`` to run instead)."""
    root = tmp_path_factory.mktemp(f"hfmoe{nproc}{broken}")
    out, paths = {}, []
    for name, cfg in plans.items():
        cfg = dict(cfg)
        plan = make_plan(_spec(root, cfg.pop("kind"), cfg.pop("config", None)), global_batch=8, seq_len=16, **cfg)
        paths.append(str(save_plan(plan, root / f"{name}.json")))
        out[name] = (plan, root, name)
    worker = ["hf_moe_broken_worker.py", broken] if broken else ["moe_grad_worker.py"]
    argv = [str(REPO / "tests" / worker[0]), *worker[1:], str(root), str(STEPS), *paths]
    proc = spawn_ranks(nproc, argv, timeout_s=240, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return out


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    return _run(tmp_path_factory, PLANS_2, 2)


@pytest.fixture(scope="module")
def job4(tmp_path_factory):
    return _run(tmp_path_factory, PLANS_4, 4)


def reference_grads(plan: Plan) -> dict[str, torch.Tensor]:
    """Step-1 gradients on one process with the whole global batch; a fused expert tensor's gradient is
    listed per expert (``<name>.<j>``), as expert parallelism holds them."""
    from runtime.models import build_model, init_weights, loss_fn

    model = build_model(plan.model, device="meta").to_empty(device="cpu")
    init_weights(model, seed=plan.training.seed)
    tr = plan.training
    batch = build_data_source(plan.model, "synthetic", global_batch=tr.global_batch, seq_len=tr.seq_len, seed=tr.seed)(
        1
    )
    loss_fn(plan.model)(model(batch.inputs), batch.targets).backward()
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out.update({f"{name}.{j}": p.grad[j] for j in range(p.shape[0])})
        else:
            out[name] = p.grad
    return out


def _etp_index(plan: Plan) -> dict[int, int]:
    """Rank -> its position in its etp group (each stage's ranks folded as (edp, ep, etp), etp fastest)."""
    from runtime.executor.moe import fold_stage_ranks

    assert plan.experts is not None
    out = {}
    for stage in plan.stages:
        ranks = sorted(stage.ranks)
        for rank, (_, _, etp) in zip(ranks, fold_stage_ranks(ranks, plan.experts.ep, plan.experts.etp)):
            out[rank] = etp
    return out


def _whole_experts(plan: Plan, per_rank: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Under etp each rank's expert gradients are its FFN slice: [gate rows; up rows] of ``gate_up_proj``, columns of
    ``down_proj``; put the etp peers' slices (every edp copy gives the same) back together."""
    if plan.experts is None or plan.experts.etp == 1:
        return per_rank
    where, etp = _etp_index(plan), plan.experts.etp
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for rank, grads in enumerate(per_rank):
        for name, g in grads.items():
            if ".experts." in name:
                slices.setdefault(name, {})[where[rank]] = g
    whole = {}
    for name, parts in slices.items():
        assert sorted(parts) == list(range(etp)), (name, sorted(parts))
        ordered = [parts[i] for i in range(etp)]
        if ".gate_up_proj." in name:
            halves = [p.chunk(2) for p in ordered]
            whole[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            whole[name] = torch.cat(ordered, dim=1)
    return [{n: whole.get(n, g) for n, g in grads.items()} for grads in per_rank]


def _check(entry, nproc: int) -> None:
    plan, root, name = entry
    measured = final_step_losses(read_metrics(root / f"{name}.jsonl"))
    expected = reference_losses(plan, STEPS)
    assert sorted(measured) == list(range(1, STEPS + 1))
    for step, ref in enumerate(expected, start=1):
        assert measured[step] == pytest.approx(ref, rel=REL_TOL), ("loss", step, measured, expected)
    ref_grads, seen = reference_grads(plan), set()
    per_rank = _whole_experts(plan, [torch.load(root / f"{name}.rank{rank}.pt") for rank in range(nproc)])
    for rank in range(nproc):
        for param, grad in per_rank[rank].items():
            ref = ref_grads[param]
            assert grad.shape == ref.shape, (name, rank, param)
            err = float((grad - ref).abs().max() / ref.abs().max())
            assert err <= GRAD_TOL, ("gradient", name, rank, param, err)
            seen.add(param)
    assert seen == set(ref_grads), sorted(set(ref_grads) - seen)  # every parameter is held somewhere


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS_2))
def test_two_rank_hf_expert_layouts_match_single_process(job2, name):
    _check(job2[name], 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS_4))
def test_four_rank_hf_expert_layouts_match_single_process(job4, name):
    _check(job4[name], 4)


def _chunk(entry, rank: int) -> dict:
    _, root, name = entry
    return json.loads((root / name / f"rank{rank}.json").read_text())["chunks"][0]


@pytest.mark.slow
def test_hf_experts_are_sharded_over_the_ep_group(job2, job4):
    # ep 2 over dp 2: rank r holds experts 2r, 2r+1 of each sparse block, as plain tensors outside the dp wrapper
    for rank, held in ((0, [0, 1]), (1, [2, 3])):
        chunk = _chunk(job2["mixtral_ep2"], rank)
        assert chunk["experts_held"] == {"blocks.0.layer.mlp": held, "blocks.1.layer.mlp": held}
        params = chunk["params"]
        mine = params[f"blocks.1.layer.mlp.experts.gate_up_proj.{held[0]}"]
        assert mine["type"] == "Tensor" and mine["global_shape"] == [96, 64]  # gate and up rows, 2 x 48
        assert params[f"blocks.1.layer.mlp.experts.down_proj.{held[1]}"]["global_shape"] == [64, 48]
        others = {0, 1, 2, 3} - set(held)
        assert not any(p.endswith(f"experts.gate_up_proj.{j}") for p in params for j in others)
        assert "blocks.1.layer.mlp.experts.gate_up_proj" not in params  # the fused tensor is gone
        assert params["blocks.1.layer.mlp.gate.weight"]["mesh_dims"] == ["dp"]  # the router: replicated over dp
    assert _chunk(job2["qwen2_sparse_step2_ep2"], 0)["experts_held"] == {"blocks.1.layer.mlp": [0, 1]}
    chunk = _chunk(job2["mixtral_ep2_recompute"], 1)  # recompute wraps blocks whose experts are sharded
    assert chunk["recomputed"] and chunk["experts_held"]["blocks.0.layer.mlp"] == [2, 3]
    # Qwen2-MoE: the shared expert and its sigmoid gate stay whole on every rank
    params = _chunk(job2["qwen2_ep2_zero2"], 1)["params"]
    assert "blocks.0.layer.mlp.shared_expert_gate.weight" in params
    assert "blocks.0.layer.mlp.shared_expert.up_proj.weight" in params
    # edp 2 with ZeRO-2: ranks 0, 2 hold experts 0-1, ranks 1, 3 experts 2-3, each expert sharded over edp
    chunks = [_chunk(job4["mixtral_ep2_dp2_zero2"], r) for r in range(4)]
    assert [c["experts_held"]["blocks.0.layer.mlp"] for c in chunks] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    w = chunks[3]["params"]["blocks.0.layer.mlp.experts.gate_up_proj.3"]
    assert w["mesh_dims"] == ["edp"] and w["placements"] == ["S(0)"] and w["local_shape"] == [48, 64]
    assert chunks[0]["expert_dp_mode"].startswith("fully_shard over edp=2")
    # ep 2 x etp 2: ranks 0, 1 hold experts 0-1, ranks 2, 3 experts 2-3, each half of every FFN (width 48 -> 24)
    chunks = [_chunk(job4["mixtral_ep2_etp2"], r) for r in range(4)]
    assert [c["experts_held"]["blocks.1.layer.mlp"] for c in chunks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert chunks[3]["params"]["blocks.1.layer.mlp.experts.gate_up_proj.3"]["global_shape"] == [48, 64]
    assert chunks[3]["params"]["blocks.1.layer.mlp.experts.down_proj.3"]["global_shape"] == [64, 24]
    # ep 2 inside pp 2: each stage's sparse block has its experts split over the stage's two dp ranks
    held = [_chunk(job4["qwen2_ep2_pp2"], r)["experts_held"] for r in range(4)]
    first, second = "blocks.0.layer.mlp", "blocks.1.layer.mlp"
    assert held == [{first: [0, 1]}, {first: [2, 3]}, {second: [0, 1]}, {second: [2, 3]}]


BROKEN = {
    # no all-to-all: each rank's experts see only its own tokens, other ranks' experts' outputs are missing
    "no_exchange": ("mixtral_ep2", "('loss', 1,"),
    # expert gradients not summed over edp / divided by dp: the same losses (AdamW), wrong gradients
    "no_expert_sync": ("qwen3_ep2_zero3", "('gradient', 'qwen3_ep2_zero3', 0, 'blocks.0.layer.mlp.experts."),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(BROKEN))
def test_the_parity_check_fails_when_expert_parallelism_is_broken(tmp_path_factory, variant):
    """The same checks on a deliberately broken runtime (``tests/hf_moe_broken_worker.py``) must fail."""
    name, where = BROKEN[variant]
    job = _run(tmp_path_factory, {name: PLANS_2[name]}, 2, broken=variant)
    with pytest.raises(AssertionError) as failure:
        _check(job[name], 2)
    assert where in str(failure.value), str(failure.value)[:500]


MOE_SPEC = "moe:tiny"
RESUME = {
    # hf: Mixtral at ep 2: each rank saves its own experts, one entry per expert (a checkpoint holding one rank's
    # experts for both would change step 3)
    "mixtral_ep2": dict(kind="mixtral", dp=2, experts={"ep": 2}),
    # the zoo's moe:tiny, each expert's FFN split over the two ranks (edp 1, plain tensors)
    "moe_etp2": dict(dp=2, experts={"ep": 1, "etp": 2}),
    # edp 2 under tp 2: each slice a DTensor sharded over its edp pair (ZeRO-2), AdamW state too
    "moe_etp2_tp2_dp2_zero2": dict(
        dp=2, tp=2, split=["embed", "blocks.0", "blocks.1", "norm", "head"], zero_stage=2, experts={"ep": 1, "etp": 2}
    ),
    # hf: Mixtral at ep 2 x etp 2 (HFLocalExperts' slices), ZeRO-1 on the dense weights
    "mixtral_ep2_etp2_zero1": dict(kind="mixtral", dp=4, zero_stage=1, experts={"ep": 2, "etp": 2}),
}


def _resume_job(tmp_path_factory, names: list[str], nproc: int) -> dict:
    """The plans ``names`` of ``RESUME`` in one launch of ``tests/resume_worker.py``: two steps with a checkpoint
    after each, then a fresh job resumes from step 2 and trains step 3."""
    root = tmp_path_factory.mktemp(f"resume{nproc}")
    out, paths = {}, []
    for name in names:
        cfg = dict(RESUME[name])
        spec = _spec(root, cfg.pop("kind")) if "kind" in cfg else parse_model(MOE_SPEC)
        plan = make_plan(spec, global_batch=8, seq_len=16, **cfg)
        paths.append(str(save_plan(plan, root / f"{name}.json")))
        out[name] = (plan, root, name)
    resume_runs(nproc, root, paths, first=2, last=3, timeout_s=300)
    return out


@pytest.fixture(scope="module")
def resume2(tmp_path_factory):
    return _resume_job(tmp_path_factory, ["mixtral_ep2", "moe_etp2"], 2)


@pytest.fixture(scope="module")
def resume4(tmp_path_factory):
    return _resume_job(tmp_path_factory, ["moe_etp2_tp2_dp2_zero2", "mixtral_ep2_etp2_zero1"], 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUME))
def test_expert_parallel_plans_resume_from_a_checkpoint_at_the_single_process_losses(request, name):
    """Each etp slice of an expert's FFN is its own checkpoint key (runtime.executor.etp_keys), so the resumed
    step 3 is the single process's. With the slices under one key DCP wrote one rank's slice and loaded it on
    every etp peer (measured with the renaming switched off, step 3 against one process: moe_etp2 5.5828 against
    5.5800, moe_etp2_tp2_dp2_zero2 5.5792 against 5.5800, mixtral_ep2_etp2_zero1 5.5804 against 5.5812).
    ``stratagem launch`` itself resuming an expert-parallel plan in a second launch: tests/test_moe_launch.py."""
    job = request.getfixturevalue(
        "resume4" if RESUME[name].get("dp", 1) * RESUME[name].get("tp", 1) == 4 else "resume2"
    )
    plan, root, _ = job[name]
    resumed = final_step_losses(read_metrics(root / f"{name}.run2.jsonl"))
    assert sorted(resumed) == [3]  # the second run started from the step-2 checkpoint
    measured = {**final_step_losses(read_metrics(root / f"{name}.run1.jsonl")), **resumed}
    for step, ref in enumerate(reference_losses(plan, 3), start=1):
        assert measured[step] == pytest.approx(ref, rel=REL_TOL), (step, measured)


def test_a_resume_with_another_expert_layout_is_refused_in_one_line(tmp_path, capsys):
    """A checkpoint written at ep 1 x etp 2 (its meta.json, as train writes it) and a plan at ep 2 x etp 1 of the
    same model and world size: ``--resume`` stops before any process starts (each etp slice has its own key and
    width, so the experts would not load)."""
    from planner.cli.main import main
    from runtime.executor.checkpoint import COMPLETE_MARKER, META_FILE, expert_meta, step_dir

    plan = make_plan(parse_model("moe:tiny"), global_batch=8, seq_len=16, dp=2, experts={"ep": 2, "etp": 1})
    folder = step_dir(tmp_path / "ckpt", 2)
    folder.mkdir(parents=True)
    meta = {"step": 2, "model": plan.model.name, "world_size": 2, **expert_meta(1, 2)}
    (folder / META_FILE).write_text(json.dumps(meta))
    (folder / COMPLETE_MARKER).write_text("step 2\n")
    path, metrics = save_plan(plan, tmp_path / "plan.json"), tmp_path / "run.jsonl"
    argv = ["launch", str(path), "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]
    status = main([*argv, "--metrics", str(metrics)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "written with experts ep=1 etp=2 but the plan has ep=2 etp=1" in err, err
    assert not metrics.exists()


def test_hf_expert_layouts_the_runtime_cannot_run_are_one_line_errors(tmp_path):
    """Refused before any process starts: a capacity factor (transformers' blocks are dropless), experts with
    tp > 1 (no TP layout for the block: TP ranks would dispatch the same tokens), replicas with different
    micro-batch counts (the all-to-alls would deadlock)."""
    from planner.core import StratagemError
    from runtime.executor.checks import check_supported

    spec = _spec(tmp_path, "mixtral")
    cases = {
        "dropless": dict(dp=2, experts={"ep": 2, "capacity_factor": 1.0}),
        "re-plan with tp 1": dict(tp=2, experts={"ep": 2}),
        "would deadlock": dict(dp=2, batch_shares=[0.75, 0.25], experts={"ep": 2}),
    }
    for needle, cfg in cases.items():
        plan = make_plan(spec, global_batch=8, seq_len=16, **cfg)
        with pytest.raises(StratagemError) as err:
            check_supported(plan)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
