"""``stratagem plan``: search the fastest parallel plan for a model on a cluster and write the plan file.

Example::

    stratagem plan --model gpt:gpt3-175b --cluster dgx-a100-80g --gpus 1024 --global-batch 1536 \\
        --seq 2048 --out plan.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from dataclasses import dataclass

from planner.core import SCHEDULE_ALIASES, DTYPES, PRECISIONS, StratagemError
from planner.cost import MemorySemantics, check_context_family
from planner.export import FRAMEWORK_MEMORY
from planner.model import FAMILY_DEFAULTS, SPATIAL_FAMILIES, ModelSpec
from planner.plan import Plan, TrainingSettings, costed, plan_label, save_plan, validate
from planner.profile import (
    DTYPE_HELP,
    PRECISION_HELP,
    ClusterProfile,
    ModelProfile,
    default_dtype,
    load_cluster_profile,
)
from planner.search import ALL_DIMENSIONS, PIN_FLAGS, SearchConfig, parse_allow, pins_note

from .common import (
    DEFAULT_MEMORY_MARGIN,
    MAX_BATCH,
    MAX_DEVICES,
    MAX_SECONDS,
    MAX_SEQ,
    DefaultsHelpFormatter,
    add_moe_imbalance,
    analytic_on_cpu_note,
    check_out_path,
    flash_attention_default,
    float_in,
    int_in,
    memory_fraction_of,
    moe_imbalance,
    no_ellipsis,
    nonempty_path,
    out_path,
    resolve_cluster_path,
    throughput_text,
)
from .compare_cli import add_source_argument, build_comparison, comparison_table
from .model_args import add_model_arguments, load_matching_profile, spec_from_args
from .recipe_args import add_recipe_arguments, recipe_from_args

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="find the fastest parallel plan (exact ILP under the cost model)",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument(
        "--model-profile",
        type=nonempty_path,
        default=None,
        help="model profile JSON (default: derived analytically for the model)",
    )
    p.add_argument("--cluster", required=True, help="shipped cluster name or a cluster profile JSON")
    p.add_argument(
        "--gpus",
        type=int_in(1, MAX_DEVICES),
        required=True,
        metavar="N",
        help="devices to plan for, a count (CPU ranks on a CPU cluster)",
    )
    p.add_argument(
        "--global-batch",
        type=int_in(1, MAX_BATCH),
        required=True,
        metavar="SAMPLES",
        help="samples per optimizer step (fixed; the plan never changes it)",
    )
    p.add_argument(
        "--seq",
        type=int_in(1, MAX_SEQ),
        default=None,
        metavar="TOKENS",
        help="tokens per sample (default: the model's max_seq)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help=DTYPE_HELP + "; with --model-profile, the profile's",
    )
    p.add_argument("--precision", default="pure", choices=PRECISIONS, help=PRECISION_HELP)
    p.add_argument(
        "--memory-margin",
        type=float_in(0, 0.9, high_open=True),
        default=None,
        metavar="FRACTION",
        help=f"share of each device's memory to keep free, 0 <= m < 0.9 (default {DEFAULT_MEMORY_MARGIN:g}): a plan "
        "fits when its predicted peak is at most (1 - m) x the device's memory; the plan records it and "
        "`stratagem show` prints each stage's headroom",
    )
    p.add_argument(
        "--memory-fraction",
        type=float_in(0, 1, low_open=True),
        default=None,
        metavar="FRACTION",
        help="the same as --memory-margin 1-f: share of each device's memory a plan may use, 0 < f <= 1",
    )
    p.add_argument(
        "--time-limit-s",
        "--time-limit",
        dest="time_limit",
        type=float_in(0, MAX_SECONDS, low_open=True),
        default=30.0,
        metavar="SECONDS",
        help="CBC time limit per ILP, seconds; a stopped solve is reported as not optimal",
    )
    p.add_argument(
        "--budget-s",
        "--budget",
        dest="budget",
        type=float_in(0, MAX_SECONDS, low_open=True),
        default=600.0,
        metavar="SECONDS",
        help="wall-clock budget of the whole search, seconds; when it runs out the best plan so far "
        "is written and reported with its proven gap, not as optimal",
    )
    p.add_argument(
        "--gap",
        type=float_in(0, 1, high_open=True),
        default=0.0,
        metavar="FRACTION",
        help="relative optimality gap CBC may stop at, 0 <= g < 1 (0.01 = 1 %%)",
    )
    p.add_argument(
        "--top-k", type=int_in(1, 100), default=5, metavar="K", help="plans to keep (the best and its runners-up)"
    )
    p.add_argument(
        "--jobs",
        type=int_in(1, 256),
        default=1,
        metavar="N",
        help="candidates solved in parallel, one CBC process each (e.g. the number of CPU cores); "
        "the best step time and its proof do not depend on it",
    )
    p.add_argument(
        "--prove-top-k",
        action="store_true",
        help="go on until the runners-up are proven the k best candidates too (slower); by default "
        "they are the best of the candidates solved while proving the best plan optimal",
    )
    p.add_argument(
        "--allow",
        default=None,
        help=f"dimensions the search may use, comma-separated (from {','.join(ALL_DIMENSIONS)}; default all "
        "but etp, expert tensor parallel, which the runtime does not run yet)",
    )
    _add_pins(p)
    add_moe_imbalance(p)
    p.add_argument(
        "--cp",
        type=int_in(1, 1 << 20),
        default=None,
        metavar="N",
        help="context-parallel degree to plan with (default: searched for sequences >= 8,192 tokens); "
        "the sequence must split into 2 x N chunks",
    )
    p.add_argument(
        "--cp-min-seq",
        type=int_in(1, MAX_SEQ),
        default=8192,
        metavar="TOKENS",
        help="search context parallelism for sequences of at least this many tokens (shorter: cp 1 unless --cp)",
    )
    p.add_argument(
        "--flash-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fused causal attention (SDPA; no s x s scores saved; long-context plans need it): the cost model "
        "prices it and `stratagem launch` runs it. Default: on for GPU clusters, off for CPU ones",
    )
    p.add_argument(
        "--cp-table",
        action="store_true",
        help="also print the best plan at every context-parallel degree (why the plan's cp; one search per cp)",
    )
    p.add_argument(
        "--for",
        dest="priced_for",
        choices=("launch", *FRAMEWORK_MEMORY),
        default=None,
        help="the trainer the plan is for, whose way of holding memory the search prices: launch (stratagem "
        "launch), torchtitan and accelerate hold it as FSDP2 and torch pipelining do; megatron and deepspeed as "
        "ZeRO's textbook states with DDP buckets. Default: the framework of --compare-to, else launch",
    )
    p.add_argument("--out", type=out_path, required=True, metavar="FILE", help="plan JSON to write")
    add_recipe_arguments(p)
    add_source_argument(p, "--compare-to", "compare the plan with your current config (speed-up, memory, flags)")
    p.set_defaults(func=run)


def model_profile(spec: ModelSpec, args: argparse.Namespace, seq_len: int) -> ModelProfile:
    """The given profile file, else the closed-form GPT/Llama profile, else the runtime's meta profiler."""
    if args.model_profile is not None and getattr(args, "precision", "pure") != "pure":
        raise StratagemError("--precision describes closed-form profiles; drop it with --model-profile (measured)")
    if args.model_profile is not None:
        return load_matching_profile(args.model_profile, spec, args.seq)
    if spec.family in ("gpt", "llama", "moe"):
        from planner.profile import build_gpt_profile

        return build_gpt_profile(spec, seq_len=seq_len, dtype=args.dtype, precision=getattr(args, "precision", "pure"))
    if args.dtype not in ("fp32", "tf32", "bf16", "fp16"):
        raise StratagemError(f"--dtype {args.dtype} cannot be profiled on the meta device for {spec.name}; use bf16")
    try:
        from runtime.profiling.model import profile_model_analytic
    except ImportError:
        raise StratagemError(
            f"no analytic profile for {spec.family} models in this build; run "
            f"'stratagem profile model --model {spec.name}' and pass --model-profile"
        ) from None
    return profile_model_analytic(spec, seq_len=seq_len, dtype=args.dtype)


