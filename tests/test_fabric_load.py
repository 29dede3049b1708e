"""FabricLoad (planner/profile/load.py): a large job's share of the inter-node bandwidth on a shared fabric.

Checked by hand: the share's interpolation, that it scales exactly the inter-node bandwidth terms (not the
latencies, not NVLink), that profiles without it are unchanged, that the search stays exact with it, and that
benchmarks/cost_accuracy.py gives Selene's two measured points to the SC21 Table 2 rows.
"""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from search_helpers import check_ilp_against_brute

from planner.core import SELENE_FABRIC_LOAD, StratagemError
from planner.cost import ParallelConfig, block_count, collective_time, cp_degrees, estimate, with_gpus
from planner.model import parse_model
from planner.profile import FabricLoad, build_gpt_profile, load_cluster_profile, resolve_cluster_path, save_profile
from planner.search import CandidateCosts, SearchConfig, enumerate_outer
from fixtures.search_brute import iter_layer_assignments, to_assignment

ROOT = Path(__file__).resolve().parents[1]
A100 = resolve_cluster_path("dgx-a100-80g")
# the profile's inter-node all-reduce fit (2 nodes x 8 GPUs): alpha 296.4 us over 30 ring steps, 182 GB/s
INTER_BW = 182e9


def _loaded(points) -> object:
    cluster = load_cluster_profile(A100)
    return cluster.model_copy(update={"fabric_load": FabricLoad(points=points, source="test")})


def test_fraction_is_linear_in_log_nodes_and_flat_outside():
    load = FabricLoad(points=[(2, 1.0), (32, 0.6), (512, 0.4)], source="test")
    assert load.fraction(1) == 1.0 and load.fraction(2) == 1.0
    assert load.fraction(8) == pytest.approx(0.8)  # log2(8/2) / log2(32/2) = 1/2 of the way
    assert load.fraction(128) == pytest.approx(0.5)  # half of the way from 32 to 512
    assert load.fraction(4096) == 0.4
    selene = FabricLoad(points=list(SELENE_FABRIC_LOAD), source="")
    assert selene.fraction(384) == pytest.approx(0.37)
    assert selene.fraction(280) == pytest.approx(1 - 0.63 * math.log(140) / math.log(192))


@pytest.mark.parametrize(
    "points, match",
    [([], "at least 1"), ([(4, 0.5), (2, 0.9)], "increasing"), ([(0, 1.0)], ">= 1"), ([(2, 1.5)], r"\(0, 1\]")],
)
def test_bad_points_are_refused(points, match):
    with pytest.raises(ValidationError, match=match):
        FabricLoad(points=points, source="test")


def test_a_profile_file_with_bad_points_is_one_line_error(tmp_path):
    data = json.loads(A100.read_text())
    data.pop("content_hash", None)
    data["fabric_load"] = {"points": [[64, 0.5], [8, 0.9]], "source": "mine"}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(StratagemError, match="fabric_load") as exc:
        load_cluster_profile(path)
    assert "\n" not in str(exc.value)


def test_saved_and_loaded_with_the_profile(tmp_path):
    cluster = _loaded([(2, 1.0), (64, 0.5)])
    back = load_cluster_profile(save_profile(cluster, tmp_path / "loaded.json"))
    assert back.fabric_load == cluster.fabric_load
    plain = load_cluster_profile(A100)  # shipped profiles have none: nothing changes
    assert plain.fabric_load is None and with_gpus(plain, 1024).inter_node_fraction() == 1.0


def test_scales_only_the_inter_node_bandwidth_term():
    load = [(2, 1.0), (4, 0.5)]
    plain, loaded = with_gpus(load_cluster_profile(A100), 32), with_gpus(_loaded(load), 32)
    assert loaded.inter_node_fraction() == 0.5  # 32 GPUs = 4 nodes
    size, n = 1e9, 32
    kw = dict(node_type="dgx-a100-80g", spans_nodes=True, ranks_per_node=8, algorithm="ring")
    t0 = collective_time(plain, "all_reduce", size, n, **kw)
    t1 = collective_time(loaded, "all_reduce", size, n, **kw)
    bandwidth_term = 2 * (n - 1) / n * size / INTER_BW  # the ring's bytes over the per-node fit
    assert t1 - t0 == pytest.approx(bandwidth_term, rel=1e-9)  # twice the bandwidth term, same latency
    inside = dict(node_type="dgx-a100-80g", spans_nodes=False, ranks_per_node=8)
    assert collective_time(loaded, "all_reduce", size, 8, **inside) == collective_time(
        plain, "all_reduce", size, 8, **inside
    )


