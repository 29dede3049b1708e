"""hf: Mixture-of-Experts configs are planned as MoE models: the meta profile attaches each MoE block's routed
experts (``ExpertProfile``) as the zoo's ``moe`` family does (Mixtral-8x7B's HF config gives the figures of
``moe:mixtral-8x7b``), the search costs them over ep (etp 1, what the runtime runs for hf:) and
``estimate --ep`` costs other layouts."""

from __future__ import annotations

import json

import pytest
from hf_helpers import write_moe_config
from transformers import AutoModelForCausalLM, MixtralConfig

from planner.cli.main import main
from planner.model import parse_model
from planner.plan import load_plan
from planner.profile import build_moe_profile
from runtime.models.hf import hf_config
from runtime.models.hf_moe import moe_dims_from_hf
from runtime.profiling.model import profile_model_analytic

# Mixtral-8x7B's config.json (mistralai/Mixtral-8x7B-v0.1; Jiang et al. 2024, arXiv:2401.04088, Table 1), as
# planner.model.spec's moe:mixtral-8x7b preset transcribes it; sequence 4096 as that preset.
MIXTRAL_8X7B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=32768,
    num_local_experts=8,
    num_experts_per_tok=2,
    rope_theta=1e6,
)


def _expert_figures(profile):
    """Each block's experts, less where the runtime keeps them without an expert layout (hf: in the dense wrapper)."""
    return [
        (
            layer.path,
            layer.experts.model_copy(
                update={
                    "wrapped_at_ep1": False,
                    "fused_saved_bytes_per_token": None,
                    "fused_backward_bytes_per_weight_byte": None,
                }
            )
            if layer.experts
            else None,
        )
        for layer in profile.layers
        if layer.kind == "block"
    ]


def test_hf_mixtral_8x7b_profile_has_the_zoo_presets_experts_and_parameters(tmp_path):
    MixtralConfig(**MIXTRAL_8X7B).save_pretrained(tmp_path)
    hf = profile_model_analytic(parse_model(f"hf:{tmp_path}/config.json"), seq_len=4096)
    zoo = build_moe_profile(parse_model("moe:mixtral-8x7b"), seq_len=4096)
    assert all(layer.experts.wrapped_at_ep1 for layer in hf.layers if layer.experts)
    assert _expert_figures(hf) == _expert_figures(zoo)  # E 8, top-2, h 4096, f 14336, dropless, on all 32 blocks
    assert hf.layers[1].experts.params == 8 * 3 * 4096 * 14336
    assert hf.total_params == pytest.approx(zoo.total_params, rel=0.01)  # 46.7e9 both (exactly equal today)
    # the block shard without the routed experts: attention + router, as the zoo's closed form
    hf_block, zoo_block = hf.layer("blocks.0").shards[0], zoo.layer("blocks.0").shards[0]
    assert hf_block.params == zoo_block.params
    assert hf_block.fwd_flops_per_sample == pytest.approx(zoo_block.fwd_flops_per_sample, rel=0.01)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_hf_moe_profile_experts_follow_the_config_mapping(tmp_path, kind):
    """The ExpertProfile read off transformers' modules equals runtime.models.hf_moe's mapping of the config, and
    the profile's parameters (shards + routed experts) are the HF model's; Qwen2-MoE's leading dense block
    (mlp_only_layers) has none."""
    overrides = {"mlp_only_layers": [0]} if kind == "qwen2_moe" else {}
    path = write_moe_config(tmp_path / kind, kind, **overrides)
    spec = parse_model(f"hf:{path}")
    profile = profile_model_analytic(spec, seq_len=16)
    dims, _ = moe_dims_from_hf(json.loads(path.read_text()))
    expected = (dims["experts"], dims["top_k"], dims["expert_ffn"], dims["hidden"], 16, None)
    got = {
        p: e and (e.experts, e.top_k, e.expert_ffn, e.hidden, e.tokens_per_sample, e.capacity_factor)
        for p, e in _expert_figures(profile)
    }
    assert got == {"blocks.0": None if kind == "qwen2_moe" else expected, "blocks.1": expected}
    model = AutoModelForCausalLM.from_config(hf_config(spec), experts_implementation="eager")
    assert profile.total_params == sum(p.numel() for p in model.parameters())
    # the routed experts' parameters are not in the block shard (the planner adds them per ep)
    assert profile.layer("blocks.1").params + 4 * 3 * 64 * 48 == profile.layer("blocks.1").total_params


