"""Loss parity of every parallel layout with a single-process run, and proof each axis is applied.

Two torchrun jobs run all configurations (one per world size: 2 ranks, then 4 for the 2-axis cases);
each plan trains 3 steps of tiny models with AdamW in fp32. The reference is ``reference_losses``: the
same model, seed and data on one process with the whole global batch. Besides the loss, the per-rank
layout reports show DTensor placements on TP parameters, the module paths each pipeline rank holds, and
sharded FSDP parameters.
"""

from __future__ import annotations

import json

import pytest
from runtime_helpers import tail, torchrun

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.metrics import final_step_losses, read_metrics

pytestmark = pytest.mark.slow
STEPS = 3
REL_TOL = 1e-5  # fp32
BF16_REL_TOL = 1e-3  # bf16 autocast on both sides; reductions run in a different order per layout
GPT = parse_model("gpt:tiny")
ALL_SPLIT = ["embed", "blocks.0", "blocks.1", "head"]

PLANS_2 = {
    "dp2": dict(dp=2),
    "fsdp_zero3": dict(dp=2, zero_stage=3),
    "fsdp_zero2_accum": dict(dp=2, zero_stage=2, num_micro_batches=2),
    # ZeRO-3 at pp=1 reduce-scatters every micro-batch (LocalRunner.sync_every_micro_batch)
    "fsdp_zero3_accum": dict(dp=2, zero_stage=3, num_micro_batches=2),
    "tp2": dict(tp=2, split=ALL_SPLIT),
    "pp2_gpipe": dict(pp=2, schedule="gpipe", num_micro_batches=4),
    "pp2_1f1b": dict(pp=2, schedule="1f1b", num_micro_batches=4),
    "pp2_interleaved": dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, num_micro_batches=4),
    # uneven shares: 6 and 2 rows in micro-batches of 2 (make_plan's gcd), so replicas run 3 and 1 micro-batches
    "dp2_uneven": dict(dp=2, batch_shares=[0.75, 0.25]),
    "fsdp_zero2_uneven": dict(dp=2, zero_stage=2, batch_shares=[0.75, 0.25]),
    "dp2_recompute": dict(dp=2, recompute={"blocks.0": "full", "blocks.1": "selective"}),
    "whale_resnet": dict(tp=2, split=["fc"], spec="resnet:tiny-wide"),
    "whale_resnet_replicated_fc": dict(tp=2, split=[], spec="resnet:tiny-wide"),
    "tp2_sequence_parallel": dict(tp=2, split=["embed", "head"], sequence_parallel=["blocks.0", "blocks.1", "norm"]),
    "llama_tp2_sp_mixed": dict(
        tp=2, split=["embed", "blocks.1", "head"], sequence_parallel=["blocks.0"], spec="llama:tiny"
    ),
    # one sample per micro-batch over tp 2: the replicated layers (the final norm; llama's embedding) run on the
    # whole micro-batch on both TP ranks (a batch slice of one sample cannot split), fed from a sequence shard too
    "tp2_mb1_whole_replica": dict(tp=2, split=ALL_SPLIT, num_micro_batches=8),
    "tp2_sp_mb1_whole_replica": dict(
        tp=2, split=["embed", "head"], sequence_parallel=["blocks.0", "blocks.1"], num_micro_batches=8
    ),
    "llama_tp2_mb1_replicated_embed": dict(
        tp=2, split=["blocks.0", "blocks.1", "head"], num_micro_batches=8, spec="llama:tiny"
    ),
    "bf16_pp2": dict(pp=2, schedule="1f1b", num_micro_batches=2, dtype="bf16"),
    "bf16_tp2": dict(tp=2, split=ALL_SPLIT, dtype="bf16"),
    "tied_pp2": dict(pp=2, schedule="1f1b", num_micro_batches=2, spec="gpt:tiny", tie=True),
    "tied_tp2": dict(tp=2, split=ALL_SPLIT, spec="gpt:tiny", tie=True),
}
PLANS_4 = {
    "pp2_tp2": dict(pp=2, tp=2, schedule="1f1b", num_micro_batches=2, split=ALL_SPLIT),
    "dp2_tp2": dict(dp=2, tp=2, split=ALL_SPLIT),
    "pp2_tp2_sp": dict(
        pp=2,
        tp=2,
        schedule="gpipe",
        num_micro_batches=2,
        split=["embed", "head"],
        sequence_parallel=["blocks.0", "blocks.1", "norm"],
    ),
    "dp2_tp2_zero3": dict(dp=2, tp=2, split=ALL_SPLIT, zero_stage=3),
    # a batch-sliced replica (blocks.1, micro-batch 4 over tp 2) ends stage 0; stage 1 opens sequence-parallel
    "pp2_tp2_replica_then_sp": dict(
        pp=2,
        tp=2,
        schedule="gpipe",
        num_micro_batches=2,
        split=["embed", "blocks.0", "head"],
        sequence_parallel=["norm"],
    ),
    "tied_pp2_tp2": dict(pp=2, tp=2, schedule="1f1b", num_micro_batches=2, split=ALL_SPLIT, tie=True),
    # two independent 1F1B pipelines: 12 and 4 rows in micro-batches of 2 -> 6 and 2 micro-batches (>= pp)
    "pp2_dp2_uneven": dict(pp=2, dp=2, schedule="1f1b", global_batch=16, batch_shares=[0.75, 0.25], micro_batch_size=2),
    # the planner's layout for replicas on different GPU types: replica d = ranks 2d, 2d+1 (axes dp, pp, tp)
    "dp2_pp2_uneven_replicas_outer": dict(
        pp=2,
        dp=2,
        schedule="1f1b",
        global_batch=16,
        batch_shares=[0.75, 0.25],
        micro_batch_size=2,
        axes=("dp", "pp", "tp"),
    ),
}


