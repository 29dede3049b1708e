"""Lose a node, keep training (issue 30): ``stratagem launch --elastic`` on two 2-rank "nodes" on localhost. Node 0
starts alone and runs the plan made for its 2 ranks; node 1 joins and the job grows to the launched 4-rank plan; node
1 is lost for good before step 4 (its agent killed: ``STRATAGEM_TEST_KILL_NODE_AT_STEP``) and node 0 re-plans for
its 2 ranks, resumes the step-3 checkpoint resharded and finishes; the losses are those of a run that never
switched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.reference import reference_losses
from planner.cli.main import main
from planner.inspect import run_segments
from planner.plan import load_plan, save_plan
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
