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
