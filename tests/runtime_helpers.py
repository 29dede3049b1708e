"""Shared by the runtime tests: run ``runtime.executor.train`` under torchrun with a bounded wait."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(
    nproc: int, train_args: list[str], *, timeout_s: float, env: dict | None = None, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """Start ``nproc`` ranks on this machine (gloo, one thread each) and wait at most ``timeout_s``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    cmd += ["-m", "runtime.executor.train", *train_args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)


def tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def resume_runs(
    nproc: int, out_dir: Path, plans: list[str], *, first: int, last: int, full: bool = False, timeout_s: float
) -> None:
    """``tests/resume_worker.py`` on ``nproc`` ranks: each plan trained to ``first`` with checkpoints, then resumed
    in a fresh job to ``last`` (``full``: an uninterrupted run to ``last`` first); metrics beside the plans."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(REPO / "tests" / "resume_worker.py"), str(out_dir), str(first), str(last)]
    cmd += [*(["--full"] if full else []), *plans]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, tail(proc)
