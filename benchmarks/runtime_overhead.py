"""Step time of `stratagem launch` against a hand-written DDP loop on the same model and batch.

    python benchmarks/runtime_overhead.py [--model gpt:small] [--steps 20] [--global-batch 16] [--seq 64]

Both run 2 CPU ranks under torchrun with gloo, AdamW, fp32 and the same synthetic data; the runtime
side is a DP2 plan (``replicate``, zero 0). The figure is the median step time over steps 3..N (the
max over ranks per step in both), and the overhead is runtime / hand-written - 1. CPU steal on this
host makes single runs vary; run it a few times before trusting a difference under ~20%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # fixtures/ (hand-made plans) lives at the repository root
WARMUP_STEPS = 2


def ddp_worker(args: argparse.Namespace) -> None:
    """The hand-written loop (one rank): DDP + AdamW over this rank's half of each global batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from planner.model import parse_model
    from runtime.executor.data import synthetic_batch
    from runtime.models import build_model, init_weights, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))  # a hung rank fails, not waits 30 min
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_model(args.model)
    model = build_model(spec, device="meta")
    model.to_empty(device="cpu")
    model = DistributedDataParallel(init_weights(model, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn, per_rank, times = loss_fn(spec), args.global_batch // world, []
    for step in range(1, args.steps + 1):
        batch = synthetic_batch(spec, batch=args.global_batch, seq_len=args.seq, seed=0, step=step)
        x, y = (
            batch.inputs[rank * per_rank : (rank + 1) * per_rank],
            batch.targets[rank * per_rank : (rank + 1) * per_rank],
        )
        t0 = time.perf_counter()
        fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900
    )
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt:small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return ddp_worker(args)

    from fixtures.plans import make_plan
    from planner.model import parse_model
    from planner.plan import save_plan
    from runtime.executor.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="rt-overhead-") as tmp:
        folder = Path(tmp)
        plan = make_plan(parse_model(args.model), dp=2, global_batch=args.global_batch, seq_len=args.seq)
        plan_path = save_plan(plan, folder / "plan.json")
        _run(
            [
                sys.executable,
                "-m",
                "planner.cli.main",
                "launch",
                str(plan_path),
                "--steps",
                str(args.steps),
                "--metrics",
                str(folder / "m.jsonl"),
            ]
        )
        ours = [r["step_time_s"] for r in read_metrics(folder / "m.jsonl") if r["event"] == "step"]
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(Path(__file__).resolve()),
                "--worker",
                "--model",
                args.model,
                "--steps",
                str(args.steps),
                "--global-batch",
                str(args.global_batch),
                "--seq",
                str(args.seq),
                "--out",
                str(folder / "ddp.json"),
            ]
        )
        ddp = json.loads((folder / "ddp.json").read_text())
    ours_s, ddp_s = statistics.median(ours[WARMUP_STEPS:]), statistics.median(ddp[WARMUP_STEPS:])
    print(
        f"{args.model}, DP2 on CPU/gloo, global batch {args.global_batch} x seq {args.seq}, "
        f"median of steps {WARMUP_STEPS + 1}..{args.steps}:"
    )
    print(f"  stratagem launch (replicate): {ours_s * 1e3:8.2f} ms/step")
    print(f"  hand-written DDP loop:        {ddp_s * 1e3:8.2f} ms/step")
    print(f"  overhead: {100 * (ours_s / ddp_s - 1):+.1f}%")


if __name__ == "__main__":
    main()
