"""Precision "autocast" (planner.profile.autocast): torch.autocast's cast kernels, fp32 element-wise ops and
fp32 saved activations, against hand-computed figures; "pure" (the published rows' mode) unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from planner.calibrate import load_runs_jsonl
from planner.core import StratagemError
from planner.cost import ParallelConfig, estimate, layer_cost, layer_kernels, with_gpus
from planner.cost.compute import _kernel_device
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile, resolve_cluster_path

REPO = Path(__file__).resolve().parents[1]
H100_DATA = REPO / "benchmarks" / "data" / "h100"
# a GPT block small enough to count by hand: s = 128 tokens, h = 64, a = 4 heads, f = 4h = 256
SPEC = parse_model("gpt:tiny", layers=2, hidden=64, heads=4, vocab=256, max_seq=128)
S, H, A, FF = 128, 64, 4, 256


@pytest.fixture(scope="module")
def h100():
    return with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), 1)


def _block(precision: str, tp: int = 1):
    profile = build_gpt_profile(SPEC, seq_len=S, precision=precision, tp_degrees=[1, 2])
    return profile, next(layer for layer in profile.layers if layer.kind == "block").shard(tp)


def test_saved_bytes_by_hand():
    _, shard = _block("autocast")
    sh = S * H
    # fp32 LayerNorm inputs 4sh + fp32 mean/rstd 8s, 16-bit GEMM inputs 2sh after each LayerNorm
    replicated = 2 * (4 * sh + 8 * S + 2 * sh)
    split = 2 * (4 * sh + 2 * S * FF)  # q, k, v and the context; the MLP's two inputs (16-bit)
    scores = (4 + 2) * A * S * S  # fp32 softmax output, 16-bit probabilities
    assert shard.saved_replicated_bytes_per_sample == replicated == 100_352
    assert shard.saved_attention_scores_bytes_per_sample == scores == 393_216
    assert shard.saved_bytes_per_sample == replicated + split + scores == 690_176
    # the 16-bit copies of the linears' weights and biases: qkv 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h
    linear = 12 * H * H + 9 * H
    assert shard.saved_fixed_bytes == 2 * linear == 99_456
    cast = next(op for op in shard.ops if op.name == "weight_cast")
    assert cast.fixed_bytes == cast.backward_fixed_bytes == 6 * linear  # read fp32, write bf16 (and back)
    # pure: Korthikanti et al. 2022 §4.1, 34 sh + 5 a s^2 with dropout; without its three masks 32 sh + 2 a s^2
    _, pure = _block("pure")
    assert pure.saved_bytes_per_sample == 32 * sh + 2 * A * S * S
    assert pure.saved_fixed_bytes == 0 and all(op.fixed_bytes == 0 for op in pure.ops)


def test_tp_split_divides_the_split_parts():
    _, one = _block("autocast", 1)
    _, two = _block("autocast", 2)
    assert two.saved_replicated_bytes_per_sample == one.saved_replicated_bytes_per_sample
    assert two.saved_attention_scores_bytes_per_sample == one.saved_attention_scores_bytes_per_sample / 2
    # biases of proj and fc2 (h each) stay whole on every rank
    assert two.saved_fixed_bytes == 2 * ((12 * H * H + 7 * H) / 2 + 2 * H)


def test_same_flops_and_params_more_kernels(h100):
    pure_profile, pure = _block("pure")
    auto_profile, auto = _block("autocast")
    assert auto_profile.precision == "autocast" and pure_profile.precision == "pure"
    assert auto_profile.total_params == pure_profile.total_params
    assert (auto.fwd_flops_per_sample, auto.params) == (pure.fwd_flops_per_sample, pure.params)
    node = h100.node_types[0]
    counts = {}
    for name, shard in (("pure", pure), ("autocast", auto)):
        dev = _kernel_device(node, shard, "bf16")
        k = layer_kernels(shard.ops, 1, dev, sp_tp=1, flash=False, score_flops=0.0)
        counts[name] = (k.forward.kernels, k.backward.kernels)
    # pure: 6 GEMMs + 7 fused element-wise kernels forward; backward 2 per GEMM + 7
    assert counts["pure"] == (13, 19)
    # autocast forward: 6 GEMMs, 2 LayerNorms + 2 casts, 3 q/k/v copies, scale + mask (full, triu, add),
    # 2 softmax casts + softmax, context permute, 2 residual adds, GELU, 8 weight casts
    assert counts["autocast"][0] == 32
    # backward: 12 GEMMs, 2+2 LayerNorm/cast, stack, scale, 2 casts + 2 softmax kernels, permute,
    # 2 x 2 residual, GELU, 8 weight-gradient casts + 4 bias reductions
    assert counts["autocast"][1] == 40


def test_fixed_bytes_do_not_scale_with_the_micro_batch(h100):
    _, shard = _block("autocast")
    profile, _ = _block("autocast")
    block = next(layer for layer in profile.layers if layer.kind == "block")
    node = h100.node_types[0]
    common = dict(
        node=node, cluster=h100, tp=1, style="split", sequence_parallel=False, flash_attention=False, dtype="bf16"
    )
    one = layer_cost(block, recompute="none", micro_batch=1, **common)
    two = layer_cost(block, recompute="none", micro_batch=2, **common)
    assert two.act_bytes - 2 * one.act_bytes == pytest.approx(-shard.saved_fixed_bytes)
    full = layer_cost(block, recompute="full", micro_batch=2, **common)  # the cached copies stay alive
    assert full.act_bytes == pytest.approx(block.input_bytes_per_sample * 2 + shard.saved_fixed_bytes)


def test_autocast_costs_more_time_and_memory(h100):
    cfg = ParallelConfig(micro_batch=4)
    spec = parse_model("gpt:gpt2")
    est = {
        p: estimate(build_gpt_profile(spec, seq_len=1024, precision=p), h100, cfg, global_batch=4, dtype="bf16")
        for p in ("pure", "autocast")
    }
    assert est["autocast"].step_time_s > est["pure"].step_time_s
    assert est["autocast"].peak_memory_bytes > est["pure"].peak_memory_bytes
    assert est["autocast"].model_tflops_per_gpu < est["pure"].model_tflops_per_gpu


@pytest.mark.parametrize(
    ("model", "kw", "match"),
    [
        ("llama:llama2-7b", dict(dtype="bf16"), "zoo's GPT"),
        ("gpt:gpt2", dict(dtype="fp32"), "16-bit"),
        ("gpt:gpt2", dict(dtype="bf16", precision="amp"), "unknown precision"),
    ],
)
def test_bad_precision_requests(model, kw, match):
    precision = kw.pop("precision", "autocast")
    with pytest.raises(StratagemError, match=match):
        build_gpt_profile(parse_model(model), seq_len=128, precision=precision, **kw)


def test_metrics_runs_use_autocast_for_cuda_launches():
    run = load_runs_jsonl(H100_DATA / "gpt2-medium_mb8_m2.jsonl")
    assert run.profile is not None and run.profile.precision == "autocast"
    # pp = 1: the runtime runs one micro-batch at a time, whatever the plan calls its schedule (gpipe)
    assert run.config.schedule == "1f1b" and run.config.num_micro_batches == 2


def test_gpu_runs_from_data_prints_every_stored_run():
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_runs.py", "--from-data", str(H100_DATA)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    runs = [line.split()[0] for line in (H100_DATA / "runs.csv").read_text().splitlines()[1:]]
    for run in runs:
        assert any(line.startswith(run.split(",")[0] + " ") for line in proc.stdout.splitlines()), run


def test_cli_precision_flag():
    base = [sys.executable, "-m", "planner.cli.main", "estimate", "--model", "gpt:gpt2", "--cluster", "dgx-h100"]
    base += ["--gpus", "1", "--global-batch", "4", "--micro-batch", "4", "--seq", "1024", "--json"]
    out = {
        p: subprocess.run(base + ["--precision", p], cwd=REPO, capture_output=True, text=True, timeout=120)
        for p in ("pure", "autocast")
    }
    assert all(proc.returncode == 0 for proc in out.values()), out["autocast"].stderr
    assert out["pure"].stdout != out["autocast"].stdout
    bad = subprocess.run(
        base[:4]
        + ["--model", "llama:llama2-7b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
        + ["--precision", "autocast"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def _brute_best(costs, outer, tables, capacity):
    """Best fitting step time over every layer assignment, each scored by ``estimate`` itself."""
    from fixtures.search_brute import iter_layer_assignments, to_assignment

    best = None
    for choice in iter_layer_assignments(tables):
        est = costs.estimate(costs.parallel_config(outer, tables, to_assignment(tables, choice)))
        fits = all(rk.memory.peak_bytes <= capacity * costs.search.memory_fraction for rk in est.per_rank)
        if fits and (best is None or est.step_time_s < best):
            best = est.step_time_s
    return best


def test_search_stays_exact_on_autocast_profiles():
    """The ILP's optimum equals brute force under ``estimate`` on autocast profiles (tests/test_search_exact.py's
    check on a few instances: the fixed forward bytes and the cached weight copies enter the tables exactly)."""
    import random

    from search_helpers import check_ilp_against_brute

    from planner.cost import block_count
    from planner.search import CandidateCosts, SearchConfig, enumerate_outer
    from fixtures.search_brute import iter_layer_assignments

    rng = random.Random(11)
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-a100-80g")), 4)
    capacity = float(cluster.node_types[0].device_memory_bytes)
    checked = feasible = data_parallel = 0
    while checked < 8:
        spec = parse_model(
            "gpt", layers=2, hidden=64, heads=4, vocab=256, max_seq=64, tie_embeddings=rng.random() < 0.5
        )
        profile = build_gpt_profile(spec, seq_len=64, tp_degrees=[1, 2, 4], precision="autocast")
        allow = frozenset({"tp", "pp", "dp", "zero", "sp", "gpipe", "layout", "recompute"})
        config = SearchConfig(time_limit_s=30, allow=allow, memory_fraction=rng.choice([1e-5, 1.0, 1.0, 1.0]))
        outers = list(
            enumerate_outer(
                cluster=cluster,
                gpus=4,
                global_batch=16,
                n_layers=len(profile.layers),
                n_blocks=block_count(profile),
                tp_degrees=profile.tp_degrees,
                config=config,
                cp_degrees=[1],
            )
        )
        outer = rng.choice([o for o in outers if o.dp > 1] if checked % 2 else outers)
        costs = CandidateCosts(profile, cluster, global_batch=16, config=config)
        tables = costs.tables(outer)
        if sum(1 for _ in iter_layer_assignments(tables)) > 300:
            continue
        best = _brute_best(costs, outer, tables, capacity)
        checked += 1
        if check_ilp_against_brute(costs, outer, tables, best) is None:
            continue
        feasible += 1
        data_parallel += outer.dp > 1  # fp32 gradients synced and, under ZeRO, fp32 states sharded
    assert feasible >= 3 and data_parallel >= 2, (feasible, data_parallel)


def test_metrics_runs_on_cpu_keep_pure(tmp_path):
    """A CPU launch is predicted from measured profiles or the pure closed form, never the CUDA autocast one."""
    import json
    import shutil

    lines = (H100_DATA / "gpt2_mb4_m1.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["device"] = "cpu"
    (tmp_path / "gpt2_mb4_m1.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    shutil.copy(H100_DATA / "gpt2_mb4_m1.json", tmp_path)
    run = load_runs_jsonl(tmp_path / "gpt2_mb4_m1.jsonl")
    assert run.profile is None or run.profile.precision == "pure"


def test_cli_precision_refused_with_a_measured_profile(tmp_path):
    profile = build_gpt_profile(SPEC, seq_len=S)
    path = tmp_path / "p.json"
    path.write_text(profile.model_dump_json())
    cmd = [sys.executable, "-m", "planner.cli.main", "estimate", "--model", "gpt:tiny", "--cluster", "dgx-h100"]
    cmd += ["--gpus", "1", "--global-batch", "1", "--model-profile", str(path), "--precision", "autocast"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--precision" in proc.stderr, proc.stderr


def test_autocast_states_are_fp32(h100):
    """fp32 weights, gradients and AdamW moments (4 + 4 + 8 bytes; pure keeps the 2 + 2 + 12 split), and the
    gradient all-reduce of dp ranks moves fp32: ZeRO-1 shards 8 bytes of optimizer state, not 12."""
    cluster = with_gpus(h100, 2)
    spec = parse_model("gpt:gpt2")
    memory = {}
    for p in ("pure", "autocast"):
        profile = build_gpt_profile(spec, seq_len=1024, precision=p)
        est = estimate(profile, cluster, ParallelConfig(dp=2, zero_stage=1), global_batch=2, dtype="bf16")
        memory[p] = est.per_rank[0].memory
    n = memory["pure"].params  # 2-byte weights sharded over dp 2 at rest (FSDP2 at ZeRO-1): n = the parameters
    assert memory["autocast"].params == pytest.approx(4 * n / 2)
    # the weights FSDP2 gathers for the step: fp32 under autocast, 16-bit in pure
    assert (memory["autocast"].unsharded, memory["pure"].unsharded) == pytest.approx((4 * n, 2 * n))
    assert memory["autocast"].optimizer == pytest.approx(8 * n / 2)
    assert memory["pure"].optimizer == pytest.approx(12 * n / 2)


def test_autocast_prices_torch_foreach_adamw(h100):
    """torch's foreach AdamW on fp32 weights moves 84 bytes per parameter (torch/optim/adam.py), Megatron's fused
    step 32: the optimizer tail scales by 84/32, nothing else in it changes at dp = 1."""
    spec = parse_model("gpt:gpt2")
    tail = {
        p: estimate(
            build_gpt_profile(spec, seq_len=1024, precision=p), h100, ParallelConfig(), global_batch=1, dtype="bf16"
        ).breakdown_s["optimizer"]
        for p in ("pure", "autocast")
    }
    assert tail["autocast"] == pytest.approx(tail["pure"] * 84 / 32)


def test_launched_runs_are_priced_as_they_ran():
    """Compiled (or FSDP2-bf16) CUDA runs are priced pure; eager autocast and pre-field runs autocast."""
    from fixtures.plans import make_plan
    from planner.calibrate import runtime_precision

    plan = make_plan(parse_model("gpt:gpt2"), dtype="bf16")
    assert runtime_precision(plan, "cuda", {"precision": "autocast", "compiled_blocks": 36}) == "pure"
    assert runtime_precision(plan, "cuda", {"precision": "fsdp-bf16", "compiled_blocks": 0}) == "pure"
    assert runtime_precision(plan, "cuda", {"precision": "autocast", "compiled_blocks": 0}) == "autocast"
    assert runtime_precision(plan, "cuda", {}) == "autocast"  # an earlier runtime's run
    assert runtime_precision(plan, "cpu", {}) == "pure"
