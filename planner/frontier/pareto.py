"""Pareto-optimal points of two costs to minimise (time and dollars, time and energy)."""

from __future__ import annotations

from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each point (x, y), whether no other point is at least as good in both and better in one.

    One sweep in x order: a point is on the front when its y is the least among the points of its x and below
    every y of a smaller x. Equal points are all on the front (none beats the other).

    >>> pareto_front([(1, 5), (2, 3), (3, 4), (2, 3), (4, 1)])
    [True, True, False, True, True]
    """
    order = sorted(range(len(points)), key=lambda i: points[i])
    front = [False] * len(points)
    best_before = float("inf")  # least y over the x values already passed
    i = 0
    while i < len(order):
        j = i
        x = points[order[i]][0]
        while j < len(order) and points[order[j]][0] == x:
            j += 1
        least = points[order[i]][1]  # sorted by (x, y): the first of the run has the least y
        for k in order[i:j]:
            front[k] = points[k][1] == least and least < best_before
        best_before = min(best_before, least)
        i = j
    return front
