"""Tokens/s of `stratagem launch` on a 1-rank plan against a plain single-process PyTorch loop, same model.

    python benchmarks/runtime_vs_plain.py          # gpt:small and llama:tiny, 16 x 128 tokens, 20 steps, 7 repeats
    python benchmarks/runtime_vs_plain.py --model gpt:small --micro-batch 8 --seq 128 --steps 30 --repeats 5

Issue 23's "must show": the runtime adds nothing to a step that a hand-written loop does not pay. Both sides
train the same zoo model (``runtime.models.build_model`` on meta, ``init_weights`` with the plan's seed,
attention through SDPA: ``apply_attention(model, fused=True)``), with AdamW ``foreach=True`` at the plan's lr
and weight decay, fp32, one batch of ``--micro-batch`` x ``--seq`` per step, the same synthetic batches
(``runtime.executor.data.synthetic_batch``), one CPU thread each (the runtime's ``init_distributed`` sets
``torch.set_num_threads(1)`` on CPU; the plain loop does the same) and ``OMP_NUM_THREADS=1``.

- **launch**: ``fixtures.plans.make_plan(spec, dp=1, ...)`` with ``flash_attention: true``, run by
  ``python -m planner.cli.main launch PLAN --steps N --metrics FILE --no-compile`` (torchrun, 1 gloo rank).
  Its step time is the metrics file's summary ``measured_step_time_s``: the median over steps 2..N of
  ``train_step``'s timer (forward + backward + optimizer step; the batch is made before the timer starts).
- **plain**: this file's ``--plain-worker``, a fresh process running forward, ``loss.backward()``,
  ``opt.step()``, ``opt.zero_grad(set_to_none=True)`` under the same timer, median over steps 2..N.

tokens/s = micro-batch x seq / that median; each side's figure is the fastest of ``--repeats`` launches, the
two sides alternating which goes first. The ratio launch / plain should be >= 0.95 on CPU (exit status 1
otherwise). Also printed, not judged: "loop" tokens/s, from the wall time of a whole training-loop iteration
(batch, step, and whatever the loop does between steps: for the launch the per-step ``all_gather`` of the
metrics, the metrics line and the log line; its iterations are timed by when rank 0's "step k" log lines
arrive here), and each side's final loss (they must agree: same model, same data). Before every run the
harness waits up to ``--quiet-wait-s`` for a 1-s window with the CPUs 90 % idle
(``runtime_vs_prediction.wait_quiet``) and prints the 1-minute load average and that idle fraction: this
host's 2 cores are shared. The environment passes through to both sides (e.g. glibc's ``MALLOC_*`` variables).

Measured 2026-11-27 (torch 2.13 CPU, this 2-core VM; other agents' jobs ran on it at times), default settings;
launch / plain tokens/s, fastest of 3 repeats each, and the 1-minute load across the run:

    UTC            gpt:small                 llama:tiny                load     note
    12:57-13:02    1.011 (9439 / 9340)       1.109 (27529 / 24813)     1.5-2.8
    13:10-13:19    0.932 (7373 / 7911)       0.813 (22026 / 27103)     1.3-4.8  a test suite running beside it
    13:31-13:34    0.844 (7965 / 9440)       1.066 (28467 / 26714)     0.8-1.1  CPUs 99-100 % idle at each start
    13:58-14:01    1.100 (10479 / 9523)      0.911 (25347 / 27835)     0.9-1.1  with the MALLOC_* setting below

So one 3-repeat run does not decide 0.95 here: a process's speed varies up to +-15 % from one run to the next
on idle CPUs (the plain loop alone, gpt:small: medians 206-276 ms per step). What the launch itself adds:

- inside the timed step, nothing measurable: the runtime's step runner on its own chunk and the plain step,
  alternating in one process (1-rank gloo ``build_job``), differ by -0.3 ms of 79 ms (llama:tiny) and +1.1 ms
  of 242 ms (gpt:small), paired medians; the profiler shows the same operators plus ``tensor_split``,
  ``loss / 1`` with its ``DivBackward0`` and a ``detach().float()`` (microseconds);
- outside it, ~0.7 ms per step: ``_gather_step`` (a 1-rank gloo ``all_gather``, the tensor round trip and a
  ``/proc/self/status`` read) 0.44 ms, ``peak_memory_bytes`` (a second read) 0.1 ms, the metrics line and
  the log line ~0.05 ms; the "loop" figures above show 1-2 ms per step between the launch's log lines;
- gpt:small only: glibc returns the heap top to the kernel and faults it back about twice as often in the
  runtime's rank as in the plain process: 7,000-10,000 vs 3,200-3,900 minor page faults, ~10 vs ~6 ``brk``
  calls and 19-29 vs 9-11 ms of system time per step. Over 10 repeats (13:42, 15 steps) the median repeat took
  287 ms in the launch and 252 ms in the plain loop (fastest 221 vs 228 ms). With
  ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824`` (mallopt(3); both sides inherit it) the
  faults drop to ~20-30 per step on both sides and 6 repeats (13:52) gave medians 248 vs 257 ms.

Since then ``stratagem launch`` sets those two variables for its ranks (``runtime.launch.KEEP_HEAP``, unless the
environment sets them). Fastest of 7 repeats, CPUs 98-100 % idle at every start (load 0.6-1.0), no other job:

    UTC            environment                          gpt:small                 llama:tiny
    14:05-14:11    as is (the plain loop without them)  1.129 (9822 / 8704)       1.164 (31068 / 26701)
    14:11-14:17    both sides with them                 1.021 (9751 / 9547)       0.971 (32665 / 33651)

The second row is the like-for-like one: with the same allocator settings the launch is within 3 % of a plain
loop, above the 0.95 asked; the first shows what the setting gives a user's launch over a loop without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # fixtures/ (hand-made plans) lives at the repository root
sys.path.insert(0, str(REPO / "benchmarks"))
TARGET_RATIO = 0.95  # issue 23: launch tokens/s >= 0.95 x the plain loop's on CPU
STEP_LINE = re.compile(r"runtime\.executor\.train: step (\d+) loss")  # rank 0's log line per step (train.run_plan)
THREADS = "1"  # intra-op threads per process, as the runtime uses per CPU rank (train.init_distributed)


def plain_worker(args: argparse.Namespace) -> None:
    """The plain loop (one process, no process group); writes its step and loop times and final loss."""
    import torch

    from planner.model import parse_model
    from runtime.executor.data import synthetic_batch
    from runtime.models import build_model, init_weights, loss_fn
    from runtime.models.attention import apply_attention

    torch.set_num_threads(int(THREADS))
    spec = parse_model(args.model)
    model = build_model(spec, device="meta")
    model.to_empty(device="cpu")
    init_weights(model, seed=args.seed)
    apply_attention(model, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    fn, step_times, loop_times, loss_value = loss_fn(spec), [], [], float("nan")
    for step in range(1, args.steps + 1):
        t_loop = time.perf_counter()
        batch = synthetic_batch(spec, batch=args.micro_batch, seq_len=args.seq, seed=args.seed, step=step)
        t0 = time.perf_counter()
        loss = fn(model(batch.inputs), batch.targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        loss_value = float(loss.detach())  # what a training loop logs
        loop_times.append(time.perf_counter() - t_loop)
    record = {"step_times_s": step_times, "loop_times_s": loop_times, "final_loss": loss_value}
    Path(args.out).write_text(json.dumps({**record, "threads": torch.get_num_threads()}))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": THREADS}


def run_launch(plan_path: Path, metrics_path: Path, steps: int) -> dict:
    """One ``stratagem launch``: median step time (its summary), loop times (between "step k" log lines)."""
    from runtime.executor.metrics import read_metrics

    cmd = [sys.executable, "-m", "planner.cli.main", "launch", str(plan_path), "--steps", str(steps)]
    cmd += ["--metrics", str(metrics_path), "--no-compile", "--timeout-s", "600"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen_s: dict[int, float] = {}  # step -> when its log line arrived
    tail: list[str] = []
    for line in proc.stdout or ():  # rank 0 logs "step k loss ... step_time ..." after each step's metrics line
        if m := STEP_LINE.search(line):
            seen_s[int(m.group(1))] = time.perf_counter()
        tail = (tail + [line])[-40:]
    if proc.wait():
        raise SystemExit(f"stratagem launch failed (exit {proc.returncode}):\n{''.join(tail)}")
    records = read_metrics(metrics_path)
    summary = next(r for r in records if r["event"] == "summary")
    step_times_s = [r["step_time_s"] for r in records if r["event"] == "step"]
    steps_seen = sorted(seen_s)
    loops = [seen_s[k] - seen_s[k - 1] for k in steps_seen[1:] if k - 1 in seen_s]
    return {
        "step_s": summary["measured_step_time_s"],
        "min_step_s": min(step_times_s[1:]),
        "loop_s": statistics.median(loops) if loops else None,
        "final_loss": summary["final_loss"],
    }


def run_plain(args: argparse.Namespace, model: str, training, out: Path) -> dict:
    """One plain-loop process: median step and loop time over steps 2..N, final loss, its thread count."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--plain-worker", "--model", model, "--out", str(out)]
    cmd += ["--micro-batch", str(args.micro_batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    cmd += ["--lr", repr(training.lr), "--weight-decay", repr(training.weight_decay), "--seed", str(training.seed)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"plain loop failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    got = json.loads(out.read_text())
    return {
        "step_s": statistics.median(got["step_times_s"][1:]),
        "min_step_s": min(got["step_times_s"][1:]),
        "loop_s": statistics.median(got["loop_times_s"][1:]),
        "final_loss": got["final_loss"],
        "threads": got["threads"],
    }


def _load(quiet_wait_s: float) -> str:
    from runtime_vs_prediction import wait_quiet

    idle = wait_quiet(quiet_wait_s)  # 0 s: one 1-s look, no wait
    return f"load {os.getloadavg()[0]:.2f}, CPUs {idle:.0%} idle"


def measure_model(model: str, args: argparse.Namespace, folder: Path) -> dict[str, list[dict]]:
    """``--repeats`` launches and plain loops of ``model``, alternating which goes first; the runs of each."""
    from fixtures.plans import make_plan
    from planner.model import parse_model
    from planner.plan import save_plan

    plan = make_plan(parse_model(model), dp=1, global_batch=args.micro_batch, seq_len=args.seq, dtype="fp32")
    plan = plan.model_copy(update={"flash_attention": True})
    plan_path = save_plan(plan, folder / f"{model.replace(':', '-')}.json")
    tokens = args.micro_batch * args.seq
    runs: dict[str, list[dict]] = {"launch": [], "plain": []}
    for i in range(args.repeats):
        for side in ("launch", "plain") if i % 2 == 0 else ("plain", "launch"):
            load = _load(args.quiet_wait_s)
            if side == "launch":
                got = run_launch(plan_path, folder / f"{plan_path.stem}-{i}.jsonl", args.steps)
            else:
                got = run_plain(args, model, plan.training, folder / f"{plan_path.stem}-plain-{i}.json")
            runs[side].append(got)
            loop = f", loop {tokens / got['loop_s']:8.0f} tok/s" if got["loop_s"] else ""
            print(
                f"  repeat {i + 1}/{args.repeats} {side:<6}: {load}; step {got['step_s'] * 1e3:7.1f} ms = "
                f"{tokens / got['step_s']:8.0f} tok/s{loop}, final loss {got['final_loss']:.6f}",
                flush=True,
            )
    return runs


def report(model: str, runs: dict[str, list[dict]], tokens: int) -> float:
    """Print the fastest repeat of each side and the ratios; returns launch / plain tokens/s."""
    best = {side: min(r["step_s"] for r in rs) for side, rs in runs.items()}
    loops = {side: [r["loop_s"] for r in rs if r["loop_s"]] for side, rs in runs.items()}
    ratio = best["plain"] / best["launch"]  # tokens/s ratio = inverse of the step-time ratio
    print(f"  {model}: fastest of {len(runs['launch'])} repeats (median step over steps 2..N):")
    for side in ("launch", "plain"):
        medians_ms = sorted(r["step_s"] * 1e3 for r in runs[side])
        spread = f"repeats {medians_ms[0]:.1f}-{medians_ms[-1]:.1f} ms, median {statistics.median(medians_ms):.1f}"
        print(f"    {side:<6} {tokens / best[side]:9.0f} tokens/s  ({best[side] * 1e3:.1f} ms/step; {spread})")
    verdict = "ok" if ratio >= TARGET_RATIO else f"BELOW {TARGET_RATIO}"
    print(f"    ratio launch / plain: {ratio:.3f} ({verdict})")
    fastest = {side: min(r["min_step_s"] for r in rs) for side, rs in runs.items()}
    print(f"    fastest single step, launch / plain: {fastest['plain'] / fastest['launch']:.3f} (least load-disturbed)")
    if loops["launch"] and loops["plain"]:
        whole = min(loops["plain"]) / min(loops["launch"])
        print(f"    whole loop (batch + step + per-step bookkeeping), launch / plain: {whole:.3f}")
    threads = {r["threads"] for r in runs["plain"]}
    losses = {side: rs[-1]["final_loss"] for side, rs in runs.items()}
    print(
        f"    final loss launch {losses['launch']:.6f}, plain {losses['plain']:.6f}; plain threads {threads}",
        flush=True,
    )
    return ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt:small,llama:tiny", help="zoo models, comma-separated")
    p.add_argument("--micro-batch", type=int, default=16, help="samples per step (1 rank, 1 micro-batch)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sample")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the median is over 2..N)")
    p.add_argument("--repeats", type=int, default=7, help="runs of each side; the fastest counts")
    p.add_argument("--quiet-wait-s", type=float, default=30.0, help="wait up to this long for idle CPUs (0: never)")
    p.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=1e-3, help=argparse.SUPPRESS)
    p.add_argument("--weight-decay", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain_worker:
        return plain_worker(args)
    if args.steps < 3:
        raise SystemExit(f"--steps {args.steps}: the median is over steps 2..N, so give at least 3")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{started}: {args.micro_batch} x {args.seq} tokens per step, {args.steps} steps, fp32, 1 thread, SDPA")
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="rt-vs-plain-") as tmp:
        for model in args.model.split(","):
            print(f"{model}:", flush=True)
            runs = measure_model(model, args, Path(tmp))
            ratios[model] = report(model, runs, args.micro_batch * args.seq)
    low = {m: r for m, r in ratios.items() if r < TARGET_RATIO}
    if low:
        raise SystemExit(f"launch / plain below {TARGET_RATIO}: " + ", ".join(f"{m} {r:.3f}" for m, r in low.items()))


if __name__ == "__main__":
    main()
