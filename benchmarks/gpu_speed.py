"""MFU, step time, peak memory and cast-kernel share of `stratagem launch` on one GPU, beside the plan's prediction.

    python benchmarks/gpu_speed.py --out DIR          # needs CUDA; writes DIR/speed.csv, the plans and metrics
    python benchmarks/gpu_speed.py --from-data DIR    # no GPU: the stored runs' table, predictions recomputed

Rows (hand-made one-GPU plans, ``fixtures.plans.make_plan``; no search, nothing fitted):
- ``gpt:gpt2-large``, micro-batch 4, sequence 1,024 (the issue-23 baseline: 11 % MFU on one H100 before);
- ``llama:llama3-8b@layers=8``, micro-batch 1, sequence 8,192: Llama 3 8B's layer shape (hidden 4,096, 32 heads,
  8 KV heads, FFN 14,336, vocabulary 128,256) with 8 of its 32 layers, so weights, gradients and AdamW state fit
  one GPU;
each launched with the runtime's GPU defaults (bf16 weights with fp32 masters on one rank, fused SDPA attention,
``torch.compile`` per block replayed as CUDA graphs), and
``gpt2-large`` once more with math attention and no compile as the baseline on the same card.
``--all`` adds diagnostics (``EXTRA_RUNS``): gpt2-large with its vocabulary padded to 50,304, at micro-batch 8, and
both models with their compiled blocks run without CUDA graphs (``STRATAGEM_COMPILE_MODE=default``; one rank's
default replays them as graphs).

Prediction: :func:`planner.cost.estimate` of the plan on the closed-form profile (pure 16-bit, flash attention as
the plan says) and the shipped cluster profile of the card (``dgx-h200`` for an H200, else ``dgx-h100``),
uncalibrated. Measured step time: the median over steps 2.. (``runtime/executor/metrics.py``). MFU = the cost
model's model FLOPs per step (6 N per token plus attention, PaLM appendix B, the same count the prediction uses)
/ step time / the profile's dense bf16 peak, so measured and predicted MFU differ exactly by the step-time ratio.
Peak memory: ``torch.cuda.max_memory_allocated`` against the prediction less its allocator reserve (which
``max_memory_allocated`` does not see). From step 3's ``torch.profiler`` operator JSON (``STRATAGEM_TORCH_PROFILE``,
``runtime/executor/train.py``): "busy", the device time of all its kernels (a step longer than that waited on the
host), and "casts", the share of it in the kernels of ``aten::copy_`` / ``aten::_to_copy`` (:func:`kernel_times`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (name, model, micro-batch, sequence, flash attention, compile)
RUNS = [
    ("gpt2-large_mb4", "gpt:gpt2-large", 4, 1024, True, True),
    ("llama3-8b-l8_mb1_s8192", "llama:llama3-8b@layers=8", 1, 8192, True, True),
    ("gpt2-large_mb4_math_eager", "gpt:gpt2-large", 4, 1024, False, False),
]
# diagnostics, run with --only NAMES or --all: the padded vocabulary, twice the tokens per step, and the compiled
# blocks without CUDA graphs (one rank's default has them: runtime.executor.speed.compile_mode)
EXTRA_RUNS = [
    ("gpt2-large-v50304_mb4", "gpt:gpt2-large@vocab=50304", 4, 1024, True, True),
    ("gpt2-large_mb8", "gpt:gpt2-large", 8, 1024, True, True),
    ("gpt2-large_mb4_no_cudagraphs", "gpt:gpt2-large", 4, 1024, True, True),
    ("llama3-8b-l8_mb1_s8192_no_cudagraphs", "llama:llama3-8b@layers=8", 1, 8192, True, True),
]
NO_GRAPHS = {"STRATAGEM_COMPILE_MODE": "default"}
RUN_ENV = {"gpt2-large_mb4_no_cudagraphs": NO_GRAPHS, "llama3-8b-l8_mb1_s8192_no_cudagraphs": NO_GRAPHS}
CAST_OPS = ("aten::copy_", "aten::_to_copy")
ANNOTATION = re.compile(r"## |[A-Za-z_][\w.]*#[\w.]+$")  # compiled-graph calls, record_function scopes
FIELDS = [
    "run", "model", "micro_batch", "seq", "flash_attention", "compile", "gpu", "torch", "cluster_profile",
    "measured_step_s", "predicted_step_s", "step_error", "tokens_per_s", "measured_mfu", "predicted_mfu",
    "measured_peak_bytes", "predicted_peak_alloc_bytes", "peak_error", "device_step3_s", "cast_share", "precision",
    "attention",
]  # fmt: skip


def build_run(model: str, mb: int, seq: int, flash: bool, cluster_name: str):
    """The one-GPU plan of a row and its uncalibrated estimate."""
    from dataclasses import replace  # a hand-made plan's node type names none of the cluster's

    from fixtures.plans import make_plan
    from planner.cost import estimate, plan_config, with_gpus
    from planner.model import parse_model
    from planner.profile import build_gpt_profile, load_cluster_profile, resolve_cluster_path

    name, _, over = model.partition("@")
    spec = parse_model(name, **{k: int(v) for k, v in (kv.split("=") for kv in over.split(",") if kv)})
    plan = make_plan(spec, dp=1, global_batch=mb, seq_len=seq, num_micro_batches=1, dtype="bf16", lr=1e-4)
    plan = plan.model_copy(update={"flash_attention": flash})
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path(cluster_name)), 1)
    profile = build_gpt_profile(plan.model, seq_len=seq, dtype="bf16")
    est = estimate(profile, cluster, replace(plan_config(plan), stage_node_types=None), global_batch=mb, dtype="bf16")
    return plan.model_copy(update={"predictions": est.to_predictions()}), est


def is_cast_kernel(name: str) -> bool:
    """A kernel that only converts dtypes: aten's copy kernels, or an inductor kernel whose fused ops are
    ``_to_copy`` and layout-only ops (``triton_poi_fused__to_copy_3``, ``triton_poi_fused__to_copy_t_7``)."""
    if name in CAST_OPS:
        return True
    if not name.startswith(("triton_poi_fused_", "triton_per_fused_", "triton_red_fused_")):
        return False
    ops = re.sub(r"_\d+$", "", name.split("_fused_", 1)[1])
    words = set(re.findall(r"_to_copy|[a-z]+", ops.replace("_to_copy", " _to_copy ")))
    return "_to_copy" in words and words <= {"_to_copy", "view", "t", "transpose", "permute", "clone", "expand"}


def kernel_times(folder: Path, run_name: str) -> tuple[float, float] | None:
    """(device time of every kernel, of the cast kernels), seconds, in step 3 (rank 0's operator JSON).

    Kernels are the rows with device time and no CPU time, less the annotations the profiler repeats on the
    device (``## Call CompiledFxGraph ... ##`` and ``record_function`` scopes such as ``Optimizer.step#AdamW.step``,
    which span other kernels). Casts: the kernels of ``aten::copy_`` / ``aten::_to_copy`` and inductor kernels that
    only convert dtypes (:func:`is_cast_kernel`); autocast's weight casts land there in a compiled block."""
    files = sorted(folder.glob(f"{run_name}_rank0_step*.json"))
    if not files:
        return None
    rows = json.loads(files[0].read_text(encoding="utf-8"))["ops"]
    device = [r for r in rows if r["self_cpu_us"] == 0 and not ANNOTATION.match(r["name"])]
    kernels = sum(r["self_device_us"] for r in device)
    casts = sum(r["self_device_us"] for r in rows if r["name"] in CAST_OPS)
    casts += sum(r["self_device_us"] for r in device if r["name"] not in CAST_OPS and is_cast_kernel(r["name"]))
    return kernels * 1e-6, casts * 1e-6


def launch(
    plan_path: Path, metrics: Path, *, steps: int, compile_blocks: bool, profile_dir: Path, env: dict, timeout_s: int
) -> str:
    cmd = [sys.executable, "-m", "planner.cli.main", "launch", str(plan_path), "--steps", str(steps)]
    cmd += ["--metrics", str(metrics), "--timeout-s", str(timeout_s), "--compile" if compile_blocks else "--no-compile"]
    env = dict(os.environ, STRATAGEM_TORCH_PROFILE=str(profile_dir), **env)
    log = metrics.with_suffix(".log")  # every rank's output, kept: a failed launch's cause is in there
    try:
        with log.open("w", encoding="utf-8") as fh:
            proc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s + 30, env=env)
    except subprocess.TimeoutExpired:
        return f"no result in {timeout_s + 30} s (output in {log.name})"
    if proc.returncode == 0:
        return ""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    causes = [line for line in lines if "Error" in line or "error:" in line][:8]  # the ranks' own errors first
    return f"exit {proc.returncode} (output in {log.name}): " + " | ".join(causes or lines[-20:])


