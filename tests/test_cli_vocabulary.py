"""Issue 12 §4: one strategy label everywhere, tables readable at 80 columns, consistent flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.cli.main import main
from planner.inspect import build_example_plan
from planner.plan import plan_label, save_plan

REPO = Path(__file__).resolve().parents[1]
CLUSTER = str(REPO / "profiles/hardware/local-cpu-2core.json")


def _lines_at_80(capsys, monkeypatch, *argv: str) -> list[str]:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def _readable(lines: list[str]) -> None:
    assert not [line for line in lines if "…" in line], "a cell was cut with an ellipsis"
    assert max(len(line) for line in lines) <= 80


def test_estimate_tables_fit_80_columns(capsys, monkeypatch):
    lines = _lines_at_80(
        capsys,
        monkeypatch,
        "estimate",
        "--model",
        "gpt:gpt3-175b",
        "--cluster",
        "dgx-a100-80g",
        "--gpus",
        "1024",
        "--global-batch",
        "1536",
        "--tp",
        "8",
        "--pp",
        "16",
        "--dp",
        "8",
        "--recompute",
        "selective",
        "--sequence-parallel",
    )
    _readable(lines)
    text = "\n".join(lines)
    assert "T/" not in text and "s per micro-batch" in text and "activ" in text
    assert "tp8 pp16 dp8 1f1b mb1x192 zero0 sp" in text and "recompute selective x96" in text
    assert "per device" in text and "of its 80" in text


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.replace("┃", "│").split("│")]


def test_estimate_memory_table_is_not_cropped_at_80_columns(capsys, monkeypatch):
    """Rich crops a table wider than the terminal without an ellipsis: the last column must still be there."""
    argv = ["estimate", "--model", "resnet:resnet50", "--cluster", "aws-p3-16xlarge", "--gpus", "8"]
    lines = _lines_at_80(capsys, monkeypatch, *argv, "--global-batch", "256", "--dtype", "fp16")
    _readable(lines)
    header = next(i for i, line in enumerate(lines) if "memory per device, GiB" in line) + 1
    assert _cells(lines[header])[-1] == "cap" and _cells(lines[header + 2])[-1] == "16"  # V100 16 GiB


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory):
    plan = build_example_plan("1f1b", pp=2, num_micro_batches=4, dp=2, tp=2, recompute_s=0.004)
    layout = {path: {"style": "split", "sequence_parallel": True} for st in plan.stages for path in st.module_paths}
    from planner.plan import LayerLayout

    plan = plan.model_copy(update={"layout": {k: LayerLayout(**v) for k, v in layout.items()}})
    return save_plan(plan, tmp_path_factory.mktemp("vocab") / "plan.json"), plan


def test_one_label_with_recompute_and_sequence_parallelism(mixed_plan, capsys, monkeypatch):
    path, plan = mixed_plan
    label = plan_label(plan)
    assert " sp " in label and "recompute full x" in label
    lines = _lines_at_80(capsys, monkeypatch, "show", str(path))
    _readable(lines)
    assert label in "\n".join(lines)
    from planner.inspect import build_html

    assert label in build_html(plan, pngs={})


def test_plan_summary_uses_the_label(tmp_path, capsys, monkeypatch):
    lines = _lines_at_80(
        capsys,
        monkeypatch,
        "plan",
        "--model",
        "gpt:tiny",
        "--model-profile",
        str(REPO / "profiles/models/gpt-tiny.json"),
        "--cluster",
        CLUSTER,
        "--gpus",
        "2",
        "--global-batch",
        "8",
        "--out",
        str(tmp_path / "p.json"),
    )
    _readable(lines)
    from planner.plan import load_plan

    assert plan_label(load_plan(tmp_path / "p.json")) in "\n".join(lines)


def test_verbose_after_the_subcommand(capsys):
    argv = ["estimate", "--model", "gpt:tiny", "--cluster", CLUSTER, "--global-batch", "8", "--gpus", "2", "--json"]
    assert main([*argv, "-v"]) == 0 and main(["-v", *argv]) == 0
    capsys.readouterr()


def test_profile_lists_its_subcommands(capsys):
    assert main(["profile"]) == 2
    err = capsys.readouterr().err
    assert all(word in err for word in ("model", "cluster", "check"))


def test_time_limit_flags_end_in_seconds(tmp_path, capsys):
    assert main(["plan", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--time-limit-s" in text and "--budget-s" in text


def test_dry_run_summarises_large_plans(tmp_path, capsys):
    plan = build_example_plan(
        "1f1b", pp=2, num_micro_batches=4, dp=16, tp=2, micro_batch_size=2, with_alternatives=False
    )
    path = save_plan(plan, tmp_path / "big.json")
    assert main(["launch", str(path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.startswith("rank ")]) == 2 and "--all-ranks" in lines[-1]
    assert main(["launch", str(path), "--dry-run", "--all-ranks"]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("rank ")]) == 64


def _subparser_actions(*path: str):
    import argparse

    from planner.cli.main import build_parser

    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_dtype_means_the_same_in_every_subcommand():
    flags = [_subparser_actions(*cmd)["--dtype"] for cmd in (("plan",), ("estimate",), ("profile", "model"))]
    assert {tuple(f.choices) for f in flags} == {("fp32", "tf32", "bf16", "fp16", "fp8")}
    assert {f.default for f in flags} == {None}  # resolved by planner.profile.load.default_dtype
    assert len({f.help.split(";")[0] for f in flags}) == 1


def test_plan_rejects_a_dtype_its_model_profile_does_not_have(tmp_path, capsys):
    profile = str(REPO / "profiles/models/gpt-tiny.json")  # measured in fp32
    argv = ["plan", "--model", "gpt:tiny", "--model-profile", profile, "--cluster", CLUSTER, "--gpus", "2"]
    argv += ["--global-batch", "8", "--seq", "64", "--dtype", "bf16", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 2
    assert "differs from" in capsys.readouterr().err and not (tmp_path / "p.json").exists()


def test_library_errors_name_settings_and_the_cli_names_flags():
    from planner.cli.main import SETTING_FLAGS
    from planner.core import SettingError
    from planner.search import SearchConfig

    with pytest.raises(SettingError, match=r"^budget_s 0 must be positive seconds") as info:
        SearchConfig(budget_s=0)
    assert info.value.render(SETTING_FLAGS).startswith("--budget-s 0 must be positive")
    plan_flags = _subparser_actions("plan")
    assert all(flag in plan_flags for flag in SETTING_FLAGS.values())


def test_plan_warns_that_analytic_profiles_on_cpus_leave_out_framework_overhead(tmp_path, capsys):
    argv = ["plan", "--model", "gpt:tiny", "--cluster", CLUSTER, "--gpus", "2", "--global-batch", "8", "--seq", "64"]
    assert main([*argv, "--out", str(tmp_path / "a.json")]) == 0
    assert "analytic profile" in capsys.readouterr().err
    from planner.plan import load_plan

    assert "framework overhead" in load_plan(tmp_path / "a.json").search.notes
    measured = str(REPO / "profiles/models/gpt-tiny.json")
    assert main([*argv, "--model-profile", measured, "--out", str(tmp_path / "m.json")]) == 0
    assert "analytic profile" not in capsys.readouterr().err
