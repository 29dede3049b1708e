"""Per-rank entry point, started by torchrun: ``python -m runtime.executor.train --plan plan.json``.

Each rank: reads the plan, joins the process group (NCCL with CUDA, else gloo), builds its chunk(s)
(``parallelize.build_chunk``), an AdamW per chunk, the step runner (``schedule``), then trains for
``--steps`` steps on its dp replica's rows of each global batch, checkpointing every K steps and
resuming from the newest complete checkpoint with ``--resume`` or after an elastic restart.
Several ``--plan`` (with as many ``--metrics``) run one after another in the same process group, which
lets tests share one launch between configurations of the same world size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from planner.core import ParallelDims, StratagemError, atomic_write_text
from planner.plan import Plan, load_plan, lr_at_step, validate
from runtime.executor.checkpoint import (
    check_compatible,
    checkpoint_meta,
    find_latest_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
    torn_checkpoints,
)
from runtime.executor.checks import check_replica_schedules, check_supported
from runtime.executor.context import ContextShard, build_context_shard
from runtime.executor.data import Batch, DataStream, build_data_source, loss_scale, replica_rows
from runtime.executor.mesh import build_mesh
from runtime.executor.metrics import (
    MetricsLog,
    peak_memory_bytes,
    peak_reserved_bytes,
    peak_rss_bytes,
    reset_peak_memory,
)
from runtime.executor.moe import build_expert_groups, set_aux_loss_scale, take_aux_loss
from runtime.executor.parallelize import Chunk, build_chunk, describe_params
from runtime.executor.pretrained import load_pretrained
from runtime.executor.schedule import LocalRunner, PipelineRunner, build_runner
from runtime.executor.speed import (
    COMPILE_CHOICES,
    autocast_dtype,
    build_optimizer,
    check_attention_kernel,
    compile_loss,
    report_compile,
    resolve_compile,
)
from runtime.executor.tensor_memory import KINDS, TensorMemory, TensorPeak, steady_peak
from runtime.executor.tied import TiedGradSync, build_tied_sync, tied_aliases
from runtime.launch import ATTEMPTS_FILE, FALLBACK_ENV, OOM_DIR_ENV

log = logging.getLogger("runtime.executor.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="runtime.executor.train", description=__doc__.splitlines()[0])
    p.add_argument("--plan", action="append", required=True, help="plan file (repeatable)")
    p.add_argument("--metrics", action="append", default=[], help="JSON-lines metrics file per --plan")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--data", default="synthetic", help="'synthetic' or a tensor file {'inputs','targets'}")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--init-from",
        action="append",
        default=[],
        help="folder of a safetensors checkpoint to start from (runtime.executor.pretrained); one, or one per --plan",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    p.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="auto",
        help="torch.compile each transformer block (auto: on CUDA, off on CPU)",
    )
    p.add_argument(
        "--layout-report",
        action="append",
        default=[],
        help="folder (one per --plan) for one JSON per rank describing what it built",
    )
    p.add_argument(
        "--elastic-plan",
        action="append",
        default=[],
        help="plan file for another world size (launch --elastic): run when the job (re)starts with its ranks",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="launch --elastic: nodes may leave or join between attempts, so every attempt resumes the newest "
        "checkpoint of --checkpoint-dir (a joining node's agent counts no restart) and records a re-plan when "
        "the world differs from the one that wrote it",
    )
    return p.parse_args(argv)


def init_distributed(timeout_s: float) -> torch.device:
    """Join the torchrun process group; returns this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    return device


