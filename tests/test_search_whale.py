"""Whale's per-layer layout choice (Jia et al., ATC'22) on the wide-classifier ResNet-50 (100,000 classes).

The profile comes from the runtime's analytic meta-device profiler. On one 8-GPU node with the tensor
axis forced to span it (``--allow tp,layout,recompute``), the plan must keep the backbone replicated (its
layers cannot be split) and split the 100,000-way classifier, paying the layout change between them;
splitting beats replicating the classifier under the cost model (checked against estimate directly). The
replicate -> split change is free here (every TP rank holds the whole pooled input; the split layer slices
it); split -> replicate would cost an all-gather.

Note: in today's cost model a replicated layer computes the whole micro-batch on every TP rank (as the
runtime runs it), so when data parallelism is allowed plain DP beats Whale's hybrid; see the report.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cli.common import resolve_cluster_path
from planner.modelspec import parse_model
from planner.profiles import load_cluster_profile
from planner.search.config import SearchConfig
from planner.search.costs import CandidateCosts
from planner.search.planner import plan_search

runtime_profile = pytest.importorskip("runtime.profile_model")


@pytest.fixture(scope="module")
def wide_resnet():
    return runtime_profile.profile_model_analytic(parse_model("resnet:resnet50-wide"), seq_len=1, dtype="bf16")


def test_backbone_replicated_classifier_split(wide_resnet):
    cluster = load_cluster_profile(resolve_cluster_path("dgx-a100-80g"))
    config = SearchConfig(top_k=2, time_limit_s=20, allow=frozenset({"tp", "layout", "recompute"}))
    result = plan_search(wide_resnet, cluster, n_devices=8, global_batch=256, config=config)
    best = result.best
    assert best.outer.tp == 8 and result.status == "optimal"
    layout = best.config.layout
    assert layout["fc"] == "split"
    assert all(style == "replicate" for path, style in layout.items() if path != "fc")
    # the alternative layout (classifier replicated too) is slower under estimate itself
    all_replicated = replace(best.config, layout={path: "replicate" for path in layout})
    slower = CandidateCosts(wide_resnet, cluster, global_batch=256, config=config).estimate(all_replicated)
    assert slower.step_time_s > best.step_s * 1.01
