"""Measured GEMM times on this machine's GPU next to the shape-aware kernel model's (``planner.cost.kernels``).

    python benchmarks/gpu_gemm_check.py --cluster dgx-h100 --out gemm.csv    # needs CUDA

For each GEMM of a GPT layer (QKV ``T x 3h x h``, attention out ``T x h x h``, MLP in ``T x 4h x h``, MLP out
``T x h x 4h``, and the LM head ``T x V x h``) at hidden ``h`` from 512 to 8192 and ``T`` tokens from 512 to
16384, in the forward shape and the two backward shapes (input gradient ``T x h_in x h_out``, weight gradient
``h_in x h_out x T``), it times ``torch.matmul`` in bf16 inside a CUDA graph (``time_gemm``: median of
``--repeats`` replays of 20 products after warm-up, rotating over 4 input sets so that no run reads operands
another left in L2; random normal data, never zeros) and prints the kernel model's prediction with the named
cluster profile's node type parameters
(``KernelModel``: SM count, tile shapes, GEMM ceiling, HBM efficiency). Nothing is fitted here: the error
column is the shipped profile's (whose GEMM ceiling was fitted on end-to-end Megatron rows, so it also
carries the framework's losses; the raw cuBLAS kernels are expected to run faster than that ceiling).
The CSV keeps every row, with the GPU's name, driver and torch version, for ``benchmarks/data``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner.cost import Device, gemm_s  # noqa: E402
from planner.profile import load_cluster_profile, resolve_cluster_path  # noqa: E402

HIDDEN = (512, 1024, 2048, 4096, 8192)
TOKENS = (512, 2048, 8192, 16384)
VOCAB = 50304  # GPT-2's 50,257 padded to a multiple of 128 (Megatron-LM --make-vocab-size-divisible-by)
VOCAB_ODD = 50257  # GPT-2's own vocabulary (the zoo's gpt2 presets): an LM head whose n is not a multiple of 8


def odd_shapes() -> list[tuple[str, int, int, int]]:
    """LM-head GEMMs at GPT-2's unpadded vocabulary next to the padded one (alignment of the leading dims)."""
    out = []
    for h in (768, 1024, 1600, 4096):
        for t in (2048, 8192):
            for v in (VOCAB_ODD, VOCAB):
                out.append((f"lmhead{v} h{h} T{t} fwd", t, v, h))
                out.append((f"lmhead{v} h{h} T{t} dgrad", t, h, v))
                out.append((f"lmhead{v} h{h} T{t} wgrad", h, v, t))
    return out


def shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k): output m x n, reduction k."""
    hidden = (1024, 4096) if quick else HIDDEN
    tokens = (2048, 8192) if quick else TOKENS
    out = []
    for h in hidden:
        for t in tokens:
            for name, n_out, n_in in (("qkv", 3 * h, h), ("proj", h, h), ("fc1", 4 * h, h), ("fc2", h, 4 * h)):
                out.append((f"{name} h{h} T{t} fwd", t, n_out, n_in))
                out.append((f"{name} h{h} T{t} dgrad", t, n_in, n_out))
                out.append((f"{name} h{h} T{t} wgrad", n_in, n_out, t))
            if t <= 8192:
                out.append((f"lmhead h{h} T{t} fwd", t, VOCAB, h))
    return out


def time_gemm(torch, m: int, n: int, k: int, repeats: int, per_graph: int = 20) -> float:
    """Median device seconds of one bf16 ``m x k @ k x n`` product: ``per_graph`` products (rotating over 4
    input sets) captured in a CUDA graph, its replays timed with CUDA events. A graph replay has no host
    launch gaps, so this is the kernels' device time (what ``gemm_s`` models; the host's issue cost is the
    kernel model's separate ``host_op_s``); a lone product timed between events would include the
    host's dispatch latency (~30 us), the GPU idling until the kernel arrives."""
    dev = torch.device("cuda")
    sets = [
        (torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(k, n, device=dev, dtype=torch.bfloat16))
        for _ in range(4)
    ]
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: cuBLAS heuristics, handles, workspace
        for a, b in sets * 2:
            torch.matmul(a, b, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            a, b = sets[i % 4]
            torch.matmul(a, b, out=out)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_graph)
    if not torch.isfinite(out).all():
        raise RuntimeError(f"non-finite GEMM output at {m}x{n}x{k}")
    del graph
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", default="dgx-h100", help="cluster profile whose first node type is this GPU")
    p.add_argument("--out", type=Path, help="CSV with every row")
    p.add_argument("--repeats", type=int, default=7, help="graph replays (each of 20 products)")
    p.add_argument("--quick", action="store_true", help="2 hidden sizes x 2 token counts")
    p.add_argument("--odd", action="store_true", help="only the LM heads at vocabulary 50,257 vs 50,304")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device here; this benchmark measures a GPU (run it where one is)", file=sys.stderr)
        return 2
    node = load_cluster_profile(resolve_cluster_path(args.cluster)).node_types[0]
    dev = Device.of_node(node, "bf16")
    props = torch.cuda.get_device_properties(0)
    gpu = f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, CUDA {torch.version.cuda}"
    print(f"GPU: {gpu}; model: {args.cluster} node type {node.name}")
    rows = []
    print(f"{'gemm':28} {'m':>6} {'n':>6} {'k':>6} {'measured_us':>12} {'model_us':>9} {'TF/s':>6} {'error':>7}")
    for name, m, n, k in odd_shapes() if args.odd else shapes(args.quick):
        meas = time_gemm(torch, m, n, k, args.repeats)
        pred = gemm_s(m, n, k, 1, dev)
        tflops = 2 * m * n * k / meas / 1e12
        err = pred / meas - 1
        rows.append(
            {
                "gemm": name,
                "m": m,
                "n": n,
                "k": k,
                "measured_s": f"{meas:.6e}",
                "model_s": f"{pred:.6e}",
                "tflops": f"{tflops:.1f}",
                "error": f"{err:+.4f}",
                "gpu": gpu,
            }
        )
        print(f"{name:28} {m:6d} {n:6d} {k:6d} {meas * 1e6:12.1f} {pred * 1e6:9.1f} {tflops:6.0f} {err:+7.1%}")
    errs = [abs(float(r["error"])) for r in rows]
    big = [abs(float(r["error"])) for r in rows if 2 * r["m"] * r["n"] * r["k"] >= 1e11]
    small = [abs(float(r["error"])) for r in rows if 2 * r["m"] * r["n"] * r["k"] < 1e11]
    print(f"{len(rows)} GEMMs: mean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%}")
    if big:
        print(f"  >= 100 GFLOP: n={len(big)} mean |error| {statistics.mean(big):.1%}")
    if small:
        print(f"  <  100 GFLOP: n={len(small)} mean |error| {statistics.mean(small):.1%}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