def full_spec(spec: ModelSpec) -> ModelSpec:
    """A zoo spec with every dimension written out (defaults applied), so the plan alone rebuilds the model."""
    if spec.is_external:
        return spec
    return spec.model_copy(update={"dims": {**FAMILY_DEFAULTS[spec.family], **spec.dims}})


def _external_limits(spec: ModelSpec, allow: frozenset[str], *, moe: bool = False) -> tuple[frozenset[str], list[str]]:
    """hf/custom models: no sequence parallelism (the runtime implements it for the zoo's gpt/llama), and the
    reason tensor parallelism is not searched when the layout could not be derived. Both go into the plan.
    An ``hf:`` Mixture-of-Experts model (``moe``: its profile has routed experts) is searched over ep and etp
    like the zoo's ``moe`` family (runtime/executor/hf_moe.py shards transformers' fused experts over the ep and
    etp groups); a custom model's experts are not (the runtime runs them replicated)."""
    if not spec.is_external:
        return allow, []
    from runtime.models.external import external

    notes = ["sequence parallelism not searched: implemented for the zoo's gpt and llama only"]
    if moe and spec.family != "hf" and allow & {"ep", "etp"}:
        notes.append(EXTERNAL_CUSTOM_EP_NOTE)
        allow = allow - {"ep", "etp"}
    note = external(spec).tp_note
    return allow - {"sp"}, ([note] if note else []) + notes


