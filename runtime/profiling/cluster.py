"""Measure a cluster: launch the torchrun worker (:mod:`runtime.profiling.cluster_bench`), collect its raw timings,
fit alpha-beta lines (:mod:`planner.profile.alphabeta`) and build a :class:`planner.profile.load.ClusterProfile`.

The run is bounded: past ``timeout_s`` the whole torchrun process group is killed. A failing rank, a
torchrun error or a timeout raise a one-line :class:`StratagemError`; no profile is built then.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner import __version__
from planner.core import StratagemError, read_json
from planner.profile import (
    BlockingLatency,
    ClusterProfile,
    CollectiveFit,
    CollectiveSample,
    ComputeFigure,
    NodeGroup,
    NodeType,
    Provenance,
    fit_alpha_beta,
)

log = logging.getLogger(__name__)
WORKER = Path(__file__).with_name("cluster_bench.py")
ProgressFn = Callable[[int, int, str], None]


# ------------------------------------------------------------------------------------------ raw results
# What the worker's rank 0 writes and this process reads (a file boundary, hence pydantic).


class _Raw(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RawSample(_Raw):
    bytes: int = Field(ge=0)
    times_s: list[float] = Field(min_length=1, description="one value per repeat (median of its iterations)")


class RawCollective(_Raw):
    op: str
    level: str
    n_ranks: int = Field(ge=2)
    samples: list[RawSample]


class RawCompute(_Raw):
    dtype: str
    matrix_n: int = Field(ge=1)
    flops_per_matmul: float = Field(gt=0)
    times_s: list[float] = Field(min_length=1)


class RawBench(_Raw):
    """What rank 0 hands to the parent: raw timings plus the facts about the machine."""

    world_size: int
    nnodes: int
    nproc_per_node: int
    backend: str
    device_name: str
    device_memory_bytes: int
    device_memory_source: str
    torch_version: str
    host: str
    cpu_steal_fraction: float | None = Field(None, description="steal / total CPU time during the run")
    load_avg_1m: float | None = Field(None, description="1-minute load average when the run started")
    not_measured: list[str] = Field(default_factory=list, description="levels that could not be measured")
    collectives: list[RawCollective]
    compute: list[RawCompute]
    wall_s: float
    sync_latency: dict[str, float] | None = Field(
        None, description="per-call latency after compute, op -> s (runtime/profiling/sync_latency.py; CPU)"
    )


# ------------------------------------------------------------------------------------------ launching


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterBenchConfig:
    """How to launch the benchmark: topology, message sizes, repetitions and the overall time bound."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0; required when nnodes > 1
    sizes_bytes: tuple[int, ...]
    repeats: int = 3
    iters: int = 10
    timeout_s: float = 300.0


def build_torchrun_command(cfg: ClusterBenchConfig, raw_path: Path) -> list[str]:
    """``python -m torch.distributed.run`` arguments: --standalone on one node, static rendezvous otherwise."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc_per_node}"]
    if cfg.nnodes == 1:
        cmd.append("--standalone")  # picks a free port itself (shared notes: gloo gotchas)
    else:
        host, _, port = (cfg.rdzv_endpoint or "").rpartition(":")
        if not host or not port.isdigit():
            raise StratagemError(
                f"--rdzv-endpoint {cfg.rdzv_endpoint!r} is not HOST:PORT; with --nnodes "
                f"{cfg.nnodes} give node 0's address, e.g. --rdzv-endpoint 10.0.0.1:29500"
            )
        cmd += [
            f"--nnodes={cfg.nnodes}",
            f"--node-rank={cfg.node_rank}",
            f"--master-addr={host}",
            f"--master-port={port}",
        ]
    cmd += [
        str(WORKER),
        f"--raw-out={raw_path}",
        "--sizes=" + ",".join(map(str, cfg.sizes_bytes)),
        f"--repeats={cfg.repeats}",
        f"--iters={cfg.iters}",
        f"--timeout-s={cfg.timeout_s}",
    ]
    return cmd


def _pump(stream, tag: str, out: queue.Queue) -> None:
    for line in stream:
        out.put((tag, line.rstrip("\n")))
    out.put((tag, None))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the torchrun process group, then SIGKILL what is left after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _failure_line(lines: list[str], returncode: int) -> str:
    """The worker's own ``@@error`` line if one came, else torchrun's last informative line."""
    for line in lines:
        if line.startswith("@@error "):
            return line.removeprefix("@@error ")
    for line in reversed(lines):
        text = line.strip()
        if text and not set(text) <= set("-=*[] "):
            return text[:300]
    return f"torchrun exited with status {returncode}"


def _follow(proc: subprocess.Popen, lines: queue.Queue, timeout_s: float, on_progress: ProgressFn | None) -> list[str]:
    """Consume torchrun's output until it exits; progress lines go to ``on_progress``. Returns stderr."""
    deadline, open_streams, err_lines = time.monotonic() + timeout_s, 2, []
    while open_streams or proc.poll() is None:
        if time.monotonic() > deadline:
            raise StratagemError(
                f"cluster profiling did not finish within --timeout-s {timeout_s:g}; "
                f"raise --timeout-s, or use --quick / fewer --sizes"
            )
        try:
            tag, line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line is None:
            open_streams -= 1
        elif line.startswith("@@progress ") and on_progress is not None:
            done, total, label = line.split(" ", 3)[1:]
            on_progress(int(done), int(total), label)
        else:
            log.debug("torchrun %s: %s", tag, line)
            if tag == "err":
                err_lines.append(line)
    return err_lines


