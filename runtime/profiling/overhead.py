"""Host time the runtime's torch.distributed wrappers add to one layer, measured in one process.

``stratagem launch`` does not run a layer as the plain module the profiler times: a tensor-split layer
runs on DTensors (``parallelize_module``; every op goes through DTensor's Python dispatch and sharding
propagation), a data-parallel chunk runs under FSDP2's ``replicate`` or ``fully_shard`` hooks (copy-in
and copy-out of flat buffers, pre-forward and post-backward hooks, per step), and AdamW steps over the
parameters one tensor at a time (``foreach`` is used only on CUDA), on DTensors whenever the layer is
TP-split or data-parallel. On a small model these fixed costs are larger than the arithmetic.

Method: on a one-rank gloo process group (nothing waits for a peer; collectives are local copies or
skipped) the layer is built four ways -- plain, TP-split with the runtime's styles, ``replicate``,
``fully_shard`` -- and run on the same input, the modes in turn each round (``_interleaved``); the
overhead of a wrapper is its median forward (backward) time minus the plain module's, floored at 0. An
FSDP2 unit also has a fixed cost (hooks, one flat buffer), measured on a one-``Linear`` probe; the
layer's figure is its marginal cost inside a unit (own unit minus that fixed cost), because the runtime
wraps a whole chunk in one ``replicate`` unit and gives ``fully_shard`` one unit per block plus one for
the rest of the chunk. The AdamW step is timed over the layer's plain parameters and over its
``replicate`` (DTensor) parameters. Not in these figures: the collectives' time at more ranks (the
cost model prices it from the cluster profile), including the host cost of DTensor's functional
collectives, which a one-rank mesh skips.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import cast
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from planner.model import ModelSpec
from planner.plan import LayerLayout
from planner.profile import ComputeFigure, RuntimeOverhead
from runtime.profiling.measure import make_input

log = logging.getLogger(__name__)

ROUNDS = 15  # at least this many interleaved rounds per layer (forward, backward, AdamW step per mode)
LR = 1e-3


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the wrappers (reuses an existing group, destroys its own)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,), mesh_dim_names=("x",))


def _tp_styles(spec: ModelSpec, path: str) -> dict[str, str]:
    """The runtime's TP styles for ``path`` split alone, relative to the layer ('' = the layer itself)."""
    from runtime.executor.tp_plan import tp_styles

    full = tp_styles(spec, {path: LayerLayout(style="split")}, [path])
    return {("" if k == path else k.removeprefix(path + ".")): v for k, v in full.items()}


def _wrap(layer: nn.Module, spec: ModelSpec, path: str, mode: str) -> nn.Module:
    """``layer`` as the runtime runs it under ``mode`` (plain | tp | replicate | fully_shard), 1-rank mesh."""
    if mode == "tp":
        # runtime.executor.tp.apply_tp skips 1-rank meshes, so parallelize_module is called directly
        from torch.distributed.tensor.parallel import parallelize_module

        from runtime.executor.tp import TP_STYLES

        styles = _tp_styles(spec, path)
        if "" in styles:
            return parallelize_module(layer, _mesh()["x"], TP_STYLES[styles[""]]())
        parallelize_module(layer, _mesh()["x"], {k: TP_STYLES[v]() for k, v in styles.items()})
    elif mode == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(layer, mesh=_mesh()["x"])
    elif mode == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        fully_shard(layer, mesh=_mesh()["x"], reshard_after_forward=True)
    return layer


