"""The spatial-parallel cost model (planner/cost/spatial.py, spatial_plan.py) on cases computed by hand."""

from __future__ import annotations

import pytest

from planner.cost import (
    UNSPLIT,
    SpatialConfig,
    SpatialCosts,
    SpatialOption,
    SpatialSplitError,
    check_split,
    collective_time,
    crosses_nodes,
    estimate_spatial,
    halo_exchange,
    layer_options,
    split_grid,
    with_gpus,
)
from planner.model import parse_model, volume_layers
from planner.profile import load_cluster_profile, resolve_cluster_path
from runtime.profiling.model import profile_model_analytic

V100 = with_gpus(load_cluster_profile(resolve_cluster_path("aws-p3-16xlarge")), 16)


@pytest.fixture(scope="module")
def unet_tiny():
    return profile_model_analytic(parse_model("unet3d:tiny"), seq_len=1, dtype="fp32")


def _layer(model: str, path: str):
    return next(v for v in volume_layers(parse_model(model)) if v.path == path)


def test_halo_bytes_and_time_by_hand():
    node = V100.node_types[0]
    conv = _layer("unet3d:tiny", "blocks.1")  # 4 -> 4 channels, 16^3, 3x3x3: halo 1
    assert (conv.c_in, conv.in_extent, conv.halo) == (4, 16, 1)
    seconds, nbytes = halo_exchange(
        conv, SpatialOption(grid=(2, 1, 1)), samples=1, dtype="fp32", node=node, cluster=V100
    )
    face = 1 * 4 * 16 * 16 * 4  # halo x channels x 16 x 16 voxels x 4 bytes, one neighbour
    assert nbytes == face
    one = collective_time(V100, "send_recv", face, 2, node_type=node, spans_nodes=False, ranks_per_node=2)
    assert seconds == pytest.approx(one)
    # d then h: the h faces carry the d halos (10 = 8 + 2 rows); each rank of a 2-wide row has one neighbour
    _, nbytes = halo_exchange(conv, SpatialOption(grid=(2, 2, 1)), samples=3, dtype="fp32", node=node, cluster=V100)
    assert nbytes == 3 * 4 * (4 * 8 * 16 + 4 * 10 * 16)
    # 4 along d: middle ranks have two neighbours
    _, nbytes = halo_exchange(conv, SpatialOption(grid=(4, 1, 1)), samples=1, dtype="fp32", node=node, cluster=V100)
    assert nbytes == 2 * face
    pool = _layer("unet3d:tiny", "blocks.2")
    assert halo_exchange(pool, SpatialOption(grid=(2, 1, 1)), samples=1, dtype="fp32", node=node, cluster=V100) == (
        0,
        0,
    )


def test_compute_divides_memory_shrinks_and_options(unet_tiny):
    costs = SpatialCosts(unet_tiny, V100, sd=4, micro_batch=2)
    whole = costs.layer("blocks.1", UNSPLIT)
    split = costs.layer("blocks.1", SpatialOption(grid=(4, 1, 1)))
    assert split.compute_s == pytest.approx(whole.compute_s / 4)
    assert whole.act_bytes / 4 < split.act_bytes < whole.act_bytes / 4 * 1.5  # + halo-padded input copy
    assert split.halo_s > 0 and split.norm_s > 0 and whole.halo_s == whole.norm_s == 0
    grids = [o.grid for o in layer_options(_layer("unet3d:tiny", "blocks.1"), 4)]
    assert grids == [(1, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 1)]  # degrees 4 and 2 (dividing sd 4)
    assert [o.grid for o in layer_options(_layer("cosmoflow:tiny", "dense.0"), 4)] == [(1, 1, 1)]


def test_layout_changes_cost_gathers(unet_tiny):
    costs = SpatialCosts(unet_tiny, V100, sd=2, micro_batch=1)
    d2, h2 = SpatialOption(grid=(2, 1, 1)), SpatialOption(grid=(1, 2, 1))
    gather = costs.edge("blocks.0", d2, UNSPLIT)
    assert gather > 0 and costs.edge("blocks.0", UNSPLIT, d2) == gather
    assert costs.edge("blocks.0", d2, h2) == pytest.approx(2 * gather)
    assert costs.edge("blocks.0", d2, d2) == 0
    wide = SpatialCosts(unet_tiny, V100, sd=4, micro_batch=1)  # degree 2 and 4 neighbours: each side's gather
    d4 = SpatialOption(grid=(4, 1, 1))
    assert wide.edge("blocks.0", d2, d4) == pytest.approx(
        wide.edge("blocks.0", d2, UNSPLIT) + wide.edge("blocks.0", UNSPLIT, d4)
    )
    assert ("blocks.1", "blocks.6") in costs.edges  # the U-Net skip connection is an edge


def test_estimate_adds_its_parts_and_split_needs_less_memory(unet_tiny):
    paths = [layer.path for layer in unet_tiny.layers]
    whole = estimate_spatial(unet_tiny, V100, SpatialConfig(dp=4, sd=4, micro_batch=1, num_micro_batches=1, layout={}))
    split = estimate_spatial(
        unet_tiny,
        V100,
        SpatialConfig(
            dp=4, sd=4, micro_batch=1, num_micro_batches=1, layout={p: SpatialOption(grid=(4, 1, 1)) for p in paths}
        ),
    )
    for est in (whole, split):
        assert est.step_time_s == pytest.approx(sum(est.breakdown_s.values()))
    assert split.memory_bytes["activations"] < whole.memory_bytes["activations"] / 3
    assert split.breakdown_s["compute"] == pytest.approx(whole.breakdown_s["compute"] / 4)


def test_grids_and_node_crossing():
    assert split_grid(16, ("d", "h", "w")) == (4, 2, 2)
    assert split_grid(2, ("d", "h")) == (2, 1, 1)
    assert crosses_nodes((4, 2, 2), 0, 8) and not crosses_nodes((4, 2, 2), 1, 8)
    assert not crosses_nodes((2, 2, 2), 0, 8)


def test_bad_splits_are_one_line_errors():
    conv = _layer("unet3d:tiny", "blocks.3")  # 8^3
    with pytest.raises(SpatialSplitError, match="spatial degree 3 along w does not divide its 8-voxel extent"):
        check_split(conv, SpatialOption(grid=(1, 1, 3)))
    wide = _layer("cosmoflow:tiny", "blocks.1")
    wide5 = next(v for v in volume_layers(parse_model("cosmoflow:tiny", kernel=5)) if v.path == "blocks.1")
    check_split(wide, SpatialOption(grid=(4, 1, 1)))
    with pytest.raises(SpatialSplitError, match="halo of 2 voxels is wider than its 1-voxel shard along d") as err:
        check_split(wide5, SpatialOption(grid=(8, 1, 1)))
    assert "\n" not in str(err.value)
    with pytest.raises(SpatialSplitError, match="pooling does not divide"):
        check_split(_layer("unet3d:tiny", "blocks.2"), SpatialOption(grid=(16, 1, 1)))


def test_volume_must_halve_cleanly():
    from planner.core import StratagemError

    with pytest.raises(StratagemError, match="use a volume divisible by 8"):
        parse_model("unet3d:cicek2016", volume=100)
