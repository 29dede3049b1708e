"""One record of the parallel layout (issue 26): :class:`planner.core.ParallelDims`. Every record that holds a
layout (the plan file, the cost model's ``ParallelConfig``, a framework export's ``FrameworkSettings``, a measured
run) reads as the same ``ParallelDims``; a converter that drops a degree (calibrate once dropped ep and etp) fails
here. Plans come from the search itself: context parallel, Mixture-of-Experts, and replicas on two GPU types."""

from __future__ import annotations

import itertools
import json

import pytest

from planner.calibrate import load_runs_jsonl
from planner.cli.main import main
from planner.core import ParallelDims, StratagemError
from planner.cost import plan_config
from planner.export import layer_kinds, nearest_candidates, to_parallel_config
from planner.plan import Mesh, check_expert_layout, load_plan
from planner.profile import build_gpt_profile

PLANS = {
    "cp": ["--model", "llama:llama3-8b", "--cluster", "dgx-h100", "--seq", "32768", "--flash-attention",
           "--gpus", "16", "--global-batch", "16", "--cp", "4"],
    "moe": ["--model", "moe:tiny", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16", "--seq", "128",
            "--allow", "dp,ep,zero", "--ep", "2"],
    "mixed": ["--model", "gpt:gpt2", "--cluster", "mixed-a100-v100", "--gpus", "32", "--global-batch", "64",
              "--allow", "tp,dp,zero,mixed"],
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(PLANS))
def plan_file(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "plan.json"
    assert main(["plan", *PLANS[request.param], "--out", str(out)]) == 0
    return request.param, out


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(pp=2, dp=3, tp=2),
        ParallelDims(pp=2, dp=2, cp=2, tp=2, axes=("pp", "dp", "cp", "tp")),
        ParallelDims(pp=2, dp=3, tp=2, axes=("dp", "pp", "tp")),
        ParallelDims(dp=2, sd=4, axes=("dp", "sd")),
    ],
)
def test_coords_rank_of_and_stage_ranks_agree(dims):
    ranks = range(dims.world_size)
    assert [dims.rank_of(**dims.coords(r)) for r in ranks] == list(ranks)
    by_stage = {p: [r for r in ranks if dims.coords(r).get("pp", 0) == p] for p in range(dims.pp)}
    assert {p: dims.stage_ranks(p) for p in range(dims.pp)} == by_stage
    assert Mesh.of(dims).parallel_dims == dims


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tp": 0}, "tp = 0 is not a positive integer"),
        ({"dp": True}, "dp = True is not a positive integer"),
        ({"cp": 2}, "needs the mesh axis 'cp'"),
        ({"pp": 2, "dp": 2, "sd": 2, "axes": ("dp", "sd")}, "needs the mesh axis 'pp'"),
        ({"axes": ("pp", "tp", "tp")}, "not distinct axes"),
        ({"axes": ("pp", "xx")}, "not distinct axes"),
        ({"dp": 3, "ep": 2}, "does not divide a stage's dp=3 x tp=1"),
    ],
)
def test_bad_layouts_are_one_line_errors(kwargs, message):
    with pytest.raises(StratagemError, match=message) as err:
        ParallelDims(**kwargs)
    assert "\n" not in str(err.value) and ";" in str(err.value)  # the problem, then the fix


def test_the_expert_rule_is_the_layout_records_rule():
    with pytest.raises(StratagemError) as plan_err:
        check_expert_layout(experts=8, ep=4, etp=1, dp=2, tp=1)
    with pytest.raises(StratagemError) as dims_err:
        ParallelDims(dp=2, ep=4)
    assert str(plan_err.value) == str(dims_err.value)


def test_every_converter_keeps_the_searched_layout(plan_file, tmp_path):
    name, path = plan_file
    plan = load_plan(path)
    dims = plan.parallel_dims
    assert {"cp": dims.cp > 1, "moe": dims.ep > 1, "mixed": dims.axes == ("dp", "pp", "tp")}[name], dims
    assert Mesh.of(dims) == plan.mesh
    assert all(stage.ranks == dims.stage_ranks(stage.pp_rank) for stage in plan.stages)
    # the record reads the plan file's own fields
    stated = {a: plan.mesh.size(a) for a in ("pp", "dp", "cp", "tp")}
    stated |= {"ep": plan.experts.ep if plan.experts else 1, "etp": plan.experts.etp if plan.experts else 1}
    assert dims.degrees() == stated
    # the cost model prices what the plan says (its fields, not its record)
    config = plan_config(plan)
    assert {a: getattr(config, a) for a in stated} == stated
    # calibrate reads a measured run of the plan with the same layout
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"event": "start", "plan_path": str(path), "device": "cuda"},
        {"event": "summary", "measured_step_time_s": 1.0},
    ]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = load_runs_jsonl(metrics).config
    assert {a: getattr(run, a) for a in stated} == stated
    # an export keeps every degree Megatron-LM can state, and prices its config with them
    profile = build_gpt_profile(plan.model, seq_len=plan.training.seq_len)
    settings, changes = nearest_candidates(plan, profile, "megatron")[0]
    assert {a: getattr(settings, a) for a in stated} == stated, [c.line() for c in changes]
    priced = to_parallel_config(settings, layer_kinds(profile))
    assert {a: getattr(priced, a) for a in stated} == stated


def test_world_size_is_one_product():
    for pp, dp, cp, tp in itertools.product((1, 2), (1, 3), (1, 2), (1, 4)):
        dims = ParallelDims.with_axes(pp=pp, dp=dp, cp=cp, tp=tp)
        assert dims.world_size == pp * dp * cp * tp == Mesh.of(dims).world_size