def measure(run: tuple, *, out: Path, steps: int, cluster_name: str, timeout_s: int = 400) -> dict | None:
    """Launch one row on this GPU; its plan, metrics and rank 0's step-3 operator tables land in ``out``."""
    import torch

    from planner.plan import save_plan

    name, model, mb, seq, flash, compile_blocks = run
    plan, _ = build_run(model, mb, seq, flash, cluster_name)
    plan_path = save_plan(plan, out / f"{name}.json")
    prof = out / f"{name}_profile"
    failure = launch(
        plan_path,
        out / f"{name}.jsonl",
        steps=steps,
        compile_blocks=compile_blocks,
        profile_dir=prof,
        env=RUN_ENV.get(name, {}),
        timeout_s=timeout_s,
    )
    if failure:
        print(f"{name}: launch failed ({failure})")
        return None
    for f in prof.glob("rank0_*"):
        f.rename(out / f"{name}_{f.name}")
    return collect(run, out, cluster_name, gpu=torch.cuda.get_device_name(0), torch_version=torch.__version__)


def collect(run: tuple, folder: Path, cluster_name: str, *, gpu: str, torch_version: str) -> dict:
    """The row of a launched run from its files in ``folder``: the metrics measured, the prediction recomputed
    from the stored plan (the same ``build_run``; nothing fitted)."""
    from runtime.executor.metrics import read_metrics

    name, model, mb, seq, flash, compile_blocks = run
    _, est = build_run(model, mb, seq, flash, cluster_name)
    records = read_metrics(folder / f"{name}.jsonl")
    summary = next(r for r in reversed(records) if r.get("event") == "summary")
    start = next(r for r in records if r.get("event") == "start")
    meas = summary["measured_step_time_s"]
    times = kernel_times(folder, name)
    alloc = est.peak_memory_bytes - max(rank.memory.reserve for rank in est.per_rank)
    peak = summary["measured_peak_memory_bytes"]
    return dict(
        run=name,
        model=model,
        micro_batch=mb,
        seq=seq,
        flash_attention=flash,
        compile=compile_blocks,
        gpu=gpu,
        torch=torch_version,
        cluster_profile=cluster_name,
        measured_step_s=meas,
        predicted_step_s=est.step_time_s,
        step_error=est.step_time_s / meas - 1,
        tokens_per_s=mb * seq / meas,
        measured_mfu=est.mfu * est.step_time_s / meas,
        predicted_mfu=est.mfu,
        measured_peak_bytes=peak,
        predicted_peak_alloc_bytes=alloc,
        peak_error=alloc / peak - 1 if peak else None,
        device_step3_s=times[0] if times else None,
        cast_share=times[1] / times[0] if times and times[0] else None,
        precision=start.get("precision"),
        attention=start.get("attention"),
    )


