"""`stratagem frontier`: rows equal `stratagem plan` for their flags, Pareto marks equal a brute-force dominance
test, the economics by hand, and bad input as one-line errors with nothing written."""

from __future__ import annotations

import csv
import json
import random
import shlex

import pytest

from planner.cli.main import main
from planner.frontier import pareto_front, run_economics
from planner.profile import load_cluster_profile

GRID = [
    "--model", "gpt:gpt2-xl", "--seq", "1024", "--global-batch", "32", "--train-tokens", "1e10",
    "--cluster", "dgx-h100", "--cluster", "dgx-a100-80g", "--gpus", "8,32", "--jobs", "2",
]  # fmt: skip


def dominated(p, points) -> bool:
    return any(q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)


def test_pareto_front_equals_brute_force():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 12)
        points = [(rng.randint(0, 5), rng.randint(0, 5)) for _ in range(n)]  # small ints: many ties
        assert pareto_front(points) == [not dominated(p, points) for p in points]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier") / "f.csv"
    png = out.with_suffix(".png")
    assert main(["frontier", *GRID, "--out", str(out), "--png", str(png)]) == 0
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    return rows, png


def test_rows_equal_plan(grid, tmp_path):
    rows, _ = grid
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    for row in rows:
        argv = shlex.split(row["plan_command"])
        assert argv[0] == "stratagem" and argv[-2:] == ["--out", "plan.json"]
        plan_path = tmp_path / f"{row['cluster']}-{row['gpus']}.json"
        assert main([*argv[1:-2], "--out", str(plan_path)]) == 0
        plan = json.loads(plan_path.read_text())
        from planner.plan import load_plan, plan_label

        loaded = load_plan(plan_path)
        assert plan_label(loaded) == row["strategy"]
        assert plan["predictions"]["step_time_s"] == pytest.approx(float(row["step_time_s"]), rel=1e-12)


def test_pareto_marks_and_economics(grid):
    rows, png = grid
    assert png.stat().st_size > 1000
    for field, mark in (("cost_usd", "pareto_time_cost"), ("energy_mwh", "pareto_time_energy")):
        points = [(float(r["train_days"]), float(r[field])) for r in rows]
        assert [r[mark] == "True" for r in rows] == [not dominated(p, points) for p in points]
    for r in rows:  # days and cost by hand: steps = tokens / (batch x seq), cost = GPU-hours x price
        steps = -(-(10**10) // (32 * 1024))
        days = steps * float(r["step_time_s"]) / 86400
        assert float(r["train_days"]) == pytest.approx(days, rel=1e-9)
        assert float(r["cost_usd"]) == pytest.approx(days * 24 * int(r["gpus"]) * float(r["price_usd_per_gpu_hour"]))


def test_energy_by_hand():
    node = load_cluster_profile("profiles/hardware/dgx-a100-80g.json").node_types[0]
    p = node.power
    e = run_economics(
        step_s=2.0, gpus=16, global_batch=8, seq_len=1000, train_tokens=8000 * 3600, node=node, util=0.5,
        price_per_gpu_hour=None, pue=1.2,
    )  # fmt: skip
    assert e.steps == 3600 and e.train_s == 7200 and e.cost_usd is None
    per_gpu_w = (p.idle_w + 0.5 * (p.board_w - p.idle_w) + p.host_w / 8) * 1.2
    assert e.energy_mwh == pytest.approx(per_gpu_w * 16 * 2 / 1e6)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--price", "dgx-h100=0"], "positive price"),
        (["--price", "dgx-v100=2"], "not one of the --cluster values"),
        (["--deadline-days", "0"], "--deadline-days"),
        (["--gpus", "8:7"], "--gpus"),
        (["--gpus", "12"], "not whole nodes"),
        (["--batch-range", "33:63"], "holds no --global-batch"),
    ],
)
def test_bad_input_one_line(extra, message, tmp_path, capsys):
    out = tmp_path / "f.csv"
    argv = [*GRID, "--out", str(out)]
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert main(["frontier", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_no_count_can_hold_the_model(tmp_path, capsys):
    out = tmp_path / "f.csv"
    argv = ["frontier", "--model", "llama:llama3-70b", "--seq", "8192", "--global-batch", "16",
            "--train-tokens", "1e9", "--cluster", "dgx-a100-80g", "--gpus", "1:2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: no GPU count in 1:2") and "memory" in err[-1]
    assert not out.exists()


def test_a_count_that_cannot_use_the_batch_says_why(tmp_path, capsys):
    out = tmp_path / "f.csv"
    base = ["frontier", "--model", "gpt:gpt2-xl", "--seq", "1024", "--train-tokens", "1e9", "--cluster", "dgx-h100",
            "--allow", "dp,zero", "--jobs", "1", "--out", str(out)]  # fmt: skip
    assert main([*base, "--global-batch", "8", "--gpus", "8,16"]) == 0
    with open(out) as fh:
        rows = {int(r["gpus"]): r for r in csv.DictReader(fh)}
    assert rows[8]["status"] == "ok"
    assert rows[16]["status"] == "no plan" and "global batch 8 over 16 devices" in rows[16]["reason"]
    out.unlink()
    assert main([*base, "--global-batch", "3", "--gpus", "8,16"]) == 2  # no count can use a batch of 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: no GPU count") and "global batch 3" in err[-1]
    assert not out.exists()


def test_batch_range_scales_the_learning_rate_and_keeps_the_tokens(tmp_path):
    out = tmp_path / "f.csv"
    argv = ["frontier", "--model", "gpt:gpt2-xl", "--seq", "1024", "--global-batch", "32", "--train-tokens", "1e9",
            "--cluster", "dgx-h100", "--gpus", "8", "--batch-range", "16:64", "--jobs", "1",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["global_batch"]) for r in rows] == [16, 32, 64]
    for r in rows:
        batch = int(r["global_batch"])
        assert float(r["lr_scale"]) == batch / 32  # linear scaling (Goyal et al. 2017)
        steps = -(-(10**9) // (batch * 1024))  # the same tokens at every batch
        assert float(r["train_days"]) == pytest.approx(steps * float(r["step_time_s"]) / 86400, rel=1e-9)
        assert f"--global-batch {batch} " in r["plan_command"]
