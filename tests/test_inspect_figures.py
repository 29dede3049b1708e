"""Every picture on a GPipe, a 1F1B and an interleaved plan: checks what was DRAWN, not only that it ran."""

from __future__ import annotations

import matplotlib
import pandas as pd
import pytest

from planner.core import StratagemError
from planner.inspect import (
    build_example_plan,
    figure_png,
    plot_layer_placement,
    plot_memory_per_rank,
    plot_metrics,
    plot_plan_comparison,
    plot_step_breakdown,
    plot_timeline,
)

matplotlib.use("Agg")
GIB = 2**30
PP, M = 4, 8
TF, TB = 0.010, 0.020  # seconds per micro-batch of one pp rank's share of the model
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


@pytest.fixture(scope="module", params=CASES, ids=[k for k, _ in CASES])
def plan(request):
    kind, v = request.param
    return build_example_plan(
        kind, pp=PP, num_micro_batches=M, virtual_stages=v, forward_s=TF, backward_s=TB, recompute_s=0.005, dp=2, tp=2
    )


def _collections(ax, prefix):
    return [c for c in ax.collections if (c.get_gid() or "").startswith(prefix)]


def _bars(ax, prefix):
    return [p for p in ax.patches if (p.get_gid() or "").startswith(prefix)]


def _path_count(ax, prefix):
    return sum(len(c.get_paths()) for c in _collections(ax, prefix))


def _drawn_width(ax, prefix):
    total = 0.0
    for c in _collections(ax, prefix):
        for path in c.get_paths():
            xs = path.vertices[:, 0]
            total += xs.max() - xs.min()
    return total


def test_timeline_draws_one_bar_per_stage_micro_batch_and_phase(plan):
    fig = plot_timeline(plan)
    ax = fig.axes[0]
    n_stages = len(plan.stages)
    for phase in ("forward:", "recompute:", "backward:"):
        assert _path_count(ax, phase) == n_stages * M  # stages x micro-batches, per phase
    assert "(ms)" in ax.get_xlabel() and ax.get_ylabel()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("bubble" in t for t in labels) and "predicted step time" in labels
    assert figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind,v", CASES)
def test_timeline_idle_area_is_the_bubble(kind, v):
    plan = build_example_plan(
        kind, pp=PP, num_micro_batches=M, virtual_stages=v, forward_s=TF, backward_s=TB, with_alternatives=False
    )
    ax = plot_timeline(plan).axes[0]
    ideal_ms = M * (TF + TB) * 1e3
    # SC21 §2.2: bubble = (p - 1)/m x ideal, divided by v when interleaved; summed over p rows
    assert _drawn_width(ax, "bubble:") / PP == pytest.approx((PP - 1) / M * ideal_ms / v, rel=1e-9)
    assert _drawn_width(ax, "forward:") / PP == pytest.approx(M * TF * 1e3, rel=1e-9)
    assert _drawn_width(ax, "pp_comm:") == 0


def test_memory_per_rank_stacks_each_kind_against_capacity(plan):
    ax = plot_memory_per_rank(plan).axes[0]
    assert "GiB" in ax.get_ylabel() and ax.get_legend() is not None
    for kind in ("params", "grads", "optimizer", "activations"):
        bars = _bars(ax, f"mem:{kind}")
        assert len(bars) == PP
        for r, bar in enumerate(bars):
            # every chunk of pp rank r carries the memory of r's devices
            expected = {
                sp.memory_breakdown_bytes[kind] for sp in plan.predictions.stages if plan.stages[sp.stage].pp_rank == r
            }
            assert len(expected) == 1 and bar.get_height() == pytest.approx(expected.pop() / GIB)
    capacity = _collections(ax, "capacity")[0]
    assert len(capacity.get_segments()) == PP
    assert capacity.get_segments()[0][0][1] == pytest.approx(80.0)


