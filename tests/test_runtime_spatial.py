"""Spatial parallelism on gloo matches one process: 3 AdamW steps' losses (fp32, <= 1e-5) and step 1's synced
gradients, for a tiny 3D U-Net (16^3) split 2-way spatially, 2-way spatial x 2-way data, mixed per-layer splits
(2 and 4 ranks: d, h, w, dh, hw grids, degrees 2 and 4 in one spatial group of 4, and unsplit layers, so every
layout change runs, along skips too) and a tiny CosmoFlow (split convolutions, gathered before its dense
layers). Two launches (2 and 4 ranks) share the plans of their world size. Each rank's local layer output
shapes show that the split really ran.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import tail, torchrun

from fixtures.reference import reference_losses
from fixtures.spatial_plans import make_spatial_plan
from planner.core import StratagemError
from planner.model import parse_model, volume_layers
from planner.plan import load_plan, save_plan
from runtime.executor.data import build_data_source
from runtime.executor.metrics import final_step_losses, read_metrics

STEPS = 3
UNET = "unet3d:tiny"
ALL_D2 = {v.path: (2, 1, 1) for v in volume_layers(parse_model(UNET))}
PLANS = {
    2: {
        "unet_sd2": dict(model=UNET, dp=1, sd=2, grids=ALL_D2),
        "unet_sd2_mixed": dict(
            model=UNET,
            dp=1,
            sd=2,
            grids={
                "blocks.0": (1, 2, 1),
                "blocks.1": (2, 1, 1),
                "blocks.3": (2, 1, 1),
                "blocks.5": (1, 1, 2),
                "blocks.7": (1, 2, 1),
                "head": (2, 1, 1),
            },
        ),
        "cosmoflow_sd2": dict(model="cosmoflow:tiny", dp=1, sd=2, grids={"blocks.0": (2, 1, 1), "blocks.1": (1, 2, 1)}),
    },
    4: {
        "unet_dp2_sd2": dict(model=UNET, dp=2, sd=2, grids=ALL_D2),
        "unet_sd4_mixed": dict(
            model=UNET,
            dp=1,
            sd=4,
            grids={
                "blocks.0": (4, 1, 1),
                "blocks.1": (2, 2, 1),
                "blocks.2": (2, 2, 1),
                "blocks.3": (4, 1, 1),
                "blocks.5": (1, 2, 2),
                "blocks.6": (2, 2, 1),
                "head": (4, 1, 1),
            },
        ),
        "unet_sd4_degrees": dict(  # degrees 4 and 2 (two copies of each 2-way grid), unsplit, a 2-way head
            model=UNET,
            dp=1,
            sd=4,
            grids={
                "blocks.0": (4, 1, 1),
                "blocks.1": (2, 1, 1),
                "blocks.2": (1, 2, 1),
                "blocks.3": (2, 2, 1),
                "blocks.5": (2, 1, 1),
                "blocks.6": (1, 1, 2),
                "blocks.7": (4, 1, 1),
                "head": (2, 1, 1),
            },
        ),
    },
}


def _reference_grads(plan) -> dict[str, torch.Tensor]:
    """Step 1's full-batch mean-loss gradients on one process."""
    from runtime.models import build_model, init_weights, loss_fn

    model = build_model(plan.model, device="meta")
    model.to_empty(device="cpu")
    init_weights(model, seed=plan.training.seed)
    tr = plan.training
    batch = build_data_source(plan.model, "synthetic", global_batch=tr.global_batch, seq_len=1, seed=tr.seed)(1)
    loss_fn(plan.model)(model(batch.inputs), batch.targets).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _launch(tmp_path_factory, world: int) -> dict:
    folder = tmp_path_factory.mktemp(f"spatial{world}")
    (folder / "grads").mkdir()
    args, out = ["--steps", str(STEPS), "--timeout-s", "60"], {}
    for name, kw in PLANS[world].items():
        plan = make_spatial_plan(**kw)  # type: ignore[arg-type]
        path = save_plan(plan, folder / f"{name}.json")
        out[name] = (load_plan(path), folder / f"{name}.jsonl")
        args += ["--plan", str(path), "--metrics", str(folder / f"{name}.jsonl")]
    proc = torchrun(world, args, timeout_s=150, env={"STRATAGEM_TEST_GRADS_DIR": str(folder / "grads")})
    assert proc.returncode == 0, tail(proc)
    return {"plans": out, "grads": folder / "grads", "world": world}


@pytest.fixture(scope="module")
def spatial2(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def spatial4(tmp_path_factory):
    return _launch(tmp_path_factory, 4)


def _check(job: dict, name: str) -> None:
    plan, metrics = job["plans"][name]
    measured = final_step_losses(read_metrics(metrics))
    expected = reference_losses(plan, STEPS)
    assert max(expected) - min(expected) > 1e-3, "the losses must move for the comparison to mean anything"
    for step, loss in enumerate(expected, start=1):
        assert measured[step] == pytest.approx(loss, abs=1e-5), (name, step, measured, expected)
    reference = _reference_grads(plan)
    tag = plan.content_hash.rpartition(":")[2][:16]
    side = int(plan.model.dim("volume"))
    for rank in range(job["world"]):
        dumped = torch.load(job["grads"] / f"{tag}.rank{rank}.pt", weights_only=True)
        for param, grad in reference.items():
            torch.testing.assert_close(dumped["grads"][param], grad, rtol=1e-4, atol=1e-6, msg=f"{name} {param}")
        for path, lay in plan.layout.items():  # a split layer's local output is its shard
            assert lay.spatial is not None
            table = {v.path: v for v in volume_layers(plan.model)}
            extent = table[path].out_extent if path != "head" else side
            assert dumped["shapes"][path][2:] == [extent // g for g in lay.spatial.grid], (name, path)


@pytest.mark.parametrize("name", list(PLANS[2]))
def test_two_rank_spatial_layouts_match_single_process(spatial2, name):
    _check(spatial2, name)


@pytest.mark.parametrize("name", list(PLANS[4]))
def test_four_rank_spatial_layouts_match_single_process(spatial4, name):
    _check(spatial4, name)


def test_bad_spatial_plans_are_one_line_errors():
    from planner.search import check_spatial_plan

    bad = {  # split degree not dividing the volume; halo (kernel 5: 2 voxels) wider than a 1-voxel shard
        "does not divide its 16-voxel extent; choose a degree dividing 16": make_spatial_plan(
            UNET, dp=1, sd=3, grids={"blocks.0": (1, 1, 3)}, global_batch=3
        ),
        "halo of 2 voxels is wider than its 1-voxel shard along d": make_spatial_plan(
            "cosmoflow:tiny", dp=1, sd=8, grids={"blocks.1": (8, 1, 1)}, global_batch=1, dims={"kernel": 5}
        ),
        "is dense": make_spatial_plan("cosmoflow:tiny", dp=1, sd=2, grids={"dense.0": (2, 1, 1)}, global_batch=2),
    }
    for message, plan in bad.items():
        with pytest.raises(StratagemError, match=message) as err:
            check_spatial_plan(plan)
        assert "\n" not in str(err.value)
