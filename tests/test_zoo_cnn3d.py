"""The zoo's 3D CNNs: modules match their layer tables, build on meta at full size, train on CPU, and their
analytic and measured profiles carry per-layer FLOPs and activation bytes that grow with the volume."""

from __future__ import annotations

import pytest
import torch

from planner.model import parse_model, volume_layers
from runtime.models import build_model, example_batch, init_weights, loss_fn
from runtime.profiling.model import ProfileSettings, profile_model, profile_model_analytic


def _table_params(model: str) -> int:
    """Parameters from the layer table: conv c_in c_out k^3 + bias (+ GroupNorm 2c), dense c_in c_out + bias."""
    total = 0
    for v in volume_layers(parse_model(model)):
        if v.op == "conv":
            total += v.c_in * v.c_out * v.kernel**3 + v.c_out + (2 * v.c_out if v.norm else 0)
        elif v.op == "upconv":
            total += v.c_in * v.c_out * v.kernel**3 + v.c_out
        elif v.op == "dense":
            total += v.c_in * v.c_out + v.c_out
    return total


@pytest.mark.parametrize("model", ["unet3d:volume512", "unet3d:cicek2016", "cosmoflow:mlperf", "cosmoflow:volume512"])
def test_full_size_models_build_on_meta_as_their_tables_say(model):
    built = build_model(parse_model(model), device="meta")
    assert sum(p.numel() for p in built.parameters()) == _table_params(model)
    assert built.layer_paths() == [v.path for v in volume_layers(parse_model(model))]


@pytest.mark.parametrize("model", ["unet3d:tiny", "cosmoflow:tiny"])
def test_tiny_models_train_on_cpu(model):
    spec = parse_model(model)
    net = build_model(spec)
    init_weights(net, seed=0)
    x, y = example_batch(spec, 2, 1)
    out = net(x)
    expected = (2, 2, 16, 16, 16) if model.startswith("unet3d") else (2, 4)
    assert tuple(out.shape) == expected
    loss = loss_fn(spec)(out, y)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in net.parameters())


def test_analytic_profile_grows_with_the_volume():
    small = profile_model_analytic(parse_model("unet3d:tiny", volume=16), seq_len=1, dtype="fp32")
    large = profile_model_analytic(parse_model("unet3d:tiny", volume=32), seq_len=1, dtype="fp32")
    for a, b in zip(small.layers, large.layers):
        assert b.shards[0].saved_bytes_per_sample == pytest.approx(8 * a.shards[0].saved_bytes_per_sample, rel=0.01)
        assert b.shards[0].fwd_flops_per_sample == pytest.approx(8 * a.shards[0].fwd_flops_per_sample, rel=0.01)
        assert b.params == a.params
    # a conv of c_in -> c_out over V^3 voxels: 2 c_in c_out 27 V^3 forward FLOPs (multiply-add = 2)
    conv = large.layer("blocks.1")
    assert conv.shards[0].fwd_flops_per_sample >= 2 * 4 * 4 * 27 * 32**3


def test_measured_profile_of_a_3d_cnn():
    spec = parse_model("cosmoflow:tiny")
    settings = ProfileSettings(micro_batches=(2,), seq_len=1, dtype="fp32", tp_degrees=(1,), warmup=1, repeats=1)
    profile = profile_model(spec, settings, created_utc="2026-01-01T00:00:00+00:00")
    assert profile.provenance.method == "measured"
    assert [layer.path for layer in profile.layers] == ["blocks.0", "blocks.1", "dense.0", "dense.1", "head"]
    assert all(layer.shards[0].timings for layer in profile.layers)
    assert (
        profile.layer("blocks.0").shards[0].saved_bytes_per_sample
        > profile.layer("dense.0").shards[0].saved_bytes_per_sample
    )
    # the measured profile plans like the analytic one (its timings price the layers)
    from planner.cost import with_gpus
    from planner.profile import load_cluster_profile, resolve_cluster_path
    from planner.search import plan_spatial_search

    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("local-cpu-2core")), 2)
    result = plan_spatial_search(profile, cluster, gpus=2, global_batch=2)
    assert result.status == "optimal" and result.best.estimate.fits