EXTERNAL_CUSTOM_EP_NOTE = (
    "expert parallelism not searched: the runtime runs a custom model's experts replicated on every rank (ep 1)"
)


def _summary_table(plan: Plan, cluster: ClusterProfile):
    from rich.table import Table

    pred, search = costed(plan)
    table = Table(title=f"plan for {plan.model.name} on {plan.world_size} x {cluster.name}")
    table.add_column("item")
    table.add_column("value")
    sched = plan.schedule
    table.add_row("strategy", plan_label(plan))
    table.add_row("predicted step time", f"{pred.step_time_s:.4g} s")
    table.add_row("throughput", throughput_text(pred.samples_per_s, pred.tokens_per_s, plan.model.family))
    table.add_row("MFU", f"{pred.mfu * 100:.1f} % ({pred.model_tflops_per_gpu:.3g} TFLOP/s per device)")
    if pred.per_replica_type:  # replicas on several node types: each type's pipeline and memory
        for t in pred.per_replica_type:
            rows = t.micro_batches * sched.micro_batch_size
            table.add_row(
                f"{len(t.replicas)} replicas on {t.node_type}",
                f"{rows} samples each ({t.micro_batches} micro-batches), pipeline {t.pipeline_s:.4g} s",
            )
            for sp in t.stages:
                table.add_row(
                    f"  stage {sp.stage} peak memory",
                    f"{sp.peak_memory_bytes / 2**30:.2f} / {sp.memory_capacity_bytes / 2**30:.2f} GiB",
                )
    else:
        for sp in pred.stages:
            table.add_row(
                f"stage {sp.stage} peak memory",
                f"{sp.peak_memory_bytes / 2**30:.2f} / {sp.memory_capacity_bytes / 2**30:.2f} GiB",
            )
    if search is not None:
        table.add_row(
            "search",
            f"{search.status}, gap {search.gap:.2g}, {search.wall_time_s:.2f} s, "
            f"{search.candidates_solved} solved / {search.candidates_pruned} pruned",
        )
        if search.notes:
            table.add_row("notes", search.notes)
    return table


