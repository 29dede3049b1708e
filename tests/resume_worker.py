"""torchrun worker: train each plan FIRST steps with checkpoints, then resume it in a fresh job up to LAST.

``python -m torch.distributed.run ... tests/resume_worker.py OUT_DIR FIRST LAST [--full] PLAN...``: for each plan,
``run_plan`` (as ``runtime.executor.train`` runs it) trains steps 1..FIRST, writing ``OUT_DIR/<plan>.run1.jsonl``
and a checkpoint after every step under ``OUT_DIR/<plan>.ckpt``; a second ``run_plan`` with ``--resume`` builds a
fresh job (freshly initialised weights), loads the step-FIRST checkpoint through DCP and trains to step LAST
(``OUT_DIR/<plan>.run2.jsonl``). ``--full``: first an uninterrupted run to LAST (``OUT_DIR/<plan>.full.jsonl``).
One launch serves several plans (the process start and imports are most of a small plan's launch); a
checkpoint that loads nothing, or loads one rank's shard on its peers, changes the resumed steps' losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from planner.plan import load_plan
from runtime.executor.train import init_distributed, parse_args, run_plan


def main(out_dir: str, first: int, last: int, full: bool, plans: list[str]) -> None:
    device = init_distributed(60.0)
    out = Path(out_dir)
    for path in plans:
        plan, stem = load_plan(path), Path(path).stem
        ckpt = ["--checkpoint-dir", str(out / f"{stem}.ckpt")]
        runs = [("full", ["--steps", str(last)])] if full else []
        runs += [("run1", ["--steps", str(first), "--checkpoint-every", "1", *ckpt])]
        runs += [("run2", ["--steps", str(last), "--resume", *ckpt])]
        for name, argv in runs:
            run_plan(plan, parse_args(["--plan", path, *argv]), device, metrics_path=str(out / f"{stem}.{name}.jsonl"))
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rest = sys.argv[4:]
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "--full" in rest, [a for a in rest if a != "--full"])
