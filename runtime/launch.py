"""``stratagem launch``: check a plan against the launch, then run it under torchrun.

Everything that can be checked without processes is checked first (plan file, world size, model,
data file, checkpoint), so a mismatch is one ``StratagemError`` line and nothing starts. For a zoo model those
checks import no torch (``runtime.executor.checks``, ``.tp_plan``, ``.checkpoint_dirs``), which would cost the CLI
seconds before torchrun starts; only what needs it does: ``hf:`` and ``py:`` models (built on meta to read their
layers), ``--data FILE`` (a ``torch.save`` file), ``--resume`` (DCP's checkpoint metadata) and ``--init-from`` (DCP's
safetensors reader). The command is ``python -m torch.distributed.run [--standalone | rendezvous] --nproc-per-node N
[--max-restarts R] -m runtime.executor.train --plan PLAN ...``; each rank then picks NCCL when CUDA is present, else
gloo.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from planner.core import StratagemError
from planner.plan import Plan, fullest_share, validate
from runtime.executor.checkpoint_dirs import find_latest_checkpoint
from runtime.executor.checks import check_replica_schedules, check_supported
from runtime.executor.tp_plan import plan_tp_styles

log = logging.getLogger(__name__)
KILL_GRACE_S = 10.0  # after SIGTERM on timeout, how long torchrun gets to stop its workers


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchOptions:
    plan_path: Path
    steps: int = 10
    data: str = "synthetic"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume: bool = False
    init_from: Path | None = None  # safetensors checkpoint folder to start from (runtime.executor.pretrained)
    metrics: Path | None = None
    max_restarts: int = 0
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    nproc_per_node: int | None = None
    timeout_s: float = 1800.0
    layout_report: Path | None = None
    compile: str = "auto"  # torch.compile per block: auto (CUDA on, CPU off), on, off (runtime.executor.speed)
    elastic: bool = False  # nodes may leave (or join): torchrun --nnodes MIN:MAX, each world size its own plan
    min_gpus: int | None = None  # elastic: the fewest devices the job continues on (whole nodes)
    rejoin_timeout_s: float = 30.0  # elastic: how long a restart waits for lost nodes before going on without them
    elastic_plans: tuple[Path, ...] = ()  # elastic: the plans made for the smaller world sizes

    def procs_per_node(self, plan: Plan) -> int:
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        if plan.world_size % self.nnodes:
            raise StratagemError(
                f"plan needs {plan.world_size} ranks, which do not split over --nnodes "
                f"{self.nnodes}; use a node count dividing {plan.world_size}"
            )
        return plan.world_size // self.nnodes


def check_launch(plan: Plan, opts: LaunchOptions, *, slurm: bool = False) -> None:
    """Every check that needs no process: raises ``StratagemError`` naming the fix.

    ``slurm``: the launch is written as an sbatch script, whose rendezvous endpoint is the first node. Imports
    torch only where the module docstring says.
    """
    if opts.steps < 1:
        raise StratagemError(f"--steps {opts.steps} must be >= 1")
    if opts.nnodes > 1 and not opts.rdzv_endpoint and not slurm:
        raise StratagemError(f"--nnodes {opts.nnodes} needs --rdzv-endpoint HOST:PORT of the first node")
    validate(plan, opts.nnodes * opts.procs_per_node(plan))
    if "sd" in plan.mesh.axes:  # a 3D CNN's spatial plan: splits dividing the volume, halos narrower than shards
        from planner.search import check_spatial_plan

        check_spatial_plan(plan)
        if opts.checkpoint_dir or opts.resume:
            raise StratagemError("spatial plans do not checkpoint yet; launch them without --checkpoint-dir/--resume")
    check_supported(plan)
    # rows and micro-batch count of every dp replica (uneven batch shares: rows / micro_batch_size each),
    # each replica's schedule able to run its count
    check_replica_schedules(plan)
    for stage in plan.stages:
        if plan.mesh.size("tp") > 1:
            plan_tp_styles(plan, stage.module_paths)
    if opts.data != "synthetic":
        from runtime.executor.data import FileData  # torch.load of the data file

        FileData(opts.data).check_shapes(plan.model, plan.training.seq_len)
    if opts.checkpoint_every and opts.checkpoint_dir is None:
        raise StratagemError("--checkpoint-every needs --checkpoint-dir DIR")
    if opts.resume:
        if opts.checkpoint_dir is None:
            raise StratagemError("--resume needs --checkpoint-dir DIR (the folder of the run to resume)")
        from runtime.executor.checkpoint import check_resumable  # reads DCP's .metadata: torch

        check_resumable(opts.checkpoint_dir, plan, batch_may_change=opts.elastic)
    if opts.init_from is not None:
        if "sd" in plan.mesh.axes:
            raise StratagemError("--init-from is not supported for spatial (3D CNN) plans yet; launch without it")
        from runtime.executor.pretrained import check_init_from  # torch and DCP: 3 s of imports, only here

        check_init_from(opts.init_from, plan)
    if opts.max_restarts and not (opts.checkpoint_dir and opts.checkpoint_every):
        log.warning("--max-restarts without --checkpoint-dir/--checkpoint-every restarts from step 1")
    if opts.elastic:
        check_elastic(plan, opts, slurm=slurm)


def check_elastic(plan: Plan, opts: LaunchOptions, *, slurm: bool = False) -> None:
    """``--elastic`` needs several nodes, checkpoints to resume from, restarts, and a minimum within the job;
    not an sbatch script (``slurm``), whose job has a fixed size."""
    if slurm:
        raise StratagemError(
            "--slurm writes a fixed-size job; --elastic needs each node's own `stratagem launch --elastic` "
            "(drop one of the two)"
        )
    nproc = opts.procs_per_node(plan)
    if opts.nnodes < 2:
        raise StratagemError("--elastic continues on the nodes left when one is lost: it needs --nnodes 2 or more")
    if opts.min_gpus is None or not 1 <= opts.min_gpus <= plan.world_size:
        raise StratagemError(
            f"--min-gpus {opts.min_gpus} is above the plan's {plan.world_size} GPUs (or missing); give the fewest "
            f"GPUs the job may continue on, at most {plan.world_size}"
        )
    if not (opts.checkpoint_dir and opts.checkpoint_every):
        raise StratagemError(
            "--elastic resumes from the last checkpoint after a node is lost: "
            "give --checkpoint-dir and --checkpoint-every"
        )
    if opts.max_restarts < 1:
        raise StratagemError("--elastic restarts the job on the nodes left: give --max-restarts 1 or more")
    if min_nodes(opts, nproc) > opts.nnodes:
        raise StratagemError(f"--min-gpus {opts.min_gpus} needs more than the job's {opts.nnodes} nodes")
    if opts.node_rank == 0 and not opts.resume:  # every elastic attempt resumes what the folder holds
        held = find_latest_checkpoint(opts.checkpoint_dir)
        if held is not None:
            raise StratagemError(
                f"--checkpoint-dir {opts.checkpoint_dir} holds checkpoints of an earlier run (newest: {held.name}), "
                f"and an elastic job resumes whatever it finds there; give --resume to continue that run, or an "
                f"empty folder"
            )


def min_nodes(opts: LaunchOptions, nproc: int) -> int:
    """The fewest whole nodes holding ``--min-gpus`` devices."""
    return -(-(opts.min_gpus or nproc) // nproc)


def train_args(opts: LaunchOptions) -> list[str]:
    """Arguments of ``runtime.executor.train`` for these options."""
    args = [
        "--plan",
        str(opts.plan_path),
        "--steps",
        str(opts.steps),
        "--data",
        opts.data,
        "--timeout-s",
        str(opts.timeout_s),
        "--compile",
        opts.compile,
    ]
    if opts.metrics:
        args += ["--metrics", str(opts.metrics)]
    if opts.checkpoint_dir:
        args += ["--checkpoint-dir", str(opts.checkpoint_dir), "--checkpoint-every", str(opts.checkpoint_every)]
    if opts.resume:
        args.append("--resume")
    if opts.init_from is not None:
        args += ["--init-from", str(opts.init_from)]
    if opts.layout_report:
        args += ["--layout-report", str(opts.layout_report)]
    for path in opts.elastic_plans:
        args += ["--elastic-plan", str(path)]
    if opts.elastic:
        args.append("--elastic")
    return args


def build_command(plan: Plan, opts: LaunchOptions) -> list[str]:
    """The torchrun command line for this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if opts.nnodes == 1:
        cmd.append("--standalone")
    else:
        rdzv_id = "stratagem-" + hashlib.sha256(str(opts.plan_path.resolve()).encode()).hexdigest()[:8]
        nodes = str(opts.nnodes)
        if opts.elastic:  # a restart waits rejoin_timeout_s for lost nodes once the minimum is there
            nodes = f"{min_nodes(opts, opts.procs_per_node(plan))}:{opts.nnodes}"
            # a lost node's agent stops its keep-alive heartbeats; it leaves the rendezvous after interval x 3
            beat = max(1, min(5, round(opts.rejoin_timeout_s / 3)))
            conf = f"last_call_timeout={max(1, round(opts.rejoin_timeout_s))},keep_alive_interval={beat}"
            # the first node hosts the rendezvous store (the endpoint is its address); without is_host every agent
            # whose hostname matches the endpoint's tries to, and on one host a later node could win and take the
            # store down with it when that node is lost
            conf += f",keep_alive_max_attempt=3,is_host={int(opts.node_rank == 0)}"
            cmd += ["--rdzv-conf", conf]
        cmd += [
            "--nnodes",
            nodes,
            "--node-rank",
            str(opts.node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            opts.rdzv_endpoint or "",
            "--rdzv-id",
            rdzv_id,
        ]
    cmd += ["--nproc-per-node", str(opts.procs_per_node(plan))]
    if opts.max_restarts:
        cmd += ["--max-restarts", str(opts.max_restarts)]
    return cmd + ["-m", "runtime.executor.train", *train_args(opts)]


ATTEMPTS_FILE = "elastic_attempts.json"  # in --checkpoint-dir: how many attempts an elastic job has started


def start_elastic_job(opts: LaunchOptions) -> None:
    """The first node of a new elastic job (no ``--resume``) restarts the attempt count in ``--checkpoint-dir``
    (:func:`check_elastic` has made sure the folder holds no checkpoint)."""
    if opts.elastic and opts.node_rank == 0 and not opts.resume and opts.checkpoint_dir is not None:
        (opts.checkpoint_dir / ATTEMPTS_FILE).unlink(missing_ok=True)


# torch's agents share one TCP store across rendezvous rounds and publish its address only in the first round
# (``DynamicRendezvousHandler.next_rendezvous``), so a node joining a later round (a node back, or one that
# started after the job had gone on without it) waits for a MASTER_ADDR no one writes; torch's opt-out makes
# every round publish its own
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def command_env(opts: LaunchOptions) -> dict[str, str]:
    """Environment torchrun needs for these options beside :func:`build_command`'s arguments."""
    return dict(ELASTIC_ENV) if opts.elastic and opts.nnodes > 1 else {}


def build_slurm_script(plan: Plan, opts: LaunchOptions) -> str:
    """An sbatch script running the plan on ``--nnodes`` nodes (one torchrun per node, c10d rendezvous)."""
    nproc = opts.procs_per_node(plan)
    torchrun = [
        shlex.quote(sys.executable),
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(opts.nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        '"$HEAD:29500"',
        "--rdzv-id",
        '"$SLURM_JOB_ID"',
    ]
    if opts.max_restarts:
        torchrun += ["--max-restarts", str(opts.max_restarts)]
    body = " ".join(torchrun) + " -m runtime.executor.train " + shlex.join(train_args(opts))
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name={slurm_job_name(plan.model.name)}",
            f"#SBATCH --nodes={opts.nnodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={nproc}",
            "set -euo pipefail",
            f"cd {shlex.quote(os.getcwd())}",
            'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"srun {body}",
            "",
        ]
    )


