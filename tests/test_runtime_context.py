"""Context parallelism at run time: loss parity with one process, the layout, and the attention maths.

Two torchrun jobs (2 ranks: CP2 on gpt and llama, all-gather and ring, with recompute; 4 ranks: CP2 x DP2,
CP2 x TP2, CP2 inside PP2, CP4 ring) train 3 AdamW steps in fp32; ``reference_losses`` runs the same model,
seed and data on one process with whole sequences. The unit tests check the chunk layout, positions and mask
against hand-computed values and each rank's masked attention against torch's causal SDPA on one process.
"""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import tail, torchrun

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.core import StratagemError
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.checks import check_context_supported
from runtime.executor.context import ContextShard, _to_rank_order, _to_sequence_order
from runtime.executor.metrics import final_step_losses, read_metrics

STEPS = 3
REL_TOL = 1e-5  # fp32
ALL_SPLIT = ["embed", "blocks.0", "blocks.1", "head"]
PLANS_2 = {
    "cp2": dict(cp=2),
    "cp2_llama_ring": dict(cp=2, spec="llama:tiny", context_parallel="ring"),
    "cp2_ring_recompute": dict(cp=2, context_parallel="ring", recompute={"blocks.0": "full"}),
    # the recompute re-runs the K/V all-gather inside the backward (same order on every cp rank)
    "cp2_recompute": dict(cp=2, recompute={"blocks.0": "full", "blocks.1": "selective"}),
}
PLANS_4 = {
    "cp2_dp2": dict(cp=2, dp=2, zero_stage=2),
    "cp2_tp2": dict(cp=2, tp=2, split=ALL_SPLIT),
    "cp2_llama_tp2_sp": dict(
        cp=2, tp=2, split=["embed", "head"], sequence_parallel=["blocks.0", "blocks.1", "norm"], spec="llama:tiny"
    ),
    # the planner's Llama-3-70B shape at 512+ GPUs: ring cp, tp 2 with sequence parallelism, micro-batch 1, so the
    # replicated final norm runs on the whole micro-batch on both TP ranks (gathered from the sequence shards)
    "cp2_llama_ring_tp2_sp_mb1": dict(
        cp=2,
        tp=2,
        split=["embed", "head"],
        sequence_parallel=["blocks.0", "blocks.1"],
        num_micro_batches=4,
        spec="llama:tiny",
        context_parallel="ring",
    ),
    "cp2_in_pp2": dict(cp=2, pp=2, schedule="1f1b", num_micro_batches=2),
    "cp4_llama_ring": dict(cp=4, spec="llama:tiny", context_parallel="ring"),
    # tied head and embedding on different pp ranks: one gradient all-reduce pair per (dp, cp, tp) coordinate
    "cp2_in_pp2_tied": dict(cp=2, pp=2, schedule="1f1b", num_micro_batches=2, tie=True),
}


def test_chunk_layout_positions_and_mask():
    shard = ContextShard(cp=2, rank=1, seq_len=8)
    assert shard.chunks == (1, 2)
    assert shard.positions().tolist() == [2, 3, 4, 5]
    x = torch.arange(8)[None, :]
    assert shard.shard(x).tolist() == [[2, 3, 4, 5]]
    bias = shard.causal_bias(device=torch.device("cpu"), dtype=torch.float32)
    assert bias.shape == (4, 8)
    assert (bias[0] == 0).tolist() == [True, True, True, False, False, False, False, False]  # position 2
    assert (bias[3] == 0).tolist() == [True] * 6 + [False, False]  # position 5


