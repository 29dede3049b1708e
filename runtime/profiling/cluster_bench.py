"""torchrun worker of ``stratagem profile cluster``: times collectives and matrix multiply on this cluster.

Launched by :mod:`runtime.profiling.cluster` as ``python -m torch.distributed.run ... cluster_bench.py``.
Every rank takes part; rank 0 writes the raw timings (:class:`RawBench`) to ``--raw-out`` and the parent
process fits and writes the :class:`planner.profile.load.ClusterProfile`. The raw format is defined in
:mod:`runtime.profiling.cluster` so the parent can read it without importing torch.

Timing method ("per-iteration median", see docs/torch-distributed-on-cpu.md section 8): for each
(op, size), a few warm-up calls, then ``repeats`` repeats of up to ``iters`` iterations; each iteration is
preceded by a barrier and timed alone, the slowest rank's time counts (all_reduce MAX), and a repeat's value
is the median of its iterations. send_recv is a ping-pong between two ranks, timed as half the round trip
(the OSU micro-benchmarks' osu_latency convention). all_to_all is ``all_to_all_single`` with equal splits; its
message is one rank's whole send buffer, of which each peer gets 1/n (NCCL-tests ``alltoall_perf``, whose bus
bandwidth factor (n-1)/n ``planner.profile.alphabeta.bus_factor`` uses) — the expert-parallel dispatch and combine
of ``runtime.executor.moe``.

Rank 0 prints ``@@progress DONE TOTAL LABEL`` lines on stdout for the parent's progress bar; a failing rank
prints ``@@error rank R: ...`` on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from planner.core import atomic_write_text
from runtime.profiling.cluster import RawBench, RawCollective, RawCompute, RawSample

#: Test hook: the rank named here raises right after joining the process group (tests check that a
#: failing rank gives exit 2, one line, and no profile file).
FAIL_RANK_ENV = "STRATAGEM_BENCH_FAIL_RANK"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
_FP32_BYTES = 4
_TARGET_REPEAT_S = 0.25  # cap the iterations of one repeat to about this much wall time
_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------ machine facts


def read_cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies from the first line of /proc/stat, or None off Linux (proc(5))."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[7], sum(fields)  # user nice system idle iowait irq softirq steal


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return f"cpu ({os.cpu_count()} logical CPUs)"


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_facts(device: torch.device, nproc_per_node: int) -> tuple[str, int, str]:
    """(device name, memory bytes one rank may use, where that figure came from)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, int(props.total_memory), "torch.cuda.get_device_properties().total_memory"
    return (
        _cpu_model(),
        _ram_bytes() // nproc_per_node,
        f"physical RAM (sysconf) {_ram_bytes()} B / {nproc_per_node} ranks per node",
    )


# ------------------------------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_op(
    op: str, message_bytes: int, group, n: int, peer_ranks: tuple[int, int], device: torch.device
) -> tuple[Callable[[], None], int]:
    """A closure running one collective, and the message bytes it really moves (rounded to n floats)."""
    numel = max(n, message_bytes // _FP32_BYTES // n * n)
    rank = dist.get_rank()
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), numel * _FP32_BYTES
    if op == "all_gather":  # message = the gathered (output) tensor, as in CollectiveFit's convention
        return (lambda: dist.all_gather_single(full, part, group=group)), numel * _FP32_BYTES
    if op == "reduce_scatter":  # message = the full (input) tensor
        return (lambda: dist.reduce_scatter_single(part, full, group=group)), numel * _FP32_BYTES
    if op == "all_to_all":  # message = one rank's send buffer, numel / n elements to each rank
        received = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(received, full, group=group)), numel * _FP32_BYTES
    src, dst = peer_ranks

    def ping_pong() -> None:
        if rank == src:
            dist.send(full, dst)
            dist.recv(full, dst)
        elif rank == dst:
            dist.recv(full, src)
            dist.send(full, src)

    return ping_pong, numel * _FP32_BYTES