def _cli(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


COMMON = ("--cluster", "dgx-h100", "--gpus", 16, "--global-batch", 64, "--seq", 128)


def test_hf_moe_plan_searches_ep_and_estimate_costs_it(capsys, tmp_path):
    """The search costs an hf: Mixtral as an MoE (expert states, expert gradient sync) over ep like the zoo's moe
    family; ``estimate --ep 2`` costs the all-to-all. A plan file edited to ep 2, or ep 2 x etp 2, launches (dry
    run: each rank's experts); edited to a capacity factor or to ep 3 it is refused with a one-line error."""
    model = ("--model", f"hf:{write_moe_config(tmp_path / 'mixtral', 'mixtral')}")
    out = tmp_path / "plan.json"
    status, _, err = _cli(capsys, "plan", *model, *COMMON, "--out", out)
    assert status == 0, err
    plan = load_plan(out)
    assert "expert parallelism not searched" not in plan.search.notes
    pred = plan.predictions
    ep = plan.experts.ep if plan.experts is not None else 1  # the tiny model's best keeps ep 1 today
    assert pred.stages[0].memory_breakdown_bytes["expert_states"] > 0
    assert pred.breakdown_s["expert_sync"] > 0 and (pred.breakdown_s["ep_comm"] > 0) == (ep > 1)
    dp, mb = plan.mesh.size("dp"), plan.schedule.micro_batch_size
    assert (plan.mesh.size("tp"), plan.mesh.size("pp"), dp) == (1, 1, 16)

    def estimate(ep, *extra):
        argv = ("estimate", *model, *COMMON, "--micro-batch", mb, "--zero", plan.zero_stage, "--ep", ep, *extra)
        status, text, err = _cli(capsys, *argv)
        assert status == 0, err
        return text

    ep1, ep2 = json.loads(estimate(1, "--json")), json.loads(estimate(2, "--json"))
    assert json.loads(estimate(ep, "--json"))["step_time_s"] == pytest.approx(pred.step_time_s, rel=1e-6)
    assert ep2["breakdown"]["ep_comm"] > 0 == ep1["breakdown"]["ep_comm"]
    assert json.loads(estimate(2, "--etp", 2, "--json"))["breakdown"]["ep_comm"] > 0
    status, _, err = _cli(capsys, "estimate", *model, *COMMON, "--micro-batch", mb, "--ep", 3)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "ep dividing the experts (1, 2, 4)" in err

    def launch(**experts):
        edited = json.loads(out.read_text())
        edited.pop("content_hash")
        edited["experts"] = {"ep": 2, "etp": 1, "capacity_factor": None, **experts}
        (tmp_path / "edited.json").write_text(json.dumps(edited))
        return _cli(capsys, "launch", tmp_path / "edited.json", "--dry-run", "--steps", 1)

    status, text, err = launch()
    assert status == 0, err
    assert "experts 0..1 of 4 (ep 2, edp 0 of 8)" in text and "experts 2..3 of 4 (ep 2, edp 7 of 8)" in text
    status, text, err = launch(etp=2)
    assert status == 0, err
    assert "experts 2..3 of 4, 1/2 of each FFN (ep 2, edp 3 of 4)" in text
    status, _, err = launch(ep=3)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "choose ep dividing the experts (1, 2, 4)" in err
    status, _, err = launch(capacity_factor=1.0)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "dropless" in err


def test_hf_mixtral_8x7b_on_64_h100_is_planned_with_expert_parallelism(capsys, tmp_path):
    """Mixtral-8x7B's HF config on 64 H100 (global batch 512, sequence 4096): the search proves a plan with
    ep > 1 optimal (pp 2, dp 32, ep 8 today)."""
    MixtralConfig(**MIXTRAL_8X7B).save_pretrained(tmp_path)
    argv = ("plan", "--model", f"hf:{tmp_path}", "--cluster", "dgx-h100", "--gpus", 64, "--global-batch", 512)
    status, _, err = _cli(capsys, *argv, "--seq", 4096, "--out", tmp_path / "plan.json")
    assert status == 0, err
    plan = load_plan(tmp_path / "plan.json")
    assert plan.experts is not None and plan.experts.ep > 1 and plan.experts.etp == 1
    assert plan.search.status == "optimal"


def test_hf_qwen3_30b_a3b_profile_matches_the_closed_form_with_its_head_dim(tmp_path):
    """Qwen/Qwen3-30B-A3B's config.json (as planner.model.spec's moe:qwen3-30b-a3b transcribes it, plus its
    head_dim 128): the same routed experts as the preset, and 30.53e9 parameters, the preset's closed form with
    head_dim 128 up to the q/k norms (48 x 2 x 128)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        vocab_size=151936,
        max_position_embeddings=40960,
        head_dim=128,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    hf = profile_model_analytic(parse_model(f"hf:{tmp_path}/config.json"), seq_len=4096)
    zoo = build_moe_profile(parse_model("moe:qwen3-30b-a3b"), seq_len=4096, head_dim=128)
    assert _expert_figures(hf) == _expert_figures(zoo)
    assert hf.total_params == zoo.total_params + 48 * 2 * 128


def test_fused_experts_saved_bytes_are_measured_and_exact_at_a_fourth_width():
    """The bytes transformers' fused Mixtral experts save per token, taken as a h + b f + c through three small
    CPU copies, equal a direct run at another width (rows of width h, f or 1 only)."""
    import torch

    from runtime.profiling.experts import _saved_by_small_copy, fused_saved_bytes_per_token

    config = MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)
    experts = AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts.to(torch.float32)
    measured = fused_saved_bytes_per_token(experts, top_k=2)
    assert measured == pytest.approx(_saved_by_small_copy(experts, 2, 48, 40), rel=1e-12)
    # per token, two rows, fp32: each row's input, gate_up, act(gate), product, down output (3h + 4f elements)
    assert measured >= 2 * 4 * (3 * 48 + 4 * 40)


def test_a_block_tp_cannot_split_counts_its_attention_scores_once(tmp_path):
    """No tp > 1 shard to fit R against (one key/value head): every saved byte but the attention scores is
    replicated, and the scores stay their own term (R + scores counted them twice before)."""
    MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
    ).save_pretrained(tmp_path)
    shard = profile_model_analytic(parse_model(f"hf:{tmp_path}/config.json"), seq_len=64).layer("blocks.0").shards[0]
    assert shard.saved_attention_scores_bytes_per_sample > 0
    assert shard.saved_replicated_bytes_per_sample == pytest.approx(
        shard.saved_bytes_per_sample - shard.saved_attention_scores_bytes_per_sample
    )


def test_fused_experts_backward_makes_whole_weight_gradients():
    """transformers' eager loop takes each expert's slice of the fused weights; each slice's backward makes a
    zero-filled gradient of the whole fused tensor that autograd sums: the backward grows by more than the
    weights themselves (measured: 2.29 x for Mixtral's loop), which the memory model prices where it runs."""
    import torch

    from runtime.profiling.experts import fused_backward_bytes_per_weight_byte

    config = MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)
    experts = AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts.to(torch.float32)
    assert 1.0 < fused_backward_bytes_per_weight_byte(experts, top_k=2) < 4.0