def slurm_job_name(model_name: str) -> str:
    """``stratagem-<model>`` with every character outside ``[A-Za-z0-9._-]`` replaced by ``-`` (an ``#SBATCH`` line
    is not shell-parsed, so quoting cannot protect it: a newline in a name would start a script line).

    >>> slurm_job_name("hf:my model; $(id)")
    'stratagem-hf-my-model----id-'
    """
    return "stratagem-" + re.sub(r"[^A-Za-z0-9._-]", "-", model_name)[:100]


# glibc malloc: keep freed heap memory in the ranks instead of returning it to the kernel and faulting it back next
# step. Measured on gpt:small (1 CPU rank, benchmarks/runtime_vs_plain.py): 7,000-10,000 minor page faults and
# 19-29 ms system time per step in the runtime's worker against 3,200-3,900 and 9-11 ms in a plain loop; with
# these, about 20-30 faults per step on both. The ranks keep up to 1 GiB of freed heap.
KEEP_HEAP = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
PREEMPT_GRACE_S = 120.0  # after a forwarded SIGTERM, how long the ranks get to checkpoint and exit


OOM_DIR_ENV = "STRATAGEM_OOM_DIR"  # where a rank that runs out of memory leaves its note (runtime.executor.train)
FALLBACK_ENV = "STRATAGEM_FALLBACK"  # set for a runner-up plan run after an out-of-memory error: its number


