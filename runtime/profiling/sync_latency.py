"""Per-call latency of a collective when the ranks arrive from compute, as in a training step.

    torchrun --standalone --nproc-per-node 2 -m runtime.profiling.sync_latency --out latency.json

The cluster profiler times collectives back to back, so every rank is already waiting when the next one
starts; its alpha is the pure call latency. In a training step each collective follows compute on every
rank: a rank that arrives first sleeps in gloo, and on a host whose cores are shared it is woken up only
when the scheduler gives it a core again. Measured here: each iteration runs ``COMPUTE_MATMULS`` small
matmuls then one small (1 KiB) collective; the latency of an op is the median iteration time with it
minus the median without it, the slowest rank counting. Modes are interleaved in rounds so load changes
hit them alike. ``functional_all_reduce`` is the same through ``torch.distributed._functional_collectives``
(the path DTensor takes). The cluster profiler records the functional figure as
``BlockingLatency.functional_collective_s`` (what TP's DTensor collectives pay) and the mean of the plain
``all_gather`` and ``reduce_scatter`` as ``plain_collective_s`` (what FSDP2's ZeRO-3 calls pay: they are
plain c10d calls, each waited on right after compute; ``planner.cost.zero3``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

COMPUTE_MATMULS, MATRIX_N = 4, 192  # ~0.3-0.4 ms of compute per iteration on one CPU core
MESSAGE_ELEMENTS = 256  # 1 KiB of fp32: the bandwidth term is negligible
ITERATIONS, ROUNDS = 15, 4
OPS = ("none", "all_reduce", "all_gather", "reduce_scatter", "send_recv", "functional_all_reduce")


def _issue(op: str, x: torch.Tensor, out: torch.Tensor, rank: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, x)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(x[: x.numel() // dist.get_world_size()].clone(), x)
    elif op == "send_recv":  # one direction per call, as a pipeline's activation transfer
        (dist.send if rank == 0 else dist.recv)(x, 1 - rank)
    elif op == "functional_all_reduce":
        import torch.distributed._functional_collectives as funcol

        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("functional_all_reduce needs an initialised default process group")
        funcol.wait_tensor(funcol.all_reduce(x, "sum", world))


def measure() -> dict[str, float]:
    """Seconds per call of each op after compute (see the module docstring); call on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.randn(MATRIX_N, MATRIX_N)
    x, out = torch.randn(MESSAGE_ELEMENTS), torch.empty(MESSAGE_ELEMENTS * world)
    ops = [op for op in OPS if op != "send_recv" or world == 2]
    times: dict[str, list[float]] = {op: [] for op in ops}
    for _ in range(ROUNDS):
        for op in ops:
            dist.barrier()
            for _ in range(ITERATIONS):
                t0 = time.perf_counter()
                for _ in range(COMPUTE_MATMULS):
                    torch.mm(a, a)
                if op != "none":
                    _issue(op, x, out, rank)
                times[op].append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(times[op]) for op in ops], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    base = float(mine[0])
    return {op: max(0.0, float(t) - base) for op, t in zip(ops[1:], mine[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON written by rank 0: op -> seconds per call")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = measure()
    if dist.get_rank() == 0:
        from planner.core import atomic_write_text

        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