def _run_job(tmp_path_factory, plans: dict, nproc: int, timeout_s: float) -> dict:
    root = tmp_path_factory.mktemp(f"parity{nproc}")
    args, out = ["--steps", str(STEPS), "--timeout-s", "60"], {}
    for name, cfg in plans.items():
        cfg = dict(cfg)
        spec = parse_model(cfg.pop("spec", "gpt:tiny"), tie_embeddings=cfg.pop("tie", None))
        plan = make_plan(spec, global_batch=cfg.pop("global_batch", 8), seq_len=16, **cfg)
        path = save_plan(plan, root / f"{name}.json")
        args += ["--plan", str(path), "--metrics", str(root / f"{name}.jsonl"), "--layout-report", str(root / name)]
        out[name] = (plan, root / f"{name}.jsonl", root / name)
    proc = torchrun(nproc, args, timeout_s=timeout_s)
    assert proc.returncode == 0, tail(proc)
    return out


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    return _run_job(tmp_path_factory, PLANS_2, 2, timeout_s=240)


@pytest.fixture(scope="module")
def job4(tmp_path_factory):
    return _run_job(tmp_path_factory, PLANS_4, 4, timeout_s=240)


def _report(folder, rank: int) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


def _param(report: dict, name: str, chunk: int = 0) -> dict:
    return report["chunks"][chunk]["params"][name]


def _check_parity(entry) -> None:
    plan, metrics, _ = entry
    measured = final_step_losses(read_metrics(metrics))
    expected = reference_losses(plan, STEPS)
    assert sorted(measured) == list(range(1, STEPS + 1))
    tol = BF16_REL_TOL if plan.training.dtype == "bf16" else REL_TOL
    for step, ref in enumerate(expected, start=1):
        assert measured[step] == pytest.approx(ref, rel=tol), (step, measured, expected)


# Whale's replica runs the ResNet backbone on half the batch per TP rank, so its BatchNorm normalises with
# half-batch statistics (as plain DP without SyncBatchNorm does): not the single-process loss. Known gap.
BATCHNORM_SPLIT = pytest.mark.xfail(strict=True, reason="batch-split replica: per-slice BatchNorm statistics")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=BATCHNORM_SPLIT) if n.startswith("whale_resnet") else n for n in PLANS_2]
)
def test_two_rank_layouts_match_single_process(job2, name):
    _check_parity(job2[name])