def _run_bounded(cmd: list[str], timeout_s: float, on_progress: ProgressFn | None) -> None:
    """Run torchrun in its own process group; one-line error on failure; kill the group on timeout/^C."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log.info("running %s", " ".join(cmd))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    lines: queue.Queue = queue.Queue()
    for stream, tag in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=_pump, args=(stream, tag, lines), daemon=True).start()
    try:
        err_lines = _follow(proc, lines, timeout_s, on_progress)
    except BaseException:  # timeout, Ctrl-C: the workers live in their own session, so end them here
        _kill_group(proc)
        raise
    if proc.wait() != 0:
        raise StratagemError(
            f"cluster benchmark failed: {_failure_line(err_lines, proc.returncode)}; "
            f"fix the failing rank (run with -v for torchrun's log) and re-run"
        )


def run_cluster_bench(cfg: ClusterBenchConfig, on_progress: ProgressFn | None = None) -> RawBench | None:
    """Launch the worker on this node and return rank 0's raw results (None on nodes other than node 0)."""
    if cfg.nproc_per_node < 1 or cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        raise StratagemError(
            f"bad topology: --nproc-per-node {cfg.nproc_per_node}, --nnodes {cfg.nnodes}, "
            f"--node-rank {cfg.node_rank}; need >= 1, >= 1 and 0 <= node-rank < nnodes"
        )
    if cfg.nproc_per_node * cfg.nnodes < 2:
        raise StratagemError(
            "a cluster profile needs at least 2 ranks to time collectives; use --nproc-per-node 2 (or more nodes)"
        )
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as tmp:
        raw_path = Path(tmp) / "raw.json"
        _run_bounded(build_torchrun_command(cfg, raw_path), cfg.timeout_s, on_progress)
        if cfg.node_rank != 0:
            return None
        data = read_json(raw_path, what="raw benchmark")
    try:
        return RawBench.model_validate(data)
    except ValidationError as exc:
        raise StratagemError(
            f"the benchmark worker wrote malformed results ({exc.errors()[0]['msg']}); "
            f"this is a bug, re-run with -v and report it"
        ) from None


def _fit(coll, source: str) -> CollectiveFit:
    fit = fit_alpha_beta(coll.op, coll.n_ranks, [(s.bytes, s.times_s) for s in coll.samples])
    return CollectiveFit(
        op=coll.op,
        level=coll.level,
        n_ranks=coll.n_ranks,
        alpha_s=fit.alpha_s,
        bus_bw_bytes_per_s=fit.bus_bw_bytes_per_s,
        origin="measured",
        fit_r2=fit.r2,
        source=source
        + (
            ""
            if fit.weighting == "relative"
            else "; fitted by absolute-error least squares (relative-error fit had no positive slope)"
        ),
        fit_max_rel_err=fit.max_rel_err,
        run_cv=fit.run_cv,
        samples=[CollectiveSample(bytes=s.bytes, times_s=s.times_s) for s in coll.samples],
    )


