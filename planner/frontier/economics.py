"""Days, GPU-hours, cost and energy of a training run from a plan's predicted step time.

The run trains ``train_tokens`` tokens at ``global_batch x seq_len`` tokens per step, so it takes
``ceil(train_tokens / (global_batch seq_len))`` steps of the predicted step time. Energy uses the node type's
:class:`planner.profile.NodePower`: each device draws ``idle + (board - idle) u`` watts (the linear power model
of Fan, Weber & Barroso, ISCA 2007) with ``u`` the plan's predicted utilisation (:func:`utilisation`), each node
its host power more, and the facility PUE times the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.core import StratagemError
from planner.profile import NodeType

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True, kw_only=True, slots=True)
class RunEconomics:
    """One training run on ``gpus`` devices: its length, device-hours, cost (None without a price) and energy
    (None without the node type's power)."""

    steps: int
    train_s: float
    gpu_hours: float
    cost_usd: float | None
    energy_mwh: float | None
    power_per_gpu_w: float | None  # facility power per device (its board, its share of the host, times the PUE)

    @property
    def days(self) -> float:
        return self.train_s / SECONDS_PER_DAY


def utilisation(hardware_flops_per_gpu_s: float, node: NodeType, dtype: str) -> float:
    """The share of its sustained dense-GEMM rate (``achieved_flops_per_s`` of the profile) a device runs at:
    the plan's hardware FLOP/s per device (recompute included) over that rate, at most 1. A device that spent
    every step in GEMMs at the profile's rate draws its board power; communication and memory-bound kernels
    draw less (the linear model's assumption)."""
    achieved = node.compute_for(dtype).achieved_flops_per_s
    return min(1.0, max(0.0, hardware_flops_per_gpu_s / achieved))


def run_economics(
    *,
    step_s: float,
    gpus: int,
    global_batch: int,
    seq_len: int,
    train_tokens: float,
    node: NodeType,
    util: float,
    price_per_gpu_hour: float | None,
    pue: float | None = None,
) -> RunEconomics:
    """The run's figures; ``price_per_gpu_hour`` None leaves the cost empty, a node type without power the energy.
    ``pue`` overrides the profile's.

    >>> from planner.profile import load_cluster_profile
    >>> node = load_cluster_profile("profiles/hardware/dgx-h100.json").node_types[0]
    >>> e = run_economics(step_s=10.0, gpus=8, global_batch=1024, seq_len=4096, train_tokens=2**32,
    ...                   node=node, util=1.0, price_per_gpu_hour=2.0)
    >>> e.steps, round(e.gpu_hours, 3), round(e.cost_usd, 2), round(e.power_per_gpu_w)
    (1024, 22.756, 45.51, 1989)
    """
    if step_s <= 0 or not math.isfinite(step_s):
        raise StratagemError(f"step time {step_s!r} s is not a positive number")
    steps = math.ceil(train_tokens / (global_batch * seq_len))
    train_s = steps * step_s
    gpu_hours = gpus * train_s / 3600.0
    cost = None if price_per_gpu_hour is None else gpu_hours * price_per_gpu_hour
    power = node.power
    if power is None:
        return RunEconomics(
            steps=steps, train_s=train_s, gpu_hours=gpu_hours, cost_usd=cost, energy_mwh=None, power_per_gpu_w=None
        )
    device_w = power.idle_w + (power.board_w - power.idle_w) * util
    per_gpu_w = (device_w + power.host_w / node.devices_per_node) * (power.pue if pue is None else pue)
    energy_mwh = per_gpu_w * gpus * train_s / 3600.0 / 1e6
    return RunEconomics(
        steps=steps,
        train_s=train_s,
        gpu_hours=gpu_hours,
        cost_usd=cost,
        energy_mwh=energy_mwh,
        power_per_gpu_w=per_gpu_w,
    )


def gpu_counts(text: str, devices_per_node: int = 8) -> list[int]:
    """``--gpus``: a list ``64,96,128`` or a range ``64:4096`` (the powers of two in it, and its ends when they
    are whole nodes). Past one node, a count must be whole nodes.

    >>> gpu_counts("64:4096")
    [64, 128, 256, 512, 1024, 2048, 4096]
    >>> gpu_counts("96:512")
    [96, 128, 256, 512]
    """
    text = text.strip()
    try:
        if ":" in text:
            lo_text, hi_text = text.split(":", 1)
            lo, hi = int(lo_text), int(hi_text)
            if lo < 1 or hi < lo:
                raise ValueError
            counts = {1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi}
            counts |= {n for n in (lo, hi) if n % devices_per_node == 0}
        else:
            counts = {int(part) for part in text.split(",") if part.strip()}
            if not counts or min(counts) < 1:
                raise ValueError
    except ValueError:
        raise StratagemError(
            f"--gpus {text!r}: write a range LOW:HIGH of device counts (e.g. 64:4096) or a list (e.g. 64,128,256)"
        ) from None
    partial = sorted(n for n in counts if n > devices_per_node and n % devices_per_node)
    if partial:
        raise StratagemError(
            f"--gpus {text!r}: {partial[0]} devices are not whole nodes of {devices_per_node}; use multiples of "
            f"{devices_per_node} past one node"
        )
    if not counts:
        raise StratagemError(f"--gpus {text!r} holds no power of two and no whole node; widen the range")
    return sorted(counts)
