"""A launch's metrics file as a table, and predicted vs measured side by side.

The metrics file (written by ``stratagem launch --metrics``, see ``runtime/executor/metrics.py``) holds one
JSON object per line: ``{"event": "start"}``, then per step ``step``, ``loss``, ``step_time_s``,
``tokens_per_s``, peak memory per rank (``peak_memory_bytes_per_rank``, or ``peak_memory_bytes``, in older files
``peak_mem_bytes``: a list, a ``{rank: bytes}`` object or one number) and the plan's ``predicted_*`` figures;
a last line with ``"event": "summary"`` (or ``"summary": true``). A restarted job appends, re-logging steps: the
last line of each step wins. Unknown scalar fields are kept as columns, so the table follows the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from planner.core import StratagemError, parse_json, read_text
from planner.plan import Plan, predicted_tensor_bytes

PEAK_KEYS = ("peak_mem_bytes", "peak_memory_bytes", "peak_memory_bytes_per_rank")  # peak_mem_bytes: older metrics files
TENSOR_KEY = "peak_tensor_bytes"  # live tensor bytes per rank, measured in the first step of each launch


def load_metrics(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(step records, summary record or None) from a metrics JSON-lines file."""
    steps: dict[int, dict[str, Any]] = {}
    summary = None
    for number, record in _records(path):
        if record.get("summary") or record.get("event") == "summary":
            summary = record
        elif "step" in record and record.get("event", "step") == "step":
            _check_step_record(record, f"metrics file {path} line {number}")
            steps[record["step"]] = record  # a restarted attempt re-logs a step: the last line wins
    if not steps:
        raise StratagemError(f"metrics file {path} has no step lines; run `stratagem launch` with --steps >= 1")
    return [steps[k] for k in sorted(steps)], summary


# numeric fields of a step line: each a finite number >= 0 (or null where the launch had nothing to measure)
_STEP_NUMBERS = ("loss", "step_time_s", "tokens_per_s", "samples_per_s")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_step_record(record: dict[str, Any], where: str) -> None:
    """A step line holds an integer step >= 0, finite numbers, and peak memory as bytes >= 0."""
    step = record["step"]
    if not _is_number(step) or not isinstance(step, int) or not 0 <= step < 2**53:
        raise StratagemError(
            f"{where}: step {step!r} is not a step number (an integer >= 0); "
            f"pass the file `stratagem launch --metrics` wrote"
        )
    for key in _STEP_NUMBERS:
        value = record.get(key)
        if value is not None and not (_is_number(value) and (key == "loss" or value > 0)):
            raise StratagemError(
                f"{where}: {key} {value!r} is not a finite number"
                f"{'' if key == 'loss' else ' > 0'}; pass the file `stratagem launch` wrote"
            )
    for key in (*PEAK_KEYS, TENSOR_KEY):
        value = record.get(key)
        values = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
        bad_keys = isinstance(value, dict) and not all(str(k).isdigit() for k in value)
        if value is not None and (bad_keys or not all(v is None or (_is_number(v) and v >= 0) for v in values)):
            raise StratagemError(
                f"{where}: {key} {value!r} is not bytes per rank (numbers >= 0, a list or "
                f"{{rank: bytes}}); pass the file `stratagem launch` wrote"
            )


def _flatten(record: dict[str, Any]) -> dict[str, Any]:
    """Scalars as they are; per-rank peak memory as ``peak_memory_bytes_rank<r>`` plus its maximum."""
    row: dict[str, Any] = {}
    for key, value in record.items():
        if key in PEAK_KEYS:
            per_rank = _per_rank(value)
            row.update({f"peak_memory_bytes_rank{r}": v for r, v in per_rank.items()})
            row["peak_memory_bytes_max"] = max(per_rank.values()) if per_rank else math.nan
        elif key == TENSOR_KEY:
            per_rank = _per_rank(value)
            row.update({f"peak_tensor_bytes_rank{r}": v for r, v in per_rank.items()})
            row["peak_tensor_bytes_max"] = max(per_rank.values()) if per_rank else math.nan
        elif key == "event":
            continue
        elif isinstance(value, (int, float, str, bool)) or value is None:
            row[key] = value
    return row


def _per_rank(value: Any) -> dict[int, float]:
    if isinstance(value, list):
        return {r: float(v) for r, v in enumerate(value) if v is not None}
    if isinstance(value, dict):
        return {int(r): float(v) for r, v in value.items() if v is not None}
    return {0: float(value)} if value is not None else {}


def metrics_frame(path: str | Path) -> pd.DataFrame:
    """One row per step of a metrics file, indexed by ``step`` (the summary line is left out)."""
    steps, _ = load_metrics(path)
    return pd.DataFrame([_flatten(r) for r in steps]).set_index("step").sort_index()