def oom_fallback(plan: Plan, note: dict) -> Plan:
    """The fastest runner-up in ``plan``'s search record whose fullest device is predicted less full than
    ``plan``'s, to run after ``plan`` ran out of memory (``note``: the rank's report); a one-line error when the
    file holds none."""
    share = fullest_share(plan)
    options = [
        alt.plan
        for alt in (plan.search.top_k if plan.search else [])
        if alt.plan is not None and fullest_share(alt.plan) < share and alt.plan.world_size == plan.world_size
    ]
    where = f"rank {note.get('rank')} ran out of memory in step {note.get('step')} ({note.get('message', '')[:120]})"
    if not options:
        raise StratagemError(
            f"{where} and the plan file holds no runner-up plan with more memory headroom; re-plan with a larger "
            f"margin, e.g. stratagem plan ... --memory-margin 0.2, and launch that plan"
        )
    best = min(options, key=lambda p: p.predictions.step_time_s if p.predictions else float("inf"))
    return best.model_copy(update={"search": plan.search, "content_hash": None})


def stop_process_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM ``proc``'s process group (``proc`` started with ``start_new_session``), then SIGKILL whatever is left
    after ``grace_s``: torchrun may end on the SIGTERM while a rank stuck in a collective's C++ loop never runs
    Python's handler (seen: 2 ranks of a hung gloo job spinning for 15 minutes after the job "stopped")."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # nothing left in the group
            break
        try:
            proc.wait(timeout=grace_s if sig == signal.SIGTERM else None)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def run_command(cmd: list[str], *, timeout_s: float, env_extra: dict[str, str] | None = None) -> int:
    """Run torchrun in its own process group; on timeout stop the whole group and raise.

    A SIGTERM to this process (a cluster preempting the job) is forwarded to the whole group: the ranks
    checkpoint at their next step boundary and exit (``runtime.executor.train.Preemption``)."""
    env = dict(os.environ, STRATAGEM_LAUNCHER_PID=str(os.getpid()), **(env_extra or {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in KEEP_HEAP.items():  # both or neither: one alone turns off glibc's dynamic thresholds
        env.setdefault(key, value)
    log.info("running %s", shlex.join(cmd))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    deadline = [time.monotonic() + timeout_s]

    def forward(signum, frame):  # noqa: ARG001 - signal handler API
        log.warning("SIGTERM: asking the ranks to checkpoint and stop")
        os.killpg(proc.pid, signal.SIGTERM)
        deadline[0] = min(deadline[0], time.monotonic() + PREEMPT_GRACE_S)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return proc.wait(timeout=min(1.0, max(0.0, deadline[0] - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline[0]:
                    raise
    except subprocess.TimeoutExpired:
        stop_process_group(proc)
        raise StratagemError(
            f"the job ran past --timeout-s {timeout_s:g} and was stopped; raise --timeout-s or lower --steps"
        ) from None
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=KILL_GRACE_S)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
