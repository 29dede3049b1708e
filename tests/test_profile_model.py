"""`stratagem profile model`: hand-counted FLOPs, Korthikanti activation memory, analytic 175B, bad input."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from planner.cli.main import main
from planner.model import parse_model
from planner.profile import (
    ClusterProfile,
    ComputeFigure,
    NodeGroup,
    NodeType,
    Provenance,
    load_model_profile,
    save_profile,
)
from runtime.models import build_model, build_tp_shard
from runtime.profiling.measure import make_input, saved_bytes
from runtime.profiling.model import ProfileSettings, profile_model

REPO = Path(__file__).resolve().parents[1]
ACHIEVED_FLOPS_PER_S = 1.0e14  # made-up throughput of the test cluster below


def _cluster_file(tmp_path: Path) -> Path:
    figure = ComputeFigure(
        dtype="bf16",
        peak_flops_per_s=2e14,
        achieved_flops_per_s=ACHIEVED_FLOPS_PER_S,
        origin="derived",
        source="test fixture",
    )
    node = NodeType(
        name="test-node",
        device="test-gpu",
        devices_per_node=8,
        device_memory_bytes=80 * 2**30,
        device_memory_source="test fixture",
        compute=[figure],
    )
    cluster = ClusterProfile(
        name="test",
        node_types=[node],
        nodes=[NodeGroup(node_type="test-node", count=1)],
        provenance=Provenance(method="datasheet", tool="test", created_utc="2026-01-01"),
    )
    return save_profile(cluster, tmp_path / "cluster.json")


def test_tiny_gpt_cli_profile_matches_hand_count(tmp_path):
    out = tmp_path / "gpt-tiny.json"
    s, h, _heads, v = 32, 64, 4, 256  # gpt:tiny at --seq 32
    rc = main(
        [
            "profile",
            "model",
            "--model",
            "gpt:tiny",
            "--micro-batch",
            "1,2",
            "--seq",
            str(s),
            "--tp",
            "1,2",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    profile = load_model_profile(out)
    assert [layer.path for layer in profile.layers] == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    # hand count, 2*m*n*k per matmul, per sample: qkv, QK^T (a heads x 2 s s h/a), probs@V, proj, fc1, fc2
    block_fwd = (
        2 * s * h * 3 * h + 2 * s * s * h + 2 * s * s * h + 2 * s * h * h + 2 * s * h * 4 * h + 2 * s * 4 * h * h
    )
    block = profile.layer("blocks.1")
    assert block.shard(1).fwd_flops_per_sample == block_fwd
    assert block.shard(1).bwd_flops_per_sample == 2 * block_fwd  # data + weight gradients
    assert block.shard(1).attention_scores_flops_per_sample == 4 * s * s * h
    assert block.shard(2).fwd_flops_per_sample == block_fwd / 2
    assert block.shard(1).params == 12 * h * h + 13 * h  # Megatron SC21 eq. 2, per layer
    head = profile.layer("head")
    assert head.shard(1).fwd_flops_per_sample == 2 * s * h * v
    assert head.shard(1).bwd_flops_per_sample == 4 * s * h * v
    assert head.shard(2).fwd_flops_per_sample == s * h * v
    assert profile.layer("embed").shard(1).fwd_flops_per_sample == 0
    assert profile.total_params == sum(p.numel() for p in build_model(parse_model("gpt:tiny")).parameters())
    assert [t.micro_batch for t in block.shard(2).timings] == [1, 2]
    assert block.shard(1).timings[0].forward.median_s > 0 and block.shard(1).time_origin == "measured"
    assert {(c.op, c.phase, c.count) for c in block.collectives if not c.with_sequence_parallel} == {
        ("all_reduce", "forward", 2),
        ("all_reduce", "backward", 2),
    }
    assert profile.provenance.method == "measured" and profile.content_hash.startswith("sha256:")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_block_saved_bytes_match_korthikanti(tp):
    """Korthikanti et al. 2022 (arXiv:2205.05198) eq. (1) / Table 2: with 16-bit activations, 1-byte
    dropout masks, one block saves s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes (t=1: 34 + 5as/h).
    The formula leaves out the LayerNorms' fp32 mean and rstd (2 norms x 2 x 4 bytes per token), which
    our count includes, so we allow exactly that: 16*s*b bytes (0.02% here; tolerance 0.1%)."""
    h, a, s, b = 1024, 16, 512, 1
    spec = parse_model("gpt", layers=1, hidden=h, heads=a, max_seq=s, vocab=1024, dropout=0.1)
    shard = build_tp_shard(spec, "blocks.0", tp, device="meta", dtype=torch.bfloat16)
    x = make_input(torch.empty(b, s, h, device="meta", dtype=torch.bfloat16), needs_grad=True)
    got = saved_bytes(shard, x, seq_len=s)
    formula = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    assert got.total_bytes == pytest.approx(formula, rel=1e-3)
    assert got.total_bytes - formula == 16 * s * b
    assert got.attention_scores_bytes == 5 * a * s * s * b / tp  # softmax 2 + dropout mask 1 + output 2


def test_profile_fits_replicated_bytes_like_table2():
    h, a, s = 1024, 16, 512
    spec = parse_model("gpt", layers=2, hidden=h, heads=a, max_seq=s, vocab=1024, dropout=0.1)
    settings = ProfileSettings(
        micro_batches=(1,),
        seq_len=s,
        dtype="bf16",
        tp_degrees=(1, 4),
        device="meta",
        achieved_flops_per_s=ACHIEVED_FLOPS_PER_S,
    )
    block = profile_model(spec, settings, created_utc="2026-01-01T00:00:00+00:00").layer("blocks.0")
    # replicated: LayerNorm inputs, QKV and FC1 inputs (2 bytes) and two dropout masks (1 byte) = 10 sbh
    assert block.shard(4).saved_replicated_bytes_per_sample == pytest.approx(10 * s * h, rel=2e-3)
    assert block.shard(1).saved_replicated_bytes_per_sample == block.shard(4).saved_replicated_bytes_per_sample
    assert block.shard(4).timings[0].forward.median_s == pytest.approx(
        block.shard(4).fwd_flops_per_sample / ACHIEVED_FLOPS_PER_S
    )


def test_analytic_175b_is_fast_and_small(tmp_path):
    out = tmp_path / "gpt3.json"
    cmd = [
        sys.executable,
        "-m",
        "planner.cli.main",
        "profile",
        "model",
        "--model",
        "gpt:gpt3-175b",
        "--analytic",
        "--cluster",
        str(_cluster_file(tmp_path)),
        "--seq",
        "2048",
        "--dtype",
        "bf16",
        "--tp",
        "1,8",
        "--micro-batch",
        "1,2",
        "--out",
        str(out),
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    wall_s = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert wall_s < 120 and rss_bytes < 2 * 2**30  # typically ~8 s and ~0.4 GB here
    profile = load_model_profile(out)
    assert profile.total_params == pytest.approx(174.6e9, rel=0.005)
    assert len(profile.layers) == 96 + 3 and profile.provenance.method == "analytic"
    block = profile.layer("blocks.95")
    s, h = 2048, 12288
    assert block.shard(1).fwd_flops_per_sample == 24 * s * h * h + 4 * s * s * h  # SC21 eq. 3 per layer
    assert block.shard(8).time_origin == "derived"
    assert block.shard(8).timings[1].backward.median_s == pytest.approx(
        2 * block.shard(8).bwd_flops_per_sample / ACHIEVED_FLOPS_PER_S
    )


def test_measured_and_closed_form_profiles_agree():
    gpt_profile = pytest.importorskip("planner.profile.gpt")
    spec = parse_model("gpt", layers=2, hidden=256, heads=8, max_seq=128, vocab=512, dropout=0.1)
    settings = ProfileSettings(
        micro_batches=(1,),
        seq_len=128,
        dtype="bf16",
        tp_degrees=(1, 2),
        device="meta",
        achieved_flops_per_s=ACHIEVED_FLOPS_PER_S,
    )
    mine = profile_model(spec, settings, created_utc="2026-01-01T00:00:00+00:00")
    ref = gpt_profile.build_gpt_profile(spec, seq_len=128, dtype="bf16", tp_degrees=[1, 2])
    assert mine.total_params == ref.total_params
    for path in ("blocks.0", "head"):
        for tp in (1, 2):
            got, want = mine.layer(path).shard(tp), ref.layer(path).shard(tp)
            assert got.fwd_flops_per_sample == want.fwd_flops_per_sample
            assert got.params == want.params
            # ours also counts LayerNorm mean/rstd and the loss targets: within 1%
            assert got.saved_bytes_per_sample == pytest.approx(want.saved_bytes_per_sample, rel=0.01)


def test_other_families_profile(tmp_path):
    spec = parse_model("resnet:tiny-wide")
    settings = ProfileSettings(micro_batches=(2,), seq_len=1, dtype="fp32", tp_degrees=(1, 2), warmup=0, repeats=1)
    profile = profile_model(spec, settings, created_utc="2026-01-01T00:00:00+00:00")
    fc = profile.layer("fc")
    assert fc.tp_style == "column" and fc.shard(2).fwd_flops_per_sample == 2 * 8 * 32 * 1000 / 2
    assert profile.layer("blocks.0").tp_style == "none" and len(profile.layer("blocks.0").shards) == 1
    llama = profile_model(
        parse_model("llama:tiny"),
        ProfileSettings(micro_batches=(1,), seq_len=16, dtype="fp32", tp_degrees=(1, 2), warmup=0, repeats=1),
        created_utc="2026-01-01T00:00:00+00:00",
    )
    assert llama.layer("blocks.0").shard(2).params < llama.layer("blocks.0").shard(1).params


def test_analytic_profile_for_the_planner():
    from runtime.profiling.model import profile_model_analytic

    profile = profile_model_analytic(parse_model("resnet:resnet50-wide"), seq_len=1, dtype="bf16")
    fc = profile.layer("fc")  # Whale's split classifier: 2048 features x 100,000 classes
    assert fc.shard(1).fwd_flops_per_sample == 2 * 2048 * 100_000
    assert [s.tp for s in fc.shards] == [1, 2, 4, 8, 16, 32]  # 64 does not divide 100,000
    assert fc.shard(1).timings == [] and profile.provenance.method == "analytic"
    assert profile.total_params == 228_408_032  # 25,557,032 - 2048*1000 - 1000 + 2048*100,000 + 100,000


def _run_cli(args, capsys):
    rc = main(["profile", "model", *args])
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "gpt:nope"], "unknown gpt preset"),
        (["--model", "bert:tiny"], "unknown model family"),
        (["--model", "gpt:tiny", "--micro-batch", "1,x"], "malformed --micro-batch"),
        (["--model", "gpt:tiny", "--tp", "0"], "malformed --tp"),
        (["--model", "gpt:tiny", "--tp", "1,3"], "tp=3 does not divide heads=4"),
        (["--model", "gpt:tiny", "--seq", "4096"], "exceeds"),
        (["--model", "resnet:tiny", "--micro-batch", "1,2"], "BatchNorm"),
        (["--model", "gpt:tiny", "--analytic"], "--analytic needs --cluster"),
        (["--model", "gpt:tiny", "--analytic", "--cluster", "no-such-cluster"], "unknown cluster"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_file(tmp_path, capsys, args, needle):
    out = tmp_path / "p.json"
    rc, err = _run_cli([*args, "--out", str(out)], capsys)
    assert rc == 2 and needle in err and "\n" not in err and err.startswith("error: ")
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("breakage,needle", [("corrupt", "not valid JSON"), ("version", "schema_version 7")])
def test_corrupt_or_wrong_version_cluster_profile_exits_2(tmp_path, capsys, breakage, needle):
    good = json.loads(_cluster_file(tmp_path).read_text())
    bad = tmp_path / "cluster.json"
    bad.write_text("{ truncated" if breakage == "corrupt" else json.dumps({**good, "schema_version": 7}))
    out = tmp_path / "p.json"
    rc, err = _run_cli(["--model", "gpt:tiny", "--analytic", "--cluster", str(bad), "--out", str(out)], capsys)
    assert rc == 2 and needle in err and "regenerate" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json"]


def test_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    rc, err = _run_cli(["--model", "gpt:tiny", "--out", str(blocker / "p.json")], capsys)
    assert rc == 2 and "writable" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_shipped_gpt_tiny_profile():
    path = REPO / "profiles" / "models" / "gpt-tiny.json"
    profile = load_model_profile(path)
    assert profile.micro_batches == [1, 2, 4] and profile.tp_degrees == [1, 2] and profile.seq_len == 64
    assert profile.provenance.method == "measured"
    assert json.loads(path.read_text())["content_hash"] == profile.content_hash