def _resolve_dtype(args: argparse.Namespace, cluster) -> str | None:
    """--dtype, else the default rule over the node types the plan's devices come from (so 16 A100s of
    mixed-a100-v100 train in bf16, 32 devices in fp16); with --model-profile the profile's dtype decides
    (checked against --dtype by :func:`_check_profile_dtype` once the profile is read)."""
    from planner.cost import with_gpus
    from planner.search import devices_by_type

    if args.dtype or args.model_profile is not None:
        return args.dtype
    used = devices_by_type(with_gpus(cluster, args.gpus), args.gpus)
    return default_dtype([nt for nt in cluster.node_types if nt.name in used], cluster.name)


def _check_profile_dtype(args: argparse.Namespace, profile: ModelProfile) -> str:
    """The training dtype: a --model-profile's own, which a --dtype given with it must equal."""
    if args.model_profile is not None and args.dtype not in (None, profile.dtype):
        raise StratagemError(
            f"--dtype {args.dtype} differs from {args.model_profile}'s dtype {profile.dtype}; drop --dtype or "
            f"profile the model again with --dtype {args.dtype}"
        )
    return profile.dtype


def _check_dtype(cluster, gpus: int, dtype: str) -> None:
    """Every node type the plan's ``gpus`` devices come from (the cluster's first ones) must have a
    throughput figure for the training dtype (V100s have no bf16); the others do not matter."""
    from planner.cost import with_gpus
    from planner.search import devices_by_type

    used = devices_by_type(with_gpus(cluster, gpus), gpus)
    for node in cluster.node_types:
        have = [c.dtype for c in node.compute]
        if node.name in used and dtype not in have:
            raise StratagemError(
                f"node type {node.name} ({node.device}) of cluster {cluster.name} has no {dtype} "
                f"throughput (has {', '.join(have)}); use --dtype with one of those"
            )


def _alternatives_table(plan: Plan):
    from rich.table import Table

    table = Table(title="runners-up")
    for col in ("#", "strategy", "step time", "slowdown", "peak memory"):
        table.add_column(col)
    for i, alt in enumerate(plan.search.top_k if plan.search else [], start=2):
        step = f"{alt.step_time_s:.4g} s" + ("" if alt.proven_optimal else " (layout not proven best)")
        table.add_row(str(i), alt.summary, step, f"{alt.slowdown:.3f}x", f"{alt.peak_memory_bytes / 2**30:.2f} GiB")
    return table


def memory_semantics_of(args: argparse.Namespace) -> MemorySemantics:
    """Whose memory the search prices (``plan --for``; default the ``--compare-to`` framework's, else launch's)."""
    target = args.priced_for or (args.compare_to[0] if getattr(args, "compare_to", None) else "launch")
    return FRAMEWORK_MEMORY.get(target, "fsdp2")


def _add_pins(p: argparse.ArgumentParser) -> None:
    """The degree flags `estimate` takes, each pinning that choice (planner/search/pins.py)."""
    g = p.add_argument_group("pin a choice (the search proves the best plan under the pins)")
    for flag, what in (("tp", "tensor-parallel"), ("pp", "pipeline-parallel"), ("dp", "data-parallel")):
        g.add_argument(f"--{flag}", type=int_in(1, MAX_DEVICES), default=None, help=f"{what} degree")
    g.add_argument("--ep", type=int_in(1, 1 << 16), default=None, help="expert-parallel degree (MoE models)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage")
    g.add_argument("--micro-batch", type=int_in(1, 1 << 20), default=None, help="samples per micro-batch")
    g.add_argument("--schedule", choices=sorted(SCHEDULE_ALIASES), default=None, help="pipeline schedule")
    g.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default=None,
        help="activation recompute of every transformer block",
    )


