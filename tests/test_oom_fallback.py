"""An out-of-memory error in a launch: `stratagem launch` moves to the fastest runner-up plan in the plan file that
is predicted to need less memory, and trains it from step 1 with the same data order and step count.

The error is injected (``STRATAGEM_TEST_OOM_AT_STEP``: the last rank raises ``torch.OutOfMemoryError`` in that
step of the plan the launch started with, as CUDA's allocator would); everything after it is what a real one
gets: the rank's note to the launcher, torchrun ending the other rank, the choice of plan, the restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import REPO, tail

from fixtures.plans import make_plan
from fixtures.reference import reference_losses
from planner.cli.main import main
from planner.model import parse_model
from planner.plan import load_plan, save_plan
from runtime.executor.metrics import final_step_losses, read_metrics

pytestmark = pytest.mark.slow
STEPS = 2


def _launch(plan_path, metrics, *, oom_at: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "planner.cli.main", "launch", str(plan_path), "--steps", str(STEPS)]
    cmd += ["--metrics", str(metrics), "--timeout-s", "200"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STRATAGEM_TEST_OOM_AT_STEP", None)
    if oom_at is not None:
        env["STRATAGEM_TEST_OOM_AT_STEP"] = str(oom_at)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oom")
    path = folder / "plan.json"
    argv = ["plan", "--model", "gpt:tiny", "--cluster", "local-cpu-2core", "--gpus", "2"]
    assert main([*argv, "--global-batch", "8", "--seq", "64", "--out", str(path)]) == 0
    return path


def test_an_oom_moves_to_the_runner_up_with_more_headroom_and_trains_as_it_would(searched, tmp_path):
    plan = load_plan(searched)
    share = lambda p: max(s.peak_memory_bytes / s.memory_capacity_bytes for s in p.predictions.stages)  # noqa: E731
    roomier = [a.plan for a in plan.search.top_k if a.plan is not None and share(a.plan) < share(plan)]
    assert roomier, "the search record must hold a runner-up predicted to need less memory"
    expected = min(roomier, key=lambda p: p.predictions.step_time_s)

    metrics = tmp_path / "m.jsonl"
    proc = _launch(searched, metrics, oom_at=1)
    assert proc.returncode == 0, tail(proc)
    assert "rank 1 ran out of memory in step 1; moving to runner-up plan" in proc.stderr
    fallback_path = searched.with_suffix(".fallback1.json")
    fallback = load_plan(fallback_path)
    assert fallback.stages == expected.stages and fallback.schedule == expected.schedule
    records = read_metrics(metrics)
    events = [r["event"] for r in records]
    assert events == ["start", "oom_fallback", "start", *["step"] * STEPS, "summary"]
    starts = [r for r in records if r["event"] == "start"]
    move = records[1]
    assert [s["plan_hash"] for s in starts] == [plan.content_hash, fallback.content_hash]
    assert (move["from_plan_hash"], move["to_plan_hash"], move["step"], move["rank"]) == (
        plan.content_hash,
        fallback.content_hash,
        1,
        1,
    )

    # the losses of a run started on the runner-up (fixtures.reference: the same plan's model, data and steps in
    # one process, which test_runtime_parity holds equal to its launches)
    losses = final_step_losses(records)
    assert [losses[s] for s in range(1, STEPS + 1)] == pytest.approx(reference_losses(expected, STEPS), rel=1e-5)


def test_an_oom_without_a_roomier_runner_up_names_the_margin_flag(tmp_path, capsys, monkeypatch):
    """The launcher's side, with torchrun replaced by a job whose rank 1 reports running out of memory (the
    ranks' side, the note and the exit, is what the test above launches)."""
    import runtime.launch

    def job(cmd, *, timeout_s, env_extra):
        (Path(env_extra["STRATAGEM_OOM_DIR"]) / "oom-rank1.json").write_text(
            json.dumps({"rank": 1, "step": 1, "plan_hash": "x", "message": "CUDA out of memory"})
        )
        return 1

    monkeypatch.setattr(runtime.launch, "run_command", job)
    plan_path = save_plan(make_plan(parse_model("gpt:tiny"), dp=2, global_batch=8, seq_len=64), tmp_path / "p.json")
    before = plan_path.read_bytes()
    assert main(["launch", str(plan_path), "--steps", "1", "--metrics", str(tmp_path / "m.jsonl")]) != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ran out of memory in step 1" in last and "--memory-margin" in last, last
    assert plan_path.read_bytes() == before and not list(tmp_path.glob("*.fallback*"))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--memory-margin", "0.9"], "--memory-margin"),
        (["--memory-margin", "-0.1"], "--memory-margin"),
        (["--memory-margin", "0.2", "--memory-fraction", "0.8"], "pass one of them"),
    ],
)
def test_bad_margins_are_one_line_errors_and_write_nothing(tmp_path, capsys, flags, needle):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt:tiny", "--cluster", "local-cpu-2core", "--gpus", "2", "--global-batch", "8"]
    try:
        status = main([*argv, "--seq", "64", "--out", str(out), *flags])
    except SystemExit as exc:  # argparse rejects a value outside its range
        status = exc.code
    assert status != 0 and needle in capsys.readouterr().err and not out.exists()


def test_the_plan_records_its_margin(tmp_path):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt:tiny", "--cluster", "local-cpu-2core", "--gpus", "2", "--global-batch", "8"]
    assert main([*argv, "--seq", "64", "--out", str(out), "--memory-margin", "0.25"]) == 0
    assert json.loads(out.read_text())["search"]["memory_margin"] == 0.25


def test_plan_for_megatron_prices_megatron_memory_and_says_so(tmp_path, capsys):
    """``plan --for megatron`` (or ``--compare-to megatron``) searches with memory as Megatron-LM holds it: the plan
    records it, its prediction is the estimate of its config under that semantics, and show prints it."""
    import dataclasses

    from planner.cost import estimate, plan_config
    from planner.plan import load_plan
    from planner.profile import build_gpt_profile, load_cluster_profile, resolve_cluster_path

    argv = ["plan", "--model", "gpt:gpt2", "--cluster", "dgx-a100-80g", "--gpus", "16", "--global-batch", "64"]
    out = {}
    for target in ("launch", "megatron"):
        out[target] = tmp_path / f"{target}.json"
        assert main([*argv, "--seq", "1024", "--for", target, "--out", str(out[target])]) == 0
    runtime, megatron = load_plan(out["launch"]), load_plan(out["megatron"])
    assert (runtime.search.memory_semantics, megatron.search.memory_semantics) == ("fsdp2", "textbook")
    profile = build_gpt_profile(megatron.model, seq_len=1024, dtype=megatron.training.dtype)
    config = dataclasses.replace(plan_config(megatron), memory_semantics="textbook")
    est = estimate(profile, load_cluster_profile(resolve_cluster_path("dgx-a100-80g")), config, global_batch=64)
    assert megatron.predictions.peak_memory_bytes == pytest.approx(est.peak_memory_bytes, rel=1e-9)
    capsys.readouterr()
    assert main(["show", str(out["megatron"])]) == 0
    assert "Megatron-LM / DeepSpeed" in capsys.readouterr().out
    assert main([*argv, "--seq", "1024", "--for", "jax", "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
