"""Measured training steps of `stratagem launch` on one GPU next to the cost model's predictions.

    python benchmarks/gpu_runs.py --out DIR            # needs CUDA; writes DIR/gpu_runs.csv and DIR/runs.tar.gz
    python benchmarks/gpu_runs.py --from-data benchmarks/data/h100   # no GPU: re-predicts the stored runs

Each row is a hand-made one-GPU plan (``fixtures.plans.make_plan``; no search) of a GPT-2-shaped model from the
zoo (explicit attention, as ``runtime/models/gpt.py`` runs it), bf16 autocast, sequence 1024, micro-batch
``mb`` and ``m`` micro-batches per step, launched with ``stratagem launch`` (torchrun, NCCL, one rank). The
prediction is :func:`planner.cost.estimate` on the closed-form profile (``build_gpt_profile``, the
shape-aware kernel model of ``planner.cost.kernels``) and the cluster profile named by ``--cluster`` (the
H100 machines here: ``dgx-h100``), uncalibrated; the plan carries it, so the launch's summary compares.
Measured = the median step time over steps 2.. (``runtime/executor/metrics.py``). With ``--profile`` the
model is also profiled layer by layer on the GPU (``stratagem profile model``) and predicted from that
measured profile. The metrics files and plans go into ``runs.tar.gz`` for ``stratagem calibrate``.
Nothing is fitted here.

The runtime trains with fp32 weights under ``torch.autocast`` (``runtime/executor/schedule.py``), so runs are
predicted with the closed-form profile's precision "autocast" (``planner.profile.autocast``; what
``planner.calibrate.metrics_runs`` uses for such runs); "pure" 16-bit (the published Megatron/torchtitan rows'
mode) is printed beside it. ``--from-data DIR`` needs no GPU: it re-predicts the runs stored in ``DIR``
(``runs.csv``, each run's plan ``RUN.json`` and metrics ``RUN.jsonl``) and prints per run the measured step time
and peak memory (``torch.cuda.max_memory_allocated``) with both predictions. The predicted peak holds the
model's reserve (CUDA context, fragmentation: ``planner.cost.memory``), which ``max_memory_allocated`` does not
see, so "alloc" prints the prediction without it too.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SEQ = 1024
# (model, micro-batch, micro-batches per step)
# "model@vocab=N": the preset with its vocabulary padded (GPT-2's 50,257 -> 50,304, a multiple of 128)
CONFIGS = [
    ("gpt:gpt2", 1, 1),
    ("gpt:gpt2", 4, 1),
    ("gpt:gpt2@vocab=50304", 4, 1),
    ("gpt:gpt2", 16, 1),
    ("gpt:gpt2-medium", 1, 1),
    ("gpt:gpt2-medium", 8, 2),
    ("gpt:gpt2-large", 4, 1),
    ("gpt:gpt2-xl", 2, 1),
]
QUICK = [("gpt:gpt2", 4, 1), ("gpt:gpt2-medium", 4, 2)]


def predict(model: str, mb: int, m: int, cluster_name: str, profile_path: Path | None = None, precision="autocast"):
    from fixtures.plans import make_plan
    from planner.model import parse_model

    name, _, over = model.partition("@")
    spec = parse_model(name, **{k: int(v) for k, v in (kv.split("=") for kv in over.split(",") if kv)})
    plan = make_plan(spec, dp=1, global_batch=mb * m, seq_len=SEQ, num_micro_batches=m, dtype="bf16", lr=1e-4)
    return plan, predict_plan(plan, cluster_name, profile_path, precision)


def predict_plan(plan, cluster_name: str, profile_path: Path | None = None, precision="autocast"):
    """:func:`planner.cost.estimate` of a one-GPU ``plan`` on the closed-form profile in ``precision`` (or the
    measured profile at ``profile_path``), as ``planner.calibrate.metrics_runs`` configures a launched plan."""
    from dataclasses import replace  # a hand-made plan's node type names none of the cluster's

    from planner.cost import estimate, plan_config, with_gpus
    from planner.profile import build_gpt_profile, load_cluster_profile, load_model_profile, resolve_cluster_path

    tr = plan.training
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path(cluster_name)), 1)
    profile = (
        load_model_profile(profile_path)
        if profile_path
        else build_gpt_profile(plan.model, seq_len=tr.seq_len, dtype=tr.dtype, precision=precision)
    )
    return estimate(
        profile,
        cluster,
        replace(plan_config(plan), stage_node_types=None),
        global_batch=tr.global_batch,
        dtype=tr.dtype,
    )


def _summary(metrics: Path) -> dict:
    """The summary record of a launch's metrics file (``runtime.executor.metrics``)."""
    from runtime.executor.metrics import read_metrics

    return next(r for r in reversed(read_metrics(metrics)) if r.get("event") == "summary")


