"""Measured step time and peak memory of `stratagem launch` next to the plan's predictions.

    python benchmarks/runtime_vs_prediction.py                 # plan + launch gpt:tiny, 2 CPU ranks
    python benchmarks/runtime_vs_prediction.py a.json b.json   # launch existing plan files

Without plan files, ``stratagem plan`` is run once per restriction of the search (``--allow dp``,
``tp``, ``pp``) for gpt:tiny on the shipped ``local-cpu-2core`` cluster profile, so each
layout comes with the cost model's prediction. Each plan is launched for ``--steps`` steps; the
measured figure is the median step time over steps 2.. (the first is warm-up). On CPU the measured
peak memory is the growth of the process RSS while the plan ran (runtime/executor/metrics.py), which
also holds allocator slack and gloo buffers, so it bounds the prediction from above rather than
matching it. This host's CPU steal makes single timings vary 2-5x
(shared/notes/torch-distributed-on-cpu.md); run it more than once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALLOW_SETS = ["dp", "tp", "pp"]


def _stratagem(*args: str, timeout_s: float = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "planner.cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise SystemExit(f"stratagem {args[0]} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")


def make_plans(folder: Path, *, gpus: int, global_batch: int, seq: int) -> list[Path]:
    paths = []
    for allow in ALLOW_SETS:
        out = folder / f"plan_{allow.replace(',', '_')}.json"
        _stratagem("plan", "--model", "gpt:tiny", "--model-profile", str(REPO / "profiles/models/gpt-tiny.json"),
                   "--cluster", str(REPO / "profiles/hardware/local-cpu-2core.json"), "--gpus", str(gpus),
                   "--global-batch", str(global_batch), "--seq", str(seq), "--dtype", "fp32", "--allow", allow,
                   "--out", str(out))
        paths.append(out)
    return paths


def measure(plan_path: Path, folder: Path, steps: int) -> dict:
    metrics = folder / (plan_path.stem + ".jsonl")
    _stratagem("launch", str(plan_path), "--steps", str(steps), "--metrics", str(metrics), "--timeout-s", "600")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    summary = records[-1]
    return {"plan": plan_path.stem, "mesh": start["mesh"], "schedule": start["schedule"],
            "zero": start["zero_stage"], **summary}


def _fmt(v, scale=1.0, unit="") -> str:
    return "n/a" if v is None else f"{v * scale:.4g}{unit}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plans", nargs="*", type=Path)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rt-vs-pred-") as tmp:
        folder = Path(tmp)
        plans = args.plans or make_plans(folder, gpus=args.gpus, global_batch=args.global_batch, seq=args.seq)
        rows = [measure(path, folder, args.steps) for path in plans]
    print(f"{'plan':<16} {'mesh pp/dp/tp':<14} {'sched':<6} {'zero':<4} {'pred step':>10} {'meas step':>10} "
          f"{'meas/pred':>9} {'pred mem':>10} {'meas peak':>10}")
    for r in rows:
        mesh = "/".join(str(r["mesh"][a]) for a in ("pp", "dp", "tp"))
        print(f"{r['plan']:<16} {mesh:<14} {r['schedule']:<6} {r['zero']:<4} "
              f"{_fmt(r['predicted_step_time_s'], 1e3, ' ms'):>10} {_fmt(r['measured_step_time_s'], 1e3, ' ms'):>10} "
              f"{_fmt(r['step_time_ratio'], 1, 'x'):>9} {_fmt(r['predicted_peak_memory_bytes'], 2**-20, ' MiB'):>10} "
              f"{_fmt(r['measured_peak_memory_bytes'], 2**-20, ' MiB'):>10}")


if __name__ == "__main__":
    main()
