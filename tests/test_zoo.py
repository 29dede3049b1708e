"""Model zoo: every family builds and trains a step; sizes match published counts; TP shards are exact."""

from __future__ import annotations

import pytest
import torch

from planner.core import StratagemError
from planner.model import parse_model
from runtime.models import (
    build_layer,
    build_model,
    build_tp_shard,
    example_batch,
    init_weights,
    layer_kind,
    layer_paths,
    loss_fn,
    tp_collectives,
    tp_constraints,
    tp_layout,
)

TINY = ["gpt:tiny", "llama:tiny", "resnet:tiny", "resnet:tiny-wide", "mlp:tiny"]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_on_cpu(name):
    spec = parse_model(name)
    model = init_weights(build_model(spec), seed=0)
    x, y = example_batch(spec, 2, 16)
    loss = loss_fn(spec)(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name,seq", [("gpt:gpt3-175b", 32), ("llama:llama2-7b", 32), ("resnet:resnet50-wide", 1)])
def test_big_presets_forward_backward_on_meta(name, seq):
    spec = parse_model(name)
    model = build_model(spec, device="meta", dtype=torch.bfloat16)
    x, y = example_batch(spec, 1, seq, device="meta", dtype=torch.bfloat16)
    out = model(x)
    loss_fn(spec)(out, y).backward()
    assert out.device.type == "meta"
    assert model.head.weight.grad is not None if hasattr(model, "head") else model.fc.weight.grad is not None


def test_gpt3_175b_param_count_matches_megatron_eq2():
    # Narayanan et al. SC21 eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)) = 174.6e9 for GPT-3
    spec = parse_model("gpt:gpt3-175b")
    params = n_params(build_model(spec, device="meta"))
    assert params == pytest.approx(174.6e9, rel=0.005)
    l, h, v, s = 96, 12288, 51200, 2048
    assert params == 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h  # + final LayerNorm (2h)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("resnet:resnet50", 25_557_032),  # torchvision resnet50 / He et al. 2016 (25.6M)
        ("gpt:gpt2", 124_439_808),  # HF gpt2 model card (124M)
        ("llama:llama2-7b", 6_738_415_616),  # HF meta-llama/Llama-2-7b-hf (6.74B)
    ],
)
def test_published_param_counts(name, expected):
    assert n_params(build_model(parse_model(name), device="meta")) == expected


def test_layer_paths_kinds_and_pipeline_cut():
    spec = parse_model("gpt:tiny")
    assert layer_paths(spec) == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    assert [layer_kind(p) for p in layer_paths(spec)] == ["embedding", "block", "block", "norm", "head"]
    assert layer_paths(parse_model("resnet:tiny")) == [
        "stem",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "pool",
        "fc",
    ]
    assert len(layer_paths(parse_model("resnet:resnet50"))) == 16 + 3
    full = init_weights(build_model(spec), seed=1)
    first, second = init_weights(build_model(spec), seed=1), init_weights(build_model(spec), seed=1)
    del first.blocks["1"]
    first.norm = first.head = None
    second.embed = None
    del second.blocks["0"]
    assert layer_paths(first) == ["embed", "blocks.0"] and layer_paths(second) == ["blocks.1", "norm", "head"]
    x, _ = example_batch(spec, 2, 8)
    torch.testing.assert_close(second(first(x)), full(x))


def test_init_is_placement_independent_and_tied():
    spec = parse_model("gpt:tiny", tie_embeddings=True)
    cpu = init_weights(build_model(spec), seed=7)
    meta = build_model(spec, device="meta")
    meta.to_empty(device="cpu")
    init_weights(meta, seed=7)
    assert meta.head.weight is meta.embed.tok.weight
    cut = build_model(spec, device="meta")
    cut.embed = None
    cut.to_empty(device="cpu")
    init_weights(cut, seed=7)
    ref = cpu.state_dict()
    for key, value in meta.state_dict().items():
        assert torch.equal(value, ref[key]), key
    assert torch.equal(cut.head.weight, cpu.embed.tok.weight)
    other = init_weights(build_model(spec), seed=8)
    assert not torch.equal(other.blocks["0"].attn.qkv.weight, cpu.blocks["0"].attn.qkv.weight)


def test_bad_specs_raise_one_line_errors():
    with pytest.raises(StratagemError, match="not divisible by heads"):
        build_model(parse_model("gpt", hidden=30, heads=4))
    with pytest.raises(StratagemError, match="no dimension"):
        build_model(parse_model("gpt:tiny").model_copy(update={"dims": {"depth": 3}}))
    with pytest.raises(StratagemError, match="kv_heads"):
        build_model(parse_model("llama", heads=4, kv_heads=3))
    with pytest.raises(StratagemError, match="tp=3"):
        build_tp_shard(parse_model("gpt:tiny"), "blocks.0", 3)
    with pytest.raises(StratagemError, match="cannot be split"):
        build_tp_shard(parse_model("gpt:tiny"), "norm", 2)
    with pytest.raises(StratagemError, match="no top-level layer"):
        tp_layout(parse_model("gpt:tiny"), "blocks.9")


