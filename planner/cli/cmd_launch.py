"""``stratagem launch plan.json``: run a plan with torch.distributed (torchrun), or show what would run."""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from planner.cli.common import (
    MAX_DEVICES,
    DefaultsHelpFormatter,
    check_out_path,
    float_in,
    int_in,
    nonempty_path,
    out_path,
)
from planner.core import StratagemError
from planner.plan import load_plan, plan_label, stage_memory_predictions


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="execute a plan with torch.distributed (torchrun)",
        description="Check the plan against this launch, then start torchrun with the plan's world size "
        "(NCCL with CUDA, else gloo). Mismatches stop here with one line and exit 2.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("plan", type=nonempty_path, help="plan file written by `stratagem plan`")
    p.add_argument("--steps", type=int_in(1, 10**9), default=10, help="optimizer steps to train")
    p.add_argument(
        "--data", default="synthetic", type=_data_arg, help="'synthetic' or a tensor file {'inputs','targets'}"
    )
    p.add_argument("--checkpoint-dir", type=nonempty_path, help="folder for DCP checkpoints (step_NNNNNN/)")
    p.add_argument("--checkpoint-every", type=int_in(0, 10**9), default=0, help="save every K steps (0 = never)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument(
        "--init-from",
        type=nonempty_path,
        metavar="DIR",
        help="start from the weights of a safetensors checkpoint (a Hugging Face model folder, sharded or not, "
        "or a zoo model's own state dict); each rank reads only its part",
    )
    p.add_argument("--metrics", type=out_path, help="JSON-lines metrics file (default: a temporary file)")
    p.add_argument("--max-restarts", type=int_in(0, 1000), default=0, help="elastic restarts after a rank dies")
    p.add_argument(
        "--nnodes", type=int_in(1, MAX_DEVICES), default=1, help="nodes (machines) in the job; passed to torchrun"
    )
    p.add_argument(
        "--node-rank", type=int_in(0, MAX_DEVICES), default=0, help="index of this node, 0..nnodes-1 (multi-node)"
    )
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node (multi-node)")
    p.add_argument(
        "--nproc-per-node", type=int_in(1, 4096), help="processes on this node (default: world size / nnodes)"
    )
    p.add_argument("--slurm", type=out_path, help="write an sbatch script for this launch to FILE instead of running")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help=f"print the command and what each rank builds (one rank per pipeline rank above "
        f"{DRY_RUN_ALL_RANKS} ranks), start nothing",
    )
    p.add_argument("--all-ranks", action="store_true", help="with --dry-run: describe every rank")
    p.add_argument(
        "--timeout-s",
        type=float_in(0, 30 * 86_400, low_open=True),
        default=1800.0,
        help="wall-clock limit of the job and of each collective, seconds",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each transformer block (default: on with CUDA, off on CPU); a block the compiler "
        "cannot take runs uncompiled with one warning",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="lose a node, keep training: a restart after a node is lost for good re-plans for the GPUs left "
        "(plans made now, one per smaller whole-node count down to --min-gpus, written beside the plan) and "
        "resumes from the last checkpoint, resharded; a node that joins later grows the job the same way (the "
        "first node hosts the rendezvous and must stay); needs --nnodes >= 2, checkpoints and --max-restarts",
    )
    p.add_argument("--min-gpus", type=int_in(1, MAX_DEVICES), help="with --elastic: the fewest GPUs to continue on")
    p.add_argument(
        "--rejoin-timeout-s",
        type=float_in(0, 86_400, low_open=True),
        default=30.0,
        help="with --elastic: how long a (re)start waits for a missing node before going on without it (s)",
    )
    p.add_argument("--layout-report", type=out_path, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


DRY_RUN_ALL_RANKS = 16  # a 1,024-rank --dry-run printed 29 MB, one line per rank


def _data_arg(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected 'synthetic' or a tensor file path, got an empty string")
    return text


def _check_paths(args: argparse.Namespace) -> None:
    """Outputs are writable regular files distinct from the plan; the checkpoint folder is a folder."""
    inputs = {"plan": args.plan} | ({"--data": args.data} if args.data != "synthetic" else {})
    for flag in ("--metrics", "--slurm", "--layout-report"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            check_out_path(value, flag=flag, inputs=inputs)
    folder = args.checkpoint_dir
    if folder is not None and folder.exists() and not folder.is_dir():
        raise StratagemError(f"--checkpoint-dir {folder} is a file, not a folder; give a folder path")


def _options(args: argparse.Namespace, metrics: Path | None):
    from runtime.launch import LaunchOptions

    return LaunchOptions(
        plan_path=args.plan,
        steps=args.steps,
        data=args.data,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        init_from=args.init_from,
        metrics=metrics,
        max_restarts=args.max_restarts,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        nproc_per_node=args.nproc_per_node,
        timeout_s=args.timeout_s,
        layout_report=args.layout_report,
        compile={None: "auto", True: "on", False: "off"}[args.compile],
        elastic=args.elastic,
        min_gpus=args.min_gpus,
        rejoin_timeout_s=args.rejoin_timeout_s,
    )


def elastic_plans(plan, opts, plan_path: Path) -> tuple[Path, ...]:
    """``launch --elastic``: the plan for each smaller whole-node device count down to ``--min-gpus``, re-planned
    with the plan's own `stratagem plan` arguments (its ``search.command``: same model, profiles, training settings
    and flags; the cluster profile at that count) and written beside it as ``<plan>.elastic<N>.json``. A count no
    plan fits is skipped, saying why; the job then cannot continue on it. Another node than the first reuses the
    plans the first wrote for this plan (same `stratagem plan` arguments and training settings) when it sees them
    (a shared folder), so a node joining a running job runs the plans that job runs."""
    from planner.cli.cmd_plan import replan_cluster_is_mixed
    from planner.plan import save_plan
    from runtime.launch import min_nodes

    if plan.search is None or not plan.search.command:
        raise StratagemError(
            f"{plan_path} does not record the `stratagem plan` arguments that made it (written by an older "
            f"stratagem or by hand), so --elastic cannot re-plan it; re-plan it with `stratagem plan`"
        )
    mixed = replan_cluster_is_mixed(plan.search.command)
    if mixed is not None:
        raise StratagemError(
            f"--elastic re-plans for the devices left, but cluster {mixed} mixes node types, and which devices are "
            f"left depends on which node is lost (not supported yet); launch it without --elastic (--max-restarts "
            f"restarts the same plan)"
        )
    nproc = opts.procs_per_node(plan)
    out = []
    for nodes in range(opts.nnodes - 1, min_nodes(opts, nproc) - 1, -1):
        gpus = nodes * nproc
        path = plan_path.with_suffix(f".elastic{gpus}.json")
        if opts.node_rank != 0 and (kept := _elastic_plan_of(plan, path, gpus)) is not None:
            print(f"elastic: {gpus} GPUs -> {plan_label(kept)} (the job's own, {path})", file=sys.stderr)
            out.append(path)
            continue
        smaller, note = _replan_for(plan, gpus)
        if smaller is None:
            print(f"elastic: no plan for {gpus} GPUs ({note}); the job stops if fewer nodes are left", file=sys.stderr)
            if opts.node_rank == 0:  # a plan an earlier launch left there must not be taken for this job's
                path.unlink(missing_ok=True)
            continue
        path = save_plan(smaller, path)
        pred = smaller.predictions.step_time_s if smaller.predictions else None
        print(
            f"elastic: {gpus} GPUs -> {plan_label(smaller)}"
            + (f", predicted {pred:.4g} s/step" if pred is not None else "")
            + f" ({path}){note}",
            file=sys.stderr,
        )
        out.append(path)
    return tuple(out)


def _replan_for(plan, gpus: int):
    """(plan for ``gpus`` devices or None, a note): at the run's global batch; only if no plan of it fits, at the
    nearest batch the recipe allows (``nearest_batches``: a split the run's batch rules out), stated in the note
    (else the note is the reason no plan exists)."""
    from planner.cli.cmd_plan import replan
    from planner.plan import nearest_batches

    batch = plan.training.global_batch
    try:
        smaller = replan(plan.search.command, gpus)
    except StratagemError as exc:
        reason = str(exc).splitlines()[0]
    else:
        if smaller.training == plan.training:
            return smaller, ""
        return None, "its plan changes the training settings"
    for other in nearest_batches(batch, gpus):
        try:
            smaller = replan(plan.search.command, gpus, global_batch=other)
        except StratagemError:
            continue
        if smaller.training.model_copy(update={"global_batch": batch}) != plan.training:
            continue
        rate = (
            "the rate scaled linearly by its recipe (Goyal et al. 2017)"
            if plan.training.lr_schedule is not None
            else "the rate unchanged (the plan has no --lr recipe to scale it)"
        )
        return smaller, (
            f"; no plan of global batch {batch} fits {gpus} GPUs ({reason}), so this one trains {other} samples per "
            f"step from the same sample on, {rate}, the steps of the run unchanged"
        )
    return None, reason


def _elastic_plan_of(plan, path: Path, gpus: int):
    """The plan at ``path`` when it is ``plan``'s re-plan for ``gpus`` devices (its recorded `stratagem plan`
    arguments are ``plan``'s with that count, and it trains the same way but perhaps at another batch); else
    None."""
    from planner.cli.cmd_plan import replan_command

    if not path.is_file():
        return None
    try:
        other = load_plan(path)
    except StratagemError:
        return None
    batch = other.training.global_batch
    mine = replan_command(
        list(plan.search.command or []), gpus, global_batch=None if batch == plan.training.global_batch else batch
    )
    theirs = list(other.search.command or []) if other.search is not None else []
    same_training = other.training.model_copy(update={"global_batch": plan.training.global_batch}) == plan.training
    return other if theirs == mine and other.world_size == gpus and same_training else None


def _run_with_oom_fallback(plan, opts, args: argparse.Namespace, metrics: Path | None) -> int:
    """Run the job; when a rank runs out of memory, move to the fastest runner-up plan in the plan file with more
    memory headroom (written beside the plan as ``<plan>.fallback<N>.json``, logged in the metrics and here) and
    train it from step 1 with the same steps and data order; again while runners-up with more headroom are left."""
    import dataclasses
    import json

    from planner.core import atomic_write_text
    from planner.plan import save_plan
    from runtime.launch import (
        FALLBACK_ENV,
        OOM_DIR_ENV,
        build_command,
        command_env,
        oom_fallback,
        run_command,
        start_elastic_job,
    )

    start_elastic_job(opts)

    fallbacks = 0
    with tempfile.TemporaryDirectory(prefix="stratagem-oom-") as notes_dir:
        while True:
            env = {**command_env(opts), OOM_DIR_ENV: notes_dir, **({FALLBACK_ENV: str(fallbacks)} if fallbacks else {})}
            status = run_command(build_command(plan, opts), timeout_s=args.timeout_s, env_extra=env)
            notes = sorted(Path(notes_dir).glob("oom-rank*.json"))
            if status == 0 or not notes:
                return status
            note = json.loads(notes[0].read_text(encoding="utf-8"))
            for path in notes:
                path.unlink()
            nxt = oom_fallback(plan, note)
            fallbacks += 1
            path = save_plan(nxt, Path(args.plan).with_suffix(f".fallback{fallbacks}.json"))
            nxt = load_plan(path)
            message = (
                f"rank {note['rank']} ran out of memory in step {note['step']}; moving to runner-up plan "
                f"{plan_label(nxt)} (predicted peak of the fullest device {fullest_text(plan)} -> "
                f"{fullest_text(nxt)}), "
                f"written to {path}; training it from step 1"
            )
            print(message, file=sys.stderr)
            if metrics is not None:
                record = {
                    "event": "oom_fallback",
                    "step": note["step"],
                    "rank": note["rank"],
                    "message": note.get("message", ""),
                    "from_plan_hash": plan.content_hash,
                    "to_plan_hash": nxt.content_hash,
                    "to_plan_path": str(path.resolve()),
                    "fallback": fallbacks,
                }
                previous = metrics.read_text(encoding="utf-8") if metrics.exists() else ""
                atomic_write_text(metrics, previous + json.dumps(record) + "\n")
            checkpoints = opts.checkpoint_dir / f"fallback{fallbacks}" if opts.checkpoint_dir else None
            plan, opts = nxt, dataclasses.replace(opts, plan_path=path, checkpoint_dir=checkpoints, resume=False)


def fullest_text(plan) -> str:
    """``"4.16 MiB, 0.034% of 12 GiB"``: the fullest stage's predicted peak and its share of its device."""
    from planner.inspect import fmt_bytes

    if plan.predictions is None or not plan.predictions.stages:
        return "not costed"
    sp, _ = max(
        stage_memory_predictions(plan.predictions, plan),
        key=lambda x: x[0].peak_memory_bytes / x[0].memory_capacity_bytes,
    )
    share = sp.peak_memory_bytes / sp.memory_capacity_bytes
    return f"{fmt_bytes(sp.peak_memory_bytes)}, {share:.2%} of {fmt_bytes(sp.memory_capacity_bytes)}"


def _print_summary(metrics: Path, *, keep: bool) -> None:
    from runtime.executor.metrics import read_metrics

    summary = [r for r in read_metrics(metrics) if r.get("event") == "summary"] if metrics.exists() else []
    if not summary:
        return
    s = summary[-1]
    pred = s["predicted_step_time_s"]
    print(
        f"trained {s['steps']} steps: final loss {s['final_loss']:.6f}, step time "
        f"{s['measured_step_time_s']:.4f} s (predicted {'n/a' if pred is None else f'{pred:.4f} s'}), "
        f"{_tensor_memory(s)}" + (f"; metrics in {metrics}" if keep else "")
    )


def _tensor_memory(s: dict) -> str:
    """Peak tensor memory of the largest rank, measured and predicted (the prediction without its reserve)."""
    measured, predicted = s.get("measured_peak_tensor_bytes"), s.get("predicted_peak_tensor_bytes")
    if not measured:
        return f"peak memory {s['measured_peak_memory_bytes'] / 2**20:.0f} MiB"
    text = f"peak tensor memory {max(measured) / 2**20:.2f} MiB"
    if predicted and s.get("tensor_memory_error") is not None:
        text += f" (predicted {max(predicted) / 2**20:.2f} MiB; largest per-rank error {s['tensor_memory_error']:.1%})"
    return text


def _preempted(metrics: Path) -> tuple[int, str | None] | None:
    """(step, checkpoint) of the last attempt's ``preempted`` event in the metrics file, if it stopped on SIGTERM."""
    from runtime.executor.metrics import read_metrics

    if not metrics.exists():
        return None
    records = read_metrics(metrics)
    last = records[-1]["attempt"] if records and "attempt" in records[-1] else None
    events = [r for r in records if r.get("event") == "preempted" and r.get("attempt") == last]
    return (events[-1]["step"], events[-1]["checkpoint"]) if events else None


GPU_VENDORS = ("NVIDIA", "Tesla", "AMD", "GPU")  # words in a shipped profile's device name marking a GPU


def check_cluster(plan, nproc_per_node: int) -> None:
    """A plan made for a shipped GPU cluster needs CUDA and ``nproc_per_node`` devices here.

    Plans for measured or hand-made clusters (no shipped profile of that name) are not checked."""
    from planner.cli.common import PROFILES_DIR
    from planner.profile import load_cluster_profile

    path = PROFILES_DIR / "hardware" / f"{plan.cluster_name}.json"
    if not path.exists():
        return
    devices = {nt.device for nt in load_cluster_profile(path).node_types}
    if not any(word in d for d in devices for word in GPU_VENDORS):
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < nproc_per_node:
        raise StratagemError(
            f"plan was made for cluster {plan.cluster_name} ({', '.join(sorted(devices))}) and "
            f"needs {nproc_per_node} GPUs on this node but it has {have}; launch on that "
            f"cluster or re-plan here with --cluster local-cpu-2core (or a measured profile)"
        )


def run(args: argparse.Namespace) -> int:
    from runtime.launch import build_command, build_slurm_script, check_launch

    _check_paths(args)
    if args.node_rank >= args.nnodes:
        raise StratagemError(
            f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes} (nodes are "
            f"numbered 0..{args.nnodes - 1})"
        )
    plan = load_plan(args.plan)
    tmp = None
    metrics = args.metrics
    if metrics is None and not (args.dry_run or args.slurm):
        tmp = tempfile.TemporaryDirectory(prefix="stratagem-launch-")
        metrics = Path(tmp.name) / "metrics.jsonl"
    opts = _options(args, metrics)
    check_launch(plan, opts, slurm=args.slurm is not None)
    if args.elastic:
        import dataclasses

        opts = dataclasses.replace(opts, elastic_plans=elastic_plans(plan, opts, Path(args.plan)))
    if not (args.slurm or args.dry_run):  # those may be prepared on a machine without the cluster's GPUs
        check_cluster(plan, opts.procs_per_node(plan))
    if args.slurm:
        from planner.core import atomic_write_text

        atomic_write_text(args.slurm, build_slurm_script(plan, opts), flag="--slurm")
        print(f"wrote {args.slurm}; submit it with: sbatch {args.slurm}")
        return 0
    if plan.search is not None and plan.search.memory_semantics == "textbook":
        print(
            "note: this plan's memory was priced as Megatron-LM / DeepSpeed hold it (plan --for); `stratagem launch` "
            "holds memory as FSDP2 and torch pipelining do, so re-plan with --for launch for a prediction of this "
            "run's memory",
            file=sys.stderr,
        )
    cmd = build_command(plan, opts)
    if args.dry_run:
        from runtime.executor.describe import describe_ranks  # torch's FSDP and DTensor: 4 s of imports

        from runtime.launch import command_env

        print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in command_env(opts).items()), shlex.join(cmd)]))
        every = args.all_ranks or plan.world_size <= DRY_RUN_ALL_RANKS
        shown = (
            None
            if every
            else [min(st.ranks) for st in sorted(plan.stages, key=lambda s: s.index) if st.index < plan.mesh.size("pp")]
        )
        for line in describe_ranks(plan, shown):
            print(line)
        if not every:
            print(
                f"({plan.world_size} ranks: the first rank of each pipeline rank is shown; the dp x tp ranks of a "
                f"pipeline rank build the same modules on other rows; --all-ranks lists every rank)"
            )
        return 0
    status = _run_with_oom_fallback(plan, opts, args, metrics)
    preempted = _preempted(metrics)
    if preempted is not None:
        step, checkpoint = preempted
        print(
            f"preempted (SIGTERM) after step {step}: "
            + (
                f"checkpoint {checkpoint}; continue with the same command plus --resume"
                if checkpoint
                else "no --checkpoint-dir, nothing saved"
            )
        )
        if tmp is not None:
            tmp.cleanup()
        return 0
    if status != 0:
        raise StratagemError(f"the training job failed (torchrun exit status {status}); see the rank logs above")
    _print_summary(metrics, keep=tmp is None)
    if tmp is not None:
        tmp.cleanup()
    return 0