def test_whale_split_classifier_matches_replicated_classifier(job2):
    """Whale's split classifier (class-sharded fc, parallel loss) gives the losses of the same TP2 plan with
    the classifier replicated: both run the backbone as batch-split replicas (same BatchNorm slices)."""
    split = final_step_losses(read_metrics(job2["whale_resnet"][1]))
    replicated = final_step_losses(read_metrics(job2["whale_resnet_replicated_fc"][1]))
    assert sorted(split) == sorted(replicated) == list(range(1, STEPS + 1))
    for step in split:
        assert split[step] == pytest.approx(replicated[step], rel=REL_TOL), (step, split, replicated)


@pytest.mark.parametrize("name", list(PLANS_4))
def test_four_rank_layouts_match_single_process(job4, name):
    _check_parity(job4[name])


def test_dp_and_fsdp_placements(job2):
    qkv = "blocks.0.attn.qkv.weight"  # (3*64, 64)
    rep = _report(job2["dp2"][2], 0)
    assert rep["chunks"][0]["dp_mode"] == "replicate"
    assert _param(rep, qkv)["placements"] == ["R"] and _param(rep, qkv)["mesh_dims"] == ["dp"]
    for name in ("fsdp_zero3", "fsdp_zero2_accum"):
        p = _param(_report(job2[name][2], 1), qkv)
        assert p["placements"] == ["S(0)"] and p["local_shape"] == [96, 64] and p["global_shape"] == [192, 64]
    assert "reshard_after_forward=True" in _report(job2["fsdp_zero3"][2], 0)["chunks"][0]["dp_mode"]
    assert "reshard_after_forward=False" in _report(job2["fsdp_zero2_accum"][2], 0)["chunks"][0]["dp_mode"]


def test_tp_placements_and_whale_split_classifier(job2):
    rep = _report(job2["tp2"][2], 1)
    assert _param(rep, "blocks.1.attn.qkv.weight")["placements"] == ["S(0)"]
    assert _param(rep, "blocks.1.mlp.fc2.weight")["placements"] == ["S(1)"]
    assert _param(rep, "embed.tok.weight")["local_shape"] == [128, 64]
    assert rep["chunks"][0]["loss_parallel"]
    # the final norm is replicated: a Whale replica computing 4 of the 8 rows on each TP rank, and the
    # split head all-gathers along the batch; the loss above matches the single process to 1e-5
    assert rep["chunks"][0]["tp_styles"]["norm"] == "batch_slice" and rep["chunks"][0]["replica_rows"] == {"norm": 4}
    assert rep["chunks"][0]["tp_styles"]["head"] == "colwise_sharded_output_from_batch"
    whale = _report(job2["whale_resnet"][2], 0)
    fc = _param(whale, "fc.weight")
    assert fc["placements"] == ["S(0)"] and fc["local_shape"][0] * 2 == fc["global_shape"][0] == 1000
    assert _param(whale, "blocks.0.conv1.weight")["type"] == "Tensor"  # the backbone stays replicated
    assert whale["chunks"][0]["loss_parallel"]
    # Whale's replica: the backbone is data parallel inside the TP group, each TP rank computing half of
    # the 8-sample micro-batch; the split classifier all-gathers the pooled features along the batch
    styles = whale["chunks"][0]["tp_styles"]
    assert styles["stem"] == "batch_slice" and styles["fc"] == "colwise_sharded_output_from_batch"
    for rank in (0, 1):
        rows = _report(job2["whale_resnet"][2], rank)["chunks"][0]["replica_rows"]
        assert rows["stem"] == rows["blocks.0"] == rows["pool"] == 4


