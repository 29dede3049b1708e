"""The baseline the planner must beat: a Megatron-style grid search under the same cost model.

Megatron-LM practice (Narayanan et al. SC21 §5, examples/sc21/run_table_1.sh): tensor parallel inside a
node (tp in {1, 2, 4, 8}), uniform layers per stage, every pp / dp / micro-batch split of the fixed global
batch, 1F1B or interleaved 1F1B, one recompute mode for all blocks (none or full), no ZeRO. Each point is
scored with ``planner.cost.estimate``; the fastest that fits in memory wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core import StratagemError
from planner.cost import ParallelConfig, estimate, fill_stage_node_types, with_gpus
from planner.profile import ClusterProfile, ModelProfile
from planner.search.space import divisors

GRID_TP = (1, 2, 4, 8)
GRID_VIRTUAL_STAGES = (1, 2, 4)


@dataclass(frozen=True, kw_only=True, slots=True)
class GridResult:
    config: ParallelConfig
    step_time_s: float
    points_tried: int


def grid_configs(profile: ModelProfile, gpus: int, global_batch: int, max_micro_batch: int = 16):
    """Every Megatron-style configuration for ``gpus`` devices (see the module docstring)."""
    blocks = sum(1 for layer in profile.layers if layer.kind == "block") or len(profile.layers)
    for tp in GRID_TP:
        if gpus % tp or tp not in profile.tp_degrees:
            continue
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            for mb in divisors(global_batch // dp):
                if mb > max_micro_batch:
                    break
                m = global_batch // dp // mb
                for v in GRID_VIRTUAL_STAGES if pp > 1 else (1,):
                    if pp * v > blocks or (v > 1 and m % pp):
                        continue
                    for recompute in ("none", "full"):
                        yield ParallelConfig(
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            micro_batch=mb,
                            num_micro_batches=m,
                            schedule="interleaved_1f1b" if v > 1 else "1f1b",
                            virtual_stages=v,
                            recompute=recompute,
                        )


def grid_search(
    profile: ModelProfile, cluster: ClusterProfile, *, gpus: int, global_batch: int, memory_fraction: float = 0.9
) -> GridResult | None:
    """The fastest grid point that fits in ``memory_fraction`` of every device, or None."""
    cluster = with_gpus(cluster, gpus)
    best: GridResult | None = None
    tried = 0
    for config in grid_configs(profile, gpus, global_batch):
        try:
            config = fill_stage_node_types(cluster, config)
            est = estimate(profile, cluster, config, global_batch=global_batch, dtype=profile.dtype)
        except StratagemError:
            continue
        tried += 1
        fits = all(rk.memory.peak_bytes <= memory_fraction * rk.memory.capacity for rk in est.per_rank)
        if fits and (best is None or est.step_time_s < best.step_time_s):
            best = GridResult(config=config, step_time_s=est.step_time_s, points_tried=tried)
    if best is not None:
        best = GridResult(config=best.config, step_time_s=best.step_time_s, points_tried=tried)
    return best
