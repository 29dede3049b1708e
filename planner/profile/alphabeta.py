"""Alpha-beta fits of collective timings: ``time(bytes) = alpha_s + bus_factor * bytes / bus_bw``.

Pure maths (no torch): the cluster profiler measures, this module fits. The model is Hockney's
alpha-beta (latency + size / bandwidth) with NCCL-tests' bus-bandwidth convention, as documented on
:class:`planner.profile.load.CollectiveFit`, so one bandwidth describes a link whatever the rank count.

Fitting minimises the *relative* error (weighted least squares, weight ``1/t^2``): collective timings
span three or more decades, and an unweighted fit would let the largest message decide ``alpha`` alone.
If noise makes that slope non-positive, the fit falls back to ordinary (absolute-error) least squares and
says so in ``weighting``; a fitted latency below zero is clamped to zero and the slope refitted.
Quality figures: ``r2`` (ordinary coefficient of determination of the medians against the line),
``max_rel_err`` (worst ``|fit - median| / median``) and ``run_cv`` (median over sizes of the coefficient of
variation across repeats — run-to-run noise, independent of the model).

Example::

    >>> fit = fit_alpha_beta("all_reduce", 2, [(1000, [2e-6]), (1_000_000, [1.001e-3])])
    >>> round(fit.alpha_s, 9), round(fit.bus_bw_bytes_per_s)
    (1e-06, 1000000000)
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from planner.core import StratagemError

log = logging.getLogger(__name__)


def bus_factor(op: str, n_ranks: int) -> float:
    """Bytes each rank moves per message byte, per NCCL-tests doc/PERFORMANCE.md ("bus bandwidth").

    all_reduce: 2(n-1)/n (ring reduce-scatter + all-gather); all_gather and reduce_scatter: (n-1)/n with
    the message being the full (gathered) tensor; send_recv: 1; all_to_all: (n-1)/n.
    """
    if n_ranks < 2:
        raise StratagemError(
            f"a collective needs at least 2 ranks, got n_ranks={n_ranks}; launch with --nproc-per-node 2 or more"
        )
    factors = {
        "all_reduce": 2 * (n_ranks - 1) / n_ranks,
        "all_gather": (n_ranks - 1) / n_ranks,
        "reduce_scatter": (n_ranks - 1) / n_ranks,
        "all_to_all": (n_ranks - 1) / n_ranks,
        "send_recv": 1.0,
    }
    if op not in factors:
        raise StratagemError(f"unknown collective {op!r}; expected one of {', '.join(factors)}")
    return factors[op]


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBetaFit:
    """One fitted line and its quality (see the module docstring for the definitions)."""

    alpha_s: float
    bus_bw_bytes_per_s: float
    r2: float
    max_rel_err: float
    run_cv: float | None
    weighting: str = "relative"  # "absolute" when the relative fit had no positive slope (a fallback)

    def predict_s(self, op: str, n_ranks: int, message_bytes: float) -> float:
        """Predicted time of one collective of ``message_bytes`` on ``n_ranks`` ranks, in seconds."""
        return self.alpha_s + bus_factor(op, n_ranks) * message_bytes / self.bus_bw_bytes_per_s


def _weighted_line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """Intercept a and slope b minimising sum(w (a + b x - y)^2), with a >= 0 (else refit through 0)."""
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    sy = sum(w * y for w, y in zip(ws, ys))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys))
    det = sw * sxx - sx * sx
    if det > 0:
        slope = (sw * sxy - sx * sy) / det
        intercept = (sy - slope * sx) / sw
        if intercept >= 0:
            return intercept, slope
    # A negative latency is unphysical (noise at small sizes): constrain alpha = 0 and refit the slope.
    return 0.0, sxy / sxx


def _run_cv(groups: Sequence[Sequence[float]]) -> float | None:
    """Median over sizes of stdev/mean across repeats (sample stdev); None with a single repeat."""
    cvs = [statistics.stdev(g) / statistics.fmean(g) for g in groups if len(g) >= 2 and statistics.fmean(g) > 0]
    return statistics.median(cvs) if cvs else None


def fit_alpha_beta(op: str, n_ranks: int, samples: Sequence[tuple[int, Sequence[float]]]) -> AlphaBetaFit:
    """Fit ``alpha_s`` and ``bus_bw_bytes_per_s`` to ``(message_bytes, times_s per repeat)`` pairs.

    Each size is represented by the median of its repeats. Needs at least two distinct sizes and
    positive times; a flat or decreasing curve (no bandwidth term) is an error naming the fix.
    """
    if len({b for b, _ in samples}) < 2:
        raise StratagemError(
            f"{op}: an alpha-beta fit needs at least 2 distinct message sizes, got {len(samples)}; pass more --sizes"
        )
    for message_bytes, times in samples:
        if not times or min(times) <= 0 or not all(math.isfinite(t) for t in times):
            raise StratagemError(
                f"{op}: timings at {message_bytes} bytes must be positive and finite, got "
                f"{list(times)}; re-run the profiler"
            )
    factor = bus_factor(op, n_ranks)
    xs = [factor * b for b, _ in samples]
    ys = [statistics.median(t) for _, t in samples]
    weighting = "relative"
    alpha_s, slope_s_per_byte = _weighted_line(xs, ys, [1.0 / (y * y) for y in ys])
    if slope_s_per_byte <= 0:
        # Noise at small sizes can tilt the relative fit downwards (seen on shared VMs); absolute errors let
        # the large messages, where bandwidth shows, decide the slope.
        weighting = "absolute"
        alpha_s, slope_s_per_byte = _weighted_line(xs, ys, [1.0] * len(ys))
        log.warning("%s: relative-error fit gave no positive slope; fell back to absolute-error least squares", op)
    if slope_s_per_byte <= 0:
        raise StratagemError(
            f"{op}: time does not grow with message size (slope {slope_s_per_byte:.3g} s/B), "
            f"so no bandwidth can be fitted; extend --sizes to larger messages"
        )
    fitted = [alpha_s + slope_s_per_byte * x for x in xs]
    mean_y = statistics.fmean(ys)
    ss_res = sum((y - f) ** 2 for y, f in zip(ys, fitted))
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    return AlphaBetaFit(
        alpha_s=alpha_s,
        bus_bw_bytes_per_s=1.0 / slope_s_per_byte,
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        max_rel_err=max(abs(f - y) / y for y, f in zip(ys, fitted)),
        run_cv=_run_cv([t for _, t in samples]),
        weighting=weighting,
    )
