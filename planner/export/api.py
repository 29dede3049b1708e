"""Export a plan and import a framework config, each with the cost model's estimate beside it.

export_plan(plan, "megatron", profile=profile, cluster=cluster) -> Export
import_config("megatron", text, world_size=1024) -> FrameworkSettings
compare(plan, current, framework, profile=..., cluster=...) -> Comparison   (plan vs the user's config)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType

from planner.core import StratagemError
from planner.cost import Estimate, ParallelConfig, estimate, fill_stage_node_types, plan_config, with_gpus
from planner.export import accelerate, deepspeed, megatron, torchtitan
from planner.export.nearest import Change, nearest_candidates
from planner.export.settings import FRAMEWORKS, FrameworkSettings, to_parallel_config
from planner.plan import Plan
from planner.profile import ClusterProfile, ModelProfile
from planner.search import SearchConfig

FORMATS: dict[str, ModuleType] = {
    "megatron": megatron,
    "torchtitan": torchtitan,
    "deepspeed": deepspeed,
    "accelerate": accelerate,
}
IMPORTERS = ("megatron", "deepspeed", "torchtitan")


def layer_kinds(profile: ModelProfile) -> list[tuple[str, str]]:
    """``[(module path, kind), ...]`` in model order: what chunking and recompute mappings need."""
    return [(layer.path, layer.kind) for layer in profile.layers]


def estimate_config(
    config: ParallelConfig, *, profile: ModelProfile, cluster: ClusterProfile, global_batch: int
) -> Estimate:
    """The cost model's estimate of ``config`` on ``cluster`` resized to its GPU count."""
    sized = with_gpus(cluster, config.world_size)
    if sized.is_mixed and config.stage_node_types is None and config.replica_node_types is None:
        config = fill_stage_node_types(sized, config)
    return estimate(profile, sized, config, global_batch=global_batch, dtype=profile.dtype)


