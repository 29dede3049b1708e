"""``stratagem estimate``: predicted step time and per-rank memory of one parallel configuration.

Example (GPT-3 175B on 1024 A100s, Megatron's configuration)::

    stratagem estimate --model gpt:gpt3-175b --cluster dgx-a100-80g --gpus 1024 --global-batch 1536 \\
        --micro-batch 1 --tp 8 --pp 16 --dp 8 --schedule 1f1b --recompute full

``--gpus N`` rescales a single-type shipped cluster to ``ceil(N / devices_per_node)`` nodes; a mixed
cluster keeps its nodes and its pipeline ranks are placed on node types in order (``--stage-node-types``
overrides; ``--replica-node-types`` puts each dp replica on a node type instead, with ``--batch-shares``
its fraction of the global batch). Without ``--model-profile`` a GPT/Llama model gets the closed-form profile
(``planner.profile.gpt``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from planner.cli.common import (
    MAX_BATCH,
    MAX_DEVICES,
    MAX_LAYERS,
    MAX_SEQ,
    MAX_WIDTH,
    DefaultsHelpFormatter,
    add_moe_imbalance,
    analytic_on_cpu_note,
    flash_attention_default,
    float_in,
    int_in,
    moe_imbalance,
    nonempty_path,
    resolve_cluster_path,
)
from planner.cli.model_args import MAX_VOLUME, MODEL_HELP, load_matching_profile, spec_from_args
from planner.core import SCHEDULE_ALIASES, DTYPES, PRECISIONS, StratagemError
from planner.cost import ParallelConfig, check_context_family, estimate, fill_stage_node_types, with_gpus
from planner.model import SPATIAL_FAMILIES
from planner.profile import (
    DTYPE_HELP,
    PRECISION_HELP,
    ClusterProfile,
    ModelProfile,
    default_dtype,
    load_cluster_profile,
)

from .compare_cli import add_source_argument, run_estimate_from
from .estimate_report import estimate_to_json, print_estimate_table


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="predict step time and memory of one configuration",
        description="Predict the step time and per-rank peak memory of one parallel "
        "configuration of a model on a cluster.",
        formatter_class=DefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help=MODEL_HELP + " (required without --from, or when --from's config does not state the model's dimensions)",
    )
    for dim, what, high in (
        ("layers", "transformer blocks, count", MAX_LAYERS),
        ("hidden", "hidden size, features per token", MAX_WIDTH),
        ("heads", "attention heads, count", MAX_WIDTH),
        ("vocab", "vocabulary size, tokens", MAX_WIDTH),
        ("ffn-hidden", "MLP inner size, features (default 4 x hidden)", MAX_WIDTH),
        ("kv-heads", "key/value heads for grouped-query attention, count (llama)", MAX_WIDTH),
        ("volume", "voxels per side of the cubic input volume (unet3d, cosmoflow)", MAX_VOLUME),
    ):
        m.add_argument(f"--{dim}", type=int_in(1, high), default=None, help=f"override the preset's {what}")
    m.add_argument(
        "--seq",
        type=int_in(1, MAX_SEQ),
        default=None,
        help="sequence length, tokens per sample (default: the model's max_seq)",
    )
    m.add_argument(
        "--dropout",
        type=float_in(0, 1, high_open=True),
        default=None,
        help="GPT dropout probability, 0 <= p < 1 (adds 1-byte masks to activation memory; Megatron used 0.1)",
    )
    m.add_argument(
        "--model-profile",
        type=nonempty_path,
        default=None,
        help="a model profile JSON (from `stratagem profile model`) instead of the closed-form GPT one",
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", required=True, help="shipped cluster name or a cluster profile path")
    c.add_argument("--gpus", type=int_in(1, MAX_DEVICES), default=None, help="GPUs to use, count (default: tp*pp*dp)")
    c.add_argument(
        "--stage-node-types",
        default=None,
        help="node type name per pipeline rank, comma-separated (mixed clusters; default: in cluster order)",
    )
    c.add_argument(
        "--replica-node-types",
        default=None,
        help="node type name per dp replica, comma-separated (mixed clusters; instead of --stage-node-types)",
    )
    c.add_argument(
        "--batch-shares",
        default=None,
        help="fraction of the global batch per dp replica, comma-separated, summing to 1 (default: equal)",
    )
    s = p.add_argument_group("configuration")
    s.add_argument(
        "--global-batch",
        type=int_in(1, MAX_BATCH),
        default=None,
        help="samples per optimizer step (required without --from)",
    )
    s.add_argument("--micro-batch", type=int_in(1, MAX_BATCH), default=1, help="samples per micro-batch")
    s.add_argument("--tp", type=int_in(1, MAX_DEVICES), default=1, help="tensor-parallel degree, GPUs per layer")
    s.add_argument(
        "--pp", type=int_in(1, MAX_DEVICES), default=1, help="pipeline-parallel degree, stages (GPUs per replica / tp)"
    )
    s.add_argument(
        "--dp",
        type=int_in(1, MAX_DEVICES),
        default=None,
        help="data-parallel degree, replicas (default: gpus / (tp * pp * cp))",
    )
    s.add_argument(
        "--cp",
        type=int_in(1, MAX_DEVICES),
        default=1,
        help="context-parallel degree: each sequence split over cp GPUs (the sequence must split into 2 x cp chunks)",
    )
    s.add_argument(
        "--context-parallel",
        default="ring",
        choices=("allgather", "ring"),
        help="K/V exchange with --cp > 1: ring point-to-point under the attention (Megatron p2p) "
        "or all-gather (Llama 3)",
    )
    s.add_argument(
        "--sd",
        type=int_in(1, MAX_DEVICES),
        default=1,
        help="spatial degree: GPUs sharing each sample's volume (3D CNNs: unet3d, cosmoflow)",
    )
    s.add_argument(
        "--spatial-dims",
        default="dhw",
        choices=["d", "dh", "dhw"],
        help="volume dims --sd splits, as balanced a grid as it divides into (3D CNNs)",
    )
    s.add_argument(
        "--schedule",
        default="1f1b",
        choices=sorted(SCHEDULE_ALIASES),
        help="pipeline schedule (interleaved = interleaved 1F1B, needs --virtual-stages >= 2)",
    )
    s.add_argument(
        "--virtual-stages",
        type=int_in(1, MAX_LAYERS),
        default=1,
        help="model chunks per pipeline rank, count (interleaved schedule)",
    )
    s.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (3 = FSDP)")
    s.add_argument(
        "--ep",
        type=int_in(1, MAX_DEVICES),
        default=1,
        help="expert-parallel degree of a Mixture-of-Experts model (ranks sharing the experts; divides the experts)",
    )
    s.add_argument(
        "--etp",
        type=int_in(1, MAX_DEVICES),
        default=1,
        help="tensor-parallel degree inside each expert (Megatron expert tensor parallel; ep x etp divides dp x tp)",
    )
    add_moe_imbalance(s)
    s.add_argument(
        "--recompute",
        default="none",
        choices=("none", "selective", "full"),
        help="activation recompute of every block (selective = attention core only, Korthikanti et al.)",
    )
    s.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism: norms/dropout sharded over tp, all-reduce -> RS + AG",
    )
    s.add_argument(
        "--flash-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fused attention (SDPA, what `stratagem launch` runs for such plans): the s x s scores are not stored. "
        "Default: on for GPU clusters (with the causal skip plan assumes), off for CPU ones",
    )
    s.add_argument(
        "--causal-skip",
        action="store_true",
        help="with --flash-attention: the causal kernel skips the masked half of the s x s blocks "
        "(what plan --flash-attention assumes; long sequences)",
    )
    s.add_argument(
        "--no-overlap-grad-reduce",
        action="store_true",
        help="gradient sync after the backward (default: overlapped with it)",
    )
    s.add_argument("--overlap-tp-comm", action="store_true", help="hide TP collectives behind GEMMs (TE)")
    s.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help=DTYPE_HELP,
    )
    p.add_argument("--precision", default="pure", choices=PRECISIONS, help=PRECISION_HELP)
    add_source_argument(p, "--from", "estimate the user's own framework config instead of the flags above")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the estimate as JSON (times in s, memory in bytes) instead of a table",
    )
    p.set_defaults(func=run)


def _model(args: argparse.Namespace, dtype: str) -> ModelProfile:
    if args.model_profile is not None and getattr(args, "precision", "pure") != "pure":
        raise StratagemError("--precision describes closed-form profiles; drop it with --model-profile (measured)")
    if args.model_profile is not None:
        return load_matching_profile(args.model_profile, spec_from_args(args), args.seq)
    spec = spec_from_args(args, max_seq=args.seq)
    check_context_family(spec, args.cp)  # before profiling a model it cannot apply to
    if spec.is_external or spec.family not in ("gpt", "llama", "moe"):  # derived on the meta device by the runtime
        from runtime.profiling.model import profile_model_analytic

        seq = args.seq or (int(spec.dim("max_seq")) if spec.is_language_model else 1)
        return profile_model_analytic(spec, seq_len=seq, dtype=dtype)
    from planner.profile import build_gpt_profile

    return build_gpt_profile(spec, seq_len=args.seq, dtype=dtype, precision=getattr(args, "precision", "pure"))


def _dtype(args: argparse.Namespace, cluster: ClusterProfile) -> str:
    return args.dtype or default_dtype(cluster.node_types, cluster.name)


def build_config(args: argparse.Namespace, cluster: ClusterProfile) -> tuple[ParallelConfig, int]:
    """The ParallelConfig the arguments describe, and the GPU count (checked against tp*pp*dp)."""
    gpus = args.gpus
    cp = args.cp
    dp = args.dp if args.dp is not None else (gpus // (args.tp * args.pp * cp) if gpus else 1)
    world = args.tp * args.pp * cp * max(dp, 1)
    if gpus is None:
        gpus = world
    if dp < 1 or world != gpus:
        raise StratagemError(
            f"tp {args.tp} x pp {args.pp} x dp {dp}{f' x cp {cp}' if cp > 1 else ''} = {world} but --gpus is "
            f"{gpus}; make the degrees multiply to the GPU count"
        )
    if world > MAX_DEVICES:
        raise StratagemError(
            f"tp {args.tp} x pp {args.pp} x dp {dp} = {world} devices, more than {MAX_DEVICES}; lower the degrees"
        )
    if args.sequence_parallel and args.tp == 1:
        raise StratagemError(
            "--sequence-parallel shards activations over tensor-parallel ranks and needs --tp >= 2; "
            "drop --sequence-parallel or raise --tp"
        )
    if args.stage_node_types and args.replica_node_types:
        raise StratagemError(
            "--stage-node-types and --replica-node-types exclude each other (node types per "
            "pipeline stage, or per dp replica); pass one of them"
        )
    per_step = dp * args.micro_batch
    shares = _shares(args.batch_shares, dp)
    replica_types = tuple(args.replica_node_types.split(",")) if args.replica_node_types else None
    if shares is None and args.global_batch % per_step:
        raise StratagemError(
            f"global batch {args.global_batch} is not a multiple of dp {dp} x micro-batch "
            f"{args.micro_batch} = {per_step}; change --global-batch or --micro-batch"
        )
    stage_types = tuple(args.stage_node_types.split(",")) if args.stage_node_types else None
    flash = flash_attention_default(args.flash_attention, cluster)
    config = ParallelConfig(
        tp=args.tp,
        pp=args.pp,
        dp=dp,
        micro_batch=args.micro_batch,
        num_micro_batches=max(1, args.global_batch // per_step),
        schedule=SCHEDULE_ALIASES[args.schedule],
        virtual_stages=args.virtual_stages,
        zero_stage=args.zero,
        replica_node_types=replica_types,
        batch_shares=shares,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        stage_node_types=stage_types,
        flash_attention=flash,
        causal_skip=flash and (args.causal_skip or args.flash_attention is None),
        cp=cp,
        context_parallel=args.context_parallel if cp > 1 else None,
        overlap_grad_reduce=not args.no_overlap_grad_reduce,
        overlap_tp_comm=args.overlap_tp_comm,
        ep=args.ep,
        etp=args.etp,
    )
    if cluster.is_mixed and stage_types is None and replica_types is None:
        config = fill_stage_node_types(cluster, config)
    return config, gpus


def _shares(text: str | None, dp: int) -> tuple[float, ...] | None:
    """``--batch-shares``: one positive finite fraction per dp replica, summing to 1."""
    if text is None:
        return None
    example = ",".join([f"{1 / dp:.3g}"] * min(dp, 4)) + (",..." if dp > 4 else "")
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        shares = ()
    if len(shares) != dp or not all(math.isfinite(x) and x > 0 for x in shares) or abs(sum(shares) - 1) > 1e-6:
        raise StratagemError(
            f"--batch-shares {text!r} must be {dp} positive fractions (one per dp replica) summing to 1, e.g. {example}"
        )
    return shares


def run(args: argparse.Namespace) -> int:
    if args.from_config:
        return run_estimate_from(args)
    if args.model is None or args.global_batch is None:
        raise StratagemError("estimate needs --model and --global-batch (or --from FRAMEWORK SOURCE)")
    cluster = load_cluster_profile(resolve_cluster_path(args.cluster))
    gpus_hint = args.gpus or args.tp * args.pp * (args.dp or 1)
    cluster = with_gpus(cluster, gpus_hint)
    spec = spec_from_args(args, max_seq=args.seq)
    if spec.family in SPATIAL_FAMILIES:  # 3D CNNs: data + spatial parallelism (planner/cli/spatial_cli.py)
        from planner.cli.spatial_cli import run_spatial_estimate

        return run_spatial_estimate(args, spec=spec, cluster=cluster, dtype=_dtype(args, cluster))
    if args.sd != 1:
        raise StratagemError(f"--sd splits 3D CNN volumes; {spec.name} is not one, drop --sd")
    config, gpus = build_config(args, cluster)
    dtype = _dtype(args, cluster)
    model = _model(args, dtype)
    imbalance_note = None
    if any(layer.experts is not None for layer in model.layers):
        imbalance, imbalance_note = moe_imbalance(args.moe_imbalance, spec.name)
        config = replace(config, moe_load_imbalance=imbalance)
    if note := analytic_on_cpu_note(model, cluster):
        print(f"warning: {note}", file=sys.stderr)
    est = estimate(model, cluster, config, global_batch=args.global_batch, dtype=dtype)
    if args.json:
        json.dump(estimate_to_json(est, config), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_estimate_table(est, config, model, cluster, gpus)
        if imbalance_note:
            print(imbalance_note)
    return 0
