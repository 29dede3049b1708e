"""Lose a node, keep training (issue 30): ``stratagem launch --elastic`` on two 2-rank "nodes" on localhost; one
node is lost for good before step 4 (its agent killed: ``STRATAGEM_TEST_KILL_NODE_AT_STEP``), the other re-plans
for its 2 ranks, resumes the step-3 checkpoint resharded and finishes; its losses are those of a run that switched
plans at the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import socket
import time
from pathlib import Path

import pytest

from fixtures.reference import reference_losses
from planner.cli.main import main
from planner.inspect import run_segments
from planner.plan import load_plan, save_plan
from runtime.executor.metrics import final_step_losses, read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from runtime_helpers import _free_port, spawn_ranks, tail  # noqa: E402

STEPS, LOST_AT = 6, 4


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


def _listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_a_lost_node_is_replanned_around_and_training_finishes(tmp_path):
    plan = _plan(tmp_path)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    endpoint = f"127.0.0.1:{_free_port()}"
    common = [str(plan), "--elastic", "--min-gpus", "2", "--nnodes", "2", "--nproc-per-node", "2"]
    common += ["--rdzv-endpoint", endpoint, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    common += ["--steps", str(STEPS), "--max-restarts", "2", "--rejoin-timeout-s", "8", "--timeout-s", "240"]
    common += ["--metrics", str(metrics)]  # one file on the shared folder: whichever node holds rank 0 writes it
    # the rejoin timeout is also how long the first rendezvous waits for the second node once the first is in: each
    # launcher re-plans before starting torchrun, which under a busy CPU (two test workers) took over 3 s once
    survivor = _launch([*common, "--node-rank", "0"])
    # node 0 hosts the rendezvous store and survives: node 1 starts once that store listens (a fixed 1 s wait could
    # let node 1's torchrun bind the endpoint first under load; killing node 1 then closed the store)
    deadline = time.monotonic() + 120
    while not _listening(endpoint) and survivor.poll() is None and time.monotonic() < deadline:
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

    records = read_metrics(metrics)
    starts = [r for r in records if r.get("event") == "start"]
    assert [s["world_size"] for s in starts][0] == 4 and starts[-1]["world_size"] == 2
    assert starts[-1]["plan_hash"] == smaller.content_hash and starts[-1]["first_step"] == LOST_AT
    (event,) = [r for r in records if r.get("event") == "replan"]
    assert (event["from_world_size"], event["to_world_size"]) == (4, 2)
    assert event["resumed_from"].endswith(f"step_{LOST_AT - 1:06d}")
    steps = [r for r in records if r.get("event") == "step"]
    last_old = max((r for r in steps if r["attempt"] == 0), key=lambda r: r["step"])
    first_new = min((r for r in steps if r["attempt"] == event["attempt"]), key=lambda r: r["step"])
    lost_s = first_new["unix_time"] - first_new["step_time_s"] - last_old["unix_time"]
    print(f"from the end of the last step before the loss to the start of the first under the new plan: {lost_s:.1f} s")
    segments = run_segments(metrics)
    assert list(segments["why"]) == ["start", "re-plan"] and list(segments["world_size"]) == [4, 2]
    assert segments["time_lost_s"].iloc[1] == pytest.approx(lost_s)
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

    # the reference: the 4-rank plan's losses to step 3 (one process, the whole batch), then the 2-rank plan
    # resumed in a fresh job from the step-3 checkpoint the elastic run wrote
    got = final_step_losses(records)
    assert sorted(got) == list(range(1, STEPS + 1))
    expected = dict(enumerate(reference_losses(load_plan(plan), LOST_AT - 1), start=1))
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    (resumed / "ckpt" / f"step_{LOST_AT - 1:06d}").symlink_to(ckpt / f"step_{LOST_AT - 1:06d}")
    argv = ["-m", "runtime.executor.train", "--plan", str(plan.with_suffix(".elastic2.json")), "--steps", str(STEPS)]
    argv += ["--resume", "--checkpoint-dir", str(resumed / "ckpt"), "--metrics", str(resumed / "m.jsonl")]
    proc = spawn_ranks(2, argv, timeout_s=120)
    assert proc.returncode == 0, tail(proc)
    expected.update(final_step_losses(read_metrics(resumed / "m.jsonl")))
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
