"""The large-batch training recipe a plan carries: learning rate per optimizer step.

Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677):

- §2.1 linear scaling rule: "when the minibatch size is multiplied by k, multiply the learning rate by k",
  so the peak rate is ``base_lr * global_batch / reference_batch`` (their reference: 0.1 per 256 images);
- §2.2 gradual warm-up: start at ``base_lr`` (the unscaled rate) and rise linearly to the peak over the
  first ``warmup_steps`` steps (their 5 epochs);
- then decay: *step* (multiply by ``step_gamma`` at each milestone; Goyal et al. 0.1 at epochs 30, 60, 80)
  or *cosine* (Loshchilov & Hutter 2017, SGDR, arXiv:1608.03983, eq. 5 without restarts) down to ``min_lr``
  at ``total_steps``; or *constant*.

The warm-up and cosine formulas are written as Megatron-Core's ``OptimizerParamScheduler.get_lr`` computes
them (megatron/core/optimizer_param_scheduler.py, megatron-core 0.16): ``step`` counts completed optimizer
steps, the warm-up includes its last step, past ``total_steps`` the rate is ``min_lr``. So an export to
Megatron reproduces the plan's rate at every step (``tests/test_export_frameworks.py`` checks this).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DecayStyle = Literal["cosine", "step", "constant"]


class LRSchedule(BaseModel):
    """Learning rate per optimizer step (see the module docstring for the formulas and their sources)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_lr: float = Field(gt=0, description="learning rate tuned at reference_batch samples per step")
    reference_batch: int = Field(ge=1, description="samples per step base_lr was tuned for (Goyal et al.: 256)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    warmup_start_lr: float = Field(ge=0, description="rate at step 0 (Goyal et al.: base_lr)")
    decay: DecayStyle = "cosine"
    total_steps: int = Field(ge=1, description="optimizer steps of the run (end of the cosine)")
    min_lr: float = Field(0.0, ge=0, description="rate at and after total_steps (cosine)")
    step_milestones: list[int] = Field(
        default_factory=list, description="steps at which a step decay multiplies the rate by step_gamma"
    )
    step_gamma: float = Field(0.1, gt=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> "LRSchedule":
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds total_steps {self.total_steps}")
        if self.step_milestones != sorted(self.step_milestones):
            raise ValueError("step_milestones must be increasing")
        return self


def build_lr_schedule(
    *,
    base_lr: float,
    reference_batch: int,
    total_steps: int,
    warmup_steps: int = 0,
    decay: DecayStyle = "cosine",
    min_lr: float = 0.0,
    step_milestones: tuple[int, ...] = (),
    step_gamma: float = 0.1,
    warmup_start_lr: float | None = None,
) -> LRSchedule:
    """Goyal et al.'s recipe with the warm-up starting at ``base_lr`` unless ``warmup_start_lr`` is given.

    >>> s = build_lr_schedule(base_lr=0.1, reference_batch=256, total_steps=100, warmup_steps=5)
    >>> round(peak_lr(s, global_batch=8192), 6)      # k = 32: 0.1 x 32
    3.2
    """
    return LRSchedule(
        base_lr=base_lr,
        reference_batch=reference_batch,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        decay=decay,
        min_lr=min_lr,
        step_milestones=list(step_milestones),
        step_gamma=step_gamma,
        warmup_start_lr=base_lr if warmup_start_lr is None else warmup_start_lr,
    )


def peak_lr(schedule: LRSchedule, *, global_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017 §2.1): the rate after warm-up at ``global_batch`` samples/step."""
    return schedule.base_lr * global_batch / schedule.reference_batch


def lr_at_step(schedule: LRSchedule, *, global_batch: int, step: int) -> float:
    """Learning rate of the optimizer step that follows ``step`` completed steps (step 0 = the first step).

    >>> s = build_lr_schedule(base_lr=0.1, reference_batch=256, total_steps=10, warmup_steps=2, decay="constant")
    >>> [round(lr_at_step(s, global_batch=512, step=k), 3) for k in range(4)]
    [0.1, 0.15, 0.2, 0.2]
    """
    peak = peak_lr(schedule, global_batch=global_batch)
    warm = schedule.warmup_steps
    if warm > 0 and step <= warm:  # Goyal et al. §2.2, linear; Megatron includes the last warm-up step
        return schedule.warmup_start_lr + (peak - schedule.warmup_start_lr) * step / warm
    if schedule.decay == "constant":
        return peak
    if schedule.decay == "step":  # Goyal et al. §5.1: x0.1 at each milestone
        return peak * schedule.step_gamma ** sum(1 for m in schedule.step_milestones if step >= m)
    if step > schedule.total_steps:
        return schedule.min_lr
    ratio = (step - warm) / max(1, schedule.total_steps - warm)  # cosine (SGDR eq. 5, one period)
    return schedule.min_lr + (peak - schedule.min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def nearest_batches(global_batch: int, gpus: int, *, limit: int = 4) -> list[int]:
    """Global batches near ``global_batch`` that ``gpus`` devices can split in a way ``global_batch`` cannot,
    nearest first (ties: the smaller first): for each divisor ``d`` of ``gpus`` that does not divide
    ``global_batch`` (a data-parallel degree the batch rules out), the multiples of ``d`` just below and above it.
    ``launch --elastic`` tries them, the rate scaled linearly (Goyal et al. 2017 §2.1), only where no plan of the
    run's own batch fits the devices left.

    >>> nearest_batches(8, 6)  # dp 3 or 6 need a multiple of 3
    [9, 6, 12]
    >>> nearest_batches(8, 4)  # every split of 4 devices divides 8
    []
    """
    found: set[int] = set()
    for d in (d for d in range(2, gpus + 1) if gpus % d == 0 and global_batch % d):
        below = global_batch // d * d
        found.update(b for b in (below, below + d) if b >= d)
    return sorted(found, key=lambda b: (abs(b - global_batch), b))[:limit]