def _time_iters(fn: Callable[[], None], iters: int, group, device: torch.device, scale: float) -> list[float]:
    """Time ``iters`` calls one by one (barrier before each); the slowest rank's time per call."""
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times[i] = (time.perf_counter() - t0) * scale
    times = times.to(device)  # NCCL reduces only CUDA tensors
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.cpu().tolist()


def time_collective(
    op: str,
    message_bytes: int,
    *,
    group,
    n: int,
    peer_ranks: tuple[int, int],
    device: torch.device,
    repeats: int,
    iters: int,
    warmup: int,
) -> RawSample:
    """Per-iteration-median timing of one collective at one size (see the module docstring)."""
    fn, real_bytes = _make_op(op, message_bytes, group, n, peer_ranks, device)
    scale = 0.5 if op == "send_recv" else 1.0  # ping-pong: one-way time = half the round trip
    warm = _time_iters(fn, max(warmup, 1), group, device, scale)
    iters = max(1, min(iters, int(_TARGET_REPEAT_S / max(min(warm), 1e-9))))
    per_repeat = [statistics.median(_time_iters(fn, iters, group, device, scale)) for _ in range(repeats)]
    return RawSample(bytes=real_bytes, times_s=per_repeat)


CPU_MATRIX_SIZES = (1024, 768, 512, 384, 256)  # largest first; 1024 is the CPU default
_CPU_MATMUL_CALL_S = 0.25  # the most one timed CPU matmul may take


def cpu_matrix_n(dtype_name: str) -> int:
    """The largest of ``CPU_MATRIX_SIZES`` whose matmul in ``dtype_name`` takes at most 0.25 s on this CPU, from a
    timed 256^3 probe (time grows as n^3). A CPU without a fast path for a 16-bit type runs it at ~1 GFLOP/s
    (measured here: bf16 0.9 GFLOP/s against fp32 66 GFLOP/s), where one 1024^3 matmul takes 2.4 s; fp32 keeps 1024."""
    dtype = _TORCH_DTYPES[dtype_name]
    a = torch.randn(256, 256).to(dtype)
    torch.mm(a, a)  # warm-up
    t0 = time.perf_counter()
    torch.mm(a, a)
    probe_s = time.perf_counter() - t0
    fits = [n for n in CPU_MATRIX_SIZES if probe_s * (n / 256) ** 3 <= _CPU_MATMUL_CALL_S]
    return fits[0] if fits else CPU_MATRIX_SIZES[-1]


def time_matmul(dtype_name: str, n: int, *, device: torch.device, repeats: int) -> RawCompute:
    """Time an n x n x n matrix multiply; FLOPs = 2 n^3 (one multiply and one add per term)."""
    dtype = _TORCH_DTYPES[dtype_name]
    if device.type == "cuda":  # tf32 = fp32 inputs on tensor cores (torch.set_float32_matmul_precision docs)
        torch.set_float32_matmul_precision("high" if dtype_name == "tf32" else "highest")
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(repeats + 2):  # two warm-up calls
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return RawCompute(dtype=dtype_name, matrix_n=n, flops_per_matmul=2.0 * n**3, times_s=times)


# ------------------------------------------------------------------------------------------ main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--raw-out", required=True, help="where rank 0 writes the raw JSON")
    p.add_argument("--sizes", required=True, help="message sizes in bytes, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="most iterations per repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--matrix-n",
        type=int,
        default=0,
        help="matmul size (0: 8192 on GPU; on CPU 1024, less where a call would take over 0.25 s)",
    )
    p.add_argument("--timeout-s", type=float, default=300.0)
    return p.parse_args(argv)


def _progress(done: int, total: int, label: str) -> None:
    if dist.get_rank() == 0:
        print(f"@@progress {done} {total} {label}", flush=True)  # noqa: T201 - protocol line to the parent


