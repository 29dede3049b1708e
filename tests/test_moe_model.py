"""The ``moe`` zoo model alone: meta builds of the presets, routing, capacity, the load-balancing loss and
its gradient, and the runtime's one-line errors for expert layouts it cannot run (no process starts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures.plans import make_plan
from planner.core import StratagemError
from planner.model import parse_model
from runtime.executor.checks import check_experts, check_supported
from runtime.executor.moe import fold_stage_ranks
from runtime.models import build_layer, build_model, init_weights, loss_fn, resolve_dims
from runtime.models.moe import MoE, capacity, moe_layers, route_tokens


def _tiny(**dims):
    spec = parse_model("moe:tiny", **dims)
    model = build_model(spec, device="meta").to_empty(device="cpu")
    return spec, init_weights(model, seed=0)


@pytest.mark.parametrize(
    ("name", "params_b"),
    [
        ("moe:mixtral-8x7b", 46.7),  # Jiang et al. 2024 (arXiv:2401.04088) §1: 46.7B total parameters
        ("moe:deepseek-v3", 671.0),  # DeepSeek-V3 report (arXiv:2412.19437) abstract: 671B (without MTP)
    ],
)
def test_presets_build_on_meta_with_their_published_size(name, params_b):
    spec = parse_model(name)
    dims = resolve_dims(spec)
    # one dense and one MoE block stand for all of their kind (the whole DeepSeek-V3 takes ~8 s to build)
    dense = [f"blocks.{i}" for i in range(dims.layers) if not dims.is_moe_block(i)]
    moe = [f"blocks.{i}" for i in range(dims.layers) if dims.is_moe_block(i)]
    total = sum(
        sum(t.numel() for t in build_layer(spec, p, device="meta").parameters()) for p in ("embed", "norm", "head")
    )
    for paths in (dense, moe):
        if paths:
            layer = build_layer(spec, paths[0], device="meta")
            assert all(t.device.type == "meta" for t in layer.parameters())
            total += len(paths) * sum(t.numel() for t in layer.parameters())
    assert total / 1e9 == pytest.approx(params_b, rel=0.01)


def test_dense_leading_blocks_and_expert_paths():
    spec, model = _tiny(layers=3, dense_layers=1)
    assert hasattr(model.blocks["0"], "mlp") and not hasattr(model.blocks["0"], "moe")
    assert sorted(moe_layers(model)) == ["blocks.1.moe", "blocks.2.moe"]
    names = {n for n, _ in model.named_parameters()}
    assert {"blocks.1.moe.router.weight", "blocks.1.moe.experts.3.w2.weight", "blocks.1.moe.shared.w1.weight"} <= names
    assert model.blocks["1"].moe.shared.w1.out_features == 64  # 1 shared expert x expert_ffn 64


def test_router_renormalises_the_top_k_probabilities():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]]])
    r = route_tokens(logits, top_k=2, capacity_factor=0.0)
    assert r.experts.tolist() == [[0, 1], [2, 3]]
    # softmax -> top-2 -> renormalised = softmax over the two chosen logits (Mixtral)
    assert torch.allclose(r.weights[0], F.softmax(torch.tensor([2.0, 1.0]), -1))
    assert torch.allclose(r.weights.sum(-1), torch.ones(2))


def test_capacity_drops_assignments_past_each_experts_slots_first_choices_first():
    # 4 tokens, 2 experts, k=1, factor 1 -> C = ceil(1 * 4 * 1 / 2) = 2 slots per expert per sequence
    assert capacity(1.0, 4, 1, 2) == 2
    logits = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    r = route_tokens(logits, top_k=1, capacity_factor=1.0)
    assert r.kept.squeeze(1).tolist() == [True, True, False, True]  # the third token to expert 0 is dropped
    assert r.weights[2].item() == 0.0
    # k=2: C = ceil(0.5 * 2 * 2 / 2) = 1; token 1's first choice (expert 1) beats token 0's second choice
    logits = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    r = route_tokens(logits, top_k=2, capacity_factor=0.5)
    assert r.experts.tolist() == [[0, 1], [1, 0]] and r.kept.tolist() == [[True, False], [True, False]]


def test_aux_loss_is_one_for_a_uniform_router_and_e_for_a_collapsed_one():
    uniform = route_tokens(torch.zeros(2, 8, 4), top_k=2, capacity_factor=0.0)
    assert uniform.aux_loss.item() == pytest.approx(1.0)  # Switch eq. 4: minimum 1 at uniform probabilities
    collapsed = torch.tensor([100.0, 50.0, 0.0, 0.0]).expand(1, 8, 4)
    # f = (1/2, 1/2, 0, 0), P = (1, 0, 0, 0) -> E * sum f P = 4 * 1/2 = 2
    assert route_tokens(collapsed, top_k=2, capacity_factor=0.0).aux_loss.item() == pytest.approx(2.0)


def test_aux_loss_gradient_is_the_coefficient_times_its_gradient():
    """The attached aux loss gives exactly the gradient of lm_loss + coef * sum of the layers' aux losses."""
    spec, model = _tiny(aux_loss_coef=0.3)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    loss_fn(spec)(model(x), y).backward()
    attached = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for moe in moe_layers(model).values():
        moe.aux_loss_coef = 0.0  # the same objective written out: the aux losses summed by hand
    captured = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, i: captured.append(_aux(mod, i[0]))) for m in moe_layers(model).values()
    ]
    (loss_fn(spec)(model(x), y) + 0.3 * sum(captured)).backward()
    for h in hooks:
        h.remove()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, attached[name], atol=1e-7), name
    assert any(attached[n].abs().sum() > 0 for n in attached if "router" in n)


