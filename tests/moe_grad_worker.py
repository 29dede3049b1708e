"""torchrun worker for tests/test_moe_parity.py: each plan's step-1 gradients on every rank, then training.

``python -m torch.distributed.run ... tests/moe_grad_worker.py OUT_DIR STEPS PLAN...``: for each plan, build
the job as ``runtime.executor.train`` does, run one step's forward/backward and the gradient syncs (no
optimizer step), save ``{parameter path: gradient}`` of what this rank holds (DTensors made whole) to
``OUT_DIR/<plan>.rank<r>.pt``, then train a fresh job ``STEPS`` steps with ``runtime.executor.train``'s
``run_plan`` (metrics in ``OUT_DIR/<plan>.jsonl``, layout reports in ``OUT_DIR/<plan>/``). Expert
parameters keep their global paths (``blocks.1.moe.experts.3.w1.weight``), so the test compares every
rank's gradients with a single process's by name. AdamW is invariant to a parameter's gradient scale,
so loss parity alone cannot see a wrong gradient factor (e.g. expert gradients not divided by dp).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from planner.plan import load_plan
from runtime.executor.train import build_job, init_distributed, parse_args, run_plan


def main(out_dir: str, steps: int, plans: list[str]) -> None:
    device = init_distributed(60.0)
    rank, out = dist.get_rank(), Path(out_dir)
    for path in plans:
        plan = load_plan(path)
        job = build_job(plan, device, data="synthetic")
        job.runner.step(job.data(1).rows(*job.rows).to(device))
        for chunk in job.chunks:
            if chunk.replica_sync is not None:
                chunk.replica_sync.sync()
            if chunk.expert_sync is not None:
                chunk.expert_sync.sync()
        grads = {}
        for chunk in job.chunks:
            groups = chunk.expert_sync.groups if chunk.expert_sync is not None else None
            for name, p in chunk.module.named_parameters():
                g = p.grad
                if g is None:
                    continue
                g = (g.full_tensor() if isinstance(g, DTensor) else g).detach()
                if groups is not None and groups.etp > 1 and ".moe.experts." in name:
                    g = _whole_expert_ffn(name, g, groups)
                grads[name.replace("_checkpoint_wrapped_module.", "")] = g
        stem = Path(path).stem
        torch.save(grads, out / f"{stem}.rank{rank}.pt")
        dist.barrier()
        args = parse_args(["--plan", path, "--steps", str(steps)])
        run_plan(plan, args, device, metrics_path=str(out / f"{stem}.jsonl"), report_dir=str(out / stem))
        dist.barrier()
    dist.destroy_process_group()


def _whole_expert_ffn(name: str, grad: torch.Tensor, groups) -> torch.Tensor:
    """An expert-TP shard's gradient gathered over the etp group: w1/w3 rows, w2 columns."""
    parts = [torch.empty_like(grad) for _ in range(groups.etp)]
    dist.all_gather(parts, grad.contiguous(), group=groups.etp_group)
    return torch.cat(parts, dim=1 if name.endswith("w2.weight") else 0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
