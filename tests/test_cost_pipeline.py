"""Pipeline step time and in-flight micro-batches, against the schedules' closed forms."""

import pytest

from planner.core import StratagemError
from planner.cost import inflight_microbatches, pipeline_step_time


@pytest.mark.parametrize("p,m", [(4, 8), (8, 64), (2, 1), (16, 48)])
def test_1f1b_bubble_is_p_minus_1_over_m_of_ideal(p, m):
    t = 0.3
    step = pipeline_step_time([t] * p, m, 1, "1f1b")
    assert (step - m * t) / (m * t) == pytest.approx((p - 1) / m)
    assert pipeline_step_time([t] * p, m, 1, "gpipe") == pytest.approx(step)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (8, 64, 3), (16, 32, 4)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    t = 0.3
    plain = pipeline_step_time([t] * p, m, 1, "1f1b") - m * t
    inter = pipeline_step_time([t] * p, m, v, "interleaved_1f1b") - m * t
    assert inter == pytest.approx(plain / v)


def test_uneven_ranks_hand_computed():
    # (m - 1) * max + sum = 3 * 2 + (1 + 2 + 1.5)
    assert pipeline_step_time([1.0, 2.0, 1.5], 4) == pytest.approx(10.5)


def test_inflight_per_schedule():
    assert inflight_microbatches("gpipe", 4, 1, 16) == 16
    assert [inflight_microbatches("1f1b", 4, s, 16) for s in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 8, 0, 3) == 3  # capped at m
    p, v = 8, 3
    # Korthikanti §4.2.3: the first stage holds p (1 + (p - 1)/(p v)) stage-worths of activations
    assert inflight_microbatches("interleaved_1f1b", p, 0, 64, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert inflight_microbatches("interleaved_1f1b", p, p - 1, 64, v) < inflight_microbatches(
        "interleaved_1f1b", p, 0, 64, v
    )


def test_bad_schedule_arguments():
    with pytest.raises(StratagemError):
        pipeline_step_time([1.0], 4, 2, "1f1b")
    with pytest.raises(StratagemError):
        inflight_microbatches("1f1b", 4, 4, 8)
    with pytest.raises(StratagemError):
        pipeline_step_time([], 4)
