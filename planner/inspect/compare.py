"""Compare plans: a table of several, and what changed between two with its predicted cost.

>>> from planner.inspect.examples import build_example_plan
>>> a = build_example_plan("gpipe", with_alternatives=False)
>>> b = build_example_plan("1f1b", with_alternatives=False)
>>> [c.what for c in diff_plans(a, b).changes]
['schedule.kind']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from planner.core import StratagemError
from planner.inspect.frames import summary_frame
from planner.plan import Plan

MAX_LISTED_MODULES = 12


def compare_plans(plans: Sequence[Plan], names: Sequence[str] | None = None) -> pd.DataFrame:
    """One summary row per plan (see ``summary_frame``) plus ``slowdown`` = step time / fastest step time.

    Rows keep the given order; names default to ``pp.. dp.. tp.. schedule ...`` labels.
    """
    if not plans:
        raise StratagemError("compare_plans got no plans; pass at least one Plan")
    if names is not None and len(names) != len(plans):
        raise StratagemError(f"compare_plans got {len(plans)} plans but {len(names)} names; give one name each")
    rows = [summary_frame(p, names[i] if names else None) for i, p in enumerate(plans)]
    frame = pd.concat(rows)
    if not frame.index.is_unique:
        frame.index = [f"{label} #{i}" for i, label in enumerate(frame.index)]
        frame.index.name = "plan"
    if "step_time_s" in frame:
        frame["slowdown"] = frame["step_time_s"] / frame["step_time_s"].min()
    return frame


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """One decision that differs between two plans."""

    what: str
    before: str
    after: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CostDelta:
    """A predicted figure in both plans; ``delta`` = after - before (SI units, see ``quantity``)."""

    quantity: str
    before: float
    after: float

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def relative(self) -> float:
        return self.delta / self.before if self.before else float("nan")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanDiff:
    """What changed from plan ``a`` to plan ``b`` and what the cost model predicts it costs."""

    changes: tuple[Change, ...]
    costs: tuple[CostDelta, ...]

    def changes_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            [dict(what=c.what, before=c.before, after=c.after) for c in self.changes],
            columns=["what", "before", "after"],
        )

    def costs_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            [
                dict(quantity=c.quantity, before=c.before, after=c.after, delta=c.delta, relative=c.relative)
                for c in self.costs
            ],
            columns=["quantity", "before", "after", "delta", "relative"],
        ).set_index("quantity")

    def __str__(self) -> str:
        lines = [f"{c.what}: {c.before} -> {c.after}" for c in self.changes] or ["no decision changed"]
        lines += [
            f"{c.quantity}: {c.before:.4g} -> {c.after:.4g} ({_relative_text(c)})"
            for c in self.costs
            if c.before or c.after
        ]
        return "\n".join(lines)


def _relative_text(cost: CostDelta) -> str:
    return f"{cost.relative:+.1%}" if cost.before else "new"


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Decisions that differ (degrees, schedule, placement, layout, recompute) and predicted cost deltas."""
    changes = _top_level_changes(a, b) + _placement_changes(a, b) + _layout_changes(a, b) + _recompute_changes(a, b)
    return PlanDiff(changes=tuple(changes), costs=tuple(_cost_deltas(a, b)))


def _fields(plan: Plan) -> dict[str, str]:
    s = plan.schedule
    out = {"model": plan.model.name, "cluster": plan.cluster_name, "world_size": str(plan.world_size)}
    out.update({f"mesh.{axis}": str(plan.mesh.size(axis)) for axis in ("pp", "dp", "tp")})
    out.update(
        {
            "schedule.kind": s.kind,
            "schedule.virtual_stages": str(s.virtual_stages),
            "schedule.micro_batch_size": str(s.micro_batch_size),
            "schedule.micro_batches_per_replica": str(s.micro_batches_per_replica),
            "training.global_batch": str(plan.training.global_batch),
            "zero_stage": str(plan.zero_stage),
            "batch_shares": str(plan.batch_shares),
            "stages": str(len(plan.stages)),
            "node_type_per_pp_rank": ",".join(_node_types_by_pp_rank(plan)),
        }
    )
    return out


def _node_types_by_pp_rank(plan: Plan) -> list[str]:
    first: dict[int, str] = {}
    for st in sorted(plan.stages, key=lambda x: x.index):
        first.setdefault(st.pp_rank, st.node_type)
    return [first[r] for r in sorted(first)]


def _top_level_changes(a: Plan, b: Plan) -> list[Change]:
    fa, fb = _fields(a), _fields(b)
    return [Change(what=k, before=fa[k], after=fb[k]) for k in fa if fa[k] != fb[k]]


def _stage_of(plan: Plan) -> dict[str, int]:
    return {p: st.index for st in plan.stages for p in st.module_paths}


def _listed(what: str, items: list[tuple[str, str, str]]) -> list[Change]:
    """Up to MAX_LISTED_MODULES per-module changes, then one line counting the rest."""
    out = [Change(what=f"{what}[{path}]", before=x, after=y) for path, x, y in items[:MAX_LISTED_MODULES]]
    if len(items) > MAX_LISTED_MODULES:
        out.append(Change(what=f"{what}[...]", before="", after=f"{len(items) - MAX_LISTED_MODULES} more modules"))
    return out


def _placement_changes(a: Plan, b: Plan) -> list[Change]:
    sa, sb = _stage_of(a), _stage_of(b)
    moved = [
        (p, f"stage {sa.get(p, '-')}", f"stage {sb.get(p, '-')}")
        for p in sorted(set(sa) | set(sb), key=lambda p: (sa.get(p, sb.get(p, 0)), p))
        if sa.get(p) != sb.get(p)
    ]
    return _listed("stage", moved)


def _layout_changes(a: Plan, b: Plan) -> list[Change]:
    def style(plan: Plan, path: str) -> str:
        lay = plan.layout.get(path)
        return "replicate" if lay is None else lay.style + ("+sp" if lay.sequence_parallel else "")

    paths = sorted(set(_stage_of(a)) | set(_stage_of(b)))
    return _listed("layout", [(p, style(a, p), style(b, p)) for p in paths if style(a, p) != style(b, p)])


def _recompute_changes(a: Plan, b: Plan) -> list[Change]:
    def modes(plan: Plan) -> dict[str, str]:
        return {p: m for st in plan.stages for p, m in st.recompute.items()}

    ma, mb = modes(a), modes(b)
    paths = sorted(set(_stage_of(a)) | set(_stage_of(b)))
    return _listed(
        "recompute",
        [(p, ma.get(p, "none"), mb.get(p, "none")) for p in paths if ma.get(p, "none") != mb.get(p, "none")],
    )


def _cost_deltas(a: Plan, b: Plan) -> list[CostDelta]:
    if a.predictions is None or b.predictions is None:
        return []
    pa, pb = a.predictions, b.predictions
    out = [
        CostDelta(quantity=q, before=getattr(pa, q), after=getattr(pb, q))
        for q in ("step_time_s", "tokens_per_s", "peak_memory_bytes", "mfu")
    ]
    for term in list(pa.breakdown_s) + [t for t in pb.breakdown_s if t not in pa.breakdown_s]:
        out.append(
            CostDelta(
                quantity=f"breakdown.{term}_s",
                before=pa.breakdown_s.get(term, 0.0),
                after=pb.breakdown_s.get(term, 0.0),
            )
        )
    return out