@pytest.mark.parametrize("cp", [2, 4])
def test_chunked_attention_equals_torch_causal_sdpa(cp):
    """Each cp rank's queries (its two chunks) against the whole sequence under its mask give that rank's rows
    of torch's causal scaled_dot_product_attention: the layout and mask maths of the runtime, on one process."""
    gen = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(2, 3, 8 * cp, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(cp):
        shard = ContextShard(cp=cp, rank=rank, seq_len=8 * cp)
        scores = shard.shard(q, dim=2) @ k.transpose(-2, -1) / 2.0  # sqrt(head_dim 4)
        scores = scores + shard.causal_bias(device=torch.device("cpu"), dtype=scores.dtype)
        mine = torch.softmax(scores, dim=-1) @ v
        torch.testing.assert_close(mine, shard.shard(reference, dim=2), rtol=1e-12, atol=1e-12)


def test_rank_order_round_trip():
    # cp 2, chunk 1: rank 0 holds chunks 0, 3 and rank 1 chunks 1, 2
    gathered = torch.tensor([0, 3, 1, 2])
    assert _to_sequence_order(gathered, 2).tolist() == [0, 1, 2, 3]
    assert _to_rank_order(torch.tensor([0, 1, 2, 3]), 2).tolist() == [0, 3, 1, 2]


def test_bad_context_plans_are_one_line_errors():
    resnet = make_plan(parse_model("resnet:tiny"), global_batch=8, seq_len=1)
    plan = resnet.model_copy(
        update={
            "mesh": resnet.mesh.model_copy(update={"axes": ["pp", "dp", "cp", "tp"], "sizes": [1, 1, 2, 1]}),
            "context_parallel": "allgather",
        }
    )
    with pytest.raises(StratagemError, match="no attention the runtime can split.*--cp 1"):
        check_context_supported(plan)
    gpt = make_plan(parse_model("gpt:tiny"), cp=2, seq_len=16)
    odd = gpt.model_copy(update={"training": gpt.training.model_copy(update={"seq_len": 18})})
    with pytest.raises(StratagemError, match="2 x cp = 4 equal chunks"):
        check_context_supported(odd)


def _run_job(tmp_path_factory, plans: dict, nproc: int) -> dict:
    root = tmp_path_factory.mktemp(f"context{nproc}")
    args, out = ["--steps", str(STEPS), "--timeout-s", "60"], {}
    for name, cfg in plans.items():
        cfg = dict(cfg)
        spec = parse_model(cfg.pop("spec", "gpt:tiny"), tie_embeddings=cfg.pop("tie", None))
        plan = make_plan(spec, global_batch=cfg.pop("global_batch", 4), seq_len=16, **cfg)
        path = save_plan(plan, root / f"{name}.json")
        args += ["--plan", str(path), "--metrics", str(root / f"{name}.jsonl"), "--layout-report", str(root / name)]
        out[name] = (plan, root / f"{name}.jsonl", root / name)
    proc = torchrun(nproc, args, timeout_s=240)
    assert proc.returncode == 0, tail(proc)
    return out


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    return _run_job(tmp_path_factory, PLANS_2, 2)


@pytest.fixture(scope="module")
def job4(tmp_path_factory):
    return _run_job(tmp_path_factory, PLANS_4, 4)


def _check_parity(entry) -> None:
    plan, metrics, _ = entry
    measured = final_step_losses(read_metrics(metrics))
    expected = reference_losses(plan, STEPS)
    assert sorted(measured) == list(range(1, STEPS + 1))
    for step, ref in enumerate(expected, start=1):
        assert measured[step] == pytest.approx(ref, rel=REL_TOL), (step, measured, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS_2))
def test_two_rank_context_parallel_matches_single_process(job2, name):
    _check_parity(job2[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS_4))
def test_four_rank_context_parallel_matches_single_process(job4, name):
    _check_parity(job4[name])


@pytest.mark.slow
def test_context_axis_is_applied(job2, job4):
    report = json.loads((job2["cp2"][2] / "rank1.json").read_text())
    assert report["coords"] == {"pp": 0, "dp": 0, "cp": 1, "tp": 0}
    assert report["chunks"][0]["context_paths"] == ["embed", "blocks.0.attn", "blocks.1.attn"]
    assert report["context"] == {"cp": 2, "mode": "allgather", "chunks": [1, 2]}
    ring = json.loads((job4["cp4_llama_ring"][2] / "rank1.json").read_text())["context"]
    assert ring == {"cp": 4, "mode": "ring", "chunks": [1, 6]}  # K/V travel the ring instead of a gather
    # gradients average over dp x cp: FSDP shards the weights over the flattened 4-rank mesh
    report = json.loads((job4["cp2_dp2"][2] / "rank3.json").read_text())
    qkv = report["chunks"][0]["params"]["blocks.0.attn.qkv.weight"]
    assert qkv["mesh_dims"] == ["dp_cp"] and qkv["local_shape"] == [48, 64]
    # cp inside pp: each pp rank's two cp ranks hold the same stage
    reports = [json.loads((job4["cp2_in_pp2"][2] / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["coords"]["pp"], r["coords"]["cp"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert reports[1]["chunks"][0]["context_paths"] == ["embed", "blocks.0.attn", "blocks.1.attn"]
    assert (
        reports[3]["chunks"][0]["module_paths"] == ["norm", "head"] and reports[3]["chunks"][0]["context_paths"] == []
    )
