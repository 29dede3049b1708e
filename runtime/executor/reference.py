"""The single-process reference run every parallel layout is checked against.

Same model, seed, data and optimizer as ``train``; the whole global batch in one forward/backward.
"""

from __future__ import annotations

import torch

from planner.plan import Plan
from planner.recipe import lr_at_step
from runtime.executor.data import build_data_source
from runtime.executor.parallelize import AUTOCAST_DTYPES


def reference_losses(plan: Plan, steps: int, *, data: str = "synthetic") -> list[float]:
    """Global-batch mean loss of steps 1..``steps`` trained on one process (CPU)."""
    from runtime.models import build_model, init_weights, loss_fn

    model = build_model(plan.model, device="meta")
    model.to_empty(device="cpu")
    init_weights(model, seed=plan.training.seed)
    tr = plan.training
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=tr.weight_decay)
    source = build_data_source(plan.model, data, global_batch=tr.global_batch, seq_len=tr.seq_len, seed=tr.seed)
    fn, losses = loss_fn(plan.model), []
    for step in range(1, steps + 1):
        batch = source(step)
        compute_dtype = AUTOCAST_DTYPES[plan.training.dtype]
        with torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype is not None):
            loss = fn(model(batch.inputs), batch.targets)
        loss.backward()
        if tr.lr_schedule is not None:   # the plan's recipe, as train.apply_lr sets it
            for group in opt.param_groups:
                group["lr"] = lr_at_step(tr.lr_schedule, global_batch=tr.global_batch, step=step - 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses
