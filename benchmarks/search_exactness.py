"""Is "proven optimal" true? The search against an independent brute force over uniform configurations.

For each instance, the brute force scores with ``planner.cost.estimate`` every *uniform* configuration it accepts —
every tp x pp x dp x cp split of the devices (context parallelism with both K/V exchanges, for sequences of at least
``SearchConfig.cp_min_seq_len`` tokens, where the search tries it), micro-batch size, schedule (1F1B, GPipe,
interleaved with 2..8 virtual stages), ZeRO stage 0-3, sequence parallelism, and one recompute mode for all blocks —
and keeps the fastest whose every rank fits in ``memory_fraction`` of its device. The search's space holds every
uniform configuration (and more: per-layer recompute, uneven stages, replicate-or-split), so its plan must never be
slower. A plan slower than the best uniform configuration by more than 1e-9 relative, a "no plan fits" where a
uniform configuration fits, or a status other than ``optimal`` is a failure.

Instances: random GPT models (2-8 blocks, hidden 1,024-8,192, heads of 128 dims, vocab 8k-51k, sequence
1,024 or 2,048) on 2-16 A100s (``dgx-a100-80g``) with a memory fraction of 0.3-0.9, so memory binds;
``--presets``: every Narayanan et al. SC21 Table 1 model at its published GPU count and batch
(``benchmarks/data/published_cases.csv``) at memory fraction 0.9. ``--long-context``: sequences of
8,192-32,768 tokens with flash attention (causal block skipping), where context parallelism pays.
``--moe N``: N random Mixture-of-Experts models (4-16 experts, top-1/2, optional shared expert and dense first
block) on 2-16 H100s, the brute force then also over every expert layout (ep dividing the experts, etp
dividing tp, ep x etp dividing dp x tp).

Every recompute mode is scored: it is not monotone in time under the cost model (recompute lengthens the
backward window that ZeRO-3 gathers and gradient syncs hide behind, so it can shorten a step).

    .venv/bin/python benchmarks/search_exactness.py [--instances 300] [--seed 0] [--presets] [--moe 40]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cli.common import resolve_cluster_path  # noqa: E402
from planner.core import StratagemError  # noqa: E402
from planner.cost import (  # noqa: E402
    ParallelConfig,
    estimate,
    with_gpus,
)
from planner.model import parse_model  # noqa: E402
from planner.profile import (  # noqa: E402
    ClusterProfile,
    ModelProfile,
    build_gpt_profile,
    load_cluster_profile,
)
from planner.search import (  # noqa: E402
    ALL_DIMENSIONS,
    SearchConfig,
    plan_search,
)

REL_TOL = 1e-9
ALL = frozenset(ALL_DIMENSIONS)
MAX_MICRO_BATCH = 16  # SearchConfig defaults: the brute force covers the same sizes
MAX_VIRTUAL_STAGES = 8
RECOMPUTE = ("none", "selective", "full")
# Narayanan et al. SC21 Table 1 (benchmarks/data/published_cases.csv): preset, GPUs, global batch
TABLE_1 = [
    ("megatron-1.7b", 32, 512),
    ("megatron-3.6b", 64, 512),
    ("megatron-7.5b", 128, 512),
    ("megatron-18.4b", 256, 1024),
    ("megatron-39.1b", 512, 1536),
    ("megatron-76.1b", 1024, 1792),
    ("megatron-145.6b", 1536, 2304),
    ("megatron-310.1b", 1920, 2160),
    ("megatron-529.6b", 2520, 2520),
    ("megatron-1008b", 3072, 3072),
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Instance:
    label: str
    profile: ModelProfile
    cluster: ClusterProfile
    gpus: int
    global_batch: int
    memory_fraction: float
    flash_attention: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    instance: Instance
    uniform_s: float | None  # best fitting uniform configuration (None: none fits)
    uniform: str
    plan_s: float | None  # the search's plan (None: it said nothing fits)
    status: str
    search_wall_s: float
    brute_wall_s: float
    scored: int  # configurations estimate accepted

    @property
    def kind(self) -> str:
        """ok | worse | missed (uniform fits, search found nothing) | not_optimal | both_infeasible"""
        if self.uniform_s is None:
            return "both_infeasible" if self.plan_s is None else "ok"
        if self.plan_s is None:
            return "missed"
        if self.plan_s > self.uniform_s * (1 + REL_TOL):
            return "worse"
        return "ok" if self.status == "optimal" else "not_optimal"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cp_choices(profile: ModelProfile, devices: int) -> list[tuple[int, str | None]]:
    """(cp, K/V exchange): 1, and every cp dividing ``devices`` with ``seq % 2cp == 0``, both exchanges, for
    sequences the search tries cp on (``SearchConfig.cp_min_seq_len``: its stated space)."""
    out: list[tuple[int, str | None]] = [(1, None)]
    if profile.model.family in ("gpt", "llama") and profile.seq_len >= SearchConfig().cp_min_seq_len:
        for cp in _divisors(devices)[1:]:
            if profile.seq_len % (2 * cp) == 0:
                out += [(cp, "allgather"), (cp, "ring")]
    return out


def uniform_configs(
    profile: ModelProfile, gpus: int, global_batch: int, flash: bool = False
) -> Iterator[tuple[ParallelConfig, ...]]:
    """Every uniform configuration, grouped: one tuple per split, its recompute modes in RECOMPUTE order.
    Written from the rules of ``estimate`` (which rejects what cannot run), not from the search's space."""
    blocks = sum(1 for layer in profile.layers if layer.kind == "block") or len(profile.layers)
    experts = next((layer.experts.experts for layer in profile.layers if layer.experts is not None), 0)
    for tp in sorted(profile.tp_degrees):
        for pp, cp, mode in (
            (pp, cp, mode)
            for pp in (_divisors(gpus // tp) if gpus % tp == 0 else [])
            for cp, mode in _cp_choices(profile, gpus // (tp * pp))
        ):
            dp = gpus // (tp * pp * cp)
            if pp > blocks or global_batch % dp or experts and cp > 1:  # MoE: cp 1 (planner.search.planner)
                continue
            for mb in [d for d in _divisors(global_batch // dp) if d <= MAX_MICRO_BATCH]:
                m = global_batch // (dp * mb)
                schedules = [("1f1b", 1)] + ([("gpipe", 1)] if pp > 1 else [])
                schedules += [("interleaved_1f1b", v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if pp > 1]
                for schedule, v in schedules:
                    for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                        for sp in (False, True) if tp > 1 else (False,):
                            for ep, etp in _expert_layouts(experts, tp, dp):
                                yield tuple(
                                    ParallelConfig(
                                        tp=tp,
                                        pp=pp,
                                        dp=dp,
                                        micro_batch=mb,
                                        num_micro_batches=m,
                                        schedule=schedule,
                                        virtual_stages=v,
                                        zero_stage=zero,
                                        sequence_parallel=sp,
                                        recompute=rc,
                                        cp=cp,
                                        context_parallel=mode,  # type: ignore[arg-type]
                                        flash_attention=flash,
                                        causal_skip=flash,
                                        ep=ep,
                                        etp=etp,
                                    )
                                    for rc in RECOMPUTE
                                )


def _expert_layouts(experts: int, tp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) of an MoE model by the folding rules (planner.plan.schema.check_expert_layout); [(1, 1)] when dense."""
    if not experts:
        return [(1, 1)]
    return [(ep, etp) for etp in _divisors(tp) for ep in _divisors(experts) if (dp * tp) % (ep * etp) == 0]


def best_uniform(inst: Instance) -> tuple[float | None, str, int]:
    """(step time of the fastest fitting uniform configuration, its summary, configurations scored)."""
    best_s, best, scored = math.inf, "", 0
    for group in uniform_configs(inst.profile, inst.gpus, inst.global_batch, inst.flash_attention):
        for config in group:
            try:
                est = estimate(
                    inst.profile, inst.cluster, config, global_batch=inst.global_batch, dtype=inst.profile.dtype
                )
            except StratagemError:
                break  # a split estimate rejects is rejected for every recompute mode
            scored += 1
            cap = inst.cluster.node_types[0].device_memory_bytes * inst.memory_fraction
            if all(rk.memory.peak_bytes <= cap for rk in est.per_rank):
                if est.step_time_s < best_s:
                    best_s, best = (
                        est.step_time_s,
                        (
                            f"tp{config.tp} pp{config.pp} dp{config.dp} cp{config.cp}({config.context_parallel}) "
                            f"{config.schedule}"
                            f"(v={config.virtual_stages}) mb{config.micro_batch}x"
                            f"{config.num_micro_batches} zero{config.zero_stage}"
                            f"{' sp' if config.sequence_parallel else ''}"
                            f"{f' ep{config.ep} etp{config.etp}' if config.ep * config.etp > 1 else ''} "
                            f"recompute={config.recompute}"
                        ),
                    )
    return (best_s if math.isfinite(best_s) else None), best, scored


def random_instance(
    rng: random.Random,
    index: int,
    *,
    max_blocks: int = 8,
    max_gpus: int = 16,
    hiddens: tuple[int, ...] = (1024, 1536, 2048, 3072, 4096, 6144, 8192),
    long_context: bool = False,
) -> Instance:
    hidden = rng.choice(hiddens)
    blocks = rng.randint(2, max_blocks)
    seq = rng.choice([8192, 16384, 32768] if long_context else [1024, 2048])
    vocab = rng.choice([8192, 32000, 51200])
    gpus = rng.choice([g for g in (2, 4, 8, 16) if g <= max_gpus])
    spec = parse_model("gpt", layers=blocks, hidden=hidden, heads=hidden // 128, vocab=vocab, max_seq=seq)
    tps = [t for t in (1, 2, 4, 8) if t <= gpus and (hidden // 128) % t == 0]
    profile = build_gpt_profile(spec, seq_len=seq, dtype="bf16", tp_degrees=tps)
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-a100-80g")), gpus)
    global_batch = gpus * rng.choice([1, 2, 4, 8]) // rng.choice([1, 2])
    fraction = round(rng.uniform(0.3, 0.9), 3)
    label = (
        f"#{index} gpt L{blocks} h{hidden} v{vocab} s{seq} on {gpus} A100, batch {global_batch}, memory {fraction:.0%}"
    )
    return Instance(
        label=label,
        profile=profile,
        cluster=cluster,
        gpus=gpus,
        global_batch=global_batch,
        memory_fraction=fraction,
        flash_attention=long_context,
    )


def moe_instance(rng: random.Random, index: int) -> Instance:
    """A random Mixture-of-Experts model on 2-16 H100s (``dgx-h100``: it has all-to-all figures)."""
    hidden = rng.choice([1024, 2048, 4096])
    blocks = rng.randint(2, 4)
    experts = rng.choice([4, 8, 16])
    gpus = rng.choice([2, 4, 8, 16])
    spec = parse_model(
        "moe",
        layers=blocks,
        hidden=hidden,
        heads=hidden // 128,
        kv_heads=max(1, hidden // 512),
        vocab=32000,
        max_seq=2048,
        experts=experts,
        top_k=rng.choice([1, 2]),
        expert_ffn=rng.choice([hidden // 2, 2 * hidden, 4 * hidden]),
        shared_experts=rng.choice([0, 1]),
        dense_layers=rng.choice([0, 1]),
    )
    tps = [t for t in (1, 2, 4, 8) if t <= gpus and max(1, hidden // 512) % t == 0]
    profile = build_gpt_profile(spec, seq_len=2048, dtype="bf16", tp_degrees=tps)
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-h100")), gpus)
    global_batch = gpus * rng.choice([1, 2, 4])
    fraction = round(rng.uniform(0.3, 0.9), 3)
    label = (
        f"#{index} moe L{blocks} h{hidden} E{experts} k{spec.dims['top_k']} on {gpus} H100, "
        f"batch {global_batch}, memory {fraction:.0%}"
    )
    return Instance(
        label=label,
        profile=profile,
        cluster=cluster,
        gpus=gpus,
        global_batch=global_batch,
        memory_fraction=fraction,
    )


def preset_instance(preset: str, gpus: int, global_batch: int) -> Instance:
    profile = build_gpt_profile(parse_model(f"gpt:{preset}"), seq_len=2048, dtype="bf16", tp_degrees=[1, 2, 4, 8])
    cluster = with_gpus(load_cluster_profile(resolve_cluster_path("dgx-a100-80g")), gpus)
    return Instance(
        label=f"SC21 Table 1 {preset} on {gpus} A100, batch {global_batch}",
        profile=profile,
        cluster=cluster,
        gpus=gpus,
        global_batch=global_batch,
        memory_fraction=0.9,
    )


def check(inst: Instance, *, jobs: int = 1) -> Verdict:
    """Search and brute force one instance."""
    config = SearchConfig(
        allow=ALL,  # every dimension, expert TP included (the brute force covers it)
        memory_fraction=inst.memory_fraction,
        max_micro_batch=MAX_MICRO_BATCH,
        max_virtual_stages=MAX_VIRTUAL_STAGES,
        jobs=jobs,
        flash_attention=inst.flash_attention,
    )
    start = time.perf_counter()
    try:
        result = plan_search(inst.profile, inst.cluster, gpus=inst.gpus, global_batch=inst.global_batch, config=config)
        plan_s, status = result.best.step_s, result.status
    except StratagemError:
        plan_s, status = None, "no plan"
    search_s = time.perf_counter() - start
    start = time.perf_counter()
    uniform_s, uniform, scored = best_uniform(inst)
    return Verdict(
        instance=inst,
        uniform_s=uniform_s,
        uniform=uniform,
        plan_s=plan_s,
        status=status,
        search_wall_s=search_s,
        brute_wall_s=time.perf_counter() - start,
        scored=scored,
    )


def _line(v: Verdict) -> str:
    plan = f"{v.plan_s:.6g} s" if v.plan_s is not None else "no plan"
    uni = f"{v.uniform_s:.6g} s" if v.uniform_s is not None else "none fits"
    gain = f"{(1 - v.plan_s / v.uniform_s):7.2%}" if v.plan_s and v.uniform_s else "      -"
    return (
        f"{v.kind:15s} plan {plan:>12s} {v.status:10s} uniform {uni:>12s} better by {gain}  "
        f"search {v.search_wall_s:5.2f} s, brute {v.scored:5d} configs {v.brute_wall_s:5.1f} s  {v.instance.label}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=300, help="random instances (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--presets", action="store_true", help="also every SC21 Table 1 preset at its GPU count")
    parser.add_argument("--jobs", type=int, default=1, help="CBC processes the search runs at once")
    parser.add_argument(
        "--long-context", action="store_true", help="8k-32k-token sequences with flash attention (cp pays)"
    )
    parser.add_argument("--moe", type=int, default=0, help="random Mixture-of-Experts instances (default 0)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per instance")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    verdicts = []
    for i in range(args.instances):
        v = check(random_instance(rng, i, long_context=args.long_context), jobs=args.jobs)
        verdicts.append(v)
        if args.verbose or v.kind not in ("ok", "both_infeasible"):
            print(_line(v), flush=True)
    for i in range(args.moe):
        v = check(moe_instance(rng, i), jobs=args.jobs)
        verdicts.append(v)
        if args.verbose or v.kind not in ("ok", "both_infeasible"):
            print(_line(v), flush=True)
    if args.presets:
        for preset, gpus, batch in TABLE_1:
            v = check(preset_instance(preset, gpus, batch), jobs=args.jobs)
            verdicts.append(v)
            print(_line(v), flush=True)
    kinds = Counter(v.kind for v in verdicts)
    gains = [1 - v.plan_s / v.uniform_s for v in verdicts if v.plan_s and v.uniform_s]
    print(
        f"\n{len(verdicts)} instances: "
        + ", ".join(f"{k} {kinds[k]}" for k in ("ok", "both_infeasible", "worse", "missed", "not_optimal"))
    )
    if gains:
        print(
            f"plan vs best uniform: better by {sum(gains) / len(gains):.2%} on average, at most {max(gains):.2%}; "
            f"{sum(1 for g in gains if g > 1e-9)} of {len(gains)} strictly better"
        )
    print(
        f"search wall time: median {sorted(v.search_wall_s for v in verdicts)[len(verdicts) // 2]:.2f} s, "
        f"max {max(v.search_wall_s for v in verdicts):.2f} s"
    )
    bad = kinds["worse"] + kinds["missed"] + kinds["not_optimal"]
    print(f"FAILURES {bad}" if bad else "0 failures: no plan worse than the best uniform configuration that fits")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
