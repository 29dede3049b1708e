"""Frames, metrics files, compare_plans and diff_plans on hand-made plans with hand-computed answers."""

from __future__ import annotations

import json

import pytest

from planner.core import StratagemError
from planner.inspect import (
    build_example_plan,
    compare_plans,
    diff_plans,
    layer_frame,
    load_metrics,
    metrics_frame,
    predicted_vs_measured,
    rank_coordinates,
    rank_frame,
    stage_frame,
    summary_frame,
)


@pytest.fixture(scope="module")
def plan():
    return build_example_plan(
        "1f1b",
        pp=2,
        num_micro_batches=4,
        dp=2,
        tp=2,
        forward_s=0.01,
        backward_s=0.02,
        recompute_s=0.005,
        tp_comm_s=0.002,
        with_alternatives=False,
    )


def test_stage_frame_per_micro_batch_and_per_step(plan):
    frame = stage_frame(plan)
    assert list(frame.index) == [0, 1]
    row = frame.loc[0]
    assert row["first_module"] == "embed" and row["modules"] == 5 and row["ranks"] == 4
    assert row["recompute"] == "full x4"
    assert row["compute_s"] == pytest.approx(4 * (0.01 + 0.02 + 0.005))
    assert row["comm_s"] == pytest.approx(4 * 0.002)
    assert row["memory_headroom_bytes"] == pytest.approx(row["memory_capacity_bytes"] - row["peak_memory_bytes"])
    # p = 2, m = 4 uniform: each rank idles (p - 1)(t_f + t_b + t_r + t_tp) = 1 x 0.037 s
    assert frame["bubble_s"].tolist() == pytest.approx([0.037, 0.037])


def test_rank_frame_coordinates_and_memory(plan):
    frame = rank_frame(plan)
    assert len(frame) == 8
    assert rank_coordinates(plan, 5) == {"pp": 1, "dp": 0, "tp": 1}  # 5 = (1*2 + 0)*2 + 1
    assert frame.loc[5, ["pp", "dp", "tp"]].tolist() == [1, 0, 1]
    assert frame.loc[5, "stages"] == "1"
    assert frame.loc[5, "peak_memory_bytes"] == plan.predictions.stages[1].peak_memory_bytes


def test_rank_frame_of_an_interleaved_rank_holds_both_chunks():
    plan = build_example_plan(
        "interleaved_1f1b", pp=2, num_micro_batches=4, virtual_stages=2, hidden=1024, with_alternatives=False
    )
    frame = rank_frame(plan)
    assert frame.loc[0, "stages"] == "0,2"
    # chunks 0 (embed + 2 blocks) and 2 (2 blocks) on rank 0: 4 blocks of 12 h^2 + V h, 2 bytes each
    h = 1024
    assert frame.loc[0, "mem_params_bytes"] == pytest.approx(2 * (4 * 12 * h * h + 51200 * h))
    assert frame.loc[1, "mem_params_bytes"] == pytest.approx(2 * (4 * 12 * h * h))


def test_layer_frame_and_summary(plan):
    layers = layer_frame(plan)
    assert len(layers) == 8 + 3
    assert layers.loc["norm", "tp_style"] == "replicate" and layers.loc["blocks.0", "tp_style"] == "split"
    assert layers.loc["blocks.6", "stage"] == 1 and layers.loc["blocks.6", "recompute"] == "full"
    summary = summary_frame(plan).iloc[0]
    assert (summary["pp"], summary["dp"], summary["tp"], summary["world_size"]) == (2, 2, 2, 8)
    assert summary["simulated_step_time_s"] == pytest.approx(summary["step_time_s"])
    assert summary["step_time_s"] == pytest.approx((4 + 2 - 1) * 0.037)  # (m + p - 1) x per-micro-batch work