def estimate_settings(
    settings: FrameworkSettings, *, profile: ModelProfile, cluster: ClusterProfile, framework: str | None = None
) -> Estimate:
    """The cost model's estimate of a framework's config, its memory as ``framework`` holds it."""
    return estimate_config(
        to_parallel_config(settings, layer_kinds(profile), framework),
        profile=profile,
        cluster=cluster,
        global_batch=settings.global_batch,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Export:
    """An exported config: its text, what changed from the plan, and both estimates (same cost model)."""

    framework: str
    text: str
    settings: FrameworkSettings
    changes: list[Change]
    plan_estimate: Estimate
    exported_estimate: Estimate

    def summary_lines(self) -> list[str]:
        """The comparison the CLI prints and the file header carries."""
        p, e = self.plan_estimate, self.exported_estimate
        gib = 2**30
        lines = [
            f"plan (cost model): step {p.step_time_s:.4g} s, peak {p.peak_memory_bytes / gib:.2f} GiB per GPU",
            f"this {self.framework} config (cost model): step {e.step_time_s:.4g} s "
            f"({(e.step_time_s / p.step_time_s - 1) * 100:+.1f} %), peak {e.peak_memory_bytes / gib:.2f} GiB"
            + ("" if e.fits_in_memory else " - DOES NOT FIT in device memory"),
        ]
        if self.changes:
            lines.append(f"changed from the plan ({len(self.changes)}): the framework cannot express")
            lines += [f"  - {c.line()}" for c in self.changes]
        else:
            lines.append("exact: the framework expresses the plan as it is")
        return lines


def _within_budget(est: Estimate, memory_fraction: float) -> bool:
    """Every rank's peak within ``memory_fraction`` of its device's memory (the search's own budget)."""
    return all(r.memory.peak_bytes <= memory_fraction * r.memory.capacity for r in est.per_rank)


def _fastest_that_fits(candidates, *, profile: ModelProfile, cluster: ClusterProfile, framework: str | None = None):
    """The candidate with the least step time among those within the search's default memory budget
    (``SearchConfig.memory_fraction``), else among those that fit at all, else the one with the least memory."""
    scored = [
        (s, changes, estimate_settings(s, profile=profile, cluster=cluster, framework=framework))
        for s, changes in candidates
    ]
    for keep in (lambda e: _within_budget(e, SearchConfig().memory_fraction), lambda e: e.fits_in_memory):
        chosen = [c for c in scored if keep(c[2])]
        if chosen:
            return min(chosen, key=lambda c: c[2].step_time_s)
    return min(scored, key=lambda c: c[2].peak_memory_bytes)


def export_plan(plan: Plan, framework: str, *, profile: ModelProfile, cluster: ClusterProfile) -> Export:
    """The framework's nearest config to ``plan``, with its estimate next to the plan's."""
    if framework not in FORMATS:
        raise StratagemError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")
    plan_est = estimate_config(
        plan_config(plan), profile=profile, cluster=cluster, global_batch=plan.training.global_batch
    )
    settings, changes, exported_est = _fastest_that_fits(
        nearest_candidates(plan, profile, framework), profile=profile, cluster=cluster, framework=framework
    )
    export = Export(
        framework=framework,
        text="",
        settings=settings,
        changes=changes,
        plan_estimate=plan_est,
        exported_estimate=exported_est,
    )
    header = [
        f"{framework} config for the Stratagem plan of {plan.model.name} on {plan.world_size} x "
        f"{plan.cluster_name} (stratagem export; plan {str(plan.content_hash or '')[:19]})",
        *export.summary_lines(),
    ]
    text = FORMATS[framework].render(settings, header=header)
    return Export(
        framework=framework,
        text=text,
        settings=settings,
        changes=changes,
        plan_estimate=plan_est,
        exported_estimate=exported_est,
    )


def import_config(
    framework: str, text: str, *, world_size: int | None = None, layers: int | None = None
) -> FrameworkSettings:
    """Parse a framework config (Megatron arguments, ``ds_config.json``, torchtitan config)."""
    if framework == "megatron":
        return megatron.parse(text, world_size=world_size)
    if framework == "deepspeed":
        return deepspeed.parse(text, world_size=world_size)
    if framework == "torchtitan":
        return torchtitan.parse(text, world_size=world_size, layers=layers)
    raise StratagemError(f"cannot import {framework!r} configs; choose one of {', '.join(IMPORTERS)}")


def flat_items(framework: str, settings: FrameworkSettings) -> dict[str, str]:
    """The config as ``{flag or dotted key: value}`` in the framework's own names."""
    items = FORMATS[framework].to_items(settings)
    out: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = "" if value is None else str(value)

    walk("", items)
    return out


def flag_changes(framework: str, current: FrameworkSettings, proposed: FrameworkSettings) -> list[str]:
    """What to change in the user's config, in the framework's flag/key names: ``--flag old -> new``."""
    old, new = flat_items(framework, current), flat_items(framework, proposed)
    lines = []
    for key in dict.fromkeys([*new, *old]):
        if key in old and key in new:
            if old[key] != new[key]:
                lines.append(f"{key} {old[key]} -> {new[key]}")
        elif key in new:
            lines.append(f"add {key}" + (f" {new[key]}" if new[key] else ""))
        else:
            lines.append(f"remove {key}" + (f" {old[key]}" if old[key] else ""))
    return lines


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """The plan against the user's current config: speed-up, memory, and the flag changes."""

    framework: str
    current: FrameworkSettings
    current_estimate: Estimate
    plan_estimate: Estimate
    proposed: FrameworkSettings
    proposed_estimate: Estimate
    changes: list[Change]
    flag_changes: list[str]

    @property
    def speedup(self) -> float:
        """Current step time / the exported plan's step time (what the user gets by switching)."""
        return self.current_estimate.step_time_s / self.proposed_estimate.step_time_s


def compare(
    plan: Plan, current: FrameworkSettings, framework: str, *, profile: ModelProfile, cluster: ClusterProfile
) -> Comparison:
    """Estimate the user's ``current`` config and the plan (and its nearest ``framework`` config)."""
    current_est = estimate_settings(current, profile=profile, cluster=cluster, framework=framework)
    exported = export_plan(plan, framework, profile=profile, cluster=cluster)
    # the planner chooses neither the weight decay nor, without a recipe in the plan, the learning rate: keep the
    # user's so that the flag changes are only what the plan changes
    proposed = replace(exported.settings, weight_decay=current.weight_decay)
    if plan.training.lr_schedule is None:
        proposed = replace(proposed, lr_schedule=current.lr_schedule)
    return Comparison(
        framework=framework,
        current=current,
        current_estimate=current_est,
        plan_estimate=exported.plan_estimate,
        proposed=proposed,
        proposed_estimate=exported.exported_estimate,
        changes=exported.changes,
        flag_changes=flag_changes(framework, current, proposed),
    )
