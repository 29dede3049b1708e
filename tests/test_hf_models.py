"""hf: models — pieces found by structure (same logits as transformers' own forward), TP layout derived from the
module tree (or refused with the reason), FLOPs equal to the zoo's Llama, Llama-3-8B parameter count without
allocation, and one-line errors for bad input."""

from __future__ import annotations

import json
import resource
import sys

import pytest
import torch
from hf_helpers import LLAMA3_8B, write_config
from transformers import AutoModelForCausalLM

from planner.core import StratagemError
from planner.model import parse_model
from runtime.models import build_model, init_weights, layer_paths, tp_layout
from runtime.models.external import external
from runtime.models.hf import build_hf, hf_config, hf_parts, require_transformers
from runtime.profiling.model import profile_model_analytic


def _spec(tmp_path, kind="llama", **overrides):
    return parse_model("hf:" + str(write_config(tmp_path / kind, kind, **overrides)))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma", "gpt2"])
def test_wrapped_model_gives_the_hf_models_logits(tmp_path, kind):
    spec = _spec(tmp_path, kind)
    ours = build_model(spec, device="meta")
    ours.to_empty(device="cpu")
    init_weights(ours, seed=0)
    assert layer_paths(spec) == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    ref = AutoModelForCausalLM.from_config(hf_config(spec), attn_implementation="eager")
    parts = hf_parts(spec)
    with torch.no_grad():  # copy our weights into the HF model by the parts found by structure
        ref.get_submodule(parts.tok).weight.copy_(ours.embed.tok.weight)
        if parts.pos:
            ref.get_submodule(parts.pos).weight.copy_(ours.embed.pos.weight)
        for i, block in enumerate(ref.get_submodule(parts.blocks)):
            block.load_state_dict(ours.blocks[str(i)].layer.state_dict())
        ref.get_submodule(parts.norm).load_state_dict(ours.norm.state_dict())
        ref.get_submodule(parts.head).load_state_dict(ours.head.state_dict())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    ref.eval(), ours.eval()
    assert torch.allclose(ref(input_ids=ids).logits, ours(ids), atol=1e-5)
    assert parts.tied == (kind in ("gpt2", "gemma")) and (parts.pos is not None) == (kind == "gpt2")


def test_tp_layout_derived_from_the_module_tree(tmp_path):
    spec = _spec(tmp_path)
    assert tp_layout(spec, "blocks.1") == {
        "layer.self_attn.q_proj": "colwise",
        "layer.self_attn.k_proj": "colwise",
        "layer.self_attn.v_proj": "colwise",
        "layer.self_attn.o_proj": "rowwise",
        "layer.mlp.gate_proj": "colwise",
        "layer.mlp.up_proj": "colwise",
        "layer.mlp.down_proj": "rowwise",
    }
    assert tp_layout(spec, "embed") == {"tok": "vocab_embedding"} and tp_layout(spec, "norm") == {}
    assert external(spec).tp_note == ""
    # GQA: 2 KV heads allow tp 1 and 2 only
    assert profile_model_analytic(spec, seq_len=16, dtype="fp32").tp_degrees == [1, 2]


def test_gpt2_is_planned_without_tp_and_says_why(tmp_path):
    spec = _spec(tmp_path, "gpt2")
    note = external(spec).tp_note
    assert "Conv1D" in note and "not searched" in note
    assert tp_layout(spec, "blocks.0") == {}
    profile = profile_model_analytic(spec, seq_len=16, dtype="fp32")
    assert profile.tp_degrees == [1] and all(layer.tp_style == "none" for layer in profile.layers)


def test_flops_and_params_agree_with_the_zoo_llama(tmp_path):
    spec = _spec(tmp_path)
    zoo = parse_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=176, vocab=256, max_seq=128)
    ours = profile_model_analytic(spec, seq_len=32, dtype="fp32", tp_degrees=(1, 2))
    theirs = profile_model_analytic(zoo, seq_len=32, dtype="fp32", tp_degrees=(1, 2))
    assert ours.total_params == theirs.total_params
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert a.path == b.path
        for sa, sb in zip(a.shards, b.shards, strict=True):
            assert (sa.tp, sa.params) == (sb.tp, sb.params)
            assert sa.fwd_flops_per_sample == pytest.approx(sb.fwd_flops_per_sample, rel=1e-12)
            assert sa.bwd_flops_per_sample == pytest.approx(sb.bwd_flops_per_sample, rel=1e-12)
    assert ours.layer("blocks.0").shard(2).fwd_flops_per_sample == pytest.approx(
        ours.layer("blocks.0").shard(1).fwd_flops_per_sample / 2
    )


def test_llama3_8b_parameter_count_without_allocation(tmp_path):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = build_hf(_spec(tmp_path, **LLAMA3_8B))
    params = sum(p.numel() for p in model.parameters())
    # Meta's model card: 8.03B (Llama 3 8B); 8,030,261,248 = embedding + 32 blocks + norm + untied head
    assert params == pytest.approx(8.03e9, rel=0.005)
    assert params == 8_030_261_248
    assert all(p.device.type == "meta" for p in model.parameters())
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1024  # 8B fp32 would be 30 GiB


def test_without_transformers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(StratagemError, match=r"pip install 'stratagem\[hf\]'"):
        require_transformers()


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "does not exist"),
        ("{not json", "not readable JSON"),
        (json.dumps({"hidden_size": 8}), "no 'model_type'"),
        (json.dumps({"model_type": "no-such-arch"}), "cannot read"),
        (json.dumps({"model_type": "t5"}), "cannot build"),
        (
            json.dumps({"model_type": "gemma2", "final_logit_softcapping": 30.0}),
            "attn_logit_softcapping.*does not apply",  # its default 50.0; the final capping is applied
        ),
    ],
)
def test_bad_configs_are_one_line_errors(tmp_path, content, match):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(StratagemError, match=match) as info:
        layer_paths(parse_model(f"hf:{path}"))
    assert "\n" not in str(info.value)


def test_measured_profile_of_an_hf_model(tmp_path):
    from runtime.profiling.model import ProfileSettings, profile_model

    spec = _spec(tmp_path)
    settings = ProfileSettings(micro_batches=(1,), seq_len=8, dtype="fp32", tp_degrees=(1, 2), warmup=0, repeats=1)
    profile = profile_model(spec, settings, created_utc="")
    block = profile.layer("blocks.0")
    assert profile.provenance.method == "measured" and [s.tp for s in block.shards] == [1, 2]
    assert block.shard(1).timings[0].forward.median_s > 0 and block.runtime_overhead is not None
    assert profile.total_params == sum(p.numel() for p in build_hf(spec).parameters())