def _write_metrics(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_metrics_frame_reads_steps_per_rank_memory_and_summary(tmp_path):
    path = _write_metrics(
        tmp_path / "run.jsonl",
        [
            dict(
                step=0,
                loss=5.0,
                step_time_s=0.9,
                tokens_per_s=100.0,
                peak_memory_bytes=[1e9, 3e9],
                predicted_step_time_s=0.4,
            ),
            dict(step=1, loss=4.5, step_time_s=0.5, tokens_per_s=200.0, peak_memory_bytes={"0": 1e9, "1": 2e9}),
            dict(step=2, loss=4.0, step_time_s=0.3, tokens_per_s=300.0, peak_memory_bytes=[1e9, 4e9]),
            dict(summary=True, measured_step_time_s=0.4),
        ],
    )
    frame = metrics_frame(path)
    assert list(frame.index) == [0, 1, 2]
    assert frame["peak_memory_bytes_max"].tolist() == [3e9, 2e9, 4e9]
    assert frame["peak_memory_bytes_rank1"].tolist() == [3e9, 2e9, 4e9]
    assert load_metrics(path)[1]["measured_step_time_s"] == 0.4
    side = predicted_vs_measured(None, frame)  # predictions from the file; steps 1 and 2 (skip 1 warm-up)
    assert side.loc["step_time_s", "predicted"] == 0.4
    assert side.loc["step_time_s", "measured"] == pytest.approx(0.4)
    assert side.loc["tokens_per_s", "measured"] == pytest.approx(250.0)
    assert side.loc["peak_memory_bytes", "measured"] == pytest.approx(3e9)
    assert side.loc["step_time_s", "measured_over_predicted"] == pytest.approx(1.0)


def test_bad_metrics_files_are_one_line_errors(tmp_path):
    with pytest.raises(StratagemError, match="does not exist"):
        metrics_frame(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"step": 0, "step_time_s": 1.0}\n{"step": 1, "step_ti\n')
    with pytest.raises(StratagemError, match="line 2 is not valid JSON"):
        metrics_frame(broken)
    only_summary = _write_metrics(tmp_path / "s.jsonl", [dict(summary=True)])
    with pytest.raises(StratagemError, match="no step lines"):
        metrics_frame(only_summary)


def test_compare_plans_ranks_by_step_time():
    plans = [
        build_example_plan(k, virtual_stages=v, with_alternatives=False)
        for k, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]
    ]
    frame = compare_plans(plans, names=["a", "b", "c"])
    assert list(frame.index) == ["a", "b", "c"]
    assert frame["slowdown"].min() == 1.0
    assert frame.loc["c", "step_time_s"] == pytest.approx(8 * 0.03 + 3 * 0.03 / 2)  # (p-1)(t_f+t_b)/v bubble
    with pytest.raises(StratagemError, match="3 plans but 2 names"):
        compare_plans(plans, names=["a", "b"])


def test_diff_plans_lists_decisions_and_their_predicted_cost():
    a = build_example_plan("gpipe", with_alternatives=False)
    b = build_example_plan("1f1b", with_alternatives=False)
    diff = diff_plans(a, b)
    assert [(c.what, c.before, c.after) for c in diff.changes] == [("schedule.kind", "gpipe", "1f1b")]
    costs = diff.costs_frame()
    assert costs.loc["step_time_s", "delta"] == pytest.approx(0.0)  # same makespan (SC21 §2.2.1) ...
    assert costs.loc["peak_memory_bytes", "delta"] < 0  # ... but fewer stashed activations
    assert not diff_plans(a, a).changes

    c = build_example_plan("gpipe", tp=2, recompute_s=0.005, with_alternatives=False)
    what = {ch.what for ch in diff_plans(a, c).changes}
    assert {"mesh.tp", "world_size", "layout[blocks.0]", "recompute[blocks.0]"} <= what
    assert "norm" not in " ".join(w for w in what if w.startswith("layout"))
    assert "step_time_s" in str(diff_plans(a, c))


def test_metrics_in_the_runtime_format_with_a_restart(tmp_path):
    # runtime/executor/metrics.py: event lines, per-rank peaks, an attempt that re-logs step 2
    path = _write_metrics(
        tmp_path / "run.jsonl",
        [
            dict(event="start", attempt=0),
            dict(event="step", step=1, loss=5.0, step_time_s=0.7, peak_memory_bytes_per_rank=[10, 20], attempt=0),
            dict(event="step", step=2, loss=4.0, step_time_s=0.9, peak_memory_bytes_per_rank=[10, 20], attempt=0),
            dict(event="step", step=2, loss=4.5, step_time_s=0.2, peak_memory_bytes_per_rank=[30, 20], attempt=1),
            dict(event="summary", measured_step_time_s=0.2, attempt=1),
        ],
    )
    frame = metrics_frame(path)
    assert list(frame.index) == [1, 2] and "event" not in frame
    assert frame.loc[2, "loss"] == 4.5 and frame.loc[2, "attempt"] == 1
    assert frame.loc[2, "peak_memory_bytes_max"] == 30
    assert load_metrics(path)[1]["measured_step_time_s"] == 0.2