def _plan_levels(world: int, nproc: int) -> tuple[list[tuple[str, list[list[int]]]], list[str]]:
    """Groups per link level: intra_node = each node's ranks; inter_node = local rank 0 of every node."""
    nnodes = world // nproc
    levels, missing = [], []
    if nproc >= 2:
        levels.append(("intra_node", [list(range(k * nproc, (k + 1) * nproc)) for k in range(nnodes)]))
    else:
        missing.append("intra_node (one rank per node)")
    if nnodes >= 2:
        levels.append(("inter_node", [[k * nproc for k in range(nnodes)]]))
    else:
        missing.append("inter_node (single node)")
    return levels, missing


def run_benchmarks(args: argparse.Namespace, device: torch.device) -> RawBench:
    """Every rank runs this; only rank 0's return value is written."""
    t_start = time.perf_counter()
    cpu0 = read_cpu_times()
    load_avg_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rank, world = dist.get_rank(), dist.get_world_size()
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    sizes = [int(s) for s in args.sizes.split(",")]
    levels, missing = _plan_levels(world, nproc)
    dtypes = ["fp32", "tf32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"]
    total = sum(len(OPS) * len(sizes) for _ in levels) + len(dtypes)
    done, results = 0, []
    for level, groups in levels:
        handles = [dist.new_group(g) for g in groups]  # every rank must create every group
        mine = [(g, h) for g, h in zip(groups, handles) if rank in g]
        for op in OPS:
            samples = []
            for size in sizes:
                if mine:
                    ranks, handle = mine[0]
                    samples.append(
                        time_collective(
                            op,
                            size,
                            group=handle,
                            n=len(ranks),
                            peer_ranks=(ranks[0], ranks[1]),
                            device=device,
                            repeats=args.repeats,
                            iters=args.iters,
                            warmup=args.warmup,
                        )
                    )
                done += 1
                _progress(done, total, f"{level} {op} {size} B")
            results.append(RawCollective(op=op, level=level, n_ranks=len(groups[0]), samples=samples))
        dist.barrier()
    compute = []
    for dtype_name in dtypes:
        matrix_n = args.matrix_n or (8192 if device.type == "cuda" else cpu_matrix_n(dtype_name))
        compute.append(time_matmul(dtype_name, matrix_n, device=device, repeats=max(3, args.repeats)))
        done += 1
        _progress(done, total, f"matmul {dtype_name}")
    sync = None
    if device.type == "cpu" and world == nproc:  # one node of CPU ranks: the cost model's BlockingLatency
        from runtime.profiling.sync_latency import measure as measure_sync_latency

        sync = measure_sync_latency()
    cpu1 = read_cpu_times()
    steal = None
    if cpu0 and cpu1 and cpu1[1] > cpu0[1]:
        steal = (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1])
    name, mem_bytes, mem_source = device_facts(device, nproc)
    return RawBench(
        world_size=world,
        nnodes=world // nproc,
        nproc_per_node=nproc,
        backend=dist.get_backend(),
        device_name=name,
        device_memory_bytes=mem_bytes,
        device_memory_source=mem_source,
        torch_version=torch.__version__,
        host=socket.gethostname(),
        cpu_steal_fraction=steal,
        load_avg_1m=load_avg_1m,
        not_measured=missing,
        collectives=results,
        compute=compute,
        wall_s=time.perf_counter() - t_start,
        sync_latency=sync,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(1)  # torchrun sets OMP_NUM_THREADS=1; intra-op threads follow (see the notes)
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    rank = int(os.environ.get("RANK", 0))
    try:
        if use_cuda and local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {local_rank} has no GPU (this node has {torch.cuda.device_count()}); "
                f"use --nproc-per-node {torch.cuda.device_count()} or fewer"
            )
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.timeout_s))
        if os.environ.get(FAIL_RANK_ENV) == str(rank):
            raise RuntimeError(f"failure injected by {FAIL_RANK_ENV}={rank}")
        raw = run_benchmarks(args, device)
        if rank == 0:
            atomic_write_text(args.raw_out, raw.model_dump_json(indent=1))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line, then hard exit
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"@@error rank {rank}: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)  # noqa: T201
        os._exit(1)  # a failed process group cannot be torn down cleanly (notes: gloo gotchas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
