"""The calibrated cluster profile, the printed table and the predicted-vs-measured picture."""

from __future__ import annotations

from pathlib import Path

from planner.calibrate.fit import FitResult, apply, mean_abs
from planner.calibrate.runs import MeasuredRun, runs_hash
from planner.core import atomic_write_bytes, atomic_write_text
from planner.profile import Calibration, ClusterProfile


def calibrated_profile(
    cluster: ClusterProfile, runs: list[MeasuredRun], result: FitResult, *, created_utc: str
) -> ClusterProfile:
    """``cluster`` with the fitted values applied and a :class:`Calibration` section recording the fit."""
    out = apply(cluster, result.values)
    section = Calibration(
        runs_hash=runs_hash(runs),
        runs=len(runs),
        fitted=result.values,
        prior=result.prior,
        cv_mean_abs_error=mean_abs(result.cv_errors) if result.cv_errors else None,
        mean_abs_error_before=mean_abs(result.residuals_before),
        mean_abs_error_after=mean_abs(result.residuals),
        created_utc=created_utc,
        note=result.note,
    )
    return out.model_copy(update={"calibration": section, "name": cluster.name, "content_hash": None})


def table_lines(runs: list[MeasuredRun], result: FitResult) -> list[str]:
    """Parameters (prior, fitted, bounds), per-run residuals, cross-validated error: lines for the terminal."""
    lines = [f"{'parameter':<36} {'prior':>10} {'fitted':>10} {'bounds':>22}"]
    for name, value in result.values.items():
        lo, hi = result.bounds[name]
        lines.append(f"{name:<36} {result.prior[name]:>10.4g} {value:>10.4g} {f'[{lo:.3g}, {hi:.3g}]':>22}")
    lines.append(f"{'run':<44} {'measured':>10} {'before':>8} {'after':>8}")
    for r, b, a in zip(runs, result.residuals_before, result.residuals):
        lines.append(f"{r.label():<44} {r.step_time_s:>9.4g}s {100 * b:>+7.1f}% {100 * a:>+7.1f}%")
    lines.append(
        f"mean |error|: before {100 * mean_abs(result.residuals_before):.1f}%, after "
        f"{100 * mean_abs(result.residuals):.1f}% (in-sample)"
    )
    if result.cv_errors:
        lines.append(f"k-fold cross-validated mean |error|: {100 * mean_abs(result.cv_errors):.1f}%")
    else:
        lines.append("cross-validation needs >= 3 runs: not done")
    lines.append(result.note)
    return lines


def save_png(runs: list[MeasuredRun], result: FitResult, path: Path) -> Path:
    """Predicted vs measured step time, before and after calibration (log-log, y = x dashed)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r.step_time_s for r in runs]
    fig, ax = plt.subplots(figsize=(5, 5))
    for res, label, marker in ((result.residuals_before, "before", "x"), (result.residuals, "after", "o")):
        ax.scatter(measured, [m * (1 + e) for m, e in zip(measured, res)], label=label, marker=marker)
    lo, hi = min(measured) * 0.7, max(measured) * 1.4
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=1)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured step time (s)",
        ylabel="predicted step time (s)",
        title="stratagem calibrate",
    )
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue(), flag="--png")  # never replaces a device, FIFO or folder


__all__ = ["atomic_write_text", "calibrated_profile", "save_png", "table_lines"]