def _allocated(est) -> float:
    """Predicted peak less the allocator reserve: what ``torch.cuda.max_memory_allocated`` measures."""
    return est.peak_memory_bytes - max(rank.memory.reserve for rank in est.per_rank)


def from_data(folder: Path, cluster_name: str) -> int:
    """Re-predict the runs stored in ``folder`` (module docstring); no GPU, nothing launched or fitted."""
    from planner.plan import load_plan

    with open(folder / "runs.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    print(f"runs of {folder} on cluster profile {cluster_name}; ms per step, GB (1e9 bytes) peak; error vs measured")
    print(
        f"{'run':<24} {'measured':>8} {'pure':>7} {'error':>7} {'autocast':>8} {'error':>7} | {'measured':>8} "
        f"{'pure':>6} {'alloc':>6} {'error':>7} {'autocast':>8} {'alloc':>6} {'error':>7}"
    )
    errs: dict[str, list[float]] = {"pure": [], "autocast": [], "mem_pure": [], "mem_autocast": []}
    for r in rows:
        plan = load_plan(folder / f"{r['run']}.json")
        summary = _summary(folder / f"{r['run']}.jsonl")
        meas, meas_peak = summary["measured_step_time_s"], summary["measured_peak_memory_bytes"]
        before, after = (predict_plan(plan, cluster_name, precision=p) for p in ("pure", "autocast"))
        alloc, alloc_before = _allocated(after), _allocated(before)
        errs["pure"].append(before.step_time_s / meas - 1)
        errs["autocast"].append(after.step_time_s / meas - 1)
        errs["mem_pure"].append(alloc_before / meas_peak - 1)
        errs["mem_autocast"].append(alloc / meas_peak - 1)
        print(
            f"{r['run']:<24} {meas * 1e3:8.1f} {before.step_time_s * 1e3:7.1f} {errs['pure'][-1]:+7.1%} "
            f"{after.step_time_s * 1e3:8.1f} {errs['autocast'][-1]:+7.1%} | {meas_peak / 1e9:8.2f} "
            f"{before.peak_memory_bytes / 1e9:6.2f} {alloc_before / 1e9:6.2f} {errs['mem_pure'][-1]:+7.1%} "
            f"{after.peak_memory_bytes / 1e9:8.2f} {alloc / 1e9:6.2f} {errs['mem_autocast'][-1]:+7.1%}"
        )
    for key, label in (("pure", "step time, pure"), ("autocast", "step time, autocast")):
        e = [abs(x) for x in errs[key]]
        print(f"{label:<22} mean |error| {statistics.mean(e):6.1%}, max {max(e):6.1%} ({len(e)} runs, uncalibrated)")
    for key, label in (("mem_pure", "peak alloc, pure"), ("mem_autocast", "peak alloc, autocast")):
        e = [abs(x) for x in errs[key]]
        print(f"{label:<22} mean |error| {statistics.mean(e):6.1%}, max {max(e):6.1%} (prediction less its reserve)")
    return 0


def launch(plan_path: Path, metrics: Path, steps: int) -> dict:
    cmd = [sys.executable, "-m", "planner.cli.main", "launch", str(plan_path), "--steps", str(steps)]
    cmd += ["--metrics", str(metrics), "--timeout-s", "300"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    if proc.returncode:
        print(f"launch {plan_path.name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2500:]}")
        return {}
    return _summary(metrics)


def profile_model(model: str, mbs: list[int], out: Path) -> Path | None:
    cmd = [sys.executable, "-m", "planner.cli.main", "profile", "model", "--model", model, "--seq", str(SEQ)]
    cmd += ["--micro-batch", ",".join(map(str, mbs)), "--dtype", "bf16", "--repeats", "10", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        print(f"profile {model} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2500:]}")
        return None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where a GPU session writes gpu_runs.csv and runs.tar.gz")
    p.add_argument("--from-data", type=Path, metavar="DIR", help="re-predict the runs stored in DIR (no GPU)")
    p.add_argument("--cluster", default="dgx-h100")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs=3, metavar=("MODEL", "MB", "M"), help="one configuration")
    p.add_argument("--profile", action="store_true", help="also predict from a measured layer profile")
    args = p.parse_args()
    if args.from_data:
        return from_data(args.from_data, args.cluster)
    if args.out is None:
        p.error("give --out DIR (a GPU session) or --from-data DIR")
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device here; this benchmark launches on a GPU", file=sys.stderr)
        return 2
    from planner.plan import save_plan

    args.out.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="stratagem-gpu-runs-")) / "runs"  # plans + metrics, then runs.tar.gz
    runs.mkdir()
    rows = []
    measured_profiles: dict[str, Path | None] = {}
    header = f"{'model':<22} {'mb':>3} {'m':>2} {'measured':>9} {'predicted':>9} {'error':>7}"
    header += f" {'from layer profile':>18} {'error':>7} {'peak GiB':>8} {'pred GiB':>8}"
    print(header)
    configs = QUICK if args.quick else CONFIGS
    if args.only:
        configs = [(args.only[0], int(args.only[1]), int(args.only[2]))]
    for model, mb, m in configs:
        name = f"{model.split(':')[1].replace('@', '_').replace('=', '')}_mb{mb}_m{m}"
        plan, est = predict(model, mb, m, args.cluster)
        plan = plan.model_copy(update={"predictions": est.to_predictions()})
        plan_path = save_plan(plan, runs / f"{name}.json")
        summary = launch(plan_path, runs / f"{name}.jsonl", args.steps)
        if not summary:
            continue
        meas = summary["measured_step_time_s"]
        prof_pred = None
        if args.profile:
            if model not in measured_profiles:
                mbs = sorted({b for mo, b, _ in CONFIGS if mo == model})
                measured_profiles[model] = profile_model(model, mbs, runs / f"{model.split(':')[1]}-profile.json")
            if measured_profiles[model] is not None:
                prof_pred = predict(model, mb, m, args.cluster, measured_profiles[model])[1].step_time_s
        row = dict(
            model=model,
            micro_batch=mb,
            micro_batches=m,
            seq=SEQ,
            measured_step_s=meas,
            predicted_step_s=est.step_time_s,
            error=est.step_time_s / meas - 1,
            predicted_from_layer_profile_s=prof_pred,
            measured_peak_bytes=summary.get("measured_peak_memory_bytes"),
            predicted_peak_bytes=est.peak_memory_bytes,
            gpu=torch.cuda.get_device_name(0),
            torch=torch.__version__,
        )
        rows.append(row)
        pe = f"{prof_pred:18.4f} {prof_pred / meas - 1:+7.1%}" if prof_pred else f"{'':18} {'':7}"
        peak = (row["measured_peak_bytes"] or 0) / 2**30
        with tarfile.open(args.out / "runs.tar.gz", "w:gz") as tar:  # after every run: a timeout keeps the rest
            tar.add(runs, arcname="runs")
        print(
            f"{model:<22} {mb:3d} {m:2d} {meas:9.4f} {est.step_time_s:9.4f} {row['error']:+7.1%} {pe} "
            f"{peak:8.2f} {est.peak_memory_bytes / 2**30:8.2f}"
        )
    if rows:
        errs = [abs(r["error"]) for r in rows]
        print(f"{len(rows)} runs: mean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%} (uncalibrated)")
        with open(args.out / "gpu_runs.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
