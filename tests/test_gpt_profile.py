"""Closed-form GPT/Llama profile: parameter counts, FLOPs (SC21 eq. 3) and schema shape."""

import pytest

from planner.core import StratagemError
from planner.model import parse_model
from planner.profile import ModelProfile, build_gpt_profile


@pytest.mark.parametrize(
    "preset,published",
    [
        ("gpt3-175b", 174.6e9),
        ("megatron-1008b", 1008.0e9),
        ("megatron-529.6b", 529.6e9),
        ("megatron-145.6b", 145.6e9),
        ("megatron-39.1b", 39.1e9),
    ],
)
def test_parameter_counts_match_sc21_table_1(preset, published):
    assert build_gpt_profile(parse_model(f"gpt:{preset}")).total_params == pytest.approx(published, rel=0.002)


def test_llama_parameter_counts():
    assert build_gpt_profile(parse_model("llama:llama2-7b")).total_params == pytest.approx(6.74e9, rel=0.002)
    assert build_gpt_profile(parse_model("llama:llama2-70b")).total_params == pytest.approx(68.98e9, rel=0.002)


def test_model_flops_equal_sc21_eq3_without_recompute():
    l, h, s, v = 24, 2304, 2048, 51200
    prof = build_gpt_profile(parse_model("gpt", layers=l, hidden=h, heads=24, vocab=v, max_seq=s, tie_embeddings=True))
    per_sample = sum(
        layer.shards[0].fwd_flops_per_sample + layer.shards[0].bwd_flops_per_sample for layer in prof.layers
    )
    assert per_sample == pytest.approx(72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)))


def test_shape_tp_shards_and_signatures():
    prof = build_gpt_profile(parse_model("gpt:gpt3-175b"))
    assert isinstance(prof, ModelProfile)
    paths = [layer.path for layer in prof.layers]
    assert paths[0] == "embed" and paths[-2:] == ["norm", "head"] and paths[1] == "blocks.0"
    blocks = [layer for layer in prof.layers if layer.kind == "block"]
    assert len({b.signature for b in blocks}) == 1 and len(blocks) == 96
    assert [s.tp for s in blocks[0].shards] == [1, 2, 4, 8, 16, 32]
    b8 = blocks[0].shard(8)
    assert b8.fwd_flops_per_sample == pytest.approx(blocks[0].shards[0].fwd_flops_per_sample / 8)
    assert {(n.op, n.with_sequence_parallel) for n in blocks[0].collectives} == {
        ("all_reduce", False),
        ("all_gather", True),
        ("reduce_scatter", True),
    }
    assert prof.layer("head").shards[0].params == 0  # tied to the embedding (SC21 eq. 2)


def test_bad_dimensions_raise():
    with pytest.raises(StratagemError, match="divisible"):
        build_gpt_profile(parse_model("gpt", hidden=100, heads=3))
    with pytest.raises(StratagemError, match="gpt and llama"):
        build_gpt_profile(parse_model("resnet:tiny"))
