"""The MoE cost model (planner/cost/moe.py): hand-computed all-to-all times and expert states, properties,
and the one-line errors of the CLI (missing all-to-all figures, experts not divisible by ep)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from planner.core import StratagemError
from planner.cost import (
    ExpertStates,
    GroupShape,
    ParallelConfig,
    all_to_all_s,
    deepep_s,
    ep_group,
    estimate,
    remote_nodes_per_token,
    require_all_to_all,
    with_gpus,
)
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile, resolve_cluster_path


@pytest.fixture(scope="module")
def h100():
    return with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), 64)


@pytest.fixture(scope="module")
def mixtral():
    return build_gpt_profile(parse_model("moe:mixtral-8x7b"), seq_len=4096)


def _fit(fits, op="all_to_all"):
    return next(f for f in fits if f.op == op)


def test_all_to_all_inside_a_node_is_the_bus_bandwidth_formula(h100):
    node = h100.node_types[0]
    fit = _fit(node.intra_node)
    t = all_to_all_s(h100, node, 1e9, GroupShape(n_ranks=8, ranks_per_node=8, spans_nodes=False))
    assert t == pytest.approx(fit.alpha_s + 7 / 8 * 1e9 / fit.bus_bw_bytes_per_s)


def test_all_to_all_across_nodes_is_bound_by_one_nic_per_rank(h100):
    node = h100.node_types[0]
    intra, inter = _fit(node.intra_node), _fit(h100.inter_node)
    t = all_to_all_s(h100, node, 1e9, GroupShape(n_ranks=16, ranks_per_node=8, spans_nodes=True))
    nvlink = 7 / 16 * 1e9 / intra.bus_bw_bytes_per_s
    network = 8 / 16 * 1e9 / (inter.bus_bw_bytes_per_s / 8)  # 47 GB/s per GPU (nccl-tests #267)
    assert t == pytest.approx(inter.alpha_s + max(nvlink, network))
    assert network > nvlink


def test_remote_nodes_per_token_by_hand():
    # one node: nothing leaves it; two nodes of 4 experts each, top-1: the other node half the time
    assert remote_nodes_per_token(8, 2, 1) == 0.0
    assert remote_nodes_per_token(8, 1, 2) == pytest.approx(0.5)
    # top-2 of 8 over 2 nodes: P(both on this node) = 4/8 * 3/7, so the other node is hit 1 - 3/14 of the time
    assert remote_nodes_per_token(8, 2, 2) == pytest.approx(1 - 3 / 14)
    # Qwen3-235B on EP32 = 4 nodes of 32 experts, top-8: 3 x (1 - C(96, 8) / C(128, 8))
    assert remote_nodes_per_token(128, 8, 4) == pytest.approx(3 * (1 - math.comb(96, 8) / math.comb(128, 8)))


def test_deepep_sends_a_token_once_per_destination_node(h100):
    node = h100.node_types[0]
    intra, inter = _fit(node.intra_node), _fit(h100.inter_node)
    inside = GroupShape(n_ranks=8, ranks_per_node=8, spans_nodes=False)
    assert deepep_s(h100, node, 1e9, 8, 128, inside) == all_to_all_s(h100, node, 1e9, inside)  # NVLink only
    group = GroupShape(n_ranks=32, ranks_per_node=8, spans_nodes=True)
    rdma = 1e9 / 8 * remote_nodes_per_token(128, 8, 4) / (inter.bus_bw_bytes_per_s / 8)
    nvlink = 7 / 8 * 1e9 / intra.bus_bw_bytes_per_s
    assert deepep_s(h100, node, 1e9, 8, 128, group) == pytest.approx(inter.alpha_s + max(rdma, nvlink))
    # NCCL's all-to-all sends 8 x 24/32 = 6 copies of a token over the network, DeepEP ~2.7
    assert deepep_s(h100, node, 1e9, 8, 128, group) < 0.5 * all_to_all_s(h100, node, 1e9, group)


def test_dispatcher_and_moe_recompute_in_the_estimate(h100):
    qwen = build_gpt_profile(parse_model("moe:qwen3-30b-a3b"), seq_len=4096)
    base = dict(pp=1, dp=16, ep=16, num_micro_batches=4, zero_stage=1)
    nccl = estimate(qwen, with_gpus(h100, 16), ParallelConfig(**base), global_batch=64)
    deep = estimate(qwen, with_gpus(h100, 16), ParallelConfig(**base, moe_dispatcher="deepep"), global_batch=64)
    assert 0 < deep.breakdown_s["ep_comm"] < nccl.breakdown_s["ep_comm"]
    rec = estimate(qwen, with_gpus(h100, 16), ParallelConfig(**base, moe_recompute=True), global_batch=64)
    assert rec.breakdown_s["recompute"] > nccl.breakdown_s["recompute"]
    assert rec.per_rank[0].memory.activations < nccl.per_rank[0].memory.activations
    with pytest.raises(StratagemError, match="unknown MoE dispatcher 'nccl'"):
        estimate(qwen, with_gpus(h100, 16), ParallelConfig(**base, moe_dispatcher="nccl"), global_batch=64)  # type: ignore[arg-type]


def test_ep_group_is_ep_ranks_etp_apart():
    assert ep_group(8, 1, 8) == GroupShape(n_ranks=8, ranks_per_node=8, spans_nodes=False)
    assert ep_group(8, 2, 8) == GroupShape(n_ranks=8, ranks_per_node=4, spans_nodes=True)


def test_expert_states_sharded_over_ep_and_edp(h100, mixtral):
    # ep 8 over dp 16: one expert (3 x 4096 x 14336 parameters) per layer per rank; 8 layers per pp rank (pp 4).
    # As Megatron-Core holds them ("textbook"), ZeRO-1 over edp = 2: 2 + 2 bytes weights and gradients, 12 / 2
    # bytes optimizer
    expert = 3 * 4096 * 14336
    textbook = dict(pp=4, dp=16, num_micro_batches=16, zero_stage=1, schedule="1f1b", memory_semantics="textbook")
    est = estimate(mixtral, h100, ParallelConfig(ep=8, **textbook), global_batch=256)
    assert est.per_rank[1].memory.expert_states == pytest.approx(8 * expert * (2 + 2 + 12 / 2))
    one = estimate(mixtral, h100, ParallelConfig(ep=1, **textbook), global_batch=256)
    assert one.per_rank[1].memory.expert_states == pytest.approx(8 * 8 * expert * (2 + 2 + 12 / 16))
    # as the runtime holds them (runtime.executor.moe.apply_expert_dp: fully_shard over edp, kept gathered from
    # forward to backward): weights 2 / 2 at rest + the gathered copy 2, optimizer 12 / 2; the gradients
    # (2 bytes, unsharded while micro-batches accumulate) are in the peak's gradient term
    runtime = estimate(
        mixtral, h100, ParallelConfig(**{**textbook, "memory_semantics": "fsdp2"}, ep=8), global_batch=256
    )
    mem = runtime.per_rank[1].memory
    assert mem.expert_states == pytest.approx(8 * expert * (2 / 2 + 2 + 12 / 2))
    assert mem.grads >= 8 * expert * 2


def test_expert_sync_overlap_by_hand():
    # --overlap-grad-reduce / --overlap-param-gather: a 3 s sync beside a 2 s backward window with contention
    # 0.1 shows 3 - 0.9 x 2 = 1.2 s; a 0.5 s gather beside a 1 s forward shows 0.1 x 0.5 (hidden, contended)
    st = ExpertStates(state_bytes=0.0, sync_s=3.0, gather_s=0.5, optimizer_s=0.25, overlap=True, kappa=0.1)
    assert st.exposed_s(2.0, 1.0) == pytest.approx(1.2 + 0.05 + 0.25)
    assert st.step_s == pytest.approx(3.75)
    off = ExpertStates(state_bytes=0.0, sync_s=3.0, gather_s=0.5, optimizer_s=0.25, overlap=False, kappa=0.1)
    assert off.exposed_s(2.0, 1.0) == pytest.approx(3.75)


def test_expert_sync_hides_behind_compute_with_overlap(h100, mixtral):
    # Megatron-Core's DDP reduces the expert buffers over the expert-data-parallel group from the same backward
    # hooks as the dense ones: with overlap the edp sync of ep 4 over dp 16 (edp 4) mostly hides
    base = dict(pp=4, dp=16, ep=4, num_micro_batches=16, zero_stage=1, schedule="1f1b")
    on = estimate(mixtral, h100, ParallelConfig(**base), global_batch=256)
    off = estimate(mixtral, h100, ParallelConfig(**base, overlap_grad_reduce=False), global_batch=256)
    assert 0 < on.breakdown_s["expert_sync"] < off.breakdown_s["expert_sync"]
    assert on.per_stage[0].time_s == off.per_stage[0].time_s  # per-micro-batch terms unchanged


def test_all_to_all_only_with_expert_parallelism(h100, mixtral):
    base = dict(pp=4, dp=16, num_micro_batches=16, zero_stage=1)
    none = estimate(mixtral, h100, ParallelConfig(**base), global_batch=256)
    ep8 = estimate(mixtral, h100, ParallelConfig(**base, ep=8), global_batch=256)
    assert none.breakdown_s["ep_comm"] == 0.0 < ep8.breakdown_s["ep_comm"]
    assert math.isclose(
        sum(ch.time_s["ep_comm"] for ch in ep8.per_stage) * 16, ep8.breakdown_s["ep_comm"] * 4, rel_tol=1e-9
    )
    # imbalance: the busiest rank's expert GEMMs and all-to-all grow with it
    heavier = estimate(mixtral, h100, ParallelConfig(**base, ep=8, moe_load_imbalance=2.0), global_batch=256)
    balanced = estimate(mixtral, h100, ParallelConfig(**base, ep=8, moe_load_imbalance=1.0), global_batch=256)
    assert balanced.step_time_s < ep8.step_time_s < heavier.step_time_s


def test_missing_all_to_all_figures_is_one_line(h100):
    stripped = h100.model_copy(
        update={"inter_node": [f for f in h100.inter_node if f.op != "all_to_all"], "content_hash": None}
    )
    with pytest.raises(StratagemError, match="no all_to_all figure for the network") as err:
        require_all_to_all(stripped)
    assert "\n" not in str(err.value) and "stratagem profile cluster" in str(err.value)


def _cli(*args: str):
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_plan_without_all_to_all_writes_nothing(tmp_path):
    data = json.loads(resolve_cluster_path("dgx-h100").read_text())
    for nt in data["node_types"]:
        nt["intra_node"] = [f for f in nt["intra_node"] if f["op"] != "all_to_all"]
    data["inter_node"] = [f for f in data["inter_node"] if f["op"] != "all_to_all"]
    data["content_hash"] = None
    cluster = tmp_path / "no-a2a.json"
    cluster.write_text(json.dumps(data))
    out = tmp_path / "plan.json"
    res = _cli("plan", "--model", "moe:tiny", "--cluster", str(cluster), "--gpus", "8", "--global-batch", "16",
               "--seq", "128", "--out", str(out))  # fmt: skip
    assert res.returncode == 2 and not out.exists()
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "all_to_all" in lines[0] and "stratagem profile cluster" in lines[0]


def test_cli_plan_and_export_moe(tmp_path):
    out = tmp_path / "plan.json"
    res = _cli("plan", "--model", "moe:tiny", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16",
               "--seq", "128", "--allow", "dp,ep,zero", "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr
    plan = json.loads(out.read_text())
    assert plan["experts"]["ep"] >= 1 and plan["experts"]["etp"] == 1
    args = tmp_path / "args.sh"
    res = _cli("export", str(out), "--to", "megatron", "--out", str(args))
    assert res.returncode == 0, res.stderr
    text = args.read_text()
    assert "--num-experts 4" in text and "--moe-router-topk 2" in text and "--expert-tensor-parallel-size 1" in text
    if plan["experts"]["ep"] > 1:
        assert f"--expert-model-parallel-size {plan['experts']['ep']}" in text


def test_cli_estimate_rejects_experts_not_divisible_by_ep():
    res = _cli("estimate", "--model", "moe:mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "64",
               "--global-batch", "256", "--seq", "4096", "--pp", "4", "--ep", "3")  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip() == "error: 8 experts do not split over ep=3; choose ep dividing the experts (1, 2, 4, 8)"


def test_megatron_arguments_round_trip_an_moe_plan(tmp_path):
    """export --to megatron, then estimate --from megatron: the same model (moe family), ep and step time."""
    plan = tmp_path / "plan.json"
    res = _cli("plan", "--model", "moe:tiny", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16",
               "--seq", "128", "--allow", "dp,ep,zero", "--out", str(plan))  # fmt: skip
    assert res.returncode == 0, res.stderr
    args = tmp_path / "args.sh"
    assert _cli("export", str(plan), "--to", "megatron", "--out", str(args)).returncode == 0
    res = _cli("estimate", "--from", "megatron", str(args), "--cluster", "dgx-h100", "--json")
    assert res.returncode == 0, res.stderr
    back, saved = json.loads(res.stdout), json.loads(plan.read_text())
    assert back["config"]["ep"] == saved["experts"]["ep"]
    assert back["step_time_s"] == pytest.approx(saved["predictions"]["step_time_s"], rel=1e-9)
