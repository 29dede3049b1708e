"""Rank worker of the reshard matrix: write checkpoints under some plans, resume them under others.

``python benchmarks/reshard_worker.py SPEC.json`` on every rank (torchrun, or ``tests/runtime_helpers.spawn_ranks``).
SPEC holds
``{"save": [{"plan": P, "out": DIR}], "resume": [{"plan": P, "checkpoint": STEP_DIR, "out": DIR}], "steps": N,
"at": K}``:

- **save**: ``run_plan`` trains P for N steps without a stop, writing a checkpoint every K steps under
  ``DIR/ckpt`` and its losses to ``DIR/metrics.jsonl`` (the run that never stopped).
- **resume**: a fresh job of plan P loads the step-K checkpoint STEP_DIR (written under another plan) and saves
  what it loaded under P's own layout to ``DIR/loaded`` (so a single process can compare it, tensor by tensor, with
  the checkpoint it came from); then ``run_plan --resume`` trains P from step K + 1 to N, losses to
  ``DIR/metrics.jsonl``.

One process group serves every entry of one world size (the process start and imports are most of a tiny plan's
run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from planner.plan import load_plan
from runtime.executor.checkpoint import checkpoint_meta, load_checkpoint, save_checkpoint
from runtime.executor.tied import tied_aliases
from runtime.executor.train import build_job, init_distributed, parse_args, run_plan


def _save(entry: dict, steps: int, at: int, device) -> None:
    out = Path(entry["out"])
    argv = ["--plan", entry["plan"], "--steps", str(steps), "--checkpoint-every", str(at)]
    argv += ["--checkpoint-dir", str(out / "ckpt")]
    run_plan(load_plan(entry["plan"]), parse_args(argv), device, metrics_path=str(out / "metrics.jsonl"))


def _resume(entry: dict, steps: int, at: int, device) -> None:
    out, plan = Path(entry["out"]), load_plan(entry["plan"])
    run_dir = out / "ckpt"
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        link = run_dir / Path(entry["checkpoint"]).name
        if not link.exists():
            link.symlink_to(Path(entry["checkpoint"]).resolve(), target_is_directory=True)
    dist.barrier()
    job = build_job(plan, device, data="synthetic")
    aliases = tied_aliases(plan)
    step = load_checkpoint(run_dir / Path(entry["checkpoint"]).name, job.modules, job.optimizers, aliases=aliases)
    assert step == at, (step, at)
    save_checkpoint(
        out / "loaded", step, job.modules, job.optimizers, meta=checkpoint_meta(plan, dist.get_world_size())
    )
    del job
    argv = ["--plan", entry["plan"], "--steps", str(steps), "--resume", "--checkpoint-dir", str(run_dir)]
    run_plan(plan, parse_args(argv), device, metrics_path=str(out / "metrics.jsonl"))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    device = init_distributed(60.0)
    for entry in spec.get("save", []):
        _save(entry, spec["steps"], spec["at"], device)
        dist.barrier()
    for entry in spec.get("resume", []):
        _resume(entry, spec["steps"], spec["at"], device)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
