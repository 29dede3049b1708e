"""What FSDP2's ZeRO-3 collectives cost a training step on CPU ranks: the collectives real vs local copies.

    torchrun --standalone --nproc-per-node 2 benchmarks/zero3_cpu_comm.py PLAN OUT.json [ROUNDS]   # zero 3, dp 2

Builds the plan's job as ``stratagem launch`` does (``runtime.executor.train.build_job``) and alternates
steps with FSDP2's ``all_gather_single`` / ``reduce_scatter_single`` real and replaced by a local copy of
the rank's own shard (same shapes, no communication; the gradients are then not averaged, which does not
change the work), one step each per round after 3 warm-up steps, and counts the calls per step. The
difference of the two step times is what the collectives cost, waits on the peer included; rank 0 writes
the 10th percentile, quartile, median and minimum of each and their differences. Compare with the cost
model's ``zero_comm`` (``planner.cost.zero3``).

Measured 2026-11-24 on this repo's 2-vCPU host, the ``fsdp`` plans of ``runtime_vs_prediction.py``
(gpt:tiny: 6 all-gathers + 3 reduce-scatters per step, 3 FSDP2 units; gpt:small: 10 + 5, 5 units),
10th percentiles, next to ``zero_comm`` of the cost model at the fits' alpha per layer / with
``BlockingLatency.plain_collective_s`` set to the latency ``runtime/profiling/sync_latency.py`` measured at
that load (mean of plain all-gather and reduce-scatter):

    host                              plain latency   gpt:tiny                     gpt:small
    quiet (1-min load 0.5-0.9)        0.39 ms         5.3, 5.4 ms  (4.44 / 4.98)    18.4 ms  (14.2 / 15.9)
    busy (load 3-5, 3 runs)           0.61-1.19 ms    7.7, 9.0, 8.9 (4.44 / 8.13)   32-48 ms (14.2 / 21.2)

(8.13 and 21.2 at the shipped profile's 0.74 ms.) Two further busy runs (load 4-12) gave 19-24 ms for
gpt:tiny. At load gpt:small's bandwidth term is slower too, which the per-call latency does not cover.
A harness that prints figures; nothing is asserted.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from planner.plan import load_plan
    from runtime.executor.train import build_job, init_distributed, train_step

    plan_path, out = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    device = init_distributed(300)
    rank, world = dist.get_rank(), dist.get_world_size()
    job = build_job(load_plan(plan_path), device, data="synthetic")
    real_ag, real_rs = dist.all_gather_single, dist.reduce_scatter_single
    calls: Counter = Counter()

    def local_ag(output_tensor, input_tensor, **_):  # group, async_op: nothing to wait for
        output_tensor.view(world, -1)[rank].copy_(input_tensor.view(-1))
        calls["all_gather"] += 1

    def local_rs(output, input_tensor=None, **kw):  # FSDP2 passes output=, input=, group=, op=
        output.view(-1).copy_((input_tensor if input_tensor is not None else kw["input"]).view(world, -1)[rank])
        calls["reduce_scatter"] += 1

    def counted_ag(*a, **kw):
        calls["all_gather"] += 1
        return real_ag(*a, **kw)

    def counted_rs(*a, **kw):
        calls["reduce_scatter"] += 1
        return real_rs(*a, **kw)

    step = 0
    for _ in range(3):  # warm-up
        step += 1
        train_step(job, step)
    times: dict[str, list[float]] = {"real": [], "local": []}
    per_step: dict[str, dict[str, float]] = {}
    for r in range(rounds):
        for mode in ("real", "local") if r % 2 == 0 else ("local", "real"):
            dist.all_gather_single = counted_ag if mode == "real" else local_ag  # type: ignore[assignment]
            dist.reduce_scatter_single = counted_rs if mode == "real" else local_rs  # type: ignore[assignment]
            calls.clear()
            step += 1
            times[mode].append(train_step(job, step).step_time_s)
            per_step[mode] = dict(calls)
    dist.all_gather_single, dist.reduce_scatter_single = real_ag, real_rs  # type: ignore[assignment]
    if rank == 0:
        stats = {
            mode: {
                "q10_ms": statistics.quantiles(t, n=10)[0] * 1e3,
                "q25_ms": statistics.quantiles(t, n=4)[0] * 1e3,
                "median_ms": statistics.median(t) * 1e3,
                "min_ms": min(t) * 1e3,
            }
            for mode, t in times.items()
        }
        res = {
            **stats,
            "calls_per_step": per_step["real"],
            "collectives_ms": {k: stats["real"][k] - stats["local"][k] for k in stats["real"]},
        }
        Path(out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(res["collectives_ms"]), res["calls_per_step"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
