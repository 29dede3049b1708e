"""hf: Mixture-of-Experts configs (Mixtral, Qwen2-MoE, Qwen3-MoE): built on meta, the wrapped model gives
transformers' own logits, and they are planned without tensor parallelism (fused expert weights) with the
reason stated."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import write_moe_config
from transformers import AutoModelForCausalLM

from planner.model import parse_model
from runtime.models import build_model, init_weights, layer_paths, loss_fn
from runtime.models.external import external
from runtime.models.hf import hf_config, hf_parts

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("kind", KINDS)
def test_wrapped_moe_gives_the_hf_models_logits_and_trains(tmp_path, kind):
    spec = parse_model("hf:" + str(write_moe_config(tmp_path / kind, kind)))
    ours = build_model(spec, device="meta").to_empty(device="cpu")
    init_weights(ours, seed=0)
    assert layer_paths(spec) == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    # transformers' reference loops over the experts ("eager"); ours gathers them ("batched_mm", meta-safe)
    ref = AutoModelForCausalLM.from_config(hf_config(spec), attn_implementation="eager", experts_implementation="eager")
    parts = hf_parts(spec)
    with torch.no_grad():
        ref.get_submodule(parts.tok).weight.copy_(ours.embed.tok.weight)
        for i, block in enumerate(ref.get_submodule(parts.blocks)):
            block.load_state_dict(ours.blocks[str(i)].layer.state_dict())
        ref.get_submodule(parts.norm).load_state_dict(ours.norm.state_dict())
        ref.get_submodule(parts.head).load_state_dict(ours.head.state_dict())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    ref.eval(), ours.eval()
    with torch.no_grad():
        assert torch.allclose(ref(input_ids=ids).logits, ours(ids), atol=1e-5)
    ours.train()
    loss_fn(spec)(ours(ids), ids).backward()
    experts = [p for n, p in ours.named_parameters() if ".experts." in n]
    assert experts and all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts)
    assert external(spec).layouts.get("blocks.0", {}) == {} and external(spec).tp_note


@pytest.mark.slow
def test_hf_moe_trains_under_pp2_and_zero3_like_one_process(tmp_path):
    """Qwen2-MoE (routed + gated shared expert) through the executor: PP2 1F1B and DP2 ZeRO-3, one launch."""
    from runtime_helpers import tail, torchrun

    from fixtures.plans import make_plan
    from fixtures.reference import reference_losses
    from planner.plan import save_plan
    from runtime.executor.metrics import final_step_losses, read_metrics

    spec = parse_model("hf:" + str(write_moe_config(tmp_path / "qwen2_moe", "qwen2_moe")))
    plans = {
        "pp2": make_plan(spec, pp=2, schedule="1f1b", num_micro_batches=2),
        "dp2_zero3": make_plan(spec, dp=2, zero_stage=3),
    }
    args = ["--steps", "3", "--timeout-s", "60"]
    for name, plan in plans.items():
        args += [
            "--plan",
            str(save_plan(plan, tmp_path / f"{name}.json")),
            "--metrics",
            str(tmp_path / f"{name}.jsonl"),
        ]
    proc = torchrun(2, args, timeout_s=180)
    assert proc.returncode == 0, tail(proc)
    for name, plan in plans.items():
        measured = final_step_losses(read_metrics(tmp_path / f"{name}.jsonl"))
        for step, ref in enumerate(reference_losses(plan, 3), start=1):
            assert measured[step] == pytest.approx(ref, rel=1e-5), (name, step, measured)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_moe_config_maps_onto_the_zoo_moe_family(tmp_path, kind):
    """The mapped zoo moe model has the HF model's parameter count (Mixtral exactly; Qwen2-MoE up to its
    attention biases and shared-expert gate, Qwen3-MoE up to its q/k norms) and runs with expert parallelism."""
    import json

    from runtime.models.hf_moe import moe_dims_from_hf

    path = write_moe_config(tmp_path / kind, kind)
    config = json.loads(path.read_text())
    dims, notes = moe_dims_from_hf(config)
    zoo = build_model(parse_model("moe", **dims), device="meta")
    hf = AutoModelForCausalLM.from_config(hf_config(parse_model("hf:" + str(path))), experts_implementation="eager")
    layers, h = config["num_hidden_layers"], config["hidden_size"]
    extra = {
        "mixtral": 0,
        "qwen2_moe": layers * (64 + 32 + 32 + h),  # q/k/v biases, the shared expert's sigmoid gate (h x 1)
        "qwen3_moe": layers * 2 * 16,  # q_norm, k_norm of head_dim 16
    }[kind]
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in zoo.parameters()) + extra
    assert (dims["experts"], dims["top_k"], dims["expert_ffn"]) == (4, 2, 48)
    assert dims["shared_experts"] == (2 if kind == "qwen2_moe" else 0)
    assert any("norm_topk_prob" in n for n in notes) == (kind != "mixtral")  # Qwen's default: unnormalised
    assert dims["rope_theta"] == config["rope_parameters"]["rope_theta"]


def test_hf_moe_mapping_refuses_what_the_zoo_cannot_hold():
    from planner.core import StratagemError
    from runtime.models.hf_moe import moe_dims_from_hf

    with pytest.raises(StratagemError, match="not a Mixture-of-Experts config"):
        moe_dims_from_hf({"model_type": "llama", "hidden_size": 64})
    qwen = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "num_hidden_layers": 4}
    with pytest.raises(StratagemError, match="not the leading blocks"):
        moe_dims_from_hf({**qwen, "mlp_only_layers": [1], "hidden_size": 64, "num_attention_heads": 4})


def test_the_runtime_runs_fused_experts_as_a_loop_not_per_row_weight_copies(tmp_path):
    """Built for the meta device, an hf: MoE model's fused experts use transformers' ``batched_mm``, which copies
    each (token, choice)'s expert weights and saves them for the backward; the runtime switches them to the
    per-expert loop (``runtime.models.hf.use_loop_experts``, called by ``build_chunk``): the same loss and
    gradients, a fraction of the live tensor bytes."""
    from runtime.executor.tensor_memory import TensorMemory
    from runtime.models.hf import use_loop_experts

    spec = parse_model("hf:" + str(write_moe_config(tmp_path / "mixtral", "mixtral")))
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    runs = {}
    for loop in (False, True):
        model = build_model(spec, device="meta").to_empty(device="cpu")
        init_weights(model, seed=0)
        if loop:
            assert use_loop_experts(model) >= 1
        with TensorMemory([model], []) as tracker:
            loss = loss_fn(spec)(model(ids), ids)
            loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        runs[loop] = (loss.item(), grads, tracker.peak().peak_bytes)
    (loss_b, grads_b, peak_b), (loss_l, grads_l, peak_l) = runs[False], runs[True]
    assert loss_l == pytest.approx(loss_b, abs=1e-6) and torch.allclose(grads_l, grads_b, atol=1e-6)
    assert peak_l < peak_b / 3, (peak_l, peak_b)