def predicted_vs_measured(
    plan: Plan | None, metrics: pd.DataFrame | str | Path, *, skip_steps: int = 1
) -> pd.DataFrame:
    """Predicted and measured step time, throughput and peak memory, with their ratio.

    Measured = median over the steps after the first ``skip_steps`` (warm-up: allocation, autotuning);
    predictions come from ``plan`` or, without one, from the metrics file's ``predicted_*`` columns.
    """
    frame = metrics if isinstance(metrics, pd.DataFrame) else metrics_frame(metrics)
    steady = frame.iloc[skip_steps:] if len(frame) > skip_steps else frame
    predicted = _predicted(plan, frame)
    measured = {
        "step_time_s": _median(steady, "step_time_s"),
        "tokens_per_s": _median(steady, "tokens_per_s"),
        "peak_memory_bytes": _median(steady, "peak_memory_bytes_max"),
    }
    if "peak_tensor_bytes_max" in frame and frame["peak_tensor_bytes_max"].notna().any():
        # measured in each launch's first step (steady state: runtime.executor.tensor_memory), so not skipped
        measured["peak_tensor_bytes"] = float(frame["peak_tensor_bytes_max"].max())
    rows = []
    for quantity, value in measured.items():
        pred = predicted.get(quantity, math.nan)
        rows.append(
            dict(
                quantity=quantity,
                predicted=pred,
                measured=value,
                measured_over_predicted=value / pred if pred and not math.isnan(pred) else math.nan,
            )
        )
    return pd.DataFrame(rows).set_index("quantity")


def _predicted(plan: Plan | None, frame: pd.DataFrame) -> dict[str, float]:
    if plan is not None and plan.predictions is not None:
        p = plan.predictions
        tensors = predicted_tensor_bytes(plan)
        return {
            "step_time_s": p.step_time_s,
            "tokens_per_s": p.tokens_per_s,
            "peak_memory_bytes": p.peak_memory_bytes,
            **({"peak_tensor_bytes": max(tensors)} if tensors else {}),
        }
    out = {}
    for quantity in ("step_time_s", "tokens_per_s", "peak_memory_bytes"):
        for column in (f"predicted_{quantity}", "predicted_peak_mem_bytes" if "memory" in quantity else ""):
            if column in frame and frame[column].notna().any():
                out[quantity] = float(frame[column].dropna().iloc[0])
                break
    return out


def _median(frame: pd.DataFrame, column: str) -> float:
    return float(frame[column].median()) if column in frame and frame[column].notna().any() else math.nan


def run_segments(path: str | Path) -> pd.DataFrame:
    """The run's timeline of plans: one row per attempt of a launch that trained steps (a restart, or a re-plan
    after a node was lost: ``launch --elastic``), with its plan, world size, the steps it trained (first, last,
    how many), its median step time, and the wall-clock time lost before it: from the last step the previous
    attempt finished to this attempt's first step (detection, rendezvous, start-up, the checkpoint's load; steps
    redone after the checkpoint are counted apart, ``steps_redone``). Times need the records' ``unix_time``
    (metrics written since it was added); without it those columns are NaN."""
    records = [r for _, r in _records(path) if isinstance(r.get("attempt", 0), int)]  # no attempt: an older file
    rows: list[dict[str, Any]] = []
    for attempt in sorted({r.get("attempt", 0) for r in records}):
        mine = [r for r in records if r.get("attempt", 0) == attempt]
        steps = [r for r in mine if r.get("event", "step") == "step" and "step" in r]
        if not steps:
            continue
        start = next((r for r in mine if r.get("event") == "start"), {})
        replan = next((r for r in mine if r.get("event") == "replan"), None)
        first, last = min(steps, key=lambda r: r["step"]), max(steps, key=lambda r: r["step"])
        previous = rows[-1] if rows else None
        lost = math.nan
        if previous is not None and "unix_time" in first and not math.isnan(previous["_last_time"]):
            lost = first["unix_time"] - first["step_time_s"] - previous["_last_time"]
        rows.append(
            {
                "attempt": attempt,
                "why": "start" if previous is None else ("re-plan" if replan else "restart"),
                "plan_hash": start.get("plan_hash"),
                "plan_path": (replan or {}).get("to_plan_path") or start.get("plan_path"),
                "world_size": start.get("world_size"),
                "global_batch": start.get("global_batch"),
                "first_step": first["step"],
                "last_step": last["step"],
                "steps": len(steps),
                "steps_redone": 0 if previous is None else max(0, previous["last_step"] - first["step"] + 1),
                "median_step_time_s": float(pd.Series([r["step_time_s"] for r in steps]).median()),
                "time_lost_s": lost,
                "_first_time": first.get("unix_time", math.nan) - first["step_time_s"],
                "_last_time": last.get("unix_time", math.nan),
            }
        )
    if not rows:
        raise StratagemError(f"metrics file {path} has no step lines; run `stratagem launch` with --steps >= 1")
    return pd.DataFrame(rows).set_index("attempt")


def _records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-empty line of a metrics file; a line that is not a JSON object raises."""
    path = Path(path)
    out = []
    for number, line in enumerate(read_text(path, what="metrics").splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(
            line,
            source=f"file {path} line {number}",
            what="metrics",
            fix="the launch was probably interrupted while writing: delete that line",
        )
        if not isinstance(record, dict):
            raise StratagemError(f"metrics file {path} line {number} is not a JSON object; re-run the launch")
        out.append((number, record))
    return out
