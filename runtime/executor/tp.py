"""Tensor parallelism from the plan's per-layer layout: ``apply_tp``.

The plan says, per top-level module path, ``split`` (tensor-parallel on the ``tp`` axis) or
``replicate`` (Whale's two choices, Jia et al. ATC'22). For a split layer the model zoo's
``tp_layout(spec, path)`` names the style of each submodule (plain data); this file maps those names to
torch.distributed.tensor.parallel styles (Megatron-LM's layout, Shoeybi et al. 2019 §3: column-split
first matmul, row-split second, one all-reduce per sub-block):

| zoo style | torch style |
|---|---|
| colwise | ``ColwiseParallel()`` (weight Shard(0); input replicated, output sharded on the last dim) |
| rowwise | ``RowwiseParallel()`` (weight Shard(1); output all-reduced to Replicate) |
| vocab_embedding | ``RowwiseParallel(input_layouts=Replicate())`` on an embedding: vocab rows sharded |
| colwise_sharded_output | ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``: logits stay a DTensor sharded over classes, consumed by ``loss_parallel`` (Whale's split classifier) |
| sequence_parallel | ``SequenceParallel()`` — only with ``LayerLayout.sequence_parallel``; not supported yet |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from planner.errors import StratagemError
from planner.modelspec import ModelSpec
from planner.plan import LayerLayout

_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "colwise_sharded_output": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
}


def split_paths(layout: Mapping[str, LayerLayout], paths: Sequence[str]) -> list[str]:
    """The paths among ``paths`` whose layout is ``split``."""
    return [p for p in paths if p in layout and layout[p].style == "split"]


def tp_styles(spec: ModelSpec, layout: Mapping[str, LayerLayout], paths: Sequence[str]) -> dict[str, str]:
    """Plain-data TP plan for the modules in ``paths``: full submodule path -> zoo style name.

    ``sequence_parallel`` entries are kept only for layers whose layout asks for it.
    """
    from runtime.models import tp_layout

    plan: dict[str, str] = {}
    for path in split_paths(layout, paths):
        if layout[path].sequence_parallel:
            raise StratagemError(
                f"layer {path} asks for sequence parallelism, which the runtime does not run yet; "
                f"re-plan without sequence parallelism")
        for rel, style in tp_layout(spec, path).items():
            if style == "sequence_parallel":
                continue
            if style not in _STYLES:
                raise StratagemError(f"unknown TP style {style!r} for {path}.{rel}; expected one of "
                                     f"{', '.join(_STYLES)} (model zoo and runtime disagree)")
            plan[f"{path}.{rel}" if rel else path] = style
    return plan


def uses_loss_parallel(styles: Mapping[str, str]) -> bool:
    """True when a split classifier leaves class-sharded logits, so the loss must run in ``loss_parallel``."""
    return "colwise_sharded_output" in styles.values()


def apply_tp(model: nn.Module, tp_mesh, styles: Mapping[str, str]) -> None:
    """Shard ``model``'s submodules in place over ``tp_mesh`` per ``styles`` (from :func:`tp_styles`)."""
    if tp_mesh.size() == 1 or not styles:
        return
    parallelize_module(model, tp_mesh, {path: _STYLES[style]() for path, style in styles.items()})
