"""Measured runs from ``stratagem launch --metrics`` JSON lines: the plan (named by the file's start line, or
``--plan``; a plan file of that name beside the metrics file when the named path is gone, e.g. a run folder
copied from the cluster) gives the model and configuration, the summary line the measured step time.

The model profile is the shipped one whose content hash the plan records (``profiles/models/*.json``,
measured on this machine); else, for a GPT trained in bf16 on CUDA, the closed-form profile with precision
"autocast" — the runtime keeps fp32 weights and runs each micro-batch under ``torch.autocast``
(``runtime/executor/schedule.py``), whose cast kernels, fp32 softmax/LayerNorm/cross-entropy and fp32 saved
activations ``planner.profile.autocast`` prices (the "pure" profile predicted the H100 runs of
``benchmarks/data/h100`` 35-75 % too fast and gpt2 mb16's peak memory at 55 %); else a shipped profile of the
same model, sequence and dtype; else (None) the closed-form "pure" profile. On CPU the runtime also runs
bf16 under autocast, but CPU runs are predicted from measured profiles. The configuration is the plan's, with
``overlap_grad_reduce`` off on CPU ranks: FSDP2 has no side stream there and its gloo collectives block the
rank (``benchmarks/runtime_vs_prediction.py``), and at ``pp = 1`` one micro-batch in flight whatever the
schedule's name (the runtime's ``LocalRunner`` runs each micro-batch's forward and backward in turn).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from planner.calibrate.runs import MeasuredRun
from planner.core import DTYPE_BYTES, Precision, StratagemError, parse_json, read_text
from planner.cost import plan_config
from planner.plan import Plan, load_plan
from planner.profile import ModelProfile, build_gpt_profile, load_model_profile

MODELS_DIR = Path(__file__).resolve().parents[2] / "profiles" / "models"


def _records(path: Path) -> list[dict]:
    return _records_of(read_text(path, what="metrics").splitlines(), path)  # bounded, UTF-8, one-line errors


def _records_of(lines: list[str], path: Path) -> list[dict]:
    out = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            record = parse_json(
                line, source=f"file {path} line {number}", what="metrics", fix="delete that line or re-run the launch"
            )
            if not isinstance(record, dict):
                raise StratagemError(f"metrics file {path} line {number} is not a JSON object; re-run the launch")
            out.append(record)
    return out


def runtime_precision(plan: Plan, device: str, start: dict | None = None) -> Precision:
    """How ``stratagem launch`` executed ``plan``'s compute on ``device``, from its metrics ``start`` record.

    "autocast" (fp32 weights under ``torch.autocast``, eager: cast kernels, fp32 softmax) for a GPT in a 16-bit
    dtype on CUDA that ran uncompiled under autocast (``launch --no-compile``), or whose start record predates the
    runtime's ``precision`` field (every bf16 CUDA run was eager autocast then); else "pure". Compiled blocks fuse
    autocast's activation casts and FSDP2's bf16 policy has none, so those runs are priced as pure 16-bit, the
    default of ``plan``/``estimate`` (the weight casts left under compile, 4-7 % of device time on an H200,
    ``benchmarks/data/h200``, are priced by neither mode)."""
    start = start or {}
    sixteen_bit_gpt = device == "cuda" and plan.model.family == "gpt" and DTYPE_BYTES.get(plan.training.dtype) == 2
    eager_autocast = "precision" not in start or (
        start.get("precision") == "autocast" and not start.get("compiled_blocks")
    )
    return "autocast" if sixteen_bit_gpt and eager_autocast else "pure"


def _profile_for(plan: Plan, device: str = "cuda", start: dict | None = None) -> ModelProfile | None:
    """The shipped measured profile the plan was made from (by hash); else the closed-form autocast profile
    when the runtime runs the plan under autocast (:func:`runtime_precision`); else a shipped profile of the
    same model, sequence length and dtype; None when there is none (the closed-form pure profile)."""
    profiles = [load_model_profile(path) for path in sorted(MODELS_DIR.glob("*.json"))]
    for profile in profiles:
        if plan.model_profile_hash and profile.content_hash == plan.model_profile_hash:
            return profile
    if runtime_precision(plan, device, start) == "autocast":
        tp = plan.mesh.size("tp")
        return build_gpt_profile(
            plan.model,
            seq_len=plan.training.seq_len,
            dtype=plan.training.dtype,
            tp_degrees=[1, tp] if tp > 1 else [1],
            precision="autocast",
        )
    for profile in profiles:
        if (
            profile.model == plan.model
            and profile.seq_len == plan.training.seq_len
            and profile.dtype == plan.training.dtype
        ):
            return profile
    return None


def _step_time(records: list[dict]) -> float | None:
    """The summary's measured step time, else (a run stopped before its summary) the median of the steps after
    the first; None when there is none."""
    summary = next((r for r in reversed(records) if r.get("event") == "summary"), None)
    times = [r["step_time_s"] for r in records if r.get("event") == "step" and "step_time_s" in r]
    measured = summary.get("measured_step_time_s") if summary else None
    if measured is None and times:
        measured = statistics.median(times[1:] or times)
    return float(measured) if measured and measured > 0 else None


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one launch's metrics file measured (:func:`step_stats`)."""

    step_time_s: float | None  # :func:`_step_time`; None when no step was measured
    noise_rel: float | None  # spread of the steps after the first (None with under 3)
    summarised: bool  # rank 0 wrote the summary line (it does after the last step)