def _pins(args: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    pins: list[tuple[str, object]] = []
    for key in PIN_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            pins.append((key, SCHEDULE_ALIASES[value] if key == "schedule" else value))
    return tuple(pins)


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchInputs:
    """What `stratagem plan` searches with, read from its arguments (:func:`prepare_search`)."""

    spec: ModelSpec
    profile: ModelProfile
    cluster: ClusterProfile
    config: SearchConfig
    notes: tuple[str, ...]
    lr_schedule: object | None


def prepare_search(args: argparse.Namespace, *, cluster: ClusterProfile | None = None) -> SearchInputs:
    """The model profile, cluster and search settings `stratagem plan` uses for ``args`` (its parsed flags): the
    one reading of plan flags, shared with `stratagem frontier` (so a frontier row is what `plan` returns for its
    flags). ``cluster``: the profile ``args.cluster`` names, when the caller has read it already. 3D CNNs are
    planned by their own search: a :class:`StratagemError` here (`plan` branches before)."""
    if cluster is None:
        cluster = load_cluster_profile(resolve_cluster_path(args.cluster))
    spec, profile, lr_schedule = _profile_inputs(args, cluster)
    if spec.family in SPATIAL_FAMILIES:
        raise StratagemError(f"{spec.name} is a 3D CNN, planned by the spatial search; use `stratagem plan` for it")
    cpu_note = analytic_on_cpu_note(profile, cluster)
    moe = any(layer.experts is not None for layer in profile.layers)
    allow, notes = _external_limits(spec, parse_allow(args.allow), moe=moe)
    pins = _pins(args)
    imbalance, imbalance_note = moe_imbalance(args.moe_imbalance, spec.name)
    notes = [
        *notes,
        *filter(None, [cpu_note, pins_note(dict(pins)) if pins else None, imbalance_note if moe else None]),
    ]
    config = SearchConfig(
        pins=pins,
        time_limit_s=args.time_limit,
        gap_rel=args.gap,
        top_k=args.top_k,
        exhaustive_top_k=args.prove_top_k,
        jobs=args.jobs,
        allow=allow,
        memory_fraction=memory_fraction_of(args),
        budget_s=args.budget,
        cp=args.cp,
        cp_min_seq_len=args.cp_min_seq,
        flash_attention=flash_attention_default(args.flash_attention, cluster),
        moe_load_imbalance=imbalance,
        memory_semantics=memory_semantics_of(args),
    )
    return SearchInputs(
        spec=spec, profile=profile, cluster=cluster, config=config, notes=tuple(notes), lr_schedule=lr_schedule
    )


def _profile_inputs(args: argparse.Namespace, cluster: ClusterProfile) -> tuple[ModelSpec, ModelProfile, object]:
    """(model spec, model profile, learning-rate schedule) of plan ``args`` on ``cluster``; sets ``args.dtype``."""
    lr_schedule = recipe_from_args(args)
    spec = full_spec(spec_from_args(args))
    check_context_family(spec, args.cp or 1)  # before profiling a model it cannot apply to
    seq_len = int(args.seq or spec.dim("max_seq")) if spec.is_language_model else int(args.seq or 1)
    args.dtype = _resolve_dtype(args, cluster)
    profile = model_profile(spec, args, seq_len)
    args.dtype = _check_profile_dtype(args, profile)
    _check_dtype(cluster, args.gpus, profile.dtype)
    return spec, profile, lr_schedule


def assemble_plan(inputs: SearchInputs, args: argparse.Namespace, result, fallback=None) -> Plan:
    """The plan file of a search's result, with the search notes of :func:`prepare_search`, validated."""
    from planner.search import build_plan

    profile = inputs.profile
    training = TrainingSettings(
        global_batch=args.global_batch,
        seq_len=profile.seq_len,
        dtype=profile.dtype,
        lr_schedule=inputs.lr_schedule,
    )
    plan = build_plan(
        result, model=inputs.spec, profile=profile, cluster=inputs.cluster, training=training, fallback=fallback
    )
    if inputs.notes and plan.search is not None:
        notes = "; ".join(filter(None, [plan.search.notes, *inputs.notes]))
        plan = plan.model_copy(update={"search": plan.search.model_copy(update={"notes": notes})})
    if plan.search is not None and getattr(args, "argv", None):
        command = replan_argv(args.argv)
        plan = plan.model_copy(update={"search": plan.search.model_copy(update={"command": command})})
    validate(plan, args.gpus)
    return plan


def replan_argv(argv: list[str]) -> list[str]:
    """The `stratagem plan` arguments a plan file records: ``argv`` from ``plan`` on, without ``--out`` and
    ``-v``, each argument naming an existing file made absolute (a re-plan may run elsewhere).

    >>> replan_argv(["-v", "plan", "--model", "gpt:tiny", "--gpus", "4", "--out", "p.json"])
    ['plan', '--model', 'gpt:tiny', '--gpus', '4']
    >>> replan_argv(["plan", "--compare-to", "megatron", "--tp 8 " * 40])[-1] == "--tp 8 " * 40  # not a path
    True
    """
    rest = argv[argv.index("plan") :] if "plan" in argv else ["plan", *argv]
    out, skip = [], False
    for arg in rest:
        if skip:
            skip = False
        elif arg in ("--out", "-o"):
            skip = True
        elif arg.startswith("--out=") or arg in ("-v", "--verbose"):
            continue
        else:
            out.append(str(Path(arg).resolve()) if arg != "plan" and _is_file(arg) else arg)
    return out


def _is_file(arg: str) -> bool:
    """``arg`` names an existing file (False for text no path can be: too long, a NUL byte)."""
    try:
        return Path(arg).is_file()
    except (OSError, ValueError):
        return False


def replan_cluster_is_mixed(command: list[str]) -> str | None:
    """The name of the cluster profile a plan's recorded `stratagem plan` arguments name, when it mixes node types
    (else None): which devices are left after a node is lost then depends on which node it was."""
    from planner.cli.main import build_parser

    args = build_parser().parse_args([*command, "--out", "plan.json"])
    cluster = load_cluster_profile(resolve_cluster_path(args.cluster))
    return cluster.name if cluster.is_mixed else None


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]


