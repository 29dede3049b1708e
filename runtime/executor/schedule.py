"""One training step's forward/backward: a torch.distributed.pipelining schedule, or (pp = 1) plain
gradient accumulation over the micro-batches.

Schedules (Huang et al. 2019 GPipe; Narayanan et al. SC21 §2.2 for 1F1B and interleaved 1F1B): the plan's
``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B``, ``interleaved_1f1b`` ->
``ScheduleInterleaved1F1B`` over this rank's chunks (stage ``i`` on pp rank ``i % pp``). Each
micro-batch's mean loss is divided by the micro-batch count before backward, so the accumulated gradient
is that of the replica's mean loss. The count is per dp replica: with uneven ``batch_shares`` replica
``r`` runs ``m_r = rows_r / micro_batch_size`` micro-batches (``check_replica_schedules``).

``loss_parallel()`` (a class-sharded split classifier) can be entered once per context object, so a
fresh one is made every step (docs/torch-distributed-on-cpu.md, "TP and PP").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from runtime.executor.checks import check_schedule
from runtime.executor.data import Batch
from runtime.executor.moe import exclude_shape_probes
from runtime.executor.parallelize import Chunk

if TYPE_CHECKING:  # torch.distributed.pipelining is imported only where a pipeline is built (build_runner)
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import _PipelineStageBase

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}  # torch.distributed.pipelining's classes


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    return loss.detach().float()


def _step_context(loss_par: bool, autocast_dtype: torch.dtype | None, device_type: str):
    """Fresh per step: ``loss_parallel`` for class-sharded logits, ``autocast`` for bf16 compute."""
    stack = contextlib.ExitStack()
    if loss_par:
        stack.enter_context(loss_parallel())
    if autocast_dtype is not None:
        stack.enter_context(torch.autocast(device_type, dtype=autocast_dtype))
    return stack


@dataclass(kw_only=True)
class PipelineRunner:
    """Runs one step through a pipeline schedule; only the last stage sees losses."""

    schedule: _PipelineSchedule
    num_micro_batches: int
    is_first: bool
    is_last: bool
    loss_parallel: bool
    autocast_dtype: torch.dtype | None = None
    device_type: str = "cpu"

    def step(self, batch: Batch) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        args = (batch.inputs,) if self.is_first else ()
        kwargs: dict[str, Any] = {"target": batch.targets, "losses": losses} if self.is_last else {}
        with _step_context(self.loss_parallel, self.autocast_dtype, self.device_type):
            # return_outputs=False: the last stage would otherwise keep every micro-batch's logits until the step
            # ends, to return them merged; the step needs only the losses
            self.schedule.step(*args, return_outputs=False, **kwargs)
        # the schedule saw each micro-batch loss divided by the count (build_runner); report the loss itself
        return [_scalar(loss) * self.num_micro_batches for loss in losses]


@dataclass(kw_only=True)
class LocalRunner:
    """pp = 1: forward/backward each micro-batch, gradients accumulated, dp sync on the last one only.

    FSDP/replicate units keep their gathered weights until the last micro-batch's backward
    (``set_reshard_after_backward``), so ZeRO-0/1/2 issue one all-gather and one gradient reduction per
    step whatever the micro-batch count: replicas with uneven counts stay in step.
    ``sync_every_micro_batch`` (ZeRO-3): FSDP2's default instead, weights resharded after each backward and
    gradients reduce-scattered every micro-batch, so a rank never holds the whole model's unsharded weights
    and gradients (what ZeRO-3 is for; replicas then need equal counts, which ``check_replica_schedules`` enforces).
    ``planner.cost.zero3`` prices both ("Accumulation").
    """

    module: torch.nn.Module
    loss_fn: LossFn
    num_micro_batches: int
    loss_parallel: bool
    autocast_dtype: torch.dtype | None = None
    device_type: str = "cpu"
    is_first: bool = True
    is_last: bool = True
    sync_every_micro_batch: bool = False
    cuda_graphs: bool = False  # compiled blocks replay as CUDA graphs (runtime.executor.speed.compile_mode)

    def step(self, batch: Batch) -> list[torch.Tensor]:
        losses = []
        inputs = batch.inputs.tensor_split(self.num_micro_batches)
        targets = batch.targets.tensor_split(self.num_micro_batches)
        for i, (x, y) in enumerate(zip(inputs, targets)):
            if isinstance(self.module, FSDPModule) and not self.sync_every_micro_batch:  # as pipelining's stages do
                last = i == self.num_micro_batches - 1
                self.module.set_requires_gradient_sync(last)
                self.module.set_reshard_after_backward(last)
            if self.cuda_graphs:  # the graphs' outputs of the last micro-batch are consumed: reuse their memory
                torch.compiler.cudagraph_mark_step_begin()
            with _step_context(self.loss_parallel, self.autocast_dtype, self.device_type):
                loss = self.loss_fn(self.module(x), y)
                (loss / self.num_micro_batches).backward()
            losses.append(_scalar(loss))
        return losses


def build_runner(
    chunks: list[Chunk],
    *,
    kind: str,
    num_stages: int,
    num_micro_batches: int,
    loss_fn: LossFn,
    pp_group,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    sync_every_micro_batch: bool = False,
    cuda_graphs: bool = False,
) -> LocalRunner | PipelineRunner:
    """The step runner for this rank's chunks (a pipeline schedule when ``num_stages`` > 1).

    ``sync_every_micro_batch`` (ZeRO-3, one stage): see :class:`LocalRunner`; pipeline stages always
    accumulate unsharded and sync on the last micro-batch (torch.distributed.pipelining).

    ``autocast_dtype`` (bf16) runs forward under ``torch.autocast``: fp32 master weights, optimizer
    state and gradients, low-precision matmuls (Micikevicius et al. 2018, mixed precision).
    ``cuda_graphs`` (one stage, blocks compiled as CUDA graphs): each micro-batch starts a new graph step.
    """
    loss_par = any(c.loss_parallel for c in chunks)
    common: dict[str, Any] = dict(loss_parallel=loss_par, autocast_dtype=autocast_dtype, device_type=device.type)
    if num_stages == 1:
        return LocalRunner(
            module=chunks[0].module,
            loss_fn=loss_fn,
            num_micro_batches=num_micro_batches,
            sync_every_micro_batch=sync_every_micro_batch,
            cuda_graphs=cuda_graphs,
            **common,
        )
    check_schedule(kind, pp=num_stages // len(chunks), virtual_stages=len(chunks), num_micro_batches=num_micro_batches)
    # imported here: torch.distributed.pipelining loads torch._dynamo (about a second per rank), which plans
    # without a pipeline never need
    import torch.distributed.pipelining as pipelining

    stages: list[_PipelineStageBase] = [
        pipelining.PipelineStage(c.module, c.stage.index, num_stages, device, group=pp_group) for c in chunks
    ]
    for stage in stages:
        exclude_shape_probes(stage)  # an MoE's load-balancing metric counts training forwards only
    indices = [c.stage.index for c in chunks]
    # torch's scale_grads divides by the count *after* the dp gradient reduction (pipelining/stage.py
    # perform_reduce_grad: "PP scales only for its own contribution ... relies on DP to scale further"), which
    # is exact only if every dp replica runs the same count (measured: uneven 6/2 micro-batches drift 1e-4 in
    # the step-2 loss). Dividing each loss by this replica's own count before backward is exact for any counts.
    mean_loss = functools.partial(_share_of_mean, loss_fn=loss_fn, num_micro_batches=num_micro_batches)
    if kind == "interleaved_1f1b":
        schedule = pipelining.ScheduleInterleaved1F1B(
            stages, n_microbatches=num_micro_batches, loss_fn=mean_loss, scale_grads=False
        )
    else:
        schedule = getattr(pipelining, _SCHEDULES[kind])(
            stages[0], n_microbatches=num_micro_batches, loss_fn=mean_loss, scale_grads=False
        )
    return PipelineRunner(
        schedule=schedule,
        num_micro_batches=num_micro_batches,
        is_first=0 in indices,
        is_last=num_stages - 1 in indices,
        **common,
    )


def _share_of_mean(out: torch.Tensor, target: torch.Tensor, *, loss_fn: LossFn, num_micro_batches: int):
    """One micro-batch's part of the replica's mean loss: its mean loss / the replica's micro-batch count."""
    return loss_fn(out, target) / num_micro_batches