def _attempt_store(timeout: timedelta):
    """Under torchrun, the agent's store with keys prefixed by the restart count (``None`` otherwise).

    Measured with torch 2.13 ``--standalone --max-restarts 1``: restarted gloo workers sometimes read the
    killed attempt's peer addresses from the agent store and fail with "Gloo connectFullMesh failed ...
    Connection refused" (2 of 5 runs); a per-attempt key prefix makes each attempt's keys its own.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"stratagem/attempt_{_restart_count()}", store)


HOLD_LIMIT_S = 300.0


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _maybe_die(step: int) -> None:
    """Test hook: ``STRATAGEM_TEST_KILL_AT_STEP=k`` makes rank ``STRATAGEM_TEST_KILL_RANK`` (default 1)
    exit abruptly before step k, on the first attempt only."""
    if (
        os.environ.get("STRATAGEM_TEST_KILL_AT_STEP") == str(step)
        and _restart_count() == 0
        and dist.get_rank() == int(os.environ.get("STRATAGEM_TEST_KILL_RANK", "1"))
    ):
        log.warning("test hook: rank %d exits at step %d", dist.get_rank(), step)
        os._exit(13)


def _maybe_kill_node(step: int) -> None:
    """Test hook: ``STRATAGEM_TEST_KILL_NODE_AT_STEP=k``, set in one node's launch only, makes every rank of that
    node kill its torchrun agent and exit before step k, first attempt only: the node is gone for good, as a
    failed machine is (``launch --elastic`` continues on the nodes left)."""
    if os.environ.get("STRATAGEM_TEST_KILL_NODE_AT_STEP") == str(step) and _restart_count() == 0:
        log.warning("test hook: this node (rank %d) is lost at step %d", dist.get_rank(), step)
        try:
            os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun agent: no restart, no rejoin
        except ProcessLookupError:  # a peer on the node killed it first
            pass
        os._exit(19)


def _maybe_hold(step: int) -> None:
    """Test hook: ``STRATAGEM_TEST_HOLD_AT_STEP=k:n`` makes every rank of an attempt with fewer than ``n`` ranks
    wait before step k until its agent stops it (a node joined: the agent restarts the workers to grow the job),
    at most ``HOLD_LIMIT_S``; a test of ``launch --elastic`` growing so knows the job has not finished first."""
    at, _, ranks = os.environ.get("STRATAGEM_TEST_HOLD_AT_STEP", "").partition(":")
    if at != str(step) or dist.get_world_size() >= int(ranks):
        return
    log.warning("test hook: rank %d holds before step %d until a node joins", dist.get_rank(), step)
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not Preemption.requested:
        if time.monotonic() > deadline:
            raise StratagemError(f"test hook: no node joined within {HOLD_LIMIT_S:g} s")
        time.sleep(0.1)
    os._exit(0)  # the agent is stopping this attempt; step k-1's checkpoint is the one the next attempt resumes


def elastic_choice(plan_paths: list[str], elastic_paths: list[str], world_size: int) -> str:
    """The plan file to run on ``world_size`` ranks: the launched one when it has that many, else the
    ``--elastic-plan`` made for it."""
    if len(plan_paths) != 1:
        raise StratagemError("--elastic-plan needs exactly one --plan")
    first = load_plan(plan_paths[0])
    if first.world_size == world_size or not elastic_paths:
        return plan_paths[0]
    plans = {plan.world_size: p for p in elastic_paths for plan in [load_plan(p)]}
    if world_size not in plans:
        have = ", ".join(str(n) for n in sorted({first.world_size, *plans}))
        raise StratagemError(
            f"the job (re)started on {world_size} ranks but plans exist only for {have}; "
            f"relaunch with --min-gpus at a count that has a plan"
        )
    return plans[world_size]


def replan_record(plan: Plan, plan_path: str, before: dict, plan_files: list[str]) -> dict | None:
    """The ``replan`` event of an elastic attempt whose world differs from the one before it (``before``: the
    resumed checkpoint's meta, or the launched plan's world size and hash when nothing was resumed); ``None``
    when it is the same. The earlier plan's file is found among ``plan_files`` by its hash."""
    world = plan.world_size
    if before["world_size"] == world and before["plan_hash"] == plan.content_hash:
        return None
    paths = {load_plan(p).content_hash: str(Path(p).resolve()) for p in plan_files}
    return {
        "event": "replan",
        "from_world_size": before["world_size"],
        "to_world_size": world,
        "from_plan_hash": before["plan_hash"],
        "to_plan_hash": plan.content_hash,
        "from_plan_path": paths.get(before["plan_hash"]),
        "to_plan_path": str(Path(plan_path).resolve()),
    }


