"""Lose a node, keep training (issue 30): ``stratagem launch --elastic`` on two 2-rank "nodes" on localhost. Node 0
starts alone and runs the plan made for its 2 ranks; node 1 joins and the job grows to the launched 4-rank plan; node
1 is lost for good before step 4 (its agent killed: ``STRATAGEM_TEST_KILL_NODE_AT_STEP``) and node 0 re-plans for
its 2 ranks, resumes the step-3 checkpoint resharded and finishes; the losses are those of a run that never
switched."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fixtures.reference import reference_losses
from planner.cli.main import main
from planner.core import StratagemError
from planner.inspect import run_segments
from planner.plan import load_plan, lr_at_step, save_plan
from runtime.executor.checkpoint import COMPLETE_MARKER
from runtime.executor.metrics import final_step_losses, read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from runtime_helpers import _free_port  # noqa: E402

STEPS, JOIN_AT, LOST_AT = 6, 3, 4


def _two_node_cluster(tmp_path: Path) -> Path:
    """The shipped 2-rank CPU profile as two such nodes."""
    data = json.loads((REPO / "profiles/hardware/local-cpu-2core.json").read_text())
    data["nodes"][0]["count"], data["name"] = 2, "local-cpu-2x2"
    data.pop("content_hash", None)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    return path


def _plan(tmp_path: Path) -> Path:
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt:tiny", "--cluster", str(_two_node_cluster(tmp_path)), "--gpus", "4"]
    assert main([*argv, "--global-batch", "8", "--seq", "32", "--dtype", "fp32", "--out", str(out)]) == 0
    return out


def _launch(argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "planner.cli.main", "launch", *argv],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


@pytest.mark.slow
def test_a_node_joins_then_one_is_lost_and_training_finishes(tmp_path):
    """Node 0 starts alone: the job runs the 2-rank plan made for it (steps 1-2), node 1 joins and the job grows to
    the launched 4-rank plan (step 3), node 1 is lost for good before step 4 and the job finishes on node 0 under
    the 2-rank plan again (steps 4-6); each attempt resumes the last checkpoint resharded to its plan."""
    plan = _plan(tmp_path)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    endpoint = f"127.0.0.1:{_free_port()}"
    common = [str(plan), "--elastic", "--min-gpus", "2", "--nnodes", "2", "--nproc-per-node", "2"]
    common += ["--rdzv-endpoint", endpoint, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    common += ["--steps", str(STEPS), "--max-restarts", "2", "--rejoin-timeout-s", "8", "--timeout-s", "240"]
    common += ["--metrics", str(metrics)]  # one file on the shared folder: whichever node holds rank 0 writes it
    # node 0 hosts the rendezvous store (launch gives it is_host) and survives; alone, it waits the rejoin timeout
    # for the second node, runs the 2-rank plan and holds before step JOIN_AT until a node joins
    survivor = _launch([*common, "--node-rank", "0"], env={"STRATAGEM_TEST_HOLD_AT_STEP": f"{JOIN_AT}:4"})
    held = ckpt / f"step_{JOIN_AT - 1:06d}" / COMPLETE_MARKER
    deadline = time.monotonic() + 180
    while not held.exists() and survivor.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    lost = _launch([*common, "--node-rank", "1"], env={"STRATAGEM_TEST_KILL_NODE_AT_STEP": str(LOST_AT)})
    try:
        out = survivor.communicate(timeout=300)[0]
        (tmp_path / "survivor.log").write_text(out)
        lost_out = lost.communicate(timeout=60)[0]
    finally:
        survivor.kill()
        lost.kill()
    assert survivor.returncode == 0, out[-3000:] + "\n--- lost node ---\n" + lost_out[-2000:]
    assert lost.returncode != 0
    smaller = load_plan(plan.with_suffix(".elastic2.json"))  # written beside the plan
    assert smaller.world_size == 2 and smaller.training == load_plan(plan).training
    launched = load_plan(plan)

    records = read_metrics(metrics)
    starts = [r for r in records if r.get("event") == "start"]
    assert [(s["attempt"], s["world_size"], s["first_step"]) for s in starts] == [
        (0, 2, 1),
        (1, 4, JOIN_AT),
        (2, 2, LOST_AT),
    ]
    assert [s["plan_hash"] for s in starts] == [smaller.content_hash, launched.content_hash, smaller.content_hash]
    events = [r for r in records if r.get("event") == "replan"]
    assert [(e["from_world_size"], e["to_world_size"]) for e in events] == [(4, 2), (2, 4), (4, 2)]
    assert [e["resumed_from"] and Path(e["resumed_from"]).name for e in events] == [
        None,
        f"step_{JOIN_AT - 1:06d}",
        f"step_{LOST_AT - 1:06d}",
    ]
    assert events[1]["from_plan_path"] == str(plan.with_suffix(".elastic2.json").resolve())
    steps = [r for r in records if r.get("event") == "step"]
    last_old = max((r for r in steps if r["attempt"] == 1), key=lambda r: r["step"])
    first_new = min((r for r in steps if r["attempt"] == 2), key=lambda r: r["step"])
    lost_s = first_new["unix_time"] - first_new["step_time_s"] - last_old["unix_time"]
    print(f"from the end of the last step before the loss to the start of the first under the new plan: {lost_s:.1f} s")
    segments = run_segments(metrics)
    assert list(segments["why"]) == ["start", "re-plan", "re-plan"] and list(segments["world_size"]) == [2, 4, 2]
    assert segments["time_lost_s"].iloc[2] == pytest.approx(lost_s)
    show = subprocess.run(
        [
            sys.executable,
            "-m",
            "planner.cli.main",
            "show",
            str(plan.with_suffix(".elastic2.json")),
            "--metrics",
            str(metrics),
            "--png",
            str(tmp_path / "png"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert show.returncode == 0 and "re-plan" in show.stdout, show.stdout + show.stderr
    assert (tmp_path / "png" / "run_plans.png").stat().st_size > 0

    # every plan trains the same global batch in the same order: the losses are those of one process that never
    # switched (fp32; the plans differ only in how the batch is split and summed)
    got = final_step_losses(records)
    assert sorted(got) == list(range(1, STEPS + 1))
    expected = dict(enumerate(reference_losses(launched, STEPS), start=1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)


def test_elastic_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    from fixtures.plans import make_plan
    from planner.model import parse_model

    plan = _plan(tmp_path)
    hand_made = save_plan(make_plan(parse_model("gpt:tiny"), dp=4), tmp_path / "hand.json")
    capsys.readouterr()  # the plan command's own output
    base = ["--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:1", "--checkpoint-dir", str(tmp_path / "c")]
    base += ["--checkpoint-every", "1", "--max-restarts", "1"]
    cases = {
        "--min-gpus 8 is above the plan's 4 GPUs": [str(plan), "--elastic", "--min-gpus", "8", "--nnodes", "2", *base],
        "it needs --nnodes 2 or more": [str(plan), "--elastic", "--min-gpus", "2", "--nproc-per-node", "4", *base[4:]],
        "give --max-restarts 1 or more": [str(plan), "--elastic", "--min-gpus", "2", "--nnodes", "2", *base[:-2]],
        "does not record the `stratagem plan` arguments": [
            str(hand_made),
            "--elastic",
            "--min-gpus",
            "2",
            "--nnodes",
            "2",
            *base,
        ],
    }
    old = tmp_path / "old"  # an earlier run's checkpoints: every elastic attempt would resume them
    (old / "step_000002").mkdir(parents=True)
    (old / "step_000002" / COMPLETE_MARKER).write_text("")
    earlier = [str(plan), "--elastic", "--min-gpus", "2", "--nnodes", "2", *base[:5], str(old), *base[6:]]
    cases["holds checkpoints of an earlier run (newest: step_000002)"] = earlier
    cases["--slurm writes a fixed-size job"] = [*cases["give --max-restarts 1 or more"], "--max-restarts", "1"]
    cases["--slurm writes a fixed-size job"] += ["--slurm", str(tmp_path / "job.sbatch")]
    mixed = tmp_path / "mixed.json"  # which devices a lost node leaves depends on its type: refused
    argv = ["plan", "--model", "gpt:tiny", "--cluster", "mixed-a100-v100", "--gpus", "32", "--global-batch", "32"]
    assert main([*argv, "--seq", "32", "--dtype", "fp32", "--out", str(mixed)]) == 0
    capsys.readouterr()
    cases["cluster mixed-a100-v100 mixes node types"] = [
        str(mixed), "--elastic", "--min-gpus", "16", "--nnodes", "4", "--nproc-per-node", "8", *base[2:],
    ]  # fmt: skip
    for needle, argv in cases.items():
        assert main(["launch", *argv]) == 2, needle
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.glob("*.elastic*.json")) and not (tmp_path / "c").exists()


def test_run_segments_name_each_attempts_plan_steps_and_the_time_lost(tmp_path):
    """A restart that redid step 3 (checkpoint at 2) and a re-plan, from hand-written records: attempts, why, steps,
    steps redone, and the time lost from the end of one attempt's last step to the start of the next one's first."""
    lines = [
        {"event": "start", "world_size": 4, "plan_hash": "a", "plan_path": "/p.json", "attempt": 0, "unix_time": 0},
        *(
            {"event": "step", "step": s, "loss": 1.0, "step_time_s": 1.0, "attempt": 0, "unix_time": s}
            for s in (1, 2, 3)
        ),
        {"event": "start", "world_size": 4, "plan_hash": "a", "plan_path": "/p.json", "attempt": 1, "unix_time": 9},
        *(
            {"event": "step", "step": s, "loss": 1.0, "step_time_s": 1.0, "attempt": 1, "unix_time": 8 + s}
            for s in (3, 4)
        ),
        {"event": "replan", "to_plan_path": "/p.elastic2.json", "attempt": 2, "unix_time": 20},
        {"event": "start", "world_size": 2, "plan_hash": "b", "attempt": 2, "unix_time": 20},
        {"event": "step", "step": 5, "loss": 1.0, "step_time_s": 2.0, "attempt": 2, "unix_time": 30},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    seg = run_segments(path)
    assert list(seg["why"]) == ["start", "restart", "re-plan"]
    assert list(seg["world_size"]) == [4, 4, 2] and list(seg["steps_redone"]) == [0, 1, 0]
    assert list(seg["plan_path"]) == ["/p.json", "/p.json", "/p.elastic2.json"]
    assert seg["time_lost_s"].isna().iloc[0] and list(seg["time_lost_s"].iloc[1:]) == [7.0, 16.0]


def test_a_changed_batch_reads_the_run_from_the_next_sample():
    """A step at another global batch reads the run's sample stream (numbered by its first batch) from the sample
    after the last one trained: rows spanning two of the stream's steps are joined in order."""
    from planner.model import parse_model
    from runtime.executor.data import DataStream, build_data_source, synthetic_batch

    spec = parse_model("gpt:tiny")
    at8 = {s: synthetic_batch(spec, batch=8, seq_len=16, seed=0, step=s) for s in (3, 4)}
    read = build_data_source(spec, "synthetic", global_batch=6, seq_len=16, seed=0, stream=DataStream(8, 3, 16))
    assert torch.equal(read(3).inputs, at8[3].inputs[:6])  # samples 16-21
    assert torch.equal(read(4).inputs, torch.cat([at8[3].inputs[6:], at8[4].inputs[:4]]))  # samples 22-27
    assert torch.equal(read(4).targets, torch.cat([at8[3].targets[6:], at8[4].targets[:4]]))
    aligned = build_data_source(spec, "synthetic", global_batch=8, seq_len=16, seed=0, stream=DataStream(8, 3, 16))
    assert torch.equal(aligned(4).inputs, at8[4].inputs)


