"""stratagem calibrate: recovers known parameters from synthetic runs with 3 % noise; bad input fails with one
line naming the row and column, and writes nothing."""

import contextlib
import io
import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from planner.calibrate import Predictor, fit, mean_abs
from planner.calibrate.runs import _run
from planner.cli.common import PROFILES_DIR
from planner.cli.main import main
from planner.profile import load_cluster_profile

A100 = load_cluster_profile(PROFILES_DIR / "hardware" / "dgx-a100-80g.json")
TRUE = {"dgx-a100-80g.gemm_ceiling": 0.60, "dgx-a100-80g.memory_bw_efficiency": 0.50}
SHAPES = [
    (1024, 12, 1, 1),
    (1024, 24, 4, 1),
    (1536, 12, 16, 2),
    (2048, 24, 2, 1),
    (2048, 12, 8, 2),
    (1024, 12, 16, 1),
    (1536, 24, 1, 1),
    (2048, 24, 16, 1),
    (1024, 24, 2, 2),
    (1536, 12, 4, 1),
    (2048, 12, 1, 2),
    (1024, 12, 8, 1),
]
HEADER = "model,layers,hidden,heads,seq,vocab,gpus,global_batch,micro_batch,tp,pp,dp,step_time_s"


def _row(h, layers, mb, tp, t="1"):
    dp = 8 // tp
    return dict(
        model="gpt",
        layers=str(layers),
        hidden=str(h),
        heads=str(h // 128),
        seq="1024",
        vocab="51200",
        gpus="8",
        global_batch=str(dp * mb * 4),
        micro_batch=str(mb),
        tp=str(tp),
        pp="1",
        dp=str(dp),
        step_time_s=t,
    )


def test_synthetic_runs_recover_the_parameters_and_predict_held_out_runs():
    runs = [_run(i + 1, _row(*s)) for i, s in enumerate(SHAPES)]
    truth = Predictor(A100, runs).predict(TRUE)
    rng = random.Random(0)
    noisy = [replace(r, step_time_s=float(t) * (1 + rng.gauss(0, 0.03))) for r, t in zip(runs, truth)]
    train, held = noisy[:9], noisy[9:]
    res = fit(A100, train)
    assert mean_abs(res.residuals_before) > 0.10  # the prior (0.72 / 0.65) is far off
    assert res.values["dgx-a100-80g.gemm_ceiling"] == pytest.approx(0.60, rel=0.05)
    assert res.values["dgx-a100-80g.memory_bw_efficiency"] == pytest.approx(0.50, rel=0.10)
    assert mean_abs(res.cv_errors) <= 0.04
    pred = Predictor(A100, held).predict(res.values)
    assert mean_abs([p / r.step_time_s - 1 for p, r in zip(pred, held)]) <= 0.04


def test_two_runs_fit_one_parameter_and_say_so():
    runs = [_run(1, _row(1024, 12, 1, 1, "0.5")), _run(2, _row(2048, 24, 16, 1, "9.0"))]
    res = fit(A100, runs)
    assert len(res.values) == 1 and "not fitted" in res.note and not res.cv_errors


def _cli(tmp_path, text, suffix=".csv"):
    """``stratagem calibrate`` on ``text`` in this process (a subprocess per case cost 2 s of start-up each; the
    written profile's test below runs the real command)."""
    runs = tmp_path / f"runs{suffix}"
    runs.write_text(text)
    out = tmp_path / "out.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    argv = ["calibrate", "--cluster", "dgx-a100-80g", "--runs", str(runs), "--out", str(out)]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(argv)
    return subprocess.CompletedProcess(argv, status, stdout.getvalue(), stderr.getvalue()), out


GOOD = ",".join(_row(1024, 12, 1, 1, "0.5").values())


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "no data rows"),
        (HEADER + "\n", "no data rows"),
        (HEADER.replace(",step_time_s", "") + "\n" + GOOD.rsplit(",", 1)[0] + "\n", "lacks column(s) step_time_s"),
        (HEADER + "\n" + GOOD.rsplit(",", 1)[0] + ",-1\n" + GOOD + "\n", "row 1 column 'step_time_s'"),
        (HEADER + "\n" + GOOD + "\n" + GOOD.rsplit(",", 1)[0] + ",nan\n", "row 2 column 'step_time_s'"),
        (HEADER + "\n" + GOOD + "\n" + GOOD.replace("gpt,", "gpt:nope,", 1) + "\n", "row 2 column 'model'"),
        (HEADER + "\n" + GOOD + "\n" + GOOD.replace("gpt,12,1024,8,", "gpt,12,1024,7,", 1) + "\n", "row 2"),
        (HEADER + "\n" + GOOD + "\n", "at least 2 measured runs"),
    ],
)
def test_bad_runs_are_one_line_errors_and_write_nothing(tmp_path, text, needle):
    res, out = _cli(tmp_path, text)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr
    assert not out.exists()


def test_jsonl_without_a_plan_is_a_one_line_error(tmp_path):
    res, out = _cli(tmp_path, '{"event": "step", "step": 1, "step_time_s": 0.1}\n', suffix=".jsonl")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "names no plan" in res.stderr and not out.exists()


def test_calibrate_writes_a_profile_with_its_calibration_section(tmp_path):
    rows = [HEADER] + [",".join(_row(*s, t).values()) for s, t in zip(SHAPES[:4], ("0.4", "2.5", "6.0", "3.0"))]
    res, out = _cli(tmp_path, "\n".join(rows) + "\n")
    assert res.returncode == 0, res.stderr
    assert "cross-validated" in res.stdout and "prior" in res.stdout
    cal = load_cluster_profile(out).calibration
    assert cal.runs == 4 and cal.runs_hash.startswith("sha256:")
    assert cal.mean_abs_error_after <= cal.mean_abs_error_before


def test_estimate_uses_a_calibrated_profile_and_says_so(tmp_path):
    rows = [HEADER] + [",".join(_row(*s, t).values()) for s, t in zip(SHAPES[:3], ("0.4", "2.5", "6.0"))]
    res, out = _cli(tmp_path, "\n".join(rows) + "\n")
    assert res.returncode == 0, res.stderr
    est = subprocess.run(
        [
            sys.executable,
            "-m",
            "planner.cli.main",
            "estimate",
            "--model",
            "gpt",
            "--layers",
            "12",
            "--hidden",
            "1024",
            "--heads",
            "8",
            "--seq",
            "1024",
            "--cluster",
            str(out),
            "--gpus",
            "8",
            "--global-batch",
            "8",
            "--micro-batch",
            "1",
            "--dp",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"),
    )
    assert est.returncode == 0, est.stderr
    assert "calibrated on 3 measured runs" in est.stdout


def test_transfer_keeps_another_networks_link_parameters_at_their_priors():
    from planner.calibrate import transfer

    fitted = {"dgx-a100-80g.gemm_ceiling": 0.66, "inter_bw_scale": 0.5}
    prior = {"dgx-a100-80g.gemm_ceiling": 0.72, "inter_bw_scale": 1.0}
    h100 = load_cluster_profile(PROFILES_DIR / "hardware" / "dgx-h100.json")
    same = transfer(fitted, prior, A100)
    assert same["inter_bw_scale"] == 0.5 and same["dgx-a100-80g.gemm_ceiling"] == pytest.approx(0.66)
    other = transfer(fitted, prior, h100, links=False)
    assert "inter_bw_scale" not in other
    ceiling = h100.node_types[0].kernel_model.gemm_ceiling
    assert other["dgx-h100.gemm_ceiling"] == pytest.approx(ceiling * 0.66 / 0.72)
