"""Frontier rows: one per (cluster, device count, global batch), their Pareto marks, the CSV and the terminal
table, and the choice under a deadline or a budget."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

from planner.frontier.pareto import pareto_front


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontierRow:
    """The best plan for one cluster type and device count (``status`` "ok"), or why there is none
    (``status`` "no plan", ``reason``). Units in the names; None where a figure does not apply."""

    cluster: str
    device: str
    gpus: int
    global_batch: int
    lr_scale: float  # learning rate / the one of --global-batch (linear scaling, Goyal et al. 2017)
    status: str
    reason: str = ""
    strategy: str = ""
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    utilisation: float | None = None
    peak_memory_gib: float | None = None
    memory_gib: float | None = None  # one device's memory
    train_days: float | None = None
    gpu_hours: float | None = None
    price_usd_per_gpu_hour: float | None = None
    cost_usd: float | None = None
    energy_mwh: float | None = None
    search: str = ""  # the search's status: optimal, or its proven gap
    search_s: float | None = None
    pareto_time_cost: bool = False
    pareto_time_energy: bool = False
    plan_command: str = ""  # the `stratagem plan` command that returns this row's plan

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def mark_pareto(rows: Sequence[FrontierRow]) -> list[FrontierRow]:
    """The rows with their Pareto marks: among rows with a plan (and a cost, or an energy), those that no other
    row beats in (days, cost) and in (days, energy)."""
    marks: dict[str, list[bool]] = {}
    for field in ("cost_usd", "energy_mwh"):
        idx = [i for i, r in enumerate(rows) if r.ok and getattr(r, field) is not None]
        front = pareto_front([(float(rows[i].train_days or 0.0), float(getattr(rows[i], field))) for i in idx])
        marks[field] = [False] * len(rows)
        for i, on in zip(idx, front):
            marks[field][i] = on
    return [
        replace(r, pareto_time_cost=marks["cost_usd"][i], pareto_time_energy=marks["energy_mwh"][i])
        for i, r in enumerate(rows)
    ]


def choose_within(
    rows: Sequence[FrontierRow], *, deadline_days: float | None = None, budget_usd: float | None = None
) -> tuple[FrontierRow | None, str]:
    """With a deadline: the cheapest row that meets it; with a budget: the fastest row within it; with both, the
    cheapest row meeting both. Returns (row or None, one line saying which and why, or that none does)."""
    if deadline_days is None and budget_usd is None:
        return None, ""
    priced = [r for r in rows if r.ok and r.cost_usd is not None]
    if not priced:
        return None, "no row has a price: give --price CLUSTER=USD to choose under a deadline or budget"
    fits = [
        r
        for r in priced
        if (deadline_days is None or r.train_days <= deadline_days)  # type: ignore[operator]
        and (budget_usd is None or r.cost_usd <= budget_usd)  # type: ignore[operator]
    ]
    want = " and ".join(
        filter(
            None,
            [
                f"finishing within {deadline_days:g} days" if deadline_days is not None else "",
                f"costing at most ${budget_usd:,.0f}" if budget_usd is not None else "",
            ],
        )
    )
    if not fits:
        fastest = min(priced, key=lambda r: r.train_days or 0.0)
        cheapest = min(priced, key=lambda r: r.cost_usd or 0.0)
        return None, (
            f"no configuration {want}: the fastest is {_name(fastest)} ({fastest.train_days:.1f} days, "
            f"${fastest.cost_usd:,.0f}), the cheapest {_name(cheapest)} ({cheapest.train_days:.1f} days, "
            f"${cheapest.cost_usd:,.0f})"
        )
    if deadline_days is not None:
        best = min(fits, key=lambda r: (r.cost_usd or 0.0, r.train_days or 0.0))
        how = "cheapest"
    else:
        best = min(fits, key=lambda r: (r.train_days or 0.0, r.cost_usd or 0.0))
        how = "fastest"
    return best, (
        f"{how} configuration {want}: {_name(best)}, {best.train_days:.1f} days, ${best.cost_usd:,.0f}, {best.strategy}"
    )


def _name(row: FrontierRow) -> str:
    return f"{row.gpus} x {row.cluster}" + (f" at batch {row.global_batch}" if row.lr_scale != 1 else "")


CSV_FIELDS = tuple(f.name for f in fields(FrontierRow))


def csv_text(rows: Sequence[FrontierRow]) -> str:
    """The rows as CSV, one column per :class:`FrontierRow` field (empty where None)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})
    return buf.getvalue()


def terminal_lines(rows: Sequence[FrontierRow], *, batch_column: bool = False) -> list[str]:
    """The rows as a table of at most 80 columns: cluster, devices, (batch,) days, cost, energy, MFU, peak memory,
    Pareto marks (C: time-cost, E: time-energy), the strategy's degrees; rows without a plan say why."""
    head = f"{'cluster':<13}{'GPUs':>5}" + (f"{'batch':>6}" if batch_column else "")
    head += f"{'days':>7}{'cost $':>9}{'MWh':>6}{'MFU':>5}{'GiB':>4} {'PF':<2} strategy"
    lines = [head]
    for r in rows:
        start = f"{r.cluster[:12]:<13}{r.gpus:>5}" + (f"{r.global_batch:>6}" if batch_column else "")
        if not r.ok:
            lines.append(_fit(f"{start}  no plan: {r.reason}"))
            continue
        cost = "-" if r.cost_usd is None else _money(r.cost_usd)
        energy = "-" if r.energy_mwh is None else _short(r.energy_mwh)
        marks = ("C" if r.pareto_time_cost else "") + ("E" if r.pareto_time_energy else "")
        line = (
            f"{start}{_short(r.train_days or 0.0):>7}{cost:>9}{energy:>6}{100 * (r.mfu or 0):>4.0f}%"
            f"{r.peak_memory_gib or 0:>4.0f} "
            f"{marks:<2} {_degrees(r.strategy)}"
        )
        lines.append(_fit(line))
    return lines


def _short(x: float) -> str:
    """A figure in at most 6 characters: 1234, 56.7, 0.123."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _money(usd: float) -> str:
    """$ compactly: 950, 12.3k, 4.56M."""
    if usd >= 1e6:
        return f"{usd / 1e6:.2f}M"
    if usd >= 1e3:
        return f"{usd / 1e3:.1f}k"
    return f"{usd:.0f}"


def _degrees(strategy: str) -> str:
    """A plan label in short: the degrees above 1, ZeRO stage, interleaving, sp and recompute (the CSV has it all).

    >>> _degrees("tp2 pp4 dp128 cp4(ring) interleaved_1f1b(v=5) mb1x16 zero3 sp recompute full x2")
    'tp2 pp4 dp128 cp4 v5 z3 sp rc'
    """
    keep = []
    for part in strategy.split():
        head = part.split("(")[0]
        if head[:2] in ("tp", "pp", "dp", "cp", "ep") and head[2:].isdigit():
            if head[2:] != "1":
                keep.append(head)
        elif part.startswith("interleaved") and "v=" in part:
            keep.append("v" + part.split("v=")[1].rstrip(")"))
        elif part.startswith("zero") and part != "zero0":
            keep.append("z" + part[4:])
        elif part == "sp":
            keep.append("sp")
        elif part == "recompute":
            keep.append("rc")
    return " ".join(keep)


def _fit(line: str, width: int = 80) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"
