"""The spatial search (planner/search/spatial.py) is exact: its best plan equals a brute force over every
(sd, micro-batch) and every per-layer option (unsplit, each grid) scored by ``estimate_spatial``, on random small
instances where memory binds; and the 3D U-Net on 512^3 volumes gets a plan on 64 V100 where data parallelism
alone does not fit."""

from __future__ import annotations

import itertools
import random

import pytest

from planner.core import StratagemError
from planner.cost import UNSPLIT, SpatialConfig, SpatialCosts, estimate_spatial, layer_options, with_gpus
from planner.model import parse_model
from planner.plan import TrainingSettings
from planner.profile import load_cluster_profile, resolve_cluster_path
from planner.search import build_spatial_plan, memory_table, plan_spatial_search
from planner.search.spatial import _outer
from runtime.profiling.model import profile_model_analytic

P3 = load_cluster_profile(resolve_cluster_path("aws-p3-16xlarge"))


def _with_memory(cluster, capacity: int):
    node = cluster.node_types[0].model_copy(update={"device_memory_bytes": capacity})
    return cluster.model_copy(update={"node_types": [node]})


def brute_force(profile, cluster, gpus: int, global_batch: int) -> float | None:
    """The fastest fitting configuration by enumeration (None if nothing fits)."""
    best = None
    for sd, dp, b in _outer(gpus, global_batch, None):
        costs = SpatialCosts(profile, cluster, sd=sd, micro_batch=b)
        options = [layer_options(v, sd) for v in costs.table]
        for combo in itertools.product(*options):
            layout = {v.path: o for v, o in zip(costs.table, combo) if o != UNSPLIT}
            config = SpatialConfig(
                dp=dp, sd=sd, micro_batch=b, num_micro_batches=global_batch // (dp * b), layout=layout
            )
            est = estimate_spatial(profile, cluster, config, costs=costs)
            if est.fits and (best is None or est.step_time_s < best):
                best = est.step_time_s
    return best


CASES = [  # model, devices, global batch
    ("unet3d:tiny", 2, 2),
    ("unet3d:tiny", 2, 4),
    ("cosmoflow:tiny", 4, 4),
    ("cosmoflow:tiny", 4, 8),
]


@pytest.mark.parametrize("seed", range(6))
def test_search_equals_brute_force(seed):
    rng = random.Random(seed)
    model, n, batch = CASES[seed % len(CASES)]
    dims = {"volume": rng.choice([16, 32])}
    profile = profile_model_analytic(parse_model(model, **dims), seq_len=1, dtype="fp16")
    cluster = with_gpus(P3, n)
    # memory between what a fully split and an unsplit micro-batch of 1 need, so that it binds
    costs = SpatialCosts(profile, cluster, sd=1, micro_batch=1)
    unsplit = estimate_spatial(
        profile, cluster, SpatialConfig(dp=n, sd=1, micro_batch=1, num_micro_batches=1, layout={})
    )
    lo = unsplit.peak_memory_bytes - unsplit.memory_bytes["activations"] * 0.9 - unsplit.memory_bytes["reserve"] * 0.5
    capacity = int(rng.uniform(lo, unsplit.peak_memory_bytes * 1.3))
    del costs
    cluster = _with_memory(cluster, capacity)
    expected = brute_force(profile, cluster, n, batch)
    if expected is None:
        with pytest.raises(StratagemError, match="no data \\+ spatial plan"):
            plan_spatial_search(profile, cluster, gpus=n, global_batch=batch)
        return
    result = plan_spatial_search(profile, cluster, gpus=n, global_batch=batch, keep=1)
    assert result.best.estimate.step_time_s == pytest.approx(expected, rel=1e-9)
    assert result.best.estimate.fits


def test_brute_force_cases_bind_memory():
    """At least one case's optimum differs from the unconstrained one (memory really decides)."""
    profile = profile_model_analytic(parse_model("unet3d:tiny", volume=32), seq_len=1, dtype="fp16")
    free = plan_spatial_search(profile, with_gpus(P3, 2), gpus=2, global_batch=2)
    unsplit = free.best.estimate
    tight = _with_memory(with_gpus(P3, 2), int(unsplit.peak_memory_bytes - unsplit.memory_bytes["activations"] * 0.4))
    bound = plan_spatial_search(profile, tight, gpus=2, global_batch=2)
    assert bound.best.config.layout and bound.best.estimate.step_time_s > unsplit.step_time_s
    assert bound.best.estimate.step_time_s == pytest.approx(brute_force(profile, tight, 2, 2), rel=1e-9)


def test_unet_512_needs_spatial_parallelism_on_64_v100():
    spec = parse_model("unet3d:volume512")
    profile = profile_model_analytic(spec, seq_len=1, dtype="fp16")
    cluster = with_gpus(P3, 64)
    data_parallel = estimate_spatial(
        profile, cluster, SpatialConfig(dp=64, sd=1, micro_batch=1, num_micro_batches=1, layout={})
    )
    assert not data_parallel.fits and data_parallel.peak_memory_bytes > 8 * data_parallel.capacity_bytes
    result = plan_spatial_search(profile, cluster, gpus=64, global_batch=64)
    best = result.best
    assert best.estimate.fits and best.config.sd >= 16 and best.config.sd * best.config.dp == 64
    plan = build_spatial_plan(
        result,
        model=spec,
        profile=profile,
        cluster=cluster,
        training=TrainingSettings(global_batch=64, seq_len=1, dtype="fp16"),
    )
    reasons = [lay.spatial.reason for lay in plan.layout.values() if lay.spatial]
    assert any(r.startswith("memory") for r in reasons)
    rows = memory_table(profile, cluster, plan)
    assert [r["layer"] for r in rows] == [layer.path for layer in profile.layers]