def test_elastic_takes_the_nearest_batch_only_where_the_runs_cannot_fit(tmp_path, capsys):
    """Pinned to pure data parallelism (--tp 1 --pp 1), 6 GPUs cannot split a global batch of 8 (dp 6): that count
    gets the nearest batch the 6 can split, stated; 4 and 2 GPUs keep the run's batch."""
    from planner.cli.cmd_launch import elastic_plans
    from runtime.launch import LaunchOptions

    cluster = json.loads((REPO / "profiles/hardware/local-cpu-2core.json").read_text())
    cluster["nodes"][0]["count"], cluster["name"] = 4, "local-cpu-4x2"
    # "nodes" on one host talk over the same loopback: the measured fits serve as the inter-node ones too
    links = cluster["node_types"][0]["intra_node"]
    cluster["inter_node"] = [{**fit, "level": "inter_node"} for fit in links]
    cluster.pop("content_hash", None)
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt:tiny", "--cluster", str(tmp_path / "cluster.json"), "--gpus", "8"]
    argv += ["--global-batch", "8", "--seq", "16", "--dtype", "fp32", "--tp", "1", "--pp", "1", "--out", str(out)]
    assert main([*argv, "--lr", "1e-3", "--train-steps", "10"]) == 0  # a recipe: its rate scales with the batch
    capsys.readouterr()
    plan = load_plan(out)
    opts = LaunchOptions(
        plan_path=out, nnodes=4, rdzv_endpoint="h:1", elastic=True, min_gpus=2, max_restarts=1,
        checkpoint_dir=tmp_path / "c", checkpoint_every=1,
    )  # fmt: skip
    paths = elastic_plans(plan, opts, out)
    err = capsys.readouterr().err
    plans = {p.world_size: p for p in map(load_plan, paths)}
    assert sorted(plans) == [2, 4, 6]
    assert [plans[n].training.global_batch for n in (2, 4, 6)] == [8, 8, 6]
    assert plans[6].mesh.size("dp") == 6
    assert plans[6].training.model_copy(update={"global_batch": 8}) == plan.training
    assert "no plan of global batch 8 fits 6 GPUs" in err and "trains 6 samples per step" in err, err
    assert "the rate scaled linearly by its recipe" in err
    schedule = plan.training.lr_schedule
    assert plans[6].training.lr_schedule == schedule and schedule is not None and schedule.reference_batch == 8
    assert lr_at_step(schedule, global_batch=6, step=3) == pytest.approx(
        0.75 * lr_at_step(schedule, global_batch=8, step=3)
    )
    # a node that joins later runs these very plans (it does not re-plan them)
    again = elastic_plans(plan, dataclasses.replace(opts, node_rank=1), out)
    assert [load_plan(p).content_hash for p in again] == [plans[n].content_hash for n in (6, 4, 2)]
    assert capsys.readouterr().err.count("the job's own") == 3