def test_pipeline_ranks_hold_their_stages(job2):
    for name in ("pp2_gpipe", "pp2_1f1b"):
        plan, _, folder = job2[name]
        for rank in (0, 1):
            held = _report(folder, rank)["chunks"]
            assert [c["module_paths"] for c in held] == [plan.stages[rank].module_paths]
    plan, _, folder = job2["pp2_interleaved"]
    held = [[c["stage"] for c in _report(folder, r)["chunks"]] for r in (0, 1)]
    assert held == [[0, 2], [1, 3]]  # stage i on pp rank i % pp
    assert _report(folder, 1)["chunks"][1]["module_paths"] == plan.stages[3].module_paths


def test_uneven_batch_shares_are_applied(job2, job4):
    # global batch 8, shares 0.75 / 0.25, micro-batches of 2: replica 0 trains rows 0..5 in 3 micro-batches
    # with loss x1.5, replica 1 rows 6..7 in 1 micro-batch x0.5
    for name in ("dp2_uneven", "fsdp_zero2_uneven"):
        reports = [_report(job2[name][2], r) for r in (0, 1)]
        assert [(r["rows"], r["micro_batches"], r["loss_scale"]) for r in reports] == [
            ([0, 6], 3, 1.5),
            ([6, 8], 1, 0.5),
        ]
    assert [_report(job2["dp2"][2], 1)[k] for k in ("rows", "micro_batches")] == [[4, 8], 1]
    # pp 2 x dp 2, global batch 16: ranks (pp, dp) = 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1)
    reports = [_report(job4["pp2_dp2_uneven"][2], r) for r in range(4)]
    assert [(r["coords"]["dp"], r["rows"], r["micro_batches"]) for r in reports] == [
        (0, [0, 12], 6),
        (1, [12, 16], 2),
        (0, [0, 12], 6),
        (1, [12, 16], 2),
    ]
    # axes dp, pp, tp (the planner's layout for replicas on different GPU types): replica 0 = ranks 0, 1
    reports = [_report(job4["dp2_pp2_uneven_replicas_outer"][2], r) for r in range(4)]
    assert [(r["coords"]["dp"], r["coords"]["pp"], r["micro_batches"]) for r in reports] == [
        (0, 0, 6),
        (0, 1, 6),
        (1, 0, 2),
        (1, 1, 2),
    ]


def test_recompute_is_applied(job2):
    assert _report(job2["dp2_recompute"][2], 0)["chunks"][0]["recomputed"] == ["blocks.0", "blocks.1"]


def test_two_axis_placements(job4):
    _, _, folder = job4["pp2_tp2"]
    last = _report(folder, 3)
    assert last["coords"] == {"pp": 1, "dp": 0, "tp": 1}
    assert last["chunks"][0]["module_paths"] == ["norm", "head"]
    assert _param(last, "head.weight")["placements"] == ["S(0)"]
    assert _param(_report(folder, 0), "blocks.0.attn.qkv.weight")["mesh_dims"] == ["tp"]
    p = _param(_report(job4["dp2_tp2"][2], 2), "blocks.0.attn.qkv.weight")
    assert p["placements"] == ["R", "S(0)"] and p["mesh_dims"] == ["dp", "tp"]
    p = _param(_report(job4["dp2_tp2_zero3"][2], 2), "blocks.0.attn.qkv.weight")
    # FSDP over TP shards dim 0 again (a strided shard, "_S(0, 2)"): 192 rows / (dp 2 x tp 2)
    assert p["placements"][1] == "S(0)" and "S(0" in p["placements"][0] and p["local_shape"] == [48, 64]


def test_sequence_parallel_is_applied(job2, job4):
    styles = _report(job2["tp2_sequence_parallel"][2], 0)["chunks"][0]["tp_styles"]
    assert styles["blocks.1.ln1"] == "sequence_parallel" and styles["blocks.1.mlp.fc2"] == "rowwise_to_sequence"
    assert _param(_report(job2["tp2_sequence_parallel"][2], 0), "norm.weight")["placements"] == ["R"]
    last = _report(job4["pp2_tp2_sp"][2], 2)["chunks"][0]
    assert last["module_paths"] == ["norm", "head"] and last["tp_styles"]["norm"] == "sequence_parallel_local"