def test_estimate_pays_it_only_across_nodes():
    spec = parse_model("gpt", layers=2, hidden=256, heads=4, vocab=1024, max_seq=128)
    model = build_gpt_profile(spec, seq_len=128, tp_degrees=[1])
    load = [(1, 1.0), (2, 0.5)]
    one_node = ParallelConfig(dp=8)
    assert (
        estimate(model, with_gpus(_loaded(load), 8), one_node, global_batch=8).step_time_s
        == estimate(model, with_gpus(load_cluster_profile(A100), 8), one_node, global_batch=8).step_time_s
    )
    two = ParallelConfig(dp=16, overlap_grad_reduce=False)
    slow = estimate(model, with_gpus(_loaded(load), 16), two, global_batch=16).step_time_s
    fast = estimate(model, with_gpus(load_cluster_profile(A100), 16), two, global_batch=16).step_time_s
    assert slow > fast


def test_search_stays_exact_with_a_fabric_load():
    """ILP optimum == brute force under ``estimate`` on 2-4 node A100 clusters whose fabric loses half."""
    rng = random.Random(17)
    checked = 0
    while checked < 8:
        n = rng.choice([16, 32])
        cluster = with_gpus(_loaded([(1, 1.0), (4, 0.45)]), n)
        spec = parse_model(
            "gpt", layers=rng.choice([1, 2]), hidden=rng.choice([64, 128]), heads=4, vocab=256, max_seq=64
        )
        profile = build_gpt_profile(spec, seq_len=64, dtype="bf16", tp_degrees=[1, 2, 4])
        config = SearchConfig(time_limit_s=30, flash_attention=False, cp_min_seq_len=0)
        outers = list(
            enumerate_outer(
                cluster=cluster,
                gpus=n,
                global_batch=n,
                n_layers=len(profile.layers),
                n_blocks=block_count(profile),
                tp_degrees=profile.tp_degrees,
                config=config,
                cp_degrees=cp_degrees(profile, n),
            )
        )
        outer = rng.choice([o for o in outers if o.dp > 1] or outers)
        costs = CandidateCosts(profile, cluster, global_batch=n, config=config)
        tables = costs.tables(outer)
        if sum(1 for _ in iter_layer_assignments(tables)) > 400:
            continue
        best = None
        for choice in iter_layer_assignments(tables):
            est = costs.estimate(costs.parallel_config(outer, tables, to_assignment(tables, choice)))
            fits = all(
                rk.memory.peak_bytes <= cluster.node_type(rk.node_type).device_memory_bytes * config.memory_fraction
                for rk in est.per_rank
            )
            if fits and (best is None or est.step_time_s < best):
                best = est.step_time_s
        check_ilp_against_brute(costs, outer, tables, best)
        checked += 1


def test_cost_accuracy_gives_selene_points_to_sc21_table2_rows():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cost_accuracy

    plain = cost_accuracy._load_cluster("dgx-a100-80g")
    loaded = cost_accuracy._load_cluster("dgx-a100-80g" + cost_accuracy.LOADED_FABRIC)
    assert loaded.fabric_load is not None and loaded.fabric_load.points == list(SELENE_FABRIC_LOAD)
    assert loaded.inter_node == plain.inter_node and loaded.node_types == plain.node_types
    assert with_gpus(loaded, 2240).inter_node_fraction() == pytest.approx(0.408, abs=5e-4)
    cases = cost_accuracy.load_cases(cost_accuracy.DEFAULT_CSV)
    loaded_rows = {c.row for c in cases if c.cluster.endswith(cost_accuracy.LOADED_FABRIC)}
    assert loaded_rows == set(range(10, 22))  # SC21 Table 2: six ZeRO-3 and six PTD-P rows


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"),
    )


def test_estimate_and_plan_name_the_fabric_load(tmp_path):
    path = save_profile(_loaded([(2, 1.0), (64, 0.5)]), tmp_path / "loaded.json")
    model = ["--model", "gpt", "--layers", "4", "--hidden", "512", "--heads", "8", "--seq", "128"]
    est = _cli("estimate", *model, "--cluster", str(path), "--gpus", "64", "--global-batch", "64", "--dp", "64")
    assert est.returncode == 0, est.stderr
    assert "fabric load: inter-node bandwidth x0.80 at 8 nodes (test)" in est.stdout  # 1 - 0.5 log2(4)/log2(32)
    plan_path = tmp_path / "plan.json"
    res = _cli("plan", *model, "--cluster", str(path), "--gpus", "64", "--global-batch", "64", "--out", str(plan_path))
    assert res.returncode == 0, res.stderr
    notes = json.loads(plan_path.read_text())["search"]["notes"]
    assert notes.startswith("fabric load: inter-node bandwidth x0.80 at 8 nodes (test).")


def test_cost_accuracy_fabric_check_compares_the_data_parallel_increment():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cost_accuracy

    r = cost_accuracy.fabric_check(cost_accuracy.DEFAULT_CSV)
    assert r["measured_s"] == pytest.approx(39.15 - 37.83)  # Korthikanti et al. §6.3: 37.83 s -> 39.15 s
    assert 0 < r["plain_s"] < r["loaded_s"]  # the fabric load only adds to the wider run's inter-node time
