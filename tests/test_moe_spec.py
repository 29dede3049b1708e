"""The moe model family and the plan's expert layout: presets, bad input in one line, rank folding."""

from __future__ import annotations

import pytest

from planner.core import StratagemError
from planner.model import PRESETS, parse_model
from planner.plan import ExpertLayout, check_expert_layout, expert_groups


@pytest.mark.parametrize("preset", sorted(PRESETS["moe"]))
def test_presets_parse(preset):
    spec = parse_model(f"moe:{preset}")
    assert spec.is_moe and spec.is_language_model
    assert int(spec.dim("top_k")) <= int(spec.dim("experts"))


def test_preset_numbers_from_their_configs():
    mixtral = parse_model("moe:mixtral-8x7b")
    assert (mixtral.dim("experts"), mixtral.dim("top_k"), mixtral.dim("expert_ffn")) == (8, 2, 14336)
    v3 = parse_model("moe:deepseek-v3")
    assert (v3.dim("layers"), v3.dim("dense_layers"), v3.dim("experts"), v3.dim("shared_experts")) == (61, 3, 256, 1)
    qwen = parse_model("moe:qwen3-30b-a3b")
    assert (qwen.dim("experts"), qwen.dim("top_k"), qwen.dim("expert_ffn")) == (128, 8, 768)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (dict(top_k=5), "top_k 5 is more than its 4 experts"),
        (dict(dense_layers=3), "dense_layers 3 is more than its 2 layers"),
        (dict(experts=0), "experts 0 must be an integer in 1"),
        (dict(capacity_factor=-0.5), "capacity_factor -0.5 must be a number >= 0"),
        (dict(kv_heads=3), "not divisible by kv_heads 3"),
    ],
)
def test_bad_moe_dims_one_line(overrides, words):
    with pytest.raises(StratagemError, match=words) as err:
        parse_model("moe:tiny", **overrides)
    assert "\n" not in str(err.value)


def test_expert_layout_rules():
    check_expert_layout(experts=8, ep=4, etp=2, dp=8, tp=1)
    with pytest.raises(StratagemError, match="8 experts do not split over ep=3"):
        check_expert_layout(experts=8, ep=3, etp=1, dp=3, tp=1)
    with pytest.raises(StratagemError, match="does not divide a stage's dp=2 x tp=2 = 4 ranks"):
        check_expert_layout(experts=8, ep=8, etp=1, dp=2, tp=2)
    assert ExpertLayout(ep=2, etp=2).edp(dp=4, tp=2) == 2


def test_expert_groups_fold_edp_ep_etp():
    groups = expert_groups(list(range(8, 16)), ep=2, etp=2)  # a stage holding ranks 8..15
    assert groups["etp"] == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["ep"] == [[8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["edp"] == [[8, 12], [9, 13], [10, 14], [11, 15]]
    for kind in ("etp", "ep", "edp"):  # each kind partitions the stage
        assert sorted(r for g in groups[kind] for r in g) == list(range(8, 16))


def _plan_data(model: str, *, dp: int, tp: int, experts: dict | None) -> dict:
    from fixtures.plans import make_plan

    data = make_plan(parse_model("gpt:tiny"), dp=dp, tp=tp, split=["blocks.0"] if tp > 1 else ()).model_dump()
    data["model"] = parse_model(model).model_dump()
    data["experts"] = experts
    return data


def test_plan_expert_layout_checked():
    from pydantic import ValidationError

    from planner.plan import Plan

    plan = Plan.model_validate(_plan_data("moe:tiny", dp=2, tp=2, experts=dict(ep=2, etp=2)))
    assert plan.experts is not None and plan.experts.edp(dp=2, tp=2) == 1
    assert Plan.model_validate(_plan_data("moe:tiny", dp=2, tp=1, experts=None)).experts is None
    with pytest.raises(ValidationError, match="4 experts do not split over ep=3"):
        Plan.model_validate(_plan_data("moe:tiny", dp=3, tp=1, experts=dict(ep=3)))
    with pytest.raises(ValidationError, match="ep=4 x etp=1 = 4 does not divide"):
        Plan.model_validate(_plan_data("moe:tiny", dp=2, tp=1, experts=dict(ep=4)))
    with pytest.raises(ValidationError, match="has no experts but the plan has an experts layout"):
        Plan.model_validate(_plan_data("gpt:tiny", dp=2, tp=1, experts=dict(ep=2)))
