"""Measured runs for ``stratagem calibrate``: one row of ``runs.csv`` = one model, configuration and step time.

Columns (these names exactly; others are ignored, order is free): ``model`` (``gpt``/``llama`` or a preset
such as ``gpt:gpt3-175b``), ``layers``, ``hidden``, ``heads``, ``seq``, ``vocab`` (overrides; may be empty
with a preset), ``gpus``, ``global_batch``, ``micro_batch``, ``tp``, ``pp``, ``dp``, optional ``schedule``
(1f1b), ``virtual_stages`` (1), ``zero`` (0), ``recompute`` (none), ``sequence_parallel`` (false),
``overlap_grad_reduce`` (true), ``dtype`` (bf16), and ``step_time_s`` (measured seconds per optimizer step).
Every problem is a :class:`StratagemError` naming the row (1 = the first data row) and the column.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.core import SCHEDULE_ALIASES, Recompute, StratagemError, read_text
from planner.cost import ParallelConfig
from planner.model import DimValue, parse_model
from planner.profile import ModelProfile

REQUIRED = ("model", "gpus", "global_batch", "micro_batch", "tp", "pp", "dp", "step_time_s")
CANDIDATE_COLUMNS = REQUIRED[:-1]  # a configuration to run: a measured run's columns without the step time
DIMS = ("layers", "hidden", "heads", "seq", "vocab")
OPTIONAL = {
    "schedule": "1f1b",
    "virtual_stages": "1",
    "zero": "0",
    "recompute": "none",
    "sequence_parallel": "false",
    "overlap_grad_reduce": "true",
    "dtype": "bf16",
}
RECOMPUTE: dict[str, Recompute] = {"none": "none", "selective": "selective", "full": "full"}
BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredRun:
    """One measured run: the model (family + dims), its configuration and the measured step time."""

    row: int
    model: str
    dims: tuple[tuple[str, DimValue], ...]
    seq: int
    gpus: int
    global_batch: int
    config: ParallelConfig
    dtype: str
    step_time_s: float
    profile: ModelProfile | None = None  # a measured model profile (metrics runs); None: closed-form
    family: str = ""  # "" = the family in ``model`` ("gpt:tiny" -> "gpt")

    def label(self) -> str:
        c = self.config
        return f"row {self.row}: {self.model} t{c.tp}p{c.pp}d{c.dp} mb{c.micro_batch}"


def _int(value: str, row: int, column: str, *, minimum: int = 1) -> int:
    try:
        out = int(value)
    except ValueError:
        raise StratagemError(
            f"runs row {row} column {column!r}: {value!r} is not an integer; write a whole number >= {minimum}"
        ) from None
    if out < minimum:
        raise StratagemError(f"runs row {row} column {column!r}: {out} is below {minimum}; fix the value")
    return out


def _run(row: int, r: dict[str, str], *, measured: bool = True) -> MeasuredRun:
    """One row; ``measured=False`` reads a candidate configuration (no ``step_time_s``; it is NaN)."""
    required = REQUIRED if measured else CANDIDATE_COLUMNS
    get = {k: (r.get(k) or "").strip() for k in (*REQUIRED, *DIMS, *OPTIONAL)}
    for k in required:
        if not get[k]:
            raise StratagemError(f"runs row {row} column {k!r} is empty; every run needs {', '.join(required)}")
    try:
        t = float(get["step_time_s"]) if measured else math.nan
    except ValueError:
        t = math.nan
    if measured and (not math.isfinite(t) or t <= 0):
        raise StratagemError(
            f"runs row {row} column 'step_time_s': {get['step_time_s']!r} is not a positive "
            f"number of seconds; write the measured seconds per optimizer step"
        )
    dims = {k: _int(get[k], row, k) for k in ("layers", "hidden", "heads", "vocab") if get[k]}
    name = get["model"]
    try:
        spec = parse_model(name, **{**dims, **({"max_seq": int(get["seq"])} if get["seq"] else {})})
    except StratagemError as exc:
        raise StratagemError(f"runs row {row} column 'model': {exc}") from None
    seq = _int(get["seq"], row, "seq") if get["seq"] else int(spec.dim("max_seq"))
    opt = {k: (get[k] or v).lower() for k, v in OPTIONAL.items()}
    if opt["schedule"] not in SCHEDULE_ALIASES:
        raise StratagemError(f"runs row {row} column 'schedule': {opt['schedule']!r}; use 1f1b, gpipe or interleaved")
    for k in ("sequence_parallel", "overlap_grad_reduce"):
        if opt[k] not in BOOLS:
            raise StratagemError(f"runs row {row} column {k!r}: {opt[k]!r}; use true or false")
    if opt["recompute"] not in RECOMPUTE:
        raise StratagemError(f"runs row {row} column 'recompute': {opt['recompute']!r}; use none, selective or full")
    tp, pp, dp = (_int(get[k], row, k) for k in ("tp", "pp", "dp"))
    mb, gb, gpus = (_int(get[k], row, k) for k in ("micro_batch", "global_batch", "gpus"))
    if tp * pp * dp != gpus:
        raise StratagemError(f"runs row {row} columns tp, pp, dp: {tp} x {pp} x {dp} != gpus {gpus}; fix the degrees")
    if gb % (dp * mb):
        raise StratagemError(
            f"runs row {row} column 'global_batch': {gb} is not a multiple of dp x micro_batch "
            f"= {dp * mb}; fix the batch"
        )
    config = ParallelConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=mb,
        num_micro_batches=gb // (dp * mb),
        schedule=SCHEDULE_ALIASES[opt["schedule"]],
        virtual_stages=_int(opt["virtual_stages"], row, "virtual_stages"),
        zero_stage=_int(opt["zero"], row, "zero", minimum=0),
        recompute=RECOMPUTE[opt["recompute"]],
        sequence_parallel=BOOLS[opt["sequence_parallel"]],
        overlap_grad_reduce=BOOLS[opt["overlap_grad_reduce"]],
    )
    return MeasuredRun(
        row=row,
        model=name,
        dims=tuple(sorted(spec.dims.items())),
        seq=seq,
        gpus=gpus,
        global_batch=gb,
        config=config,
        dtype=opt["dtype"],
        step_time_s=t,
    )


def load_runs_csv(path: str | Path, *, allow_empty: bool = False) -> list[MeasuredRun]:
    """Measured runs from a CSV file (module docstring); errors name the row and column. ``allow_empty``: a file
    with only the header is no runs (``stratagem tune suggest`` before the first trial)."""
    return [_run(i, r) for i, r in _rows(path, REQUIRED, what="runs", allow_empty=allow_empty)]


def load_candidates_csv(path: str | Path) -> list[MeasuredRun]:
    """Configurations a user can run (the runs file's columns without ``step_time_s``; their step time is NaN)."""
    return [_run(i, r, measured=False) for i, r in _rows(path, CANDIDATE_COLUMNS, what="candidates")]


def _rows(path: str | Path, columns: tuple[str, ...], *, what: str, allow_empty: bool = False):
    path = Path(path)
    unit = "measured run" if what == "runs" else "configuration"
    text = read_text(path, what=what)  # bounded, UTF-8, one-line errors
    try:
        reader = csv.DictReader(text.splitlines())
        rows = list(reader)
    except csv.Error as exc:
        raise StratagemError(f"{what} file {path} is not CSV ({exc}); write one {unit} per row") from None
    if not rows and not allow_empty:
        raise StratagemError(f"{what} file {path} has no data rows; add one {unit} per row under the header")
    header = reader.fieldnames or []
    if not header:
        raise StratagemError(f"{what} file {path} is empty; write the header line ({', '.join(columns)}) first")
    missing = [c for c in columns if c not in header]
    if missing:
        raise StratagemError(
            f"{what} file {path} lacks column(s) {', '.join(missing)}; the header needs "
            f"{', '.join(columns)} (see `stratagem calibrate --help`)"
        )
    return list(enumerate(rows, start=1))


def run_columns(run: MeasuredRun) -> dict[str, str]:
    """A run's (or candidate's) configuration as the runs file's columns, for writing it back
    (``load_candidates_csv`` reads it again to the same configuration)."""
    c = run.config
    if not isinstance(c.recompute, str):
        raise StratagemError(f"{run.label()} recomputes per layer; the runs file states one recompute mode")
    dims = dict(run.dims)
    return {
        "model": run.model,
        **{k: str(dims[k]) for k in ("layers", "hidden", "heads", "vocab") if k in dims},
        "seq": str(run.seq),
        "gpus": str(run.gpus),
        "global_batch": str(run.global_batch),
        "micro_batch": str(c.micro_batch),
        "tp": str(c.tp),
        "pp": str(c.pp),
        "dp": str(c.dp),
        "schedule": c.schedule,
        "virtual_stages": str(c.virtual_stages),
        "zero": str(c.zero_stage),
        "recompute": c.recompute,
        "sequence_parallel": "true" if c.sequence_parallel else "false",
        "overlap_grad_reduce": "true" if c.overlap_grad_reduce else "false",
        "dtype": run.dtype,
    }


def runs_hash(runs: list[MeasuredRun]) -> str:
    """``sha256:`` of the runs' canonical JSON (the calibration section records it)."""
    body = [
        {
            **{k: v for k, v in asdict(r).items() if k not in ("config", "profile")},
            "config": repr(r.config),
            "profile": r.profile.content_hash if r.profile is not None else None,
        }
        for r in runs
    ]
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
