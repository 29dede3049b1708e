"""Cluster profiler: alpha-beta fitting on synthetic data, size parsing, and the torchrun run end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli.cmd_profile_cluster import parse_size, parse_sizes
from planner.core import StratagemError
from planner.profile import bus_factor, fit_alpha_beta, load_cluster_profile
from runtime.profiling.cluster import (
    ClusterBenchConfig,
    RawBench,
    RawCollective,
    RawCompute,
    RawSample,
    _failure_line,
    build_cluster_profile,
    build_torchrun_command,
)
from runtime.profiling.cluster_bench import FAIL_RANK_ENV

SIZES = [1024 * 4**k for k in range(8)]  # 1 KiB .. 16 MiB


def _synthetic(op: str, n: int, alpha_s: float, bw: float, noise=(1.0,)) -> list[tuple[int, list[float]]]:
    return [(b, [(alpha_s + bus_factor(op, n) * b / bw) * f for f in noise]) for b in SIZES]


# ------------------------------------------------------------------------------------------ fitting


@pytest.mark.parametrize(
    "op,n,factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("send_recv", 2, 1.0),
        ("all_to_all", 4, 0.75),
    ],
)
def test_bus_factor_matches_nccl_tests_convention(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize(
    "op,n", [("all_reduce", 2), ("all_reduce", 8), ("all_gather", 4), ("reduce_scatter", 16), ("send_recv", 2)]
)
@pytest.mark.parametrize("alpha_s,bw", [(5e-6, 150e9), (2e-4, 0.8e9), (0.0, 3e9)])
def test_fit_recovers_known_alpha_and_bandwidth(op, n, alpha_s, bw):
    fit = fit_alpha_beta(op, n, _synthetic(op, n, alpha_s, bw))
    assert fit.alpha_s == pytest.approx(alpha_s, rel=1e-6, abs=1e-15)
    assert fit.bus_bw_bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    assert fit.max_rel_err < 1e-9
    assert fit.run_cv is None  # a single repeat has no spread


def test_fit_uses_median_of_repeats_and_reports_cv():
    # Repeats 0.9x, 1x, 1.3x the truth: the median is the truth, so the fit is still exact, and the CV is
    # stdev([0.9, 1, 1.3]) / mean = 0.2081666 / 1.0666667 = 0.1951562 at every size (hand-computed).
    fit = fit_alpha_beta("all_gather", 4, _synthetic("all_gather", 4, 1e-5, 2e9, noise=(0.9, 1.0, 1.3)))
    assert fit.alpha_s == pytest.approx(1e-5, rel=1e-6)
    assert fit.bus_bw_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert fit.run_cv == pytest.approx(0.1951562, rel=1e-6)


def test_fit_hand_computed_two_points():
    # all_reduce on 4 ranks: factor 1.5. t(1000) = 1e-5 + 1500/1e9, t(1e6) = 1e-5 + 1.5e6/1e9.
    fit = fit_alpha_beta("all_reduce", 4, [(1000, [1.15e-5]), (1_000_000, [1.51e-3])])
    assert fit.alpha_s == pytest.approx(1e-5, rel=1e-9)
    assert fit.bus_bw_bytes_per_s == pytest.approx(1e9, rel=1e-9)
    assert fit.predict_s("all_reduce", 4, 4e6) == pytest.approx(1e-5 + 6e-3, rel=1e-9)


def test_fit_clamps_negative_latency_to_zero():
    # Times proportional to size but the small one too fast: unconstrained alpha < 0 -> alpha = 0.
    fit = fit_alpha_beta("send_recv", 2, [(1000, [0.5e-6]), (10_000, [10e-6]), (100_000, [100e-6])])
    # Through the origin, weight 1/t^2: slope = sum(x/t) / sum((x/t)^2) with x/t = 2e9, 1e9, 1e9
    # -> 4e9 / 6e18 s/B, i.e. 1.5e9 B/s; predictions 0.667 us, 6.67 us, 66.7 us -> max rel err 1/3.
    assert fit.alpha_s == 0.0
    assert fit.bus_bw_bytes_per_s == pytest.approx(1.5e9, rel=1e-9)
    assert fit.max_rel_err == pytest.approx(1 / 3, rel=1e-9)


def test_fit_falls_back_to_absolute_least_squares_when_noise_tilts_the_slope():
    # t = 3, 1, 5 ms at 1, 2, 3 MB: the relative fit's slope is negative (the 1 ms point weighs 9x and 25x
    # more). Ordinary least squares by hand: slope = Sxy/Sxx = (1e6 * 2e-3) / 2e12 = 1e-9 s/B -> 1 GB/s,
    # intercept = 3e-3 - 1e-9 * 2e6 = 1e-3 s.
    fit = fit_alpha_beta("send_recv", 2, [(1_000_000, [3e-3]), (2_000_000, [1e-3]), (3_000_000, [5e-3])])
    assert fit.weighting == "absolute"
    assert fit.alpha_s == pytest.approx(1e-3, rel=1e-9)
    assert fit.bus_bw_bytes_per_s == pytest.approx(1e9, rel=1e-9)
    # fitted 2, 3, 4 ms: SSres = 1 + 4 + 1 = 6 ms^2, SStot = 0 + 4 + 4 = 8 ms^2 -> r2 = 0.25;
    # worst point 2 MB: |3 - 1| / 1 = 2.
    assert fit.r2 == pytest.approx(0.25, rel=1e-9)
    assert fit.max_rel_err == pytest.approx(2.0, rel=1e-9)


@pytest.mark.parametrize(
    "samples,fix",
    [
        ([(1000, [1e-3])], "--sizes"),
        ([(1000, [1e-3]), (2000, [0.0])], "re-run"),
        ([(1000, [2e-3]), (1_000_000, [1e-3])], "larger messages"),  # decreasing under both weightings
    ],
)
def test_fit_rejects_unusable_data(samples, fix):
    with pytest.raises(StratagemError, match=fix):
        fit_alpha_beta("all_reduce", 2, samples)


def test_bus_factor_rejects_single_rank():
    with pytest.raises(StratagemError, match="--nproc-per-node"):
        bus_factor("all_reduce", 1)


# ------------------------------------------------------------------------------------------ CLI parsing


def test_parse_sizes():
    assert parse_size("4KiB") == 4096 and parse_size("1MB") == 10**6 and parse_size("512") == 512
    assert parse_sizes("4KiB..4MiB") == [4096, 16384, 65536, 262144, 1048576, 4194304]
    assert len(parse_sizes("1KiB..64MiB")) == 9
    assert parse_sizes("1KiB..8KiB:x2") == [1024, 2048, 4096, 8192]
    assert parse_sizes("1MiB,4KiB") == [4096, 2**20]
    for bad in ("4 parsecs", "0", "8KiB..1KiB", "1KiB..8KiB:x1"):
        with pytest.raises(StratagemError, match="e.g."):
            parse_sizes(bad)


def test_torchrun_command_single_and_multi_node(tmp_path):
    single = build_torchrun_command(ClusterBenchConfig(nproc_per_node=2, sizes_bytes=(4096,)), tmp_path / "r")
    assert "--standalone" in single and "--nproc-per-node=2" in single
    multi = build_torchrun_command(
        ClusterBenchConfig(
            nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", sizes_bytes=(4096,)
        ),
        tmp_path / "r",
    )
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29500"} <= set(multi)
    with pytest.raises(StratagemError, match="HOST:PORT"):
        build_torchrun_command(ClusterBenchConfig(nproc_per_node=8, nnodes=2, sizes_bytes=(1,)), tmp_path)


def test_failure_line_prefers_worker_error():
    lines = ["[W] noise", "@@error rank 1: RuntimeError: boom", "Traceback ...", "===="]
    assert _failure_line(lines, 1) == "rank 1: RuntimeError: boom"
    assert _failure_line(["torch.distributed.elastic... ChildFailedError", "======"], 1).endswith("Error")
    assert _failure_line([], 3) == "torchrun exited with status 3"


# ------------------------------------------------------------------------------------------ profile build


def test_build_cluster_profile_from_raw_results():
    alpha_s, bw = 1e-4, 1e9
    coll = [
        RawCollective(
            op=op,
            level="intra_node",
            n_ranks=2,
            samples=[RawSample(bytes=b, times_s=t) for b, t in _synthetic(op, 2, alpha_s, bw)],
        )
        for op in ("all_reduce", "send_recv")
    ]
    raw = RawBench(
        world_size=2,
        nnodes=1,
        nproc_per_node=2,
        backend="gloo",
        device_name="test cpu",
        device_memory_bytes=2**30,
        device_memory_source="test",
        torch_version="x",
        host="h",
        cpu_steal_fraction=0.25,
        not_measured=["inter_node (single node)"],
        collectives=coll,
        compute=[RawCompute(dtype="fp32", matrix_n=100, flops_per_matmul=2e6, times_s=[1e-3, 2e-3, 4e-3])],
        wall_s=1.0,
        sync_latency={"all_reduce": 8e-4, "functional_all_reduce": 1.5e-3},
    )
    cfg = ClusterBenchConfig(nproc_per_node=2, sizes_bytes=tuple(SIZES))
    prof = build_cluster_profile(raw, name="t", command="c", created_utc="2026-01-01T00:00:00+00:00", cfg=cfg)
    node = prof.node_types[0]
    assert [f.op for f in node.intra_node] == ["all_reduce", "send_recv"] and prof.inter_node == []
    assert node.intra_node[0].bus_bw_bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert node.intra_node[1].alpha_s == pytest.approx(alpha_s, rel=1e-6)
    assert len(node.intra_node[0].samples) == len(SIZES)
    # 2e6 FLOPs / {1, 2, 4} ms -> best 2 GFLOP/s, median 1 GFLOP/s
    assert node.compute[0].peak_flops_per_s == pytest.approx(2e9)
    assert node.compute[0].achieved_flops_per_s == pytest.approx(1e9)
    assert "inter_node" in prof.provenance.notes and "25.0%" in prof.provenance.notes
    assert prof.total_devices == 2
    assert node.blocking_latency is not None and node.blocking_latency.functional_collective_s == 1.5e-3
    assert "all_reduce 0.80 ms" in node.blocking_latency.source
    without = raw.model_copy(update={"sync_latency": None})
    assert (
        build_cluster_profile(without, name="t", command="c", created_utc="x", cfg=cfg).node_types[0].blocking_latency
        is None
    )


# ------------------------------------------------------------------------------------------ torchrun runs


def _cli(args: list[str], env_extra: dict[str, str] | None = None, timeout_s: float = 120):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args], capture_output=True, text=True, env=env, timeout=timeout_s
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--sizes", "4 parsecs"], "malformed message size"),
        (["--sizes", "8KiB..1KiB"], "malformed size range"),
        (["--nproc-per-node", "0"], "expected an integer 1..4096"),
        (["--repeats", "0"], "expected an integer 1.."),  # 0 is refused, not silently replaced by the default
        (["--iters", "0"], "expected an integer 1.."),
        (["--out-parent-is-a-file"], "not a writable folder"),
    ],
)
def test_bad_cli_input_exits_2_before_torchrun_and_writes_nothing(tmp_path, capsys, args, needle):
    from planner.cli.main import main

    out = tmp_path / "p.json"
    if args == ["--out-parent-is-a-file"]:
        (tmp_path / "file.txt").write_text("x")
        out, args = tmp_path / "file.txt" / "p.json", []
    rc = main(["profile", "cluster", "--nproc-per-node", "2", "--quick", *args, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and "\n" not in err and err.startswith("error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["file.txt"] if "file.txt" in str(out) else [])


@pytest.mark.slow
def test_quick_profile_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "local.json"
    res = _cli(["profile", "cluster", "--nproc-per-node", "2", "--quick", "--timeout-s", "100", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-2000:]
    prof = load_cluster_profile(out)  # validates schema version, fields and content hash
    node = prof.node_types[0]
    assert sorted(f.op for f in node.intra_node) == [
        "all_gather",
        "all_reduce",
        "all_to_all",
        "reduce_scatter",
        "send_recv",
    ]
    assert all(f.n_ranks == 2 and f.origin == "measured" and len(f.samples) == 7 for f in node.intra_node)
    assert all(len(s.times_s) == 3 for f in node.intra_node for s in f.samples)
    assert prof.inter_node == [] and "inter_node (single node)" in prof.provenance.notes
    assert {c.dtype for c in node.compute} == {"fp32", "bf16"}
    assert node.devices_per_node == 2 and prof.provenance.method == "measured"
    assert node.blocking_latency is not None and node.blocking_latency.functional_collective_s >= 0
    assert "alpha-beta fits" in res.stdout


@pytest.mark.slow
def test_failing_rank_gives_one_line_error_and_no_file(tmp_path):
    out = tmp_path / "never.json"
    res = _cli(
        ["profile", "cluster", "--nproc-per-node", "2", "--quick", "--timeout-s", "100", "--out", str(out)],
        env_extra={FAIL_RANK_ENV: "1"},
    )
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "rank 1" in lines[0], res.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_timeout_kills_the_run_and_writes_nothing(tmp_path):
    out = tmp_path / "never.json"
    res = _cli(
        ["profile", "cluster", "--nproc-per-node", "2", "--quick", "--timeout-s", "1", "--out", str(out)], timeout_s=60
    )
    assert res.returncode == 2 and "--timeout-s" in res.stderr and not out.exists()
    assert res.stderr.count("\n") == 1


@pytest.mark.slow
def test_two_nodes_on_loopback_measure_the_inter_node_level(tmp_path):
    # Two "nodes" of one rank each on this machine: functional check of the inter-node path only.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        "profile",
        "cluster",
        "--nproc-per-node",
        "1",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--sizes",
        "64KiB..16MiB",
        "--repeats",
        "2",
        "--timeout-s",
        "90",
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "planner.cli.main", *common, "--node-rank", "1", "--out", str(tmp_path / "node1.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        res = _cli([*common, "--node-rank", "0", "--out", str(tmp_path / "node0.json")])
        out1, err1 = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert res.returncode == 0 and node1.returncode == 0, res.stderr[-1500:] + err1[-1500:]
    assert not (tmp_path / "node1.json").exists()  # only node 0 writes
    prof = load_cluster_profile(tmp_path / "node0.json")
    assert sorted(f.op for f in prof.inter_node) == [
        "all_gather",
        "all_reduce",
        "all_to_all",
        "reduce_scatter",
        "send_recv",
    ]
    assert prof.node_types[0].intra_node == [] and "intra_node (one rank per node)" in prof.provenance.notes
    assert prof.nodes[0].count == 2 and prof.total_devices == 2


def test_raw_bench_is_json_round_trippable():
    raw = RawSample(bytes=8, times_s=[1e-3])
    assert RawSample.model_validate(json.loads(raw.model_dump_json())) == raw
    assert Path(build_torchrun_command.__globals__["WORKER"]).exists()
