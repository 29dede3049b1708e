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


def _loss_context(enabled: bool):
    return loss_parallel() if enabled else contextlib.nullcontext()


@dataclass(kw_only=True)
class PipelineRunner:
    """Runs one step through a pipeline schedule; only the last stage sees losses."""

    schedule: object
    is_first: bool
    is_last: bool
    loss_parallel: bool

    def step(self, batch: Batch) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        args = (batch.inputs,) if self.is_first else ()
        kwargs = {"target": batch.targets, "losses": losses} if self.is_last else {}
        with _loss_context(self.loss_parallel):
            self.schedule.step(*args, **kwargs)
        return [_scalar(l) for l in losses]


@dataclass(kw_only=True)
class LocalRunner:
    """pp = 1: forward/backward each micro-batch, gradients accumulated, dp sync on the last one only."""

    module: torch.nn.Module
    loss_fn: LossFn
    num_micro_batches: int
    loss_parallel: bool
    is_first: bool = True
    is_last: bool = True

    def step(self, batch: Batch) -> list[torch.Tensor]:
        losses = []
        inputs = batch.inputs.tensor_split(self.num_micro_batches)
        targets = batch.targets.tensor_split(self.num_micro_batches)
        for i, (x, y) in enumerate(zip(inputs, targets)):
            if isinstance(self.module, FSDPModule):
                self.module.set_requires_gradient_sync(i == self.num_micro_batches - 1)
            with _loss_context(self.loss_parallel):
                loss = self.loss_fn(self.module(x), y)
                (loss / self.num_micro_batches).backward()
            losses.append(_scalar(loss))
        return losses


def build_runner(chunks: list[Chunk], *, kind: str, num_stages: int, num_micro_batches: int,
                 loss_fn: LossFn, pp_group, device: torch.device):
    """The step runner for this rank's chunks (a pipeline schedule when ``num_stages`` > 1)."""
    loss_par = any(c.loss_parallel for c in chunks)
    if num_stages == 1:
        return LocalRunner(module=chunks[0].module, loss_fn=loss_fn, num_micro_batches=num_micro_batches,
                           loss_parallel=loss_par)
    stages = [PipelineStage(c.module, c.stage.index, num_stages, device, group=pp_group) for c in chunks]
    indices = [c.stage.index for c in chunks]
    try:
        if kind == "interleaved_1f1b":
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=num_micro_batches, loss_fn=loss_fn)
        else:
            if len(stages) != 1:
                raise StratagemError(f"schedule {kind} runs one stage per pp rank but this rank holds stages "
                                     f"{indices}; use interleaved_1f1b for virtual stages")
            schedule = _SCHEDULES[kind](stages[0], n_microbatches=num_micro_batches, loss_fn=loss_fn)
    except ValueError as exc:
        raise StratagemError(f"cannot build a {kind} schedule with {num_micro_batches} micro-batches over "
                             f"{num_stages} stages: {exc}; change num_micro_batches in the plan") from None
    return PipelineRunner(schedule=schedule, is_first=0 in indices, is_last=num_stages - 1 in indices,
                          loss_parallel=loss_par)
