"""Resume any plan from any checkpoint of the same model (issue 30): the reshard matrix
(``benchmarks/reshard_matrix.py``: every parameter and AdamW state equal after the reshard, the resumed losses
those of a run that never stopped), the slicing arithmetic of etp, and the one-line refusals."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from fixtures.plans import make_plan
from planner.core import StratagemError
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.checkpoint import (
    COMPLETE_MARKER,
    META_FILE,
    check_compatible,
    check_resumable,
    checkpoint_meta,
    step_dir,
    torn_checkpoints,
)
from runtime.executor.etp_keys import join_slices, split_key, take_slice

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import reshard_matrix  # noqa: E402
from runtime_helpers import spawn_ranks, tail  # noqa: E402

GPT = parse_model("gpt:tiny")


def _launch(nproc: int, argv: list[str]) -> None:
    proc = spawn_ranks(nproc, argv, timeout_s=600, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, tail(proc)


# the pairs CI runs (the whole matrix, 146 pairs: benchmarks/reshard_matrix.py, benchmarks/data/reshard/): each
# crosses what needs code beyond DCP's offsets, and world sizes 2 -> 4 and 4 -> 2
PAIRS = [
    ("gpt:tiny+tied", "tp2", "pp2"),  # tied head: pp = 1 names its AdamW state once, pp2 holds two copies
    ("gpt:tiny+tied", "pp2", "tp2dp2"),  # 2 -> 4 ranks, stages -> tensor shards
    ("gpt:tiny+tied", "tp2dp2", "cp2"),  # 4 -> 2 ranks, context parallel
    ("moe:tiny", "ep2", "etp2dp4z3"),  # experts by global index -> etp slices, each ZeRO-3-sharded over edp 2
    ("moe:tiny", "etp2dp4z3", "zero3"),  # etp slices joined again, 4 -> 2 ranks
    ("moe:tiny", "zero3", "ep2"),
]


@pytest.mark.slow
def test_each_layout_resumes_another_layouts_checkpoint(tmp_path, capsys):
    """Checkpoint under one layout, resume under another: the state loaded equals the checkpoint entry by entry and
    the next 3 losses are those of the run that never stopped (``benchmarks/reshard_matrix.py``'s checks)."""
    rows = reshard_matrix.run(["gpt:tiny+tied", "moe:tiny"], tmp_path, launch=_launch, only=PAIRS)
    reshard_matrix.print_matrix(rows)
    table = capsys.readouterr().out
    assert [(r["model"], r["source"], r["target"]) for r in rows] == PAIRS
    assert all(r["ok"] for r in rows), table
    assert all(r["entries"] > 400 for r in rows)  # model and AdamW entries were compared, not an empty file


@pytest.mark.parametrize("rule", [(0, 1), (1, 1), (0, 2)])
def test_etp_slices_join_and_cut_again(rule):
    whole = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    for etp in (2, 4):
        parts = [take_slice(whole, rule, i, etp) for i in range(etp)]
        assert torch.equal(join_slices(parts, rule), whole)
        again = [take_slice(join_slices(parts, rule), rule, i, 2) for i in range(2)]
        assert torch.equal(join_slices(again, rule), whole)
    dim, blocks = rule
    gate_rows = take_slice(whole, (0, 2), 1, 2)  # hf gate_up: slice 1 = [gate rows 2:4; up rows 6:8]
    assert torch.equal(gate_rows, torch.cat([whole[2:4], whole[6:8]]))
    assert split_key("model.a.w1.weight") == ("model.a.w1.weight", 0, 1)
    assert dim in (0, 1) and blocks in (1, 2)


def _meta_folder(root: Path, step: int, meta: dict, *, complete: bool = True) -> Path:
    folder = step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / META_FILE).write_text(json.dumps({"step": step, **meta}))
    if complete:
        (folder / COMPLETE_MARKER).write_text(f"step {step}\n")
    return folder


def test_another_layout_resumes_but_another_model_or_recipe_is_refused_in_one_line():
    written = make_plan(GPT, dp=2, zero_stage=3)
    meta = checkpoint_meta(written, 2)
    for other in (make_plan(GPT, tp=2, split=["embed", "head"]), make_plan(GPT, pp=2, dp=2, schedule="1f1b")):
        check_compatible("ck", meta, other)  # another layout and world size: resharded on load
    refused = {
        "written for model gpt:tiny but the plan trains llama:tiny": make_plan(parse_model("llama:tiny")),
        "another gpt:tiny (layers 2 -> 4)": make_plan(parse_model("gpt:tiny", layers=4)),
        "other training settings (seq_len 16 -> 32)": make_plan(GPT, seq_len=32),
        "other training settings (lr 0.001 -> 0.002)": make_plan(GPT, lr=2e-3),
    }
    for needle, plan in refused.items():
        with pytest.raises(StratagemError) as err:
            check_compatible("ck", meta, plan)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    old = {"model": "gpt:tiny", "world_size": 2}  # written before meta.json held the training settings
    check_compatible("ck", old, make_plan(GPT, tp=2, split=["embed", "head"]))
    with pytest.raises(StratagemError, match="predates resharding .* written by 2 ranks but the plan has 4"):
        check_compatible("ck", old, make_plan(GPT, dp=4))


def test_a_torn_checkpoint_is_skipped_and_named(tmp_path, caplog):
    plan = make_plan(GPT, dp=2)
    meta = checkpoint_meta(plan, 2)
    _meta_folder(tmp_path, 2, meta)
    good = _meta_folder(tmp_path, 4, meta)
    torn = [_meta_folder(tmp_path, 6, meta, complete=False), tmp_path / "step_000008.tmp"]
    torn[1].mkdir()
    assert torn_checkpoints(tmp_path) == torn
    with caplog.at_level(logging.WARNING), pytest.raises(StratagemError) as err:
        check_resumable(tmp_path, plan)  # these folders hold no DCP shards: refused after naming the torn ones
    assert f"checkpoint {good} is damaged" in str(err.value) and "\n" not in str(err.value), str(err.value)
    for folder in torn:
        assert f"{folder} is incomplete (its save was interrupted): resuming from {good}" in caplog.text


def test_launch_refuses_a_checkpoint_of_another_recipe_before_starting(tmp_path, capsys):
    from planner.cli.main import main

    _meta_folder(tmp_path / "ckpt", 2, checkpoint_meta(make_plan(GPT, dp=2), 2))
    path, metrics = (
        save_plan(make_plan(GPT, tp=2, split=["embed", "head"], seq_len=32), tmp_path / "p.json"),
        tmp_path / "m",
    )
    argv = ["launch", str(path), "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]
    status = main([*argv, "--metrics", str(metrics)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "other training settings (seq_len 16 -> 32)" in err, err
    assert not metrics.exists()
