"""One training step's forward/backward: a torch.distributed.pipelining schedule, or (pp = 1) plain
gradient accumulation over the micro-batches.

Schedules (Huang et al. 2019 GPipe; Narayanan et al. SC21 §2.2 for 1F1B and interleaved 1F1B): the plan's
``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B``, ``interleaved_1f1b`` ->
``ScheduleInterleaved1F1B`` over this rank's chunks (stage ``i`` on pp rank ``i % pp``). Each schedule
scales gradients by 1/num_micro_batches (``scale_grads=True``), so with a mean loss per micro-batch the
gradient is that of the replica's mean loss.

``loss_parallel()`` (a class-sharded split classifier) can be entered once per context object, so a
fresh one is made every step (shared/notes/torch-distributed-on-cpu.md, "TP and PP").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from planner.errors import StratagemError
from runtime.executor.data import Batch
from runtime.executor.parallelize import Chunk

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


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

    schedule: object
    is_first: bool
    is_last: bool
    loss_parallel: bool
    autocast_dtype: torch.dtype | None = None
    device_type: str = "cpu"

    def step(self, batch: Batch) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        args = (batch.inputs,) if self.is_first else ()
        kwargs = {"target": batch.targets, "losses": losses} if self.is_last else {}
        with _step_context(self.loss_parallel, self.autocast_dtype, self.device_type):
            self.schedule.step(*args, **kwargs)
        return [_scalar(l) for l in losses]


@dataclass(kw_only=True)
class LocalRunner:
    """pp = 1: forward/backward each micro-batch, gradients accumulated, dp sync on the last one only."""

    module: torch.nn.Module
    loss_fn: LossFn
    num_micro_batches: int
    loss_parallel: bool
    autocast_dtype: torch.dtype | None = None
    device_type: str = "cpu"
    is_first: bool = True
    is_last: bool = True

    def step(self, batch: Batch) -> list[torch.Tensor]:
        losses = []
        inputs = batch.inputs.tensor_split(self.num_micro_batches)
        targets = batch.targets.tensor_split(self.num_micro_batches)
        for i, (x, y) in enumerate(zip(inputs, targets)):
            if isinstance(self.module, FSDPModule):
                self.module.set_requires_gradient_sync(i == self.num_micro_batches - 1)
            with _step_context(self.loss_parallel, self.autocast_dtype, self.device_type):
                loss = self.loss_fn(self.module(x), y)
                (loss / self.num_micro_batches).backward()
            losses.append(_scalar(loss))
        return losses


def check_schedule(kind: str, *, pp: int, virtual_stages: int, num_micro_batches: int) -> None:
    """Reject a schedule torch.distributed.pipelining cannot build, before any process starts.

    Rules of torch 2.13 (pipelining/schedules.py): 1F1B needs at least one micro-batch per stage;
    interleaved 1F1B runs ``rounds = max(1, m // pp)`` rounds and needs ``m % rounds == 0``.
    """
    if pp == 1:
        return
    if virtual_stages > 1 and kind != "interleaved_1f1b":
        raise StratagemError(f"schedule {kind} runs one stage per pp rank but the plan has virtual_stages="
                             f"{virtual_stages}; use interleaved_1f1b or virtual_stages=1")
    if kind == "1f1b" and num_micro_batches < pp:
        raise StratagemError(f"1f1b needs at least one micro-batch per stage ({pp}) but the plan has "
                             f"{num_micro_batches}; raise num_micro_batches or use gpipe")
    rounds = max(1, num_micro_batches // pp)
    if kind == "interleaved_1f1b" and num_micro_batches % rounds:
        raise StratagemError(f"interleaved_1f1b with pp={pp} runs {rounds} rounds, which {num_micro_batches} "
                             f"micro-batches do not divide; use a multiple of {pp} micro-batches")


def build_runner(chunks: list[Chunk], *, kind: str, num_stages: int, num_micro_batches: int,
                 loss_fn: LossFn, pp_group, device: torch.device, autocast_dtype: torch.dtype | None = None):
    """The step runner for this rank's chunks (a pipeline schedule when ``num_stages`` > 1).

    ``autocast_dtype`` (bf16) runs forward under ``torch.autocast``: fp32 master weights, optimizer
    state and gradients, low-precision matmuls (Micikevicius et al. 2018, mixed precision).
    """
    loss_par = any(c.loss_parallel for c in chunks)
    common = dict(loss_parallel=loss_par, autocast_dtype=autocast_dtype, device_type=device.type)
    if num_stages == 1:
        return LocalRunner(module=chunks[0].module, loss_fn=loss_fn, num_micro_batches=num_micro_batches, **common)
    check_schedule(kind, pp=num_stages // len(chunks), virtual_stages=len(chunks), num_micro_batches=num_micro_batches)
    stages = [PipelineStage(c.module, c.stage.index, num_stages, device, group=pp_group) for c in chunks]
    indices = [c.stage.index for c in chunks]
    if kind == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=num_micro_batches, loss_fn=loss_fn)
    else:
        schedule = _SCHEDULES[kind](stages[0], n_microbatches=num_micro_batches, loss_fn=loss_fn)
    return PipelineRunner(schedule=schedule, is_first=0 in indices, is_last=num_stages - 1 in indices, **common)