def _compute_figure(c, backend: str) -> ComputeFigure:
    rates = [c.flops_per_matmul / t for t in c.times_s]
    return ComputeFigure(
        dtype=c.dtype,
        peak_flops_per_s=max(rates),
        achieved_flops_per_s=statistics.median(rates),
        origin="measured",
        source=f"torch.mm {c.matrix_n}x{c.matrix_n} {c.dtype} timed on rank 0 while every rank ran it"
        f"{' (1 CPU thread per rank)' if backend == 'gloo' else ''}; FLOPs = 2n^3; "
        f"peak = best of {len(rates)}, achieved = median",
    )


def _notes(raw: RawBench) -> str:
    notes = [f"not measured: {m}" for m in raw.not_measured]
    if raw.cpu_steal_fraction is not None:
        notes.append(
            f"CPU steal during the run {100 * raw.cpu_steal_fraction:.1f}% (from /proc/stat); on "
            f"shared VMs timings vary 2-5x between runs (measured for this project on 2-core VMs)"
        )
    if raw.load_avg_1m is not None:
        notes.append(f"load average {raw.load_avg_1m:.1f} at the start (other processes compete for the CPUs)")
    notes.append(f"benchmark wall time {raw.wall_s:.1f} s")
    return "; ".join(notes)


def _blocking_latency(raw: RawBench) -> BlockingLatency | None:
    """The node's after-compute collective latency (CPU ranks), or None when it was not measured."""
    if not raw.sync_latency or "functional_all_reduce" not in raw.sync_latency:
        return None
    others = ", ".join(f"{op} {s * 1e3:.2f} ms" for op, s in raw.sync_latency.items() if op != "functional_all_reduce")
    fsdp_ops = [raw.sync_latency[op] for op in ("all_gather", "reduce_scatter") if op in raw.sync_latency]
    return BlockingLatency(
        functional_collective_s=raw.sync_latency["functional_all_reduce"],
        plain_collective_s=statistics.mean(fsdp_ops) if fsdp_ops else None,
        source=(
            f"runtime/profiling/sync_latency.py in stratagem profile cluster: {raw.nproc_per_node} {raw.backend} "
            f"ranks, 4 matmuls of 192^2 then one 1 KiB funcol all_reduce per iteration, median minus the "
            f"median without it, slowest rank; plain c10d: {others} (plain_collective_s = the mean of "
            f"all_gather and reduce_scatter, FSDP2's ZeRO-3 calls)"
        ),
    )


def build_cluster_profile(
    raw: RawBench, *, name: str, command: str, created_utc: str, cfg: ClusterBenchConfig
) -> ClusterProfile:
    """Fit every (op, level) and assemble the profile; inter-node fits only if they were measured."""
    source = (
        f"measured by stratagem profile cluster: {raw.backend}, {raw.nnodes} node(s) x "
        f"{raw.nproc_per_node} ranks, per-iteration median of <= {cfg.iters} iterations, "
        f"{cfg.repeats} repeats, slowest rank counts; send_recv = half a ping-pong"
    )
    fits = [_fit(c, source) for c in raw.collectives if c.samples]
    node = NodeType(
        name=name,
        device=raw.device_name,
        devices_per_node=raw.nproc_per_node,
        device_memory_bytes=raw.device_memory_bytes,
        device_memory_source=raw.device_memory_source,
        compute=[_compute_figure(c, raw.backend) for c in raw.compute],
        intra_node=[f for f in fits if f.level == "intra_node"],
        blocking_latency=_blocking_latency(raw),
    )
    return ClusterProfile(
        name=name,
        description=f"{raw.nnodes} x {raw.nproc_per_node} ranks on {raw.device_name} ({raw.backend}), measured",
        node_types=[node],
        nodes=[NodeGroup(node_type=name, count=raw.nnodes)],
        inter_node=[f for f in fits if f.level == "inter_node"],
        provenance=Provenance(
            method="measured",
            tool=f"stratagem {__version__}",
            created_utc=created_utc,
            torch_version=raw.torch_version,
            device_name=raw.device_name,
            host=raw.host,
            command=command,
            notes=_notes(raw),
        ),
    )
