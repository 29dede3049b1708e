"""Shared by the runtime tests: ``runtime.executor.train`` (or a test worker) on several ranks, every wait bounded."""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


RANK_GRACE_S = 10.0  # after one rank fails, how long the others get to fail or finish on their own


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Zygote:
    """Client of one ``tests/rank_zygote.py`` server (a process that imported torch once and forks ranks)."""

    def __init__(self, hash_seed: int):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONHASHSEED": str(hash_seed)}
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "rank_zygote.py")],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = False

    def ask(self, request: dict) -> dict:
        if not self.ready:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"tests/rank_zygote.py did not start (exit {self.proc.wait()})")
            self.ready = True
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/rank_zygote.py ended (exit {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"tests/rank_zygote.py: {reply['error']}")
        return reply


_ZYGOTES: list[_Zygote] = []


def _zygotes() -> list[_Zygote]:
    """Two servers with different hash seeds, started on first use and ended with the test session."""
    if not _ZYGOTES:
        seeds = random.Random().sample(range(1, 2**31), 2)
        _ZYGOTES.extend(_Zygote(seed) for seed in seeds)
        atexit.register(lambda: [z.proc.stdin.close() for z in _ZYGOTES])
    return _ZYGOTES


class _ForkedRank:
    """One rank forked by a zygote, with the part of ``subprocess.Popen`` that :func:`spawn_ranks` uses."""

    def __init__(self, zygote: _Zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.ask({"poll": self.pid})["code"]
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode


def _start_rank(rank: int, argv: list[str], env: dict, out_path: str, err_path: str, out, err):
    """Rank ``rank`` as ``python argv``: forked from a zygote (``tests/rank_zygote.py``), or a fresh interpreter
    where ``STRATAGEM_TEST_FRESH_RANKS=1``."""
    if os.environ.get("STRATAGEM_TEST_FRESH_RANKS") == "1":
        return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=out, stderr=err, text=True)
    zygote = _zygotes()[rank % 2]
    request = {"argv": argv, "env": env, "cwd": str(REPO), "stdout": out_path, "stderr": err_path}
    return _ForkedRank(zygote, zygote.ask({"spawn": request})["pid"])


def spawn_ranks(
    nproc: int, argv: list[str], *, timeout_s: float, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python argv`` as ``nproc`` ranks on this machine with the environment torchrun gives its workers (rank,
    world size, a free rendezvous port on 127.0.0.1, restart count 0), without torchrun's agent: its start-up and
    rendezvous cost about 3 s per launch, which the tests of what runs inside the ranks need not pay (the tests
    of ``stratagem launch`` run the real torchrun). Each rank is forked from a process that has imported torch
    and the runtime already (``tests/rank_zygote.py``: 3.5 s of CPU per rank saved; ``STRATAGEM_TEST_FRESH_RANKS=1``
    starts fresh interpreters instead). One thread each; at most ``timeout_s`` in all, then every
    rank is killed and ``subprocess.TimeoutExpired`` raised; when a rank fails, the others get ``RANK_GRACE_S``
    (a rank left waiting on a collective would wait for its timeout). The result's stdout and stderr are the
    ranks' in rank order; its return code the first non-zero one."""
    port = _free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        for rank in range(nproc):
            rank_env = {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
            }
            out = open(Path(tmp) / f"{rank}.out", "w+")
            err = open(Path(tmp) / f"{rank}.err", "w+")
            logs.append((out, err))
            procs.append(_start_rank(rank, argv, rank_env, out.name, err.name, out, err))
        deadline = time.monotonic() + timeout_s
        failed_at = None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + RANK_GRACE_S):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for out, err in logs:
            out.seek(0), err.seek(0)
            texts.append((out.read(), err.read()))
            out.close(), err.close()
    stdout = "".join(o for o, _ in texts)
    stderr = "".join(e for _, e in texts)
    if time.monotonic() > deadline:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout_s, output=stdout, stderr=stderr)
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)


def torchrun(
    nproc: int, train_args: list[str], *, timeout_s: float, env: dict | None = None, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """``runtime.executor.train`` on ``nproc`` ranks on this machine (gloo, one thread each), waiting at most
    ``timeout_s``: under torchrun with ``max_restarts``, else started directly (:func:`spawn_ranks`)."""
    if not max_restarts:
        return spawn_ranks(nproc, ["-m", "runtime.executor.train", *train_args], timeout_s=timeout_s, env=env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", str(max_restarts), "-m", "runtime.executor.train", *train_args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)


def tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def resume_runs(
    nproc: int, out_dir: Path, plans: list[str], *, first: int, last: int, full: bool = False, timeout_s: float
) -> None:
    """``tests/resume_worker.py`` on ``nproc`` ranks: each plan trained to ``first`` with checkpoints, then resumed
    in a fresh job to ``last`` (``full``: an uninterrupted run to ``last`` first); metrics beside the plans."""
    argv = [str(REPO / "tests" / "resume_worker.py"), str(out_dir), str(first), str(last)]
    argv += [*(["--full"] if full else []), *plans]
    proc = spawn_ranks(nproc, argv, timeout_s=timeout_s, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, tail(proc)
