"""Context parallelism from the command line: plan/estimate flags, the per-cp table, export, and one-line
errors (exit 2) for a sequence that does not split into 2 x cp chunks or a model without attention."""

from __future__ import annotations

import pytest

from planner.cli.main import main
from planner.export import parse as parse_megatron
from planner.plan import load_plan, plan_label

LLAMA = ["--model", "llama:llama3-8b", "--cluster", "dgx-h100", "--seq", "32768", "--flash-attention"]


def _run(capsys, *argv):
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["estimate", *LLAMA[:4], "--seq", "32766", "--gpus", "8", "--global-batch", "8", "--cp", "4"], "2 x cp = 8"),
        (["estimate", "--model", "mlp:tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--cp", "2"], "--cp 1"),
        (
            [
                "plan",
                "--model",
                "resnet:tiny",
                "--cluster",
                "dgx-h100",
                "--gpus",
                "2",
                "--global-batch",
                "8",
                "--cp",
                "2",
                "--out",
                "{tmp}/p.json",
            ],
            "--cp 1",
        ),
        (
            [
                "plan",
                "--model",
                "gpt:tiny",
                "--cluster",
                "dgx-h100",
                "--gpus",
                "4",
                "--global-batch",
                "8",
                "--seq",
                "30",
                "--cp",
                "4",
                "--out",
                "{tmp}/p.json",
            ],
            "2 x cp = 8",
        ),
    ],
)
def test_bad_cp_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    status, _, err = _run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert status == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert not (tmp_path / "p.json").exists()


def test_plan_with_cp_writes_cp_and_exports_it(capsys, tmp_path):
    out = tmp_path / "plan.json"
    status, text, _ = _run(
        capsys, "plan", *LLAMA, "--gpus", "16", "--global-batch", "16", "--cp", "4", "--cp-table", "--out", str(out)
    )
    assert status == 0
    plan = load_plan(out)
    assert plan.mesh.axes == ["pp", "dp", "cp", "tp"] and plan.mesh.size("cp") == 4
    assert plan.context_parallel in ("allgather", "ring") and plan.flash_attention
    assert f"cp4({plan.context_parallel})" in plan_label(plan) and "cp4(" in text
    assert "best plan per context-parallel degree" in text and "<- chosen" in text
    script = tmp_path / "megatron.sh"
    assert _run(capsys, "export", str(out), "--to", "megatron", "--out", str(script))[0] == 0
    settings = parse_megatron(script.read_text())
    assert settings.cp == 4 and settings.context_parallel == plan.context_parallel and settings.flash_attention
    status, text, _ = _run(capsys, "estimate", "--from", "megatron", str(script), "--cluster", "dgx-h100")
    assert status == 0 and f"cp4({plan.context_parallel})" in text
