"""torchrun worker for tests/test_init_from.py: one step of each plan, started from its checkpoint folder.

``python -m torch.distributed.run ... tests/init_from_worker.py OUT_DIR PLAN=FOLDER...``: for each pair,
``run_plan`` (as ``runtime.executor.train`` runs it, with ``--init-from FOLDER``) trains one step and writes its
metrics to ``OUT_DIR/<plan>.jsonl``. One launch serves every model and layout of the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from planner.plan import load_plan
from runtime.executor.train import init_distributed, parse_args, run_plan


def main(out_dir: str, pairs: list[str]) -> None:
    device = init_distributed(60.0)
    for pair in pairs:
        path, folder = pair.split("=", 1)
        args = parse_args(["--plan", path, "--steps", "1"])
        metrics = str(Path(out_dir) / f"{Path(path).stem}.jsonl")
        run_plan(load_plan(path), args, device, metrics_path=metrics, init_from=folder)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
