"""Training a hybrid data + spatial plan of a 3D CNN (``plan.mesh.axes == ["dp", "sd"]``).

Every rank builds the whole model from the seed (3D CNN weights are small), takes its dp replica's rows of each
global batch, and runs every layer as the plan lays it out (``runtime/executor/spatial.py``): a split layer on
its shard of the volume, an unsplit one on the whole sample, with layout changes between them and along U-Net
skip connections. Loss and gradients (why they equal one process's):

- U-Net with a split head: each rank adds its voxels' cross-entropy / (micro-batch voxels x micro-batches);
  the sum over one copy's sub-group is the replica's mean loss. An unsplit head (CosmoFlow): every rank computes
  the replica's loss in full, identically. Every copy of a computation holds the true gradient of its shard.
- A layer split ``s`` ways: a rank's weight gradient is its shard's part, and ``sd / s`` copies hold the same
  parts; an unsplit layer (``s = 1``) holds the whole gradient on every rank. One all-reduce over all ``dp x sd``
  ranks, divided by ``dp x sd / s``, gives every rank the full-batch mean's gradient.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from planner.core import StratagemError
from planner.plan import Plan, lr_at_step
from planner.search import check_spatial_plan, spatial_config_of
from runtime.executor.data import build_data_source
from runtime.executor.metrics import MetricsLog, peak_memory_bytes, reset_peak_memory
from runtime.executor.spatial import UNSPLIT, SpatialGroup, relayout, shard_of, split_conv, split_group_norm
from runtime.models.cnn3d import VolumeBlock, VolumeModel

log = logging.getLogger(__name__)
Grid = tuple[int, int, int]


def is_spatial_plan(plan: Plan) -> bool:
    return "sd" in plan.mesh.axes


def run_block(block: VolumeBlock, x: torch.Tensor, sg: SpatialGroup, grid: Grid) -> torch.Tensor:
    """One layer on its shard (``grid`` split) or on the whole sample (UNSPLIT)."""
    layer = block.layer
    if grid == UNSPLIT:
        return block(x)
    if layer.op == "pool":
        return F.max_pool3d(x, layer.kernel, layer.stride)
    if layer.op == "upconv":
        return block.conv(x)
    conv = cast(nn.Conv3d, block.conv)  # op "conv": an upconv returned above
    x = split_conv(conv, x, sg, grid) if layer.kernel > 1 else conv(x)
    if block.norm is not None:
        x = split_group_norm(block.norm, x, sg)
    x = block.activate(x)
    return F.max_pool3d(x, layer.pool) if layer.pool > 1 else x


def forward_spatial(
    model: VolumeModel,
    x: torch.Tensor,
    groups: dict[int, SpatialGroup],
    layout: dict[str, Grid],
    shapes: dict[str, list[int]] | None = None,
) -> tuple[torch.Tensor, Grid]:
    """The model's output on this rank and its layout; ``x`` is the whole input micro-batch. ``shapes``, when
    given, receives each layer's local output shape (the tests' evidence that a layer really ran split)."""
    have: Grid = UNSPLIT
    kept: dict[str, tuple[torch.Tensor, Grid]] = {}
    for path, block in model.named_layers():
        layer, want = model.table[path], layout.get(path, UNSPLIT)
        x, have = relayout(x, groups, have, want), want
        if layer.skip_from is not None:
            skip, skip_grid = kept.pop(layer.skip_from)
            x = torch.cat((x, relayout(skip, groups, skip_grid, want)), dim=1)
        x = run_block(block, x, groups[math.prod(want)], want)  # type: ignore[arg-type]
        if shapes is not None:
            shapes[path] = list(x.shape)
        if path in model.skip_sources:
            kept[path] = (x, want)
    return x, have


def loss_part(
    plan: Plan, out: torch.Tensor, grid: Grid, targets: torch.Tensor, sg: SpatialGroup, micro_batches: int
) -> tuple[torch.Tensor, float]:
    """(this rank's loss term to backpropagate, its share of the replica's reported loss)."""
    from runtime.models import loss_fn

    if grid == UNSPLIT:
        loss = loss_fn(plan.model)(out, targets) / micro_batches
        return loss, float(loss.detach()) if sg.copy == 0 else 0.0
    local = shard_of(targets.unsqueeze(1), grid, sg.index).squeeze(1)
    total = targets.numel()  # micro-batch x D x H x W voxels
    loss = F.cross_entropy(out.float(), local, reduction="sum") / total / micro_batches
    return loss, float(loss.detach()) if sg.copy == 0 else 0.0


def sync_gradients(model: VolumeModel, layout: dict[str, Grid], dp: int, sd: int) -> None:
    """Module docstring: one all-reduce over all ranks per divisor; a layer split ``s`` ways is summed over its
    ``s`` shards and its ``sd / s`` copies, so it is divided by ``dp * sd / s``."""
    by_divisor: dict[int, list[torch.Tensor]] = {}
    for path, block in model.named_layers():
        divisor = dp * sd // math.prod(layout.get(path, UNSPLIT))
        by_divisor.setdefault(divisor, []).extend(p.grad for p in block.parameters() if p.grad is not None)
    for divisor, grads in sorted(by_divisor.items()):
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= divisor
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _maybe_dump_gradients(plan: Plan, model: VolumeModel, step: int, rank: int, shapes: dict) -> None:
    """Test hook: ``STRATAGEM_TEST_GRADS_DIR=D`` makes every rank save its synced step-1 gradients to
    ``D/<plan content hash>.rank<r>.pt`` (tests compare them with one process's: AdamW's update hides a wrong
    gradient scale)."""
    folder = os.environ.get("STRATAGEM_TEST_GRADS_DIR")
    if folder and step == 1:
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        tag = (plan.content_hash or "plan").rpartition(":")[2][:16]
        torch.save({"grads": grads, "shapes": shapes}, os.path.join(folder, f"{tag}.rank{rank}.pt"))


def spatial_groups(plan: Plan, degrees: set[int]) -> dict[int, SpatialGroup]:
    """This rank's sub-group for every split degree (and 1: itself), each from a DeviceMesh
    ``(dp, sd / s, s)``: ``s`` consecutive ranks of the spatial group."""
    dp, sd = plan.mesh.size("dp"), plan.mesh.size("sd")
    rank = dist.get_rank()
    groups = {1: SpatialGroup(ranks=(rank,), index=0, group=None, copy=rank % sd)}
    for s in sorted(degrees - {1}):
        mesh = init_device_mesh("cpu", (dp, sd // s, s), mesh_dim_names=("dp", "copy", "shard"))
        base = rank - rank % s
        groups[s] = SpatialGroup(
            ranks=tuple(range(base, base + s)), index=rank % s, group=mesh["shard"].get_group(), copy=(rank % sd) // s
        )
    return groups


def build_spatial_model(plan: Plan) -> VolumeModel:
    from runtime.models import build_model, init_weights

    model = build_model(plan.model, device="meta")
    model.to_empty(device="cpu")
    init_weights(model, seed=plan.training.seed)
    if not isinstance(model, VolumeModel):
        raise StratagemError(f"{plan.model.name} is not a 3D CNN; spatial plans run unet3d and cosmoflow models")
    return model


def run_spatial_plan(plan: Plan, *, steps: int, data: str, metrics_path: str | None, device: torch.device) -> dict:
    """Train ``plan`` for ``steps`` steps on this rank; returns the metrics summary (rank 0's is real)."""
    check_spatial_plan(plan)
    if device.type != "cpu":
        raise StratagemError("spatial plans run on CPU/gloo in this build; launch without CUDA devices")
    config = spatial_config_of(plan)
    layout: dict[str, Grid] = {p: o.grid for p, o in config.layout.items()}
    groups = spatial_groups(plan, {math.prod(g) for g in layout.values()})
    model = build_spatial_model(plan)
    tr = plan.training
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=tr.weight_decay)
    source = build_data_source(plan.model, data, global_batch=tr.global_batch, seq_len=tr.seq_len, seed=tr.seed)
    rank, dp_index = dist.get_rank(), dist.get_rank() // config.sd
    rows = tr.global_batch // config.dp
    metrics = MetricsLog(metrics_path if rank == 0 else None, plan, attempt=0)
    metrics.write({"event": "start", "model": plan.model.name, "mesh": dict(zip(plan.mesh.axes, plan.mesh.sizes)),
                   "schedule": "spatial", "world_size": dist.get_world_size(), "device": device.type})  # fmt: skip
    for step in range(1, steps + 1):
        baseline = reset_peak_memory(device)
        start = time.perf_counter()
        batch = source(step)
        inputs = batch.inputs[dp_index * rows : (dp_index + 1) * rows]
        targets = batch.targets[dp_index * rows : (dp_index + 1) * rows]
        reported = 0.0
        shapes: dict[str, list[int]] = {}
        for mb in range(config.num_micro_batches):
            sl = slice(mb * config.micro_batch, (mb + 1) * config.micro_batch)
            out, grid = forward_spatial(model, inputs[sl], groups, layout, shapes)
            loss, part = loss_part(plan, out, grid, targets[sl], groups[math.prod(grid)], config.num_micro_batches)
            loss.backward()
            reported += part
        sync_gradients(model, layout, config.dp, config.sd)
        _maybe_dump_gradients(plan, model, step, rank, shapes)
        lr = lr_at_step(tr.lr_schedule, global_batch=tr.global_batch, step=step - 1) if tr.lr_schedule else tr.lr
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        table = torch.tensor([reported / config.dp, elapsed, float(peak_memory_bytes(device, baseline))])
        gathered = [torch.zeros_like(table) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, table)
        stacked = torch.stack(gathered)
        loss_value = float(stacked[:, 0].sum())
        metrics.step(step=step, loss=loss_value, step_time_s=float(stacked[:, 1].max()), tokens=tr.global_batch,
                     samples=tr.global_batch, peak_memory_bytes=[int(v) for v in stacked[:, 2]], lr=lr)  # fmt: skip
        if rank == 0:
            log.info("step %d loss %.6f", step, loss_value)
    return metrics.summary()