def test_layer_placement_has_one_cell_per_module_on_its_pp_rank(plan):
    ax = plot_layer_placement(plan).axes[0]
    cells = _bars(ax, "module:")
    paths = [p for st in plan.stages for p in st.module_paths]
    assert len(cells) == len(paths) == plan.model.dim("layers") + 3  # embed, blocks, norm, head
    rank_of = {p: st.pp_rank for st in plan.stages for p in st.module_paths}
    for cell in cells:
        path = cell.get_gid().split(":", 1)[1]
        assert cell.get_y() + cell.get_height() / 2 == pytest.approx(rank_of[path])
        assert (cell.get_hatch() == "///") == (path != "norm")  # every module but norm is TP-split
    markers = [line for line in ax.lines if (line.get_gid() or "").startswith("recompute:")]
    assert len(markers) == plan.model.dim("layers")  # the example recomputes every block


def test_step_breakdown_terms_sum_to_the_step(plan):
    fig = plot_step_breakdown(plan)
    left, right = fig.axes[:2]
    terms = _bars(left, "term:")
    assert len(terms) == sum(v > 0 for v in plan.predictions.breakdown_s.values())
    assert sum(b.get_height() for b in terms) == pytest.approx(plan.predictions.step_time_s * 1e3)
    assert "(ms)" in left.get_ylabel() and "(ms)" in right.get_ylabel()
    forward = _bars(right, "stage:forward")
    assert len(forward) == len(plan.stages)
    per_stage_ms = TF / plan.schedule.virtual_stages * M * 1e3
    assert all(b.get_height() == pytest.approx(per_stage_ms) for b in forward)


def test_plan_comparison_marks_the_chosen_plan(plan):
    ax = plot_plan_comparison(plan).axes[0]
    chosen = _collections(ax, "chosen")[0].get_offsets()
    others = _collections(ax, "alternatives")[0].get_offsets()
    assert len(chosen) == 1 and len(others) == len(plan.search.top_k) == 2
    assert tuple(chosen[0]) == pytest.approx(
        (plan.predictions.step_time_s * 1e3, plan.predictions.peak_memory_bytes / GIB)
    )
    assert "(ms)" in ax.get_xlabel() and "GiB" in ax.get_ylabel()


def test_plan_comparison_of_several_plans_stars_the_first():
    plans = [build_example_plan(k, virtual_stages=v, with_alternatives=False) for k, v in CASES]
    ax = plot_plan_comparison(plans, names=["gpipe", "1f1b", "interleaved"]).axes[0]
    assert len(_collections(ax, "chosen")[0].get_offsets()) == 1
    assert len(_collections(ax, "alternatives")[0].get_offsets()) == 2
    assert [t.get_text() for t in ax.texts] == ["#1", "#2", "#3"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"#1 gpipe", "#2 1f1b", "#3 interleaved"} <= set(legend)


def test_metrics_plot_draws_every_step_and_the_prediction(plan):
    frame = pd.DataFrame({"step_time_s": [0.6, 0.5, 0.5], "loss": [5.0, 4.9, 4.8]}, index=[0, 1, 2])
    left, right = plot_metrics(frame, plan).axes[:2]
    measured = [line for line in left.lines if line.get_gid() == "measured"][0]
    assert list(measured.get_ydata()) == pytest.approx([600.0, 500.0, 500.0])
    predicted = [line for line in left.lines if line.get_label() == "predicted"][0]
    assert predicted.get_ydata()[0] == pytest.approx(plan.predictions.step_time_s * 1e3)


def test_pictures_that_need_predictions_say_so():
    bare = build_example_plan(with_alternatives=False).model_copy(update={"predictions": None})
    for draw in (plot_timeline, plot_memory_per_rank, plot_step_breakdown, plot_plan_comparison):
        with pytest.raises(StratagemError, match="no predictions"):
            draw(bare)
    assert plot_layer_placement(bare).axes  # placement needs no predictions
