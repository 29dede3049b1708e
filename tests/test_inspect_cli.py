"""`stratagem show`: summary on the terminal, self-contained HTML, PNGs, one-line errors."""

from __future__ import annotations

import base64
import json
import re

import pytest

from planner.cli.main import main
from planner.inspect import build_example_plan
from planner.plan import save_plan


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    plan = build_example_plan("1f1b", pp=2, num_micro_batches=4, dp=2, tp=2, tp_comm_s=0.002, pp_comm_s=0.001)
    return save_plan(plan, tmp_path_factory.mktemp("show") / "plan.json"), plan


@pytest.fixture(scope="module")
def metrics_file(plan_file, tmp_path_factory):
    _, plan = plan_file
    path = tmp_path_factory.mktemp("metrics") / "run.jsonl"
    lines = [
        dict(
            step=i,
            loss=5.0 - i,
            step_time_s=t,
            tokens_per_s=1000.0,
            peak_memory_bytes=[2**30, 2**31],
            predicted_step_time_s=plan.predictions.step_time_s,
        )
        for i, t in enumerate([0.9, 0.2, 0.2])
    ]
    lines.append(dict(summary=True))
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_show_prints_a_readable_summary(plan_file, metrics_file, capsys):
    path, plan = plan_file
    assert main(["show", str(path), "--metrics", str(metrics_file)]) == 0
    out = capsys.readouterr().out
    assert "8 = pp 2 x dp 2 x tp 2" in out
    assert "1f1b, 4 micro-batches of 1" in out
    assert "embed..blocks.3" in out and "blocks.4..head" in out
    assert "runner-up plans" in out and "gpipe pp2 v1 m4" in out
    measured = re.search(r"step_time_s\W+([\d.]+ m?s)\W+([\d.]+ m?s)\W+([\d.]+)", out)
    assert measured.group(2) == "200 ms"  # median of steps 1 and 2, warm-up step 0 left out
    assert "median of steps 1..2" in out


def test_show_writes_self_contained_html_and_pngs(plan_file, metrics_file, tmp_path, capsys):
    path, _ = plan_file
    html_path, png_dir = tmp_path / "report.html", tmp_path / "png"
    assert (
        main(["show", str(path), "--metrics", str(metrics_file), "--html", str(html_path), "--png", str(png_dir)]) == 0
    )
    page = html_path.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 6  # placement, timeline, memory, breakdown, comparison, metrics
    assert all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    assert "http" not in page  # nothing fetched from elsewhere
    assert sorted(p.name for p in png_dir.iterdir()) == sorted(
        [
            "layer_placement.png",
            "timeline.png",
            "memory_per_rank.png",
            "step_breakdown.png",
            "plan_comparison.png",
            "metrics.png",
        ]
    )


def test_show_without_predictions_draws_the_placement_only(tmp_path, capsys):
    plan = build_example_plan(with_alternatives=False).model_copy(update={"predictions": None})
    path = save_plan(plan, tmp_path / "bare.json")
    assert main(["show", str(path), "--png", str(tmp_path / "png")]) == 0
    assert "none (the plan was not costed)" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "png").iterdir()] == ["layer_placement.png"]


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "is not valid JSON"),
        ('{"schema_version": 1, "planner_version": "x"}', "is invalid at"),
        (None, "does not exist"),
    ],
)
def test_bad_plan_file_is_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_bad_metrics_file_is_a_one_line_error(plan_file, tmp_path, capsys):
    path, _ = plan_file
    bad = tmp_path / "m.jsonl"
    bad.write_text("garbage\n")
    assert main(["show", str(path), "--metrics", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "line 1 is not valid JSON" in err and err.count("\n") == 1