@pytest.mark.slow
def test_a_resume_at_another_batch_continues_from_the_next_sample(tmp_path):
    """Two ranks resume a checkpoint of a run at global batch 8 (step 2) under the plan at batch 6 that launch
    --elastic made for a world the run's batch did not fit: steps 3-4 read samples 16-27 of the run and the losses
    are one process's that trained so."""
    from fixtures.plans import make_plan
    from planner.model import parse_model
    from runtime.executor.data import DataStream, build_data_source
    from runtime_helpers import spawn_ranks, tail

    spec = parse_model("gpt:tiny")
    first = save_plan(make_plan(spec, dp=2, global_batch=8), tmp_path / "b8.json")
    second = save_plan(make_plan(spec, dp=2, global_batch=6), tmp_path / "b6.json")
    ckpt = tmp_path / "ckpt"
    base = ["-m", "runtime.executor.train", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    proc = spawn_ranks(2, [*base, "--plan", str(first), "--steps", "2"], timeout_s=120)
    assert proc.returncode == 0, tail(proc)
    metrics = tmp_path / "m.jsonl"
    argv = [*base, "--plan", str(second), "--steps", "4", "--elastic", "--metrics", str(metrics)]
    proc = spawn_ranks(2, argv, timeout_s=120)
    assert proc.returncode == 0, tail(proc)
    records = read_metrics(metrics)
    (event,) = [r for r in records if r.get("event") == "replan"]
    assert Path(event["resumed_from"]).name == "step_000002" and event["first_step"] == 3
    assert json.loads((ckpt / "step_000004" / "meta.json").read_text())["data"] == {"batch": 8, "samples": 28}

    plan8, plan6 = load_plan(first), load_plan(second)
    # launch --elastic --resume of the batch-8 plan from the batch-6 checkpoint: accepted (a job whose world shrank
    # and grew back); a plain --resume still refuses the other batch
    from runtime.executor.checkpoint import check_resumable

    assert check_resumable(ckpt, plan8, batch_may_change=True).name == "step_000004"
    with pytest.raises(StratagemError, match="global_batch 6 -> 8"):
        check_resumable(ckpt, plan8)
    tr = plan8.training
    at8 = build_data_source(spec, "synthetic", global_batch=8, seq_len=tr.seq_len, seed=tr.seed)
    at6 = build_data_source(
        spec, "synthetic", global_batch=6, seq_len=tr.seq_len, seed=tr.seed, stream=DataStream(8, 3, 16)
    )
    expected = reference_losses(plan6, 4, source=lambda step: at8(step) if step <= 2 else at6(step))
    got = final_step_losses(records)
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step - 1], rel=1e-5), (step, got, expected)
