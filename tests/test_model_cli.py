"""Every command takes every kind of --model (zoo + overrides, hf:, py:) and records the full spec; a profile of
another model is a one-line error at plan time."""

from __future__ import annotations

import json

import pytest
from hf_helpers import write_config
from runtime_helpers import REPO

from planner.cli.main import main
from planner.plan import load_plan
from planner.profile import load_model_profile
from runtime.executor.checks import check_supported

EXAMPLE = f"py:{REPO / 'examples' / 'custom_model.py'}:build"
CUSTOM_GPT = ["--model", "gpt", "--layers", "3", "--hidden", "32", "--heads", "2", "--vocab", "128"]


def _cli(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def _plan(capsys, tmp_path, model_args, *extra, gpus=2, cluster="local-cpu-2core"):
    out = tmp_path / "plan.json"
    status, text, err = _cli(
        capsys,
        "plan",
        *model_args,
        "--cluster",
        cluster,
        "--gpus",
        gpus,
        "--global-batch",
        8,
        "--seq",
        16,
        "--out",
        out,
        *extra,
    )
    return status, err, out


def test_custom_gpt_sizes_through_profile_plan_and_launch_check(capsys, tmp_path):
    prof = tmp_path / "custom.json"
    status, _, err = _cli(
        capsys,
        "profile",
        "model",
        *CUSTOM_GPT,
        "--analytic",
        "--cluster",
        "local-cpu-2core",
        "--seq",
        16,
        "--out",
        prof,
    )
    assert status == 0, err
    assert load_model_profile(prof).model.dims["layers"] == 3
    status, err, out = _plan(capsys, tmp_path, CUSTOM_GPT, "--model-profile", prof)
    assert status == 0, err
    plan = load_plan(out)
    assert plan.model.dims["layers"] == 3 and plan.model.dims["hidden"] == 32 and "max_seq" in plan.model.dims
    check_supported(plan)  # the stages hold the model's 6 modules: the launch would build the same model


@pytest.mark.parametrize(
    "model_args,match",
    [
        (["--model", "gpt"], "profiles gpt:heads2-hidden32-layers3-vocab128, not gpt; differs in .*hidden 32 vs 64"),
        (["--model", "gpt:tiny"], "profiles gpt:"),
        (["--model", "llama", "--layers", "3", "--hidden", "32", "--heads", "2", "--vocab", "128"], "not llama"),
    ],
)
def test_profile_of_another_model_is_rejected_at_plan_time(capsys, tmp_path, model_args, match):
    prof = tmp_path / "custom.json"
    assert (
        _cli(
            capsys,
            "profile",
            "model",
            *CUSTOM_GPT,
            "--analytic",
            "--cluster",
            "local-cpu-2core",
            "--seq",
            16,
            "--out",
            prof,
        )[0]
        == 0
    )
    status, err, out = _plan(capsys, tmp_path, model_args, "--model-profile", prof)
    assert status == 2 and not out.exists()
    assert err.startswith("error: ") and err.count("\n") == 1
    assert __import__("re").search(match, err), err


def test_overrides_a_family_does_not_have_are_rejected(capsys, tmp_path):
    status, err, _ = _plan(capsys, tmp_path, ["--model", "gpt:tiny", "--kv-heads", "2"])
    assert status == 2 and "no dimension 'kv_heads'" in err
    status, err, _ = _plan(capsys, tmp_path, ["--model", EXAMPLE, "--layers", "2"])
    assert status == 2 and "takes no size overrides" in err


def test_every_command_takes_an_hf_config(capsys, tmp_path):
    config = write_config(tmp_path / "llama")
    model = ["--model", f"hf:{config.parent}", "--layers", "4"]
    prof = tmp_path / "hf.json"
    status, text, err = _cli(
        capsys,
        "profile",
        "model",
        *model,
        "--analytic",
        "--cluster",
        "local-cpu-2core",
        "--seq",
        16,
        "--tp",
        "1,2",
        "--out",
        prof,
    )
    assert status == 0, err
    profile = load_model_profile(prof)
    assert profile.model.family == "hf" and profile.model.config["num_hidden_layers"] == 4
    assert len(profile.layers) == 4 + 3
    status, text, err = _cli(
        capsys,
        "estimate",
        *model,
        "--cluster",
        "local-cpu-2core",
        "--global-batch",
        8,
        "--seq",
        16,
        "--tp",
        2,
        "--dp",
        1,
        "--json",
    )
    assert status == 0, err
    assert json.loads(text)["step_time_s"] > 0
    status, err, out = _plan(capsys, tmp_path, model, "--model-profile", prof)
    assert status == 0, err
    plan = load_plan(out)
    assert plan.model.config["num_hidden_layers"] == 4 and "sequence parallelism not searched" in plan.search.notes
    status, text, err = _cli(capsys, "show", out)
    assert status == 0 and "hf:llama" in text
    status, text, err = _cli(capsys, "launch", out, "--dry-run", "--steps", 1)
    assert status == 0, err
    assert "blocks.3" in text


def test_a_custom_model_is_planned_and_shown(capsys, tmp_path):
    status, err, out = _plan(capsys, tmp_path, ["--model", EXAMPLE], gpus=2)  # a 2-device inventory
    assert status == 0, err
    plan = load_plan(out)
    assert plan.model.family == "custom" and plan.model.config["sha256"]
    status, text, _ = _cli(capsys, "show", out)
    assert status == 0 and "custom:build" in text


def test_hf_without_tp_layout_says_so_in_the_plan(capsys, tmp_path):
    config = write_config(tmp_path / "gpt2", "gpt2")
    status, err, out = _plan(capsys, tmp_path, ["--model", f"hf:{config}"])
    assert status == 0, err
    plan = load_plan(out)
    assert plan.mesh.size("tp") == 1 and "Conv1D" in plan.search.notes


def test_hf_without_transformers_is_one_line_naming_the_extra(capsys, tmp_path, monkeypatch):
    config = write_config(tmp_path / "llama", num_hidden_layers=3)  # a spec no earlier test has built
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    status, err, out = _plan(capsys, tmp_path, ["--model", f"hf:{config}"])
    assert status == 2 and not out.exists()
    assert (
        err == "error: hf: models need the optional 'transformers' package; install it with "
        "pip install 'stratagem[hf]'\n"
    )