def next_attempt(ckpt_dir: str | Path) -> int:
    """Rank 0 of an elastic attempt: its number (0 for the first), counted in ``--checkpoint-dir`` (which every
    node reads: the checkpoints are resharded from it), so it holds whichever node has rank 0. torch's restart
    count does not serve: an agent counts no restart when a node joins, and a joining node starts at 0."""
    path = Path(ckpt_dir) / ATTEMPTS_FILE
    try:
        started = int(json.loads(path.read_text(encoding="utf-8"))["started"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: count from here
        started = 0
    atomic_write_text(path, json.dumps({"started": started + 1}) + "\n")
    return started


def _maybe_sigterm_launcher(step: int) -> None:
    """Test hook: ``STRATAGEM_TEST_SIGTERM_AT_STEP=k`` makes rank 0 send SIGTERM to the ``stratagem launch``
    process (``STRATAGEM_LAUNCHER_PID``) before step k, as a cluster's preemption would, first attempt only."""
    if (
        os.environ.get("STRATAGEM_TEST_SIGTERM_AT_STEP") == str(step)
        and _restart_count() == 0
        and dist.get_rank() == 0
        and os.environ.get("STRATAGEM_LAUNCHER_PID")
    ):
        os.kill(int(os.environ["STRATAGEM_LAUNCHER_PID"]), signal.SIGTERM)


def _maybe_oom(step: int) -> None:
    """Test hook: ``STRATAGEM_TEST_OOM_AT_STEP=k`` makes the last rank raise ``torch.OutOfMemoryError`` in step k
    of the plan ``stratagem launch`` started with (not in a fallback plan it moved to)."""
    if (
        os.environ.get("STRATAGEM_TEST_OOM_AT_STEP") == str(step)
        and not os.environ.get(FALLBACK_ENV)
        and dist.get_rank() == dist.get_world_size() - 1
    ):
        raise torch.OutOfMemoryError(f"test hook: rank {dist.get_rank()} out of memory at step {step}")


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: CUDA's ``torch.OutOfMemoryError``, or the CPU allocator's RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def report_out_of_memory(plan: Plan, step: int, exc: BaseException) -> None:
    """Leave a note for `stratagem launch` (``STRATAGEM_OOM_DIR``): which rank ran out of memory, where, under
    which plan; it then moves to a runner-up plan with more headroom."""
    folder = os.environ.get(OOM_DIR_ENV)
    rank = dist.get_rank()
    log.error("rank %d ran out of memory in step %d: %s", rank, step, str(exc).splitlines()[0][:200])
    if folder:
        note = {"rank": rank, "step": step, "plan_hash": plan.content_hash, "message": str(exc).splitlines()[0][:300]}
        atomic_write_text(Path(folder) / f"oom-rank{rank}.json", json.dumps(note) + "\n")


def write_layout_report(
    folder: str,
    rank: int,
    coords: dict,
    chunks: list[Chunk],
    *,
    rows: tuple[int, int],
    loss_scale: float,
    micro_batches: int,
    context: ContextShard | None = None,
) -> None:
    """Per-rank JSON of what was built: chunks, placements, and the rows [start, end) of each global batch
    this rank's dp replica trains on, in how many micro-batches, with its loss scale (uneven batch shares)."""
    report = {
        "rank": rank,
        "coords": coords,
        "rows": list(rows),
        "micro_batches": micro_batches,
        "context": None
        if context is None
        else {"cp": context.cp, "mode": context.mode, "chunks": list(context.chunks)},  # context parallelism
        "loss_scale": loss_scale,
        "chunks": [
            {
                "stage": c.stage.index,
                "module_paths": c.module.layer_paths(),
                "tp_styles": c.tp_styles,
                "recomputed": c.recomputed,
                "dp_mode": c.dp_mode,
                "loss_parallel": c.loss_parallel,
                "replica_rows": dict(c.replica_rows),
                "context_paths": list(c.context_paths),
                "experts_held": dict(c.experts_held),
                "attention": c.attention,
                "compiled": list(c.compiled),
                "precision": c.precision,
                "expert_dp_mode": c.expert_dp_mode,
                "params": describe_params(c.module),
            }
            for c in chunks
        ],
    }
    atomic_write_text(Path(folder) / f"rank{rank}.json", json.dumps(report, indent=1) + "\n")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    loss: float
    step_time_s: float
    lr: float
    peak_memory_bytes: list[int]
    peak_rss_bytes: list[int]
    preempted: bool = False
    moe_aux_loss: float | None = None  # load-balancing loss (1.0 = balanced), mean over MoE layers and ranks
    # the step's peak of live tensor bytes per rank (runtime.executor.tensor_memory), measured in one step
    tensor_peaks: list[TensorPeak] | None = None
    # CUDA: each rank's torch.cuda.max_memory_reserved (the caching allocator's blocks); None on other devices
    peak_reserved_bytes: list[int] | None = None


class Preemption:
    """SIGTERM — what Slurm and Kubernetes send before they kill a job — only sets a flag here. The ranks
    agree on it at the next step boundary (it travels in the step's all_gather, so a signal seen by one rank
    stops all of them after the same step), checkpoint there and exit cleanly."""

    requested = False

    @classmethod
    def install(cls) -> None:
        signal.signal(signal.SIGTERM, cls._on_sigterm)

    @classmethod
    def _on_sigterm(cls, signum, frame) -> None:  # noqa: ARG003 - signal handler API
        cls.requested = True


def _gather_step(
    device,
    loss_part: float,
    step_time_s: float,
    peak_bytes: int,
    lr: float,
    aux: tuple[float, int] = (0.0, 0),
    tensor_peak: TensorPeak | None = None,
) -> StepResult:
    """All ranks: global loss (sum of parts), max step time, per-rank memory, whether any rank was asked
    to stop (SIGTERM), the MoE load-balancing loss (mean over every rank's layers and forwards) and, when
    measured, each rank's peak of live tensor bytes by kind, in one all_gather."""
    tensors = [float(tensor_peak.peak_bytes)] + [float(tensor_peak.by_kind[k]) for k in KINDS] if tensor_peak else []
    reserved = peak_reserved_bytes(device)
    mine = torch.tensor(
        [
            loss_part,
            step_time_s,
            float(peak_bytes),
            float(peak_rss_bytes()),
            float(Preemption.requested),
            *aux,
            *(tensors or [0.0] * (1 + len(KINDS))),
            -1.0 if reserved is None else float(reserved),
        ],
        dtype=torch.float64,
        device=device,
    )
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    table = torch.stack(parts).cpu()
    return StepResult(
        loss=float(table[:, 0].sum()),
        step_time_s=float(table[:, 1].max()),
        lr=lr,
        peak_memory_bytes=[int(v) for v in table[:, 2]],
        peak_rss_bytes=[int(v) for v in table[:, 3]],
        preempted=bool(table[:, 4].max() > 0),
        moe_aux_loss=float(table[:, 5].sum() / table[:, 6].sum()) if table[:, 6].sum() > 0 else None,
        tensor_peaks=[
            TensorPeak(peak_bytes=int(row[7]), by_kind={k: int(v) for k, v in zip(KINDS, row[8:-1].tolist())})
            for row in table
        ]
        if tensor_peak
        else None,
        peak_reserved_bytes=[int(v) for v in table[:, -1]] if bool((table[:, -1] >= 0).all()) else None,
    )


@dataclass(kw_only=True)
class Job:
    """Everything one rank needs to train one plan."""

    plan: Plan
    dims: ParallelDims
    coords: dict[str, int]
    device: torch.device
    chunks: list[Chunk]
    optimizers: list[torch.optim.Optimizer]
    runner: LocalRunner | PipelineRunner
    data: Callable[[int], Batch]
    rows: tuple[int, int]
    micro_batches: int
    tied: TiedGradSync | None = None
    memory_baseline_bytes: int = 0
    loss_scale: float = 1.0
    context: ContextShard | None = None  # this rank's two chunks of each sequence (context parallelism)

    @property
    def modules(self) -> list[torch.nn.Module]:
        return [c.module for c in self.chunks]


def build_job(
    plan: Plan,
    device: torch.device,
    *,
    data: str,
    report_dir: str | None = None,
    compile_blocks: bool = False,
    init_from: str | None = None,
) -> Job:
    """Build this rank's chunks, optimizers, step runner and data view for ``plan`` (collective);
    ``compile_blocks``: ``torch.compile`` each transformer block (``runtime.executor.speed``); ``init_from``: a
    safetensors checkpoint folder whose weights replace the initial ones before the optimizers are built."""
    from runtime.models import loss_fn

    rank = dist.get_rank()
    baseline = reset_peak_memory(device)
    validate(plan, dist.get_world_size())
    check_supported(plan)
    split = check_replica_schedules(plan)  # each replica's own micro-batch count with uneven batch shares
    dims = plan.parallel_dims
    coords = dims.coords(rank)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = plan.training.dtype == "tf32"
    mesh = build_mesh(dims, device.type)
    mine = sorted((s for s in plan.stages if s.pp_rank == coords["pp"]), key=lambda s: s.index)
    if not mine or any(rank not in s.ranks for s in mine):
        raise StratagemError(
            f"rank {rank} (pp={coords['pp']}) is not listed in its stages' ranks; "
            f"the plan's rank layout is corrupt, re-plan"
        )
    context = build_context_shard(plan, mesh, coords)
    experts = build_expert_groups(plan, dims, rank, mesh["tp"].get_group(), device.type)
    chunks = [build_chunk(plan, stage, mesh, device, context, experts, compile_blocks=compile_blocks) for stage in mine]
    if init_from:
        load_pretrained(init_from, [c.module for c in chunks], plan.model)
    tr = plan.training
    rows, num_micro = split.rows, split.micro_batches[coords["dp"]]
    scale, base_loss = loss_scale(rows, coords["dp"]), loss_fn(plan.model)
    if any(c.compiled for c in chunks) and not any(c.loss_parallel for c in chunks):
        base_loss = compile_loss(base_loss)
    for chunk in chunks:  # the MoE load-balancing loss's gradient gets the factor each micro-batch's loss gets
        set_aux_loss_scale(chunk.module, scale / num_micro / dims.tp)
    if report_dir:
        write_layout_report(
            report_dir,
            rank,
            coords,
            chunks,
            rows=replica_rows(rows, coords["dp"]),
            loss_scale=scale,
            micro_batches=num_micro,
            context=context,
        )
    scaled_loss = base_loss if scale == 1.0 else (lambda out, tgt: base_loss(out, tgt) * scale)
    runner = build_runner(
        chunks,
        kind=plan.schedule.kind,
        num_stages=len(plan.stages),
        num_micro_batches=num_micro,
        loss_fn=scaled_loss,
        pp_group=mesh["pp"].get_group(),
        device=device,
        autocast_dtype=autocast_dtype(plan),
        sync_every_micro_batch=plan.zero_stage == 3,
        cuda_graphs=any(c.cuda_graphs for c in chunks),
    )
    return Job(
        plan=plan,
        dims=dims,
        coords=coords,
        device=device,
        chunks=chunks,
        runner=runner,
        optimizers=[
            build_optimizer(
                c.module,
                lr=tr.lr,
                weight_decay=tr.weight_decay,
                device=device,
                master_weights=c.precision == "bf16-master",
            )
            for c in chunks
        ],
        data=build_data_source(plan.model, data, global_batch=tr.global_batch, seq_len=tr.seq_len, seed=tr.seed),
        rows=replica_rows(rows, coords["dp"]),
        micro_batches=num_micro,
        memory_baseline_bytes=baseline,
        loss_scale=scale,
        tied=build_tied_sync(plan, dims, coords, [c.module for c in chunks]),
        context=context,
    )


def apply_lr(job: Job, step: int) -> float:
    """Set every optimizer's rate for 1-based ``step`` from the plan's recipe (planner/plan/recipe.py; none =
    the constant ``training.lr``); returns it."""
    tr = job.plan.training
    lr = tr.lr if tr.lr_schedule is None else lr_at_step(tr.lr_schedule, global_batch=tr.global_batch, step=step - 1)
    for opt in job.optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
    return lr


def train_step(job: Job, step: int, tracker: TensorMemory | None = None) -> StepResult:
    """One optimizer step; returns the global-batch mean loss, max step time over ranks, memory per rank.

    ``tracker`` (entered by the caller): also measure the step's peak of live tensor bytes. In a run's first
    step the optimizer state is created by its ``step()``; the forward and backward of every later step run
    with it alive, so the figure reported is the steady state's: max(peak of forward and backward + the
    optimizer state created in this step, peak of the optimizer step)."""
    batch = job.data(step).rows(*job.rows)
    if job.context is not None:  # this cp rank's two chunks of every sequence, inputs and targets alike
        batch = Batch(inputs=job.context.shard(batch.inputs), targets=job.context.shard(batch.targets))
    batch = batch.to(job.device)
    if tracker is not None:
        tracker.reset()
    t0 = time.perf_counter()
    losses = job.runner.step(batch)
    for chunk in job.chunks:
        if chunk.replica_sync is not None:
            chunk.replica_sync.sync()
        if chunk.expert_sync is not None:
            chunk.expert_sync.sync()
    if job.tied is not None:
        job.tied.sync()
    lr = apply_lr(job, step)
    if tracker is not None:
        passes = tracker.peak()
        tracker.reset()
    for opt in job.optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    if job.device.type == "cuda":
        torch.cuda.synchronize(job.device)
    elapsed_s = time.perf_counter() - t0
    # each replica's last-stage, tp-rank-0 rank adds its (share-scaled) mean loss / dp: the sum over ranks
    # is the global-batch mean (see data.loss_scale; a replica's micro-batches are all the same size); with
    # context parallelism every cp rank adds its tokens' mean / (dp cp) (equal token counts)
    counts = job.runner.is_last and job.coords["tp"] == 0 and losses
    part = float(torch.stack(losses).mean()) / (job.dims.dp * job.dims.cp) if counts else 0.0
    peak = peak_memory_bytes(job.device, job.memory_baseline_bytes)
    tensor_peak = steady_peak(passes, tracker.peak(), tracker.now()) if tracker is not None else None
    return _gather_step(job.device, part, elapsed_s, peak, lr, take_aux_loss(job.modules), tensor_peak)


PROFILE_ENV = "STRATAGEM_TORCH_PROFILE"  # a folder: the third step is traced and its kernel table written there


def profiled_step(job: Job, step: int, tag: str = "") -> StepResult:
    """:func:`train_step` under ``torch.profiler`` (CPU + CUDA activities); writes this rank's operator table,
    sorted by device time (CUDA) or CPU time, to ``$STRATAGEM_TORCH_PROFILE/rank<r>_step<s>.txt`` and every
    operator's self times and input shapes to ``rank<r>_step<s>.json`` (``{"ops": [{name, input_shapes,
    calls, self_device_us, self_cpu_us}]}``). ``tag``: appended to the names (``_plan<i>`` when one process
    trains several plans)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if job.device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        res = train_step(job, step)
    key = "cuda_time_total" if job.device.type == "cuda" else "cpu_time_total"
    folder = Path(os.environ[PROFILE_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=60)
    stem = folder / f"rank{dist.get_rank()}_step{step}{tag}"
    atomic_write_text(stem.with_suffix(".txt"), table)
    ops = [
        {
            "name": e.key,
            "input_shapes": [list(s) if isinstance(s, list | tuple) else s for s in (e.input_shapes or [])],
            "calls": e.count,
            "self_device_us": float(getattr(e, "self_device_time_total", 0.0) or 0.0),
            "self_cpu_us": float(e.self_cpu_time_total),
        }
        for e in prof.key_averages(group_by_input_shape=True)
    ]
    atomic_write_text(stem.with_suffix(".json"), json.dumps({"device": job.device.type, "ops": ops}) + "\n")
    return res


def _run_step(job: Job, step: int, first: int, profile_tag: str) -> StepResult:
    """Step ``step``: the launch's first (the warm-up step-time figures leave out) also measures live tensor
    memory; the third is traced when ``STRATAGEM_TORCH_PROFILE`` is set. Running out of memory is reported to
    the launcher (:func:`report_out_of_memory`) before the error ends the rank."""
    try:
        _maybe_oom(step)
        if step == first + 2 and os.environ.get(PROFILE_ENV):
            return profiled_step(job, step, profile_tag)
        if step == first:
            with TensorMemory(job.modules, job.optimizers) as tracker:
                return train_step(job, step, tracker)
        return train_step(job, step)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if is_out_of_memory(exc):
            report_out_of_memory(job.plan, step, exc)
        raise


def resumed_stream(meta: dict, first: int, global_batch: int) -> DataStream:
    """Where step ``first`` reads the run's samples, from the resumed checkpoint's ``meta``: its ``data`` entry
    (the stream's batch and the samples trained), or for a checkpoint without one its training settings' batch
    times its steps."""
    pos = meta.get("data")
    if isinstance(pos, dict) and isinstance(pos.get("batch"), int) and isinstance(pos.get("samples"), int):
        return DataStream(batch=pos["batch"], first_step=first, first_sample=pos["samples"])
    training = meta.get("training")
    batch = training.get("global_batch", global_batch) if isinstance(training, dict) else global_batch
    return DataStream(batch=int(batch), first_step=first, first_sample=(first - 1) * int(batch))


def _resume(
    plan: Plan,
    job: Job,
    data: str,
    checkpoint_dir: str | None,
    latest: Path | None,
    metrics_path: str | None,
    plan_path: str | None,
    elastic_from: dict | None,
) -> tuple[int, MetricsLog, DataStream]:
    """Load ``latest`` (if any) into the job; (first step, the metrics log, where the steps read the run's
    samples). Under ``launch --elastic`` (``elastic_from``: the launched plan's world size and hash, and every plan
    file of the job) the attempt is counted in ``checkpoint_dir`` (:func:`next_attempt`) and a ``replan`` event is
    written when the world differs from the one that wrote the checkpoint (or, with none, from the launched
    plan's): a node was lost or joined. A checkpoint written at another global batch (an elastic plan's nearest
    batch) is read on from its next sample (:class:`runtime.executor.data.DataStream`)."""
    first = 1
    before = None if elastic_from is None else {k: elastic_from[k] for k in ("world_size", "plan_hash")}
    stream = DataStream(batch=plan.training.global_batch, first_step=1, first_sample=0)
    if latest is not None:
        meta = read_checkpoint_meta(latest)
        check_compatible(latest, meta, plan, batch_may_change=elastic_from is not None)
        first = load_checkpoint(latest, job.modules, job.optimizers, aliases=tied_aliases(plan)) + 1
        log.info("rank %d resumed from %s", dist.get_rank(), latest)
        if before is not None and "world_size" in meta and "plan_hash" in meta:
            before = {"world_size": meta["world_size"], "plan_hash": meta["plan_hash"]}
        stream = resumed_stream(meta, first, plan.training.global_batch)
        if not stream.aligned(plan.training.global_batch):
            tr = plan.training
            job.data = build_data_source(
                plan.model, data, global_batch=tr.global_batch, seq_len=tr.seq_len, seed=tr.seed, stream=stream
            )
            log.info(
                "rank %d: global batch %d -> %d (launch --elastic: the nearest the recipe allows on %d ranks); "
                "step %d reads from sample %d of the run",
                dist.get_rank(),
                stream.batch,
                tr.global_batch,
                plan.world_size,
                first,
                stream.first_sample,
            )
    attempt = _restart_count()
    if elastic_from is not None and checkpoint_dir is not None:
        attempt = next_attempt(checkpoint_dir) if dist.get_rank() == 0 else 0  # only rank 0 writes metrics
    metrics = MetricsLog(metrics_path, plan, attempt=attempt)
    if elastic_from is not None and before is not None:
        record = replan_record(plan, plan_path or "", before, elastic_from["plans"])
        if record is not None:
            metrics.write({**record, "resumed_from": str(latest) if latest is not None else None, "first_step": first})
    return first, metrics, stream


def run_plan(
    plan: Plan,
    args: argparse.Namespace,
    device: torch.device,
    *,
    metrics_path: str | None = None,
    report_dir: str | None = None,
    plan_path: str | None = None,
    profile_tag: str = "",
    init_from: str | None = None,
    elastic_from: dict | None = None,
) -> dict:
    """Train ``plan`` for ``args.steps`` steps on this rank; returns the summary record (rank 0's is real).
    ``profile_tag``: appended to the operator tables' names (``STRATAGEM_TORCH_PROFILE``); ``init_from``: the
    safetensors checkpoint folder to start from when no checkpoint of the run is resumed."""
    if "sd" in plan.mesh.axes:  # a 3D CNN's hybrid data + spatial plan (runtime/executor/spatial_train.py)
        from runtime.executor.spatial_train import run_spatial_plan

        if args.checkpoint_dir or args.resume:
            raise StratagemError("spatial plans do not checkpoint yet; launch them without --checkpoint-dir/--resume")
        if getattr(args, "compile", "auto") == "on":
            log.warning("--compile: spatial (3D CNN) plans run uncompiled; the flag is ignored for them")
        return run_spatial_plan(plan, steps=args.steps, data=args.data, metrics_path=metrics_path, device=device)
    compile_blocks = resolve_compile(getattr(args, "compile", "auto"), device)
    check_attention_kernel(plan, device)
    latest = None
    if args.checkpoint_dir and (args.resume or _restart_count() > 0 or elastic_from is not None):
        latest = find_latest_checkpoint(args.checkpoint_dir)
    if latest is not None:
        init_from = None  # the run's own checkpoint has the newer weights
    job = build_job(
        plan, device, data=args.data, report_dir=report_dir, compile_blocks=compile_blocks, init_from=init_from
    )
    rank = dist.get_rank()
    first, metrics, stream = _resume(
        plan, job, args.data, args.checkpoint_dir, latest, metrics_path if rank == 0 else None, plan_path, elastic_from
    )
    metrics.write(
        {
            "event": "start",
            "model": plan.model.name,
            "mesh": dict(zip(job.dims.axes, plan.mesh.sizes)),
            "schedule": plan.schedule.kind,
            "zero_stage": plan.zero_stage,
            "first_step": first,
            "device": device.type,
            "world_size": dist.get_world_size(),
            "global_batch": plan.training.global_batch,
            "first_sample": stream.first_sample,
            "plan_hash": plan.content_hash,
            "plan_path": str(Path(plan_path).resolve()) if plan_path else None,
            "attention": job.chunks[0].attention,
            "precision": job.chunks[0].precision,
            "compiled_blocks": sum(len(c.compiled) for c in job.chunks),
            "resumed_from": str(latest) if latest is not None else None,
            "resume_skipped": [str(p) for p in torn_checkpoints(args.checkpoint_dir)] if latest is not None else [],
        }
    )
    tr = plan.training
    tokens = tr.global_batch * (tr.seq_len if plan.model.is_language_model else 1)
    meta = checkpoint_meta(plan, dist.get_world_size()) if args.checkpoint_dir else {}  # once, not every step
    for step in range(first, args.steps + 1):
        _maybe_die(step)
        _maybe_kill_node(step)
        _maybe_hold(step)
        _maybe_sigterm_launcher(step)
        res = _run_step(job, step, first, profile_tag)
        metrics.step(
            step=step,
            loss=res.loss,
            step_time_s=res.step_time_s,
            tokens=tokens,
            samples=tr.global_batch,
            peak_memory_bytes=res.peak_memory_bytes,
            peak_rss_bytes=res.peak_rss_bytes,
            lr=res.lr,
            moe_aux_loss=res.moe_aux_loss,
            tensor_peaks=res.tensor_peaks,
            peak_reserved_bytes=res.peak_reserved_bytes,
        )
        if rank == 0:
            log.info("step %d loss %.6f step_time %.3fs", step, res.loss, res.step_time_s)
        if step == first:
            fallback = report_compile([p for c in job.chunks for p in c.compiled])
            if fallback:
                metrics.write({"event": "compile_fallback", "message": fallback})
        if report_dir and step == first:  # again, with the rows each replica computed in a real step
            write_layout_report(
                report_dir,
                rank,
                job.coords,
                job.chunks,
                rows=job.rows,
                loss_scale=job.loss_scale,
                micro_batches=job.micro_batches,
                context=job.context,
            )
        saved = None
        if args.checkpoint_dir and ((args.checkpoint_every and step % args.checkpoint_every == 0) or res.preempted):
            trained = stream.first_sample + (step - stream.first_step + 1) * tr.global_batch
            data_pos = {"batch": stream.batch, "samples": trained}  # where the next step reads the run's samples
            saved = save_checkpoint(
                args.checkpoint_dir, step, job.modules, job.optimizers, meta={**meta, "data": data_pos}
            )
        if res.preempted:
            log.warning(
                "rank %d: SIGTERM; stopping after step %d%s",
                rank,
                step,
                f", checkpoint {saved}" if saved else " (no --checkpoint-dir: nothing saved)",
            )
            metrics.write({"event": "preempted", "step": step, "checkpoint": str(saved) if saved else None})
            break
    return metrics.summary()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name, values in (("--metrics", args.metrics), ("--layout-report", args.layout_report)):
        if values and len(values) != len(args.plan):
            raise SystemExit(f"error: give one {name} per --plan")
    if len(args.init_from) not in (0, 1, len(args.plan)):
        raise SystemExit("error: give one --init-from, or one per --plan")
    init_from = args.init_from * len(args.plan) if len(args.init_from) == 1 else args.init_from
    Preemption.install()
    device = init_distributed(args.timeout_s)
    try:
        elastic_from = None
        if args.elastic:  # the world before this attempt, unless a checkpoint says otherwise: the launched plan's
            launched = load_plan(args.plan[0])
            elastic_from = {
                "world_size": launched.world_size,
                "plan_hash": launched.content_hash,
                "plans": [*args.plan, *args.elastic_plan],
            }
            args.plan = [elastic_choice(args.plan, args.elastic_plan, dist.get_world_size())]
        for i, path in enumerate(args.plan):
            run_plan(
                load_plan(path),
                args,
                device,
                metrics_path=args.metrics[i] if args.metrics else None,
                report_dir=args.layout_report[i] if args.layout_report else None,
                plan_path=path,
                profile_tag=f"_plan{i}" if len(args.plan) > 1 else "",
                init_from=init_from[i] if init_from else None,
                elastic_from=elastic_from,
            )
            dist.barrier()
    except StratagemError as exc:
        print(f"error: rank {dist.get_rank()}: {exc}", file=sys.stderr)
        os._exit(exc.exit_status)  # peers are blocked in collectives; the process group is unusable
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
