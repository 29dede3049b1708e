"""Why a plan chose its context-parallel degree: the best plan at every cp the model allows.

:func:`best_per_cp` runs the exact search once per cp degree (``SearchConfig.cp`` fixed, both K/V exchanges
tried), so each row is the proven best plan *at that cp* (or why none fits). The row of the cp the free
search chose is the fastest; the others show what a smaller cp costs (activation memory forces recompute,
smaller micro-batches or deeper pipelines) and what a larger one costs (K/V exchange, fewer data-parallel
replicas). ``stratagem plan --cp-table`` and ``benchmarks/search_speed.py`` print it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.core import StratagemError
from planner.cost import cp_degrees
from planner.profile import ClusterProfile, ModelProfile
from planner.search.config import SearchConfig
from planner.search.planner import plan_search


@dataclass(frozen=True, kw_only=True, slots=True)
class CpRow:
    """The best plan at one cp degree (``summary`` None: nothing fits; ``error`` says why)."""

    cp: int
    summary: str | None
    step_s: float
    peak_memory_bytes: float
    activation_bytes: float
    status: str
    search_s: float
    error: str = ""


def best_per_cp(
    profile: ModelProfile, cluster: ClusterProfile, *, gpus: int, global_batch: int, config: SearchConfig
) -> list[CpRow]:
    """One :class:`CpRow` per cp degree the model, sequence and devices allow (``cp_degrees``)."""
    rows = []
    for cp in cp_degrees(profile, gpus):
        try:
            result = plan_search(
                profile, cluster, gpus=gpus, global_batch=global_batch, config=replace(config, cp=cp, top_k=1)
            )
        except StratagemError as exc:
            rows.append(
                CpRow(
                    cp=cp,
                    summary=None,
                    step_s=math.inf,
                    peak_memory_bytes=math.nan,
                    activation_bytes=math.nan,
                    status="no plan",
                    search_s=0.0,
                    error=str(exc).split(";")[0],
                )
            )
            continue
        est = result.best.estimate
        rows.append(
            CpRow(
                cp=cp,
                summary=result.best.outer.summary(),
                step_s=result.best.step_s,
                peak_memory_bytes=est.peak_memory_bytes,
                activation_bytes=max(rk.memory.activations for rk in est.per_rank),
                status=result.status if result.status == "optimal" else f"{result.status} gap<={result.gap:.2%}",
                search_s=result.wall_time_s,
            )
        )
    return rows


def format_cp_table(rows: list[CpRow]) -> list[str]:
    """Text lines of the table, fastest marked."""
    best = min((r.step_s for r in rows), default=math.inf)
    lines = [
        f"{'cp':>4s} {'step_s':>9s} {'vs best':>8s} {'peak GiB':>9s} {'act GiB':>8s}  {'status':10s} "
        "best plan at this cp"
    ]
    for r in rows:
        if r.summary is None:
            lines.append(f"{r.cp:4d} {'-':>9s} {'-':>8s} {'-':>9s} {'-':>8s}  {r.status:10s} {r.error}")
            continue
        mark = " <- chosen" if r.step_s == best else ""
        lines.append(
            f"{r.cp:4d} {r.step_s:9.3f} {r.step_s / best:7.3f}x {r.peak_memory_bytes / 2**30:9.1f} "
            f"{r.activation_bytes / 2**30:8.1f}  {r.status:10s} {r.summary}{mark}"
        )
    return lines