def replan_command(command: list[str], gpus: int, *, global_batch: int | None = None) -> list[str]:
    """``command`` (a plan's `stratagem plan` arguments) for ``gpus`` devices, and at ``global_batch`` when given
    (with ``--lr``, the reference batch pinned to the command's own batch, so the rate scales to the new one).

    >>> argv = ["plan", "--model", "gpt:tiny", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
    >>> replan_command([*argv, "--lr", "1e-3", "--train-steps", "9"], 6, global_batch=6)[5:]
    ['--gpus', '6', '--global-batch', '6', '--lr', '1e-3', '--train-steps', '9', '--reference-batch', '8']
    """
    from planner.cli.main import build_parser

    argv = [*command]
    if global_batch is not None:
        parsed = build_parser().parse_args([*argv, "--out", "plan.json"])
        if parsed.lr is not None and parsed.reference_batch is None:
            argv += ["--reference-batch", str(parsed.global_batch)]
        _set_flag(argv, "--global-batch", str(global_batch))
    _set_flag(argv, "--gpus", str(gpus))
    return argv


def replan(command: list[str], gpus: int, *, global_batch: int | None = None) -> Plan:
    """The plan `stratagem plan` writes for ``command`` (a plan file's ``search.command``) on ``gpus`` devices:
    the same search, flags and profiles; nothing printed, nothing written. ``global_batch``: at another global
    batch, the recipe's rate (``--lr``) still tuned at the command's reference batch, so it scales linearly
    (Goyal et al. 2017) to the new one."""
    from planner.cli.main import build_parser
    from planner.search import fallback_candidate, plan_search

    argv = replan_command(command, gpus, global_batch=global_batch)
    args = build_parser().parse_args([*argv, "--out", "plan.json"])
    args.argv = argv
    if args.model.partition(":")[0] in SPATIAL_FAMILIES:
        raise StratagemError(
            "3D CNN (spatial) plans cannot be re-planned by launch --elastic yet; launch them without it"
        )
    inputs = prepare_search(args, cluster=load_cluster_profile(resolve_cluster_path(args.cluster)))
    result = plan_search(
        inputs.profile, inputs.cluster, gpus=gpus, global_batch=args.global_batch, config=inputs.config
    )
    fallback = None
    if inputs.config.memory_semantics == "fsdp2":
        fallback = fallback_candidate(
            inputs.profile, inputs.cluster, result, gpus=gpus, global_batch=args.global_batch, config=inputs.config
        )
    return assemble_plan(inputs, args, result, fallback)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from planner.search import fallback_candidate, plan_search

    cluster_path = resolve_cluster_path(args.cluster)
    check_out_path(args.out, inputs={"--model-profile": args.model_profile, "--cluster": cluster_path})
    # 3D CNNs: hybrid data + spatial search (the family from the name: building the spec of an hf: model runs its
    # fidelity check, which prepare_search does once)
    if args.model.partition(":")[0] in SPATIAL_FAMILIES:
        from planner.cli.spatial_cli import run_spatial

        cluster = load_cluster_profile(cluster_path)
        spec, profile, lr_schedule = _profile_inputs(args, cluster)
        cpu_note = analytic_on_cpu_note(profile, cluster)
        if cpu_note:
            print(f"warning: {cpu_note}", file=sys.stderr)
        return run_spatial(args, spec=spec, profile=profile, cluster=cluster, lr_schedule=lr_schedule)
    inputs = prepare_search(args, cluster=load_cluster_profile(cluster_path))
    cpu_note = analytic_on_cpu_note(inputs.profile, inputs.cluster)
    if cpu_note:
        print(f"warning: {cpu_note}", file=sys.stderr)
    profile, cluster, config = inputs.profile, inputs.cluster, inputs.config
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("searching", total=None)
        result = plan_search(
            profile,
            cluster,
            gpus=args.gpus,
            global_batch=args.global_batch,
            config=config,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
        fallback = None
        # the fallback is what `stratagem launch` moves to on an out-of-memory step; a plan priced for another
        # trainer (plan --for megatron, ...) is not priced as launch holds memory, so it gets none
        if config.memory_semantics == "fsdp2":
            bar.update(task, description="searching for a fallback with more memory headroom", completed=0, total=None)
            fallback = fallback_candidate(
                profile, cluster, result, gpus=args.gpus, global_batch=args.global_batch, config=config
            )
    plan = assemble_plan(inputs, args, result, fallback)
    if args.compare_to:
        plan = plan.model_copy(
            update={"comparison": build_comparison(plan, *args.compare_to, profile=profile, cluster=cluster)}
        )
    save_plan(plan, args.out)
    out = Console()
    out.print(no_ellipsis(_summary_table(plan, cluster)))
    _, search = costed(plan)
    if search is not None and search.top_k:
        out.print(no_ellipsis(_alternatives_table(plan)))
    if plan.comparison is not None:
        out.print(*comparison_table(plan.comparison))
    if search is not None and search.status != "optimal":
        fix = (
            "plan with --gap 0 to prove it"
            if search.status == "within_gap"
            else "raise --budget-s to prove it"
            if "budget" in search.notes
            else "raise --time-limit-s to prove it"
        )
        out.print(
            f"[bold yellow]not proven optimal[/]: search {search.status}, best within "
            f"{search.gap:.2%} of the optimum under the cost model; {fix}"
        )
    if args.cp_table:
        from planner.search import best_per_cp, format_cp_table

        rows = best_per_cp(profile, cluster, gpus=args.gpus, global_batch=args.global_batch, config=config)
        out.print("best plan per context-parallel degree:", highlight=False)
        for line in format_cp_table(rows):
            out.print(line, highlight=False, markup=False, soft_wrap=True)
    out.print(f"wrote {args.out}")
    return 0
