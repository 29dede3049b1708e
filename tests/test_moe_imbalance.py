"""`--moe-imbalance` (issue 24 §1): the dropless load imbalance a plan assumes is a flag with per-router defaults
(the router's published fit, else 1.5), recorded in the plan, printed by show, and what a re-estimate of the
plan uses."""

from __future__ import annotations

import json

import pytest

from planner.cli.main import main
from planner.cost import default_load_imbalance, plan_config
from planner.plan import load_plan

ARGS = ["plan", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "32", "--seq", "1024"]


def _plan(tmp_path, model: str, *extra) -> tuple[dict, str]:
    out = tmp_path / f"{model.replace(':', '_')}{len(extra)}.json"
    assert main([*ARGS, "--model", model, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text()), str(out)


def test_router_defaults_name_their_source():
    assert default_load_imbalance("moe:mixtral-8x7b")[0] == 1.031
    assert default_load_imbalance("hf:qwen3-moe/config.json")[0] == 1.5
    value, source = default_load_imbalance("moe:deepseek-v3")
    assert value == 1.5 and "no published forced/dropless pair" in source


def test_plan_records_the_routers_imbalance_or_the_flag_and_show_prints_it(tmp_path, capsys):
    doc, path = _plan(tmp_path, "moe:mixtral-8x7b", "--layers", "4")
    assert doc["experts"]["load_imbalance"] == 1.031 and "MoE load imbalance 1.031" in doc["search"]["notes"]
    assert plan_config(load_plan(path)).moe_load_imbalance == 1.031
    flagged, _ = _plan(tmp_path, "moe:mixtral-8x7b", "--layers", "4", "--moe-imbalance", "1.2")
    assert flagged["experts"]["load_imbalance"] == 1.2 and "(--moe-imbalance)" in flagged["search"]["notes"]
    capsys.readouterr()
    assert main(["show", path]) == 0
    assert "load imbalance 1.031" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0.9", "nan", "x"])
def test_an_impossible_imbalance_is_one_line(tmp_path, capsys, value):
    assert main([*ARGS, "--model", "moe:tiny", "--moe-imbalance", value, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--moe-imbalance" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "p.json").exists()