def _fwd_bwd_s(layer: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """One forward and one backward (gradient of ones), wall seconds."""
    t0 = time.perf_counter()
    out = layer(x)
    t1 = time.perf_counter()
    out.backward(torch.ones_like(out))
    return t1 - t0, time.perf_counter() - t1


def _interleaved(
    layers: dict[str, nn.Module], x: torch.Tensor, *, first: bool, rounds: int, warmup: int
) -> dict[str, tuple[float, float, float]]:
    """(forward_s, backward_s, AdamW step_s) medians per mode, the modes timed in turn each round.

    Interleaving makes a burst of load on a shared host hit every mode alike, so the differences
    (the overheads) stay meaningful where two separate medians would not.
    """
    opts = {
        m: torch.optim.AdamW(params, lr=LR) if (params := [p for p in layer.parameters() if p.requires_grad]) else None
        for m, layer in layers.items()
    }
    times: dict[str, list[tuple[float, float, float]]] = {m: [] for m in layers}
    for i in range(warmup + rounds):
        for mode, layer in layers.items():
            fwd, bwd = _fwd_bwd_s(layer, make_input(x, needs_grad=not first))
            t0 = time.perf_counter()
            opt = opts[mode]
            if opt is not None:  # a layer without parameters (a pooling layer) has no step
                opt.step()
                opt.zero_grad(set_to_none=True)
            if i >= warmup:
                times[mode].append((fwd, bwd, time.perf_counter() - t0))
    return {
        m: cast("tuple[float, float, float]", tuple(statistics.median(t[k] for t in v) for k in range(3)))
        for m, v in times.items()
    }


def measure_runtime_overhead(
    build: Callable[[], nn.Module],
    spec: ModelSpec,
    path: str,
    x: torch.Tensor,
    *,
    first: bool,
    splittable: bool,
    warmup: int,
    repeats: int,
) -> RuntimeOverhead:
    """Wrapper overheads of one layer on input ``x`` (one micro-batch); see the module docstring.

    ``build()`` returns a fresh, initialised full layer (tp=1); ``first``: the input needs no gradient.
    """
    has_params = any(p.requires_grad for p in build().parameters())
    modes = ("plain",) + (("tp",) if splittable else ()) + (("replicate", "fully_shard") if has_params else ())
    layers = {m: _wrap(build(), spec, path, m) for m in modes}
    med = _interleaved(layers, x, first=first, rounds=max(repeats, ROUNDS), warmup=warmup)
    unit = _unit_overhead(warmup=warmup, rounds=max(repeats, ROUNDS))

    def extra(mode: str, i: int) -> float:
        return max(0.0, med[mode][i] - med["plain"][i]) if mode in med else 0.0

    def marginal(mode: str, i: int) -> float:
        return max(0.0, extra(mode, i) - unit[mode][i])

    return RuntimeOverhead(
        micro_batch=int(x.shape[0]),
        tp_forward_s=extra("tp", 0),
        tp_backward_s=extra("tp", 1),
        replicate_forward_s=marginal("replicate", 0),
        replicate_backward_s=marginal("replicate", 1),
        fully_shard_forward_s=marginal("fully_shard", 0),
        fully_shard_backward_s=marginal("fully_shard", 1),
        replicate_unit_forward_s=unit["replicate"][0],
        replicate_unit_backward_s=unit["replicate"][1],
        fully_shard_unit_forward_s=unit["fully_shard"][0],
        fully_shard_unit_backward_s=unit["fully_shard"][1],
        optimizer_step_s=med["plain"][2],
        optimizer_step_dtensor_s=max(med["replicate"][2], med["plain"][2]) if has_params else 0.0,
    )


UNIT_PROBE_FEATURES = 8  # the unit-cost probe: one nn.Linear(8, 8) on a (1, 8) input


def _unit_overhead(*, warmup: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Fixed (forward, backward) cost of one FSDP2 unit per wrapper: a one-Linear probe, wrapped minus plain."""

    def probe() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(UNIT_PROBE_FEATURES, UNIT_PROBE_FEATURES)

    layers = {m: _wrap(probe(), None, "", m) for m in ("plain", "replicate", "fully_shard")}  # type: ignore[arg-type]
    med = _interleaved(layers, torch.randn(1, UNIT_PROBE_FEATURES), first=False, rounds=rounds, warmup=warmup)
    return {
        m: (max(0.0, med[m][0] - med["plain"][0]), max(0.0, med[m][1] - med["plain"][1]))
        for m in ("replicate", "fully_shard")
    }


# The cluster profiler's compute benchmark (runtime/profiling/cluster_bench.py: on CPU a 1024^3 matmul, smaller for
# a dtype this CPU runs slowly (cluster_bench.cpu_matrix_n), FLOPs = 2 n^3, achieved = median), repeated here so
# layer timings can be related to a cluster profile taken under other load (planner.cost.framework.timings_scale).
REFERENCE_REPEATS = 5


def reference_matmul_rates(s) -> list[float]:
    """FLOP/s of each timed reference matmul in this process (``s``: ProfileSettings); [] if not CPU/CUDA."""
    from runtime.profiling.cluster_bench import cpu_matrix_n, time_matmul

    if s.dtype not in ("fp32", "bf16", "fp16", "tf32"):
        return []
    device = torch.device(s.device)
    n = cpu_matrix_n(s.dtype) if device.type == "cpu" else 8192
    raw = time_matmul(s.dtype, n, device=device, repeats=REFERENCE_REPEATS)
    return [raw.flops_per_matmul / t for t in raw.times_s]


def reference_matmul_figure(dtype: str, rates: list[float]) -> ComputeFigure | None:
    """The reference figure (best and median of ``rates``), or None when nothing was timed."""
    if not rates:
        return None
    return ComputeFigure(
        dtype=dtype,
        peak_flops_per_s=max(rates),
        achieved_flops_per_s=statistics.median(rates),
        origin="measured",
        source=f"runtime/profiling/cluster_bench.time_matmul in the model profiler's process, "
        f"before and after the layers ({len(rates)} matmuls); peak = best, achieved = median",
    )
