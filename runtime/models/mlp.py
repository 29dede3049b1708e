"""A plain MLP: ``blocks.i`` = Linear + GELU (``layers`` of them), then ``out`` (Linear to the classes)."""

from __future__ import annotations

from torch import nn

from runtime.models.dims import MLPDims
from runtime.models.layered import LayeredModel, blocks_dict


class LinearGELU(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c_in, c_out)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


def build_mlp_layer(dims: MLPDims, path: str, tp: int = 1) -> nn.Module:
    """One top-level layer (``blocks.i`` or ``out``); ``tp`` > 1 splits only ``out`` over the classes."""
    if path.startswith("blocks."):
        i = int(path.split(".")[1])
        return LinearGELU(dims.in_features if i == 0 else dims.hidden, dims.hidden)
    if path == "out":
        return nn.Linear(dims.hidden, dims.out_features // tp)
    raise KeyError(path)


def build_mlp(dims: MLPDims) -> LayeredModel:
    blocks = [build_mlp_layer(dims, f"blocks.{i}") for i in range(dims.layers)]
    return LayeredModel({"blocks": blocks_dict(blocks), "out": build_mlp_layer(dims, "out")})