def from_data(folder: Path, cluster_name: str | None) -> list[dict]:
    """Rows of the runs stored in ``folder`` (plans, metrics, operator JSONs; ``machine.txt`` names the card and
    torch), predictions recomputed here; runs whose files are not there are left out and named."""
    lines = (folder / "machine.txt").read_text(encoding="utf-8").splitlines()
    gpu = lines[1].split(", ")[0]
    torch_version = next(line.split()[1] for line in lines if line.startswith("torch "))
    cluster = cluster_name or ("dgx-h200" if "H200" in gpu else "dgx-h100")
    rows = []
    for run in RUNS + EXTRA_RUNS:
        if (folder / f"{run[0]}.jsonl").exists():
            rows.append(collect(run, folder, cluster, gpu=gpu, torch_version=torch_version))
        else:
            print(f"{run[0]}: no stored metrics in {folder}", file=sys.stderr)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    from planner.core import atomic_write_text

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def print_table(rows: list[dict]) -> None:
    w = max([28] + [len(r["run"]) for r in rows])
    print(
        f"{'run':<{w}} {'step ms':>8} {'pred ms':>8} {'error':>7} {'MFU':>6} {'pred':>6} {'peak GB':>8} "
        f"{'pred GB':>8} {'error':>7} {'busy ms':>7} {'casts':>6}"
    )
    for r in rows:
        cast = "" if r["cast_share"] in (None, "") else f"{float(r['cast_share']):6.1%}"
        peak_err = "" if r["peak_error"] in (None, "") else f"{float(r['peak_error']):+7.1%}"
        busy = "" if r["device_step3_s"] in (None, "") else f"{float(r['device_step3_s']) * 1e3:7.1f}"
        print(
            f"{r['run']:<{w}} {float(r['measured_step_s']) * 1e3:8.1f} {float(r['predicted_step_s']) * 1e3:8.1f} "
            f"{float(r['step_error']):+7.1%} {float(r['measured_mfu']):6.1%} {float(r['predicted_mfu']):6.1%} "
            f"{float(r['measured_peak_bytes']) / 1e9:8.2f} {float(r['predicted_peak_alloc_bytes']) / 1e9:8.2f} "
            f"{peak_err:>7} {busy:>7} {cast:>6}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where a GPU session writes speed.csv, plans and metrics")
    p.add_argument("--from-data", type=Path, metavar="DIR", help="print the table of a stored session (no GPU)")
    p.add_argument("--cluster", help="cluster profile (default: dgx-h200 on an H200, else dgx-h100)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--only", help="runs by name, comma-separated, in this order")
    p.add_argument("--run-timeout", type=int, default=400, help="seconds one launch may take (default 400)")
    p.add_argument("--all", action="store_true", help="also the diagnostic runs (EXTRA_RUNS)")
    p.add_argument("--csv", type=Path, help="with --from-data: also write the rows to this CSV file")
    args = p.parse_args()
    if args.from_data:
        rows = from_data(args.from_data, args.cluster)
        print_table(rows)
        if args.csv and rows:
            write_csv(rows, args.csv)
        return 0 if rows else 1
    if args.out is None:
        p.error("give --out DIR (a GPU session) or --from-data DIR")
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device here; this benchmark launches on a GPU", file=sys.stderr)
        return 2
    cluster = args.cluster or ("dgx-h200" if "H200" in torch.cuda.get_device_name(0) else "dgx-h100")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stratagem-gpu-speed-"))
    rows = []
    by_name = {run[0]: run for run in RUNS + EXTRA_RUNS}
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in by_name]
        if unknown:
            p.error(f"--only: no run named {', '.join(unknown)} (runs: {', '.join(by_name)})")
        chosen = [by_name[n] for n in args.only.split(",")]
    else:
        chosen = RUNS + (EXTRA_RUNS if args.all else [])
    for run in chosen:
        row = measure(run, out=work, steps=args.steps, cluster_name=cluster, timeout_s=args.run_timeout)
        for f in work.glob(f"{run[0]}*.*"):  # a failed run's log too
            (args.out / f.name).write_bytes(f.read_bytes())
        if row is None:
            continue
        rows.append(row)
        write_csv(rows, args.out / "speed.csv")  # after every run: a timeout keeps the rest
        print_table([row])
    print_table(rows)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
