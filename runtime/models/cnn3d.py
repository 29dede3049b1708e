"""The zoo's 3D CNNs, 3D U-Net and CosmoFlow, built from the layer tables of ``planner/model/cnn3d.py``.

Top-level layers: ``blocks.i`` (convolution blocks, poolings, up-convolutions), ``dense.i`` (CosmoFlow) and
``head``; ``forward`` runs them in order and concatenates a U-Net decoder's input with the skip features of
its level (``VolumeLayer.skip_from``: ``cat((x, skip), dim=1)``). Losses: per-voxel cross-entropy (U-Net
segmentation), mean squared error on the 4 parameters (CosmoFlow regression).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from planner.model import VolumeLayer, norm_groups
from runtime.models.dims import VolumeDims
from runtime.models.layered import LayeredModel

LEAKY_SLOPE = 0.3  # Keras LeakyReLU default alpha, as the CosmoFlow reference uses it


class VolumeBlock(nn.Module):
    """One row of the layer table: conv [+ GroupNorm] [+ activation] [+ max-pool], a pooling, an
    up-convolution, or a dense layer (flattening a volume first)."""

    conv: nn.Conv3d | nn.ConvTranspose3d

    def __init__(self, layer: VolumeLayer) -> None:
        super().__init__()
        self.layer = layer
        if layer.op == "conv":
            self.conv = nn.Conv3d(layer.c_in, layer.c_out, layer.kernel, padding=layer.halo)
        elif layer.op == "upconv":
            self.conv = nn.ConvTranspose3d(layer.c_in, layer.c_out, layer.kernel, stride=layer.stride)
        elif layer.op == "dense":
            self.fc = nn.Linear(layer.c_in, layer.c_out)
        self.norm = nn.GroupNorm(norm_groups(layer.c_out), layer.c_out) if layer.norm else None

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer.activation == "relu":
            return F.relu(x)
        if self.layer.activation == "leaky_relu":
            return F.leaky_relu(x, LEAKY_SLOPE)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = self.layer.op
        if op == "pool":
            return F.max_pool3d(x, self.layer.kernel, self.layer.stride)
        if op == "dense":
            return self.activate(self.fc(x.flatten(1)))
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        x = self.activate(x)
        return F.max_pool3d(x, self.layer.pool) if self.layer.pool > 1 else x


class VolumeModel(LayeredModel):
    """A 3D CNN: the layers of its table in order, with U-Net skip concatenations."""

    def __init__(self, dims: VolumeDims) -> None:
        table = {layer.path: layer for layer in dims.layers}
        groups: dict[str, nn.Module] = {}
        for layer in dims.layers:
            top, _, key = layer.path.partition(".")
            if key:
                cast(nn.ModuleDict, groups.setdefault(top, nn.ModuleDict()))[key] = VolumeBlock(layer)
            else:
                groups[top] = VolumeBlock(layer)
        super().__init__(groups)
        self.skip_sources = {t.skip_from for t in table.values() if t.skip_from}
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept: dict[str, torch.Tensor] = {}
        for path, module in self.named_layers():
            layer = self.table[path]
            if layer.skip_from is not None:
                x = torch.cat((x, kept.pop(layer.skip_from)), dim=1)
            x = module(x)
            if path in self.skip_sources:
                kept[path] = x
        return x

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        """(path, module) of the top-level layers present, in forward order."""
        out = []
        for path in self.layer_paths():
            top, _, key = path.partition(".")
            module = getattr(self, top)
            out.append((path, module[key] if key else module))
        return out


def build_volume_model(dims: VolumeDims) -> VolumeModel:
    return VolumeModel(dims)


def build_volume_layer(dims: VolumeDims, path: str, tp: int = 1) -> nn.Module:
    """One top-level layer alone (3D CNNs are never tensor-split: ``tp`` is ignored)."""
    del tp
    for layer in dims.layers:
        if layer.path == path:
            return VolumeBlock(layer)
    raise KeyError(path)


def volume_loss(dims: VolumeDims):
    """Per-voxel cross-entropy (U-Net: logits (N, classes, D, H, W), labels (N, D, H, W)) or MSE (CosmoFlow)."""
    if dims.spec.family == "cosmoflow":

        def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(pred.float(), target.float())

        return mse

    def voxel_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), target)

    return voxel_ce


def volume_targets(dims: VolumeDims, inputs: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Learnable synthetic targets for ``inputs``: voxel labels from the first channel's value in equal-width
    bins over [-2, 2) (U-Net), or 4 random parameters in [-1, 1] (CosmoFlow)."""
    spec = dims.spec
    if spec.family == "cosmoflow":
        return torch.rand(inputs.shape[0], int(spec.dim("outputs")), generator=gen) * 2 - 1
    classes = int(spec.dim("num_classes"))
    bins = torch.floor((inputs[:, 0].float() + 2) / 4 * classes)
    return bins.clamp(0, classes - 1).long()


def layer_input(dims: VolumeDims, path: str, x: torch.Tensor, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The input layer ``path`` sees inside the model: ``x``, concatenated with its skip features (U-Net)."""
    for layer in dims.layers:
        if layer.path == path and layer.skip_from is not None:
            return torch.cat((x, outputs[layer.skip_from]), dim=1)
    return x