def step_stats(path: str | Path) -> StepStats:
    """A metrics file's step time, the run-to-run noise of its steps (1.4826 x the median absolute deviation of the
    steps after the first, relative to their median: a normal's standard deviation, robust to a stray step) and
    whether it was summarised, read once. A missing file measured nothing; a torn last line (a rank killed
    mid-write) is left out and the lines before it still count."""
    path = Path(path)
    if not path.exists():
        return StepStats(step_time_s=None, noise_rel=None, summarised=False)
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    try:
        records = _records_of(lines, path)
    except StratagemError:
        try:
            records = _records_of(lines[:-1], path)
        except StratagemError:  # torn before its end too: nothing to trust
            records = []
    times = [r["step_time_s"] for r in records if r.get("event") == "step" and "step_time_s" in r][1:]
    mid = statistics.median(times) if len(times) >= 3 else 0.0
    noise = 1.4826 * statistics.median(abs(t - mid) for t in times) / mid if mid > 0 else None
    summarised = any(r.get("event") == "summary" for r in records)
    return StepStats(step_time_s=_step_time(records), noise_rel=noise, summarised=summarised)


def load_runs_jsonl(path: str | Path, *, plan_path: str | Path | None = None, row: int = 1) -> MeasuredRun:
    """One measured run from a metrics file (module docstring); ``row`` numbers it in reports."""
    path = Path(path)
    records = _records(path)
    start = next((r for r in records if r.get("event") == "start"), {})
    named = plan_path or start.get("plan_path")
    if not named:
        raise StratagemError(
            f"metrics file {path} names no plan (its start line has no plan_path); pass the "
            f"launched plan with --plan PLAN.json"
        )
    if not plan_path and not Path(named).exists() and (path.parent / Path(named).name).exists():
        named = path.parent / Path(named).name  # a run folder copied from the cluster: the plan beside its metrics
    plan = load_plan(named)
    if start.get("plan_hash") and plan.content_hash and start["plan_hash"] != plan.content_hash:
        raise StratagemError(
            f"metrics file {path} was measured with another plan than {named} (plan_hash "
            f"differs); pass the plan that was launched with --plan"
        )
    measured = _step_time(records)
    if measured is None:
        raise StratagemError(
            f"metrics file {path} has no measured step time; run `stratagem launch` with --steps >= 2 and --metrics"
        )
    device = str(start.get("device", "cuda"))
    cpu = device == "cpu"
    config = plan_config(plan, overlap_grad_reduce=not cpu)
    tr = plan.training
    return MeasuredRun(
        row=row,
        model=plan.model.name,
        dims=tuple(sorted(plan.model.dims.items())),
        seq=tr.seq_len,
        gpus=config.world_size,
        global_batch=tr.global_batch,
        config=config,
        dtype=tr.dtype,
        step_time_s=float(measured),
        profile=_profile_for(plan, device, start),
        family=plan.model.family,
    )