def _aux(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    return route_tokens(moe.router(x), top_k=moe.top_k, capacity_factor=moe.capacity_factor).aux_loss


def test_folding_regroups_a_stages_ranks_as_edp_ep_etp():
    assert fold_stage_ranks([0, 1, 2, 3], ep=2) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert fold_stage_ranks([8, 9, 10, 11], ep=1, etp=2) == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]


def test_top_k_above_experts_is_one_line():
    with pytest.raises(StratagemError, match="top_k"):
        resolve_dims(parse_model("moe:tiny", top_k=5))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (dict(dp=3, experts={"ep": 1, "etp": 3}), "etp=3 does not divide expert_ffn=64"),
        (
            dict(tp=2, split=["blocks.0", "blocks.1"], global_batch=1, seq_len=15, experts={"ep": 2}),
            "do not split over tp=2",
        ),
    ],
)
def test_expert_layouts_the_runtime_cannot_run_are_one_line_errors(cfg, message):
    plan = make_plan(parse_model("moe:tiny"), **cfg)
    with pytest.raises(StratagemError, match=message) as err:
        check_supported(plan)
    assert "\n" not in str(err.value)


def test_a_dense_plan_of_an_moe_model_is_supported():
    check_experts(make_plan(parse_model("moe:tiny"), dp=2))


def test_profiled_moe_blocks_hold_their_routed_experts_apart():
    """A profiled MoE block's shards leave the routed experts out; the layer describes them for the planner."""
    from planner.profile import load as profiles
    from runtime.profiling.model import profile_model_analytic

    if not hasattr(profiles, "ExpertProfile"):
        pytest.skip("the profile schema has no ExpertProfile yet (issue 15, planner half)")
    spec = parse_model("moe:tiny", layers=3, dense_layers=1)
    profile = profile_model_analytic(spec, seq_len=16, dtype="fp32", tp_degrees=(1, 2))
    dense, moe = profile.layers[1], profile.layers[2]
    assert dense.experts is None
    assert (moe.experts.experts, moe.experts.top_k, moe.experts.expert_ffn) == (4, 2, 64)
    attention, router, norms, shared = 4 * 64 * 64 - 2 * 64 * 32, 64 * 4, 2 * 64, 3 * 64 * 64
    assert moe.shards[0].params == attention + router + norms + shared
    assert moe.shards[1].params == attention // 2 + router + norms + shared // 2  # tp 2 splits the shared expert
    model = build_model(spec, device="meta")
    assert profile.total_params == sum(p.numel() for p in model.parameters())


def test_forward_and_backward_run_on_the_meta_device_with_balanced_routing():
    """No data on meta: each expert takes an equal share, so FLOPs count top-k expert GEMMs per token."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = parse_model("moe:tiny", shared_experts=0)
    model = build_model(spec, device="meta")
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model.blocks["0"](model.embed(x))
    flops = counter.get_flop_counts()["Global"]
    tokens, h, f, e = 32, 64, 64, 4
    attention = 2 * tokens * h * (64 + 32 + 32 + 64) + 2 * 2 * tokens * 16 * 64  # projections + QK^T and PV
    experts = 2 * tokens * 2 * 3 * h * f  # top-2: three h x f GEMMs per chosen expert
    assert sum(flops.values()) == attention + 2 * tokens * h * e + experts
