"""Whale's per-layer layout choice (Jia et al., ATC'22) on the wide-classifier ResNet-50 (100,000 classes).

The profile comes from the runtime's analytic meta-device profiler. With the FULL default search space
(data parallelism, ZeRO, pipeline allowed) on one 8-GPU DGX-A100 node, the plan uses a TP group that
replicates the backbone — Whale's replica: data parallel inside the TP group, each rank computing a batch
slice, gradients averaged over dp x tp — and splits the 100,000-way classifier, whose 205 M parameters
then never cross the data-parallel all-reduce. Under the cost model this beats pure data parallelism
(every layer replicated, tp = 1) at every micro-batch size the search allows, and the same outer choice
with the classifier replicated too.

Known limit: the search caps the micro-batch at 16 (``SearchConfig.max_micro_batch``); pure DP at
micro-batch 32 with ZeRO-1 (9.11 ms) would beat the plan found (9.28 ms) under the same cost model.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from planner.cli.common import resolve_cluster_path
from planner.cost import ParallelConfig
from planner.model import parse_model
from planner.profile import load_cluster_profile
from planner.search import CandidateCosts, SearchConfig, plan_search

runtime_profile = pytest.importorskip("runtime.profiling.model")
log = logging.getLogger(__name__)
GPUS, BATCH = 8, 256


@pytest.fixture(scope="module")
def wide_resnet():
    return runtime_profile.profile_model_analytic(parse_model("resnet:resnet50-wide"), seq_len=1, dtype="bf16")


def test_full_space_replicates_backbone_and_splits_classifier(wide_resnet):
    cluster = load_cluster_profile(resolve_cluster_path("dgx-a100-80g"))
    config = SearchConfig(top_k=2, time_limit_s=20)
    result = plan_search(wide_resnet, cluster, gpus=GPUS, global_batch=BATCH, config=config)
    best = result.best
    assert best.outer.tp > 1 and result.status == "optimal"
    layout = best.config.layout
    assert layout["fc"] == "split"
    assert all(style == "replicate" for path, style in layout.items() if path != "fc")
    costs = CandidateCosts(wide_resnet, cluster, global_batch=BATCH, config=config)
    # the same outer choice with the classifier replicated too is slower under estimate itself
    all_replicated = replace(best.config, layout={path: "replicate" for path in layout})
    assert costs.estimate(all_replicated).step_time_s > best.step_s * 1.01
    # pure data parallelism (tp = 1, every layer replicated) at every micro-batch and ZeRO stage the
    # search allows: the Whale hybrid wins by > 3 %
    per_replica = BATCH // GPUS
    dp_best = min(
        costs.estimate(
            ParallelConfig(dp=GPUS, micro_batch=mb, num_micro_batches=per_replica // mb, zero_stage=zero)
        ).step_time_s
        for mb in (1, 2, 4, 8, 16)
        for zero in (0, 1, 2, 3)
    )
    log.info("Whale plan %s: %.3f ms; best pure DP: %.3f ms", best.outer, best.step_s * 1e3, dp_best * 1e3)
    print(f"Whale plan {best.outer}: {best.step_s * 1e3:.3f} ms; best pure DP (mb <= 16): {dp_best * 1e3:.3f} ms")
    assert best.step_s < dp_best / 1.03