def test_tp_layout_and_constraints_are_megatron():
    spec = parse_model("gpt:gpt2")
    layout = tp_layout(spec, "blocks.0")
    assert {k: v for k, v in layout.items() if v != "sequence_parallel"} == {
        "attn.qkv": "colwise",
        "attn.proj": "rowwise",
        "mlp.fc1": "colwise",
        "mlp.fc2": "rowwise",
    }
    assert tp_layout(spec, "embed") == {"tok": "vocab_embedding"}
    assert tp_layout(spec, "head") == {"": "colwise_sharded_output"}
    assert tp_layout(parse_model("resnet:tiny"), "blocks.0") == {}
    assert tp_constraints(spec, "blocks.3") == {"heads": 12, "ffn_hidden": 3072}
    assert tp_constraints(spec, "head") == {"vocab": 50257}
    assert tp_constraints(parse_model("llama:llama2-70b"), "blocks.0") == {
        "heads": 64,
        "kv_heads": 8,
        "ffn_hidden": 28672,
    }


def test_tp_collectives_gpt_block_hand_count():
    spec = parse_model("gpt:gpt2")
    needs = tp_collectives(spec, "blocks.0", 1024, dtype=torch.bfloat16)
    no_sp = [(n.op, n.phase, n.count, n.bytes_per_sample) for n in needs if not n.with_sequence_parallel]
    act = 1024 * 768 * 2  # s * h * 2 bytes
    assert sorted(no_sp) == [("all_reduce", "backward", 2, act), ("all_reduce", "forward", 2, act)]
    sp = {(n.op, n.phase): n.count for n in needs if n.with_sequence_parallel}
    assert sp == {
        ("all_gather", "forward"): 2,
        ("reduce_scatter", "forward"): 2,
        ("all_gather", "backward"): 2,
        ("reduce_scatter", "backward"): 2,
    }
    assert tp_collectives(spec, "norm", 1024) == []


def _shard_params(full: torch.nn.Module, shard: torch.nn.Module, rank: int, tp: int) -> None:
    """Copy rank's slice of the full block's weights into a shard (Megatron layout)."""
    with torch.no_grad():
        for name, p in shard.named_parameters():
            src = full.get_parameter(name)
            if p.shape == src.shape:
                p.copy_(src)
            elif p.shape[0] != src.shape[0]:  # colwise: rows (output features) split
                p.copy_(src.chunk(tp, 0)[rank])
            else:  # rowwise: columns (input features) split
                p.copy_(src.chunk(tp, 1)[rank])


@pytest.mark.parametrize("name,tp", [("gpt:tiny", 2), ("gpt:tiny", 4), ("llama:tiny", 2)])  # llama:tiny: 2 kv heads
def test_tp_block_shards_sum_to_full_block(name, tp):
    """Megatron split: colwise shards hold whole heads (per-head fused qkv), rowwise partial sums add up."""
    spec = parse_model(name)
    rowwise = ("attn.proj", "mlp.fc2") if name.startswith("gpt") else ()  # llama has no biases
    full = init_weights(build_model(spec), seed=0).blocks["0"].eval()
    x = torch.randn(2, 8, 64)
    h = full.ln1(x)
    want_attn, want_mlp = full.attn(h), full.mlp(full.ln2(x))
    got_attn, got_mlp = 0, 0
    for rank in range(tp):
        shard = build_tp_shard(spec, "blocks.0", tp).eval()
        _shard_params(full, shard, rank, tp)
        for path in rowwise:  # a row-parallel bias is added once, after the all-reduce
            if rank > 0:
                shard.get_submodule(path).bias.data.zero_()
        got_attn = got_attn + shard.attn(h)
        got_mlp = got_mlp + shard.mlp(full.ln2(x))
    torch.testing.assert_close(got_attn, want_attn)
    torch.testing.assert_close(got_mlp, want_mlp)


def test_tp_embedding_and_head_shards():
    spec = parse_model("gpt:tiny")
    model = init_weights(build_model(spec), seed=0).eval()
    ids, _ = example_batch(spec, 2, 8)
    h = torch.randn(2, 8, 64)
    emb_sum, logits = 0, []
    for rank in range(2):
        emb = build_tp_shard(spec, "embed", 2).eval()
        emb.tok.start = rank * 128
        emb.tok.weight.data.copy_(model.embed.tok.weight[rank * 128 : (rank + 1) * 128])
        emb.pos.weight.data.copy_(model.embed.pos.weight if rank == 0 else torch.zeros_like(emb.pos.weight))
        emb_sum = emb_sum + emb(ids)
        head = build_tp_shard(spec, "head", 2)
        head.weight.data.copy_(model.head.weight[rank * 128 : (rank + 1) * 128])
        logits.append(head(h))
    torch.testing.assert_close(emb_sum, model.embed(ids))
    torch.testing.assert_close(torch.cat(logits, -1), model.head(h))


def test_build_layer_matches_model_layer_shapes():
    spec = parse_model("resnet:tiny")
    model = build_model(spec)
    for path in layer_paths(spec):
        alone = build_layer(spec, path)
        want = [p.shape for p in model.get_submodule(path).parameters()]
        assert [p.shape for p in alone.parameters()] == want


def test_the_torch_free_path_table_names_every_zoo_family():
    from runtime.models import paths, zoo

    assert tuple(zoo._FAMILIES) == paths.ZOO_FAMILIES
