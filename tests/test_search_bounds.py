"""The outer loop's lower bounds, end to end: for every outer candidate of random small instances, each bound the
branch and bound prunes with (the quick layer-time bound, a family's bound over its expert layouts, the bound
with sends / tail / memory, the memory-aware refined bound) is at most the candidate's solved optimum, and a
candidate the search skips as dominated is no faster than the one dominating it. A bound above its candidate's
optimum would let the search prune the true best plan and still call its answer optimal."""

from __future__ import annotations

import math
import random

from planner.core import StratagemError
from planner.cost import with_gpus
from planner.model import parse_model
from planner.profile import build_gpt_profile, load_cluster_profile, resolve_cluster_path
from planner.search import (
    CandidateCosts,
    LayerCostCache,
    SearchConfig,
    dominates,
    expand_experts,
    lower_bound_s,
    memory_shortfall_bytes,
    refined_lower_bound_s,
)
from planner.search.planner import _enumerate, _key, _solve_candidate
from planner.search.space import OuterShape

SLACK = 1 + 1e-9


def _instances(rng: random.Random) -> list[tuple]:
    out = []
    for _ in range(4):
        family = rng.choice(["gpt", "llama"])
        extra = {"kv_heads": 2} if family == "llama" else {}
        spec = parse_model(family, layers=rng.choice([4, 6]), hidden=rng.choice([64, 128]), heads=4, vocab=512,
                           max_seq=256, **extra)  # fmt: skip
        out.append((spec, rng.choice([64, 256]), rng.choice(["dgx-a100-80g", "dgx-h100"]), rng.choice([4, 8, 16]),
                    rng.choice([16, 32])))  # fmt: skip
    out.append((parse_model("moe:tiny"), 64, "dgx-h100", 8, 16))  # expert families (ep, etp) bounded as one
    out.append((parse_model("gpt", layers=4, hidden=64, heads=4, vocab=512, max_seq=16384), 16384, "dgx-h100", 8, 8))
    return out


def test_every_bound_is_below_its_candidates_solved_optimum():
    rng = random.Random(20261127)
    checked = 0
    for spec, seq, cluster_name, gpus, batch in _instances(rng):
        cluster = with_gpus(load_cluster_profile(resolve_cluster_path(cluster_name)), gpus)
        config = SearchConfig(time_limit_s=60, top_k=1, flash_attention=seq > 1024, cp_min_seq_len=8192)
        profile = build_gpt_profile(spec, seq_len=seq, dtype="bf16")
        costs = CandidateCosts(profile, cluster, global_batch=batch, config=config)
        outers = []  # (bound of its shape, candidate or expert family)
        for entry in _enumerate(profile, cluster, gpus=gpus, global_batch=batch, config=config):
            if isinstance(entry, OuterShape):
                try:
                    shape_bound = costs.shape_bound_s(entry)
                except StratagemError:
                    shape_bound = 0.0  # the search bounds such a shape by 0
                outers += [(shape_bound, member) for member in entry.members(families=True)]
            else:
                outers.append((0.0, entry))
        rng.shuffle(outers)
        solved: list[tuple] = []  # (outer, tables, optimum)
        for shape_bound, outer in outers[:14]:
            try:
                family_bound = costs.quick_bound_s(outer)
            except StratagemError:
                continue  # unpriceable: dropped and listed by the search, never bounded
            for member in expand_experts(outer) if outer.expert_family else [outer]:
                try:
                    tables = costs.tables(member)
                except StratagemError:
                    continue
                bounds = {"shape": shape_bound, "family": family_bound, "quick": costs.quick_bound_s(member)}
                if memory_shortfall_bytes(tables) > 0:
                    continue  # the search drops it as infeasible before bounding
                bounds["tables"] = lower_bound_s(tables)
                bounds["refined"] = refined_lower_bound_s(tables)
                candidate, result = _solve_candidate(costs, member, tables, config)
                if candidate is None:
                    assert result.status == "infeasible" or not math.isfinite(bounds["refined"]), result.status
                    continue
                assert result.status == "optimal", (member.summary(), result.status)
                for name, bound in bounds.items():
                    assert bound <= candidate.step_s * SLACK, (name, bound, candidate.step_s, member.summary())
                for other, other_tables, other_s in solved:
                    if _key(other) == _key(member) and dominates(other_tables, tables):
                        assert other_s <= candidate.step_s * SLACK, (other.summary(), member.summary())
                solved.append((member, tables, candidate.step_s))
                checked += 1
    assert checked >= 40, checked


def test_bounds_and_tables_do_not_depend_on_what_was_priced_before():
    """Every cached term (layer costs, groups of option costs, rank models, least layer times, the hidden sync and
    ZeRO-3 terms) is keyed by all it reads: a candidate's quick bound and tables are the same from costs that priced
    other candidates first, and shared a LayerCostCache with searches of other device counts and global batches
    (as `stratagem frontier` shares it), as from fresh costs. A term cached under too short a key (ZeRO-3's hidden
    gathers once ignored the micro-batch count) gives a candidate another's bound."""
    rng = random.Random(20261129)
    spec = parse_model("llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, max_seq=256)
    profile = build_gpt_profile(spec, seq_len=256, dtype="bf16")
    config = SearchConfig(time_limit_s=60, top_k=1)
    shared = LayerCostCache()
    checked = zero3_pp = 0
    for gpus, batch in ((8, 32), (16, 32), (16, 64)):
        cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), gpus)
        warm = CandidateCosts(profile, cluster, global_batch=batch, config=config, shared=shared)
        members = [
            member
            for entry in _enumerate(profile, cluster, gpus=gpus, global_batch=batch, config=config)
            for member in (entry.members(families=True) if isinstance(entry, OuterShape) else [entry])
        ]
        rng.shuffle(members)
        for outer in members[:60]:
            fresh = CandidateCosts(profile, cluster, global_batch=batch, config=config)
            assert warm.quick_bound_s(outer) == fresh.quick_bound_s(outer), outer.summary()
            assert warm.tables(outer) == fresh.tables(outer), outer.summary()
            checked += 1
            zero3_pp += outer.zero_stage == 3 and outer.pp > 1
    assert checked == 180 and zero3_pp >= 5, (checked, zero3_pp)


def test_a_shapes_size_counts_its_members():
    """OuterShape.size, counted without making the candidates, is what members() yields (expert layouts counted,
    GPipe skipped where an MoE model's 1F1B runs): the search's candidate totals rest on it."""
    cases = [
        (parse_model("gpt", layers=4, hidden=64, heads=4, vocab=512, max_seq=256), 256, 16, 32),
        (parse_model("moe:tiny"), 64, 8, 16),
        (parse_model("llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, max_seq=16384), 16384, 8, 8),
    ]
    shapes = 0
    for spec, seq, gpus, batch in cases:
        cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), gpus)
        config = SearchConfig(time_limit_s=60, top_k=1, flash_attention=True, cp_min_seq_len=8192)
        profile = build_gpt_profile(spec, seq_len=seq, dtype="bf16")
        for entry in _enumerate(profile, cluster, gpus=gpus, global_batch=batch, config=config):
            if isinstance(entry, OuterShape):
                assert entry.size == sum(len(c.expert_family) or 1 for c in entry.members(families=True)), entry
                shapes += 1
    assert shapes >= 30, shapes
