"""ResNet-50 style bottleneck network (He et al. 2016, Table 1), written here without torchvision.

Layers: ``stem`` (7x7/2 conv, BN, ReLU, 3x3/2 max-pool), ``blocks.0..N-1`` (bottlenecks; stage i has
``depths_i`` blocks of inner width ``width * 2**i`` and output ``4 * width * 2**i``; the first block of
stages 1-3 strides by 2 on its 3x3 conv, the "v1.5" placement torchvision uses), ``pool`` (global average
pool + flatten), ``fc`` (classifier; ``tp`` > 1 gives one rank's slice of the classes, Whale-style).
"""

from __future__ import annotations

from torch import nn

from runtime.models.dims import ResNetDims
from runtime.models.layered import LayeredModel, blocks_dict

EXPANSION = 4  # He et al. 2016 §4.1: bottleneck output = 4 x inner width


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride), 1x1 expand, each with BN; projection shortcut when the shape changes."""

    def __init__(self, c_in: int, inner: int, stride: int) -> None:
        super().__init__()
        c_out = inner * EXPANSION
        self.conv1, self.bn1 = _conv_bn(c_in, inner, 1)
        self.conv2, self.bn2 = _conv_bn(inner, inner, 3, stride)
        self.conv3, self.bn3 = _conv_bn(inner, c_out, 1)
        self.relu = nn.ReLU()
        self.downsample = nn.Sequential(*_conv_bn(c_in, c_out, 1, stride)) if stride != 1 or c_in != c_out else None

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + shortcut)


class Stem(nn.Sequential):
    def __init__(self, dims: ResNetDims) -> None:
        super().__init__(*_conv_bn(dims.in_channels, dims.width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))


class Pool(nn.Module):
    """Global average pool, flattened to (batch, channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.avg = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.avg(x).flatten(1)


def block_shapes(dims: ResNetDims) -> list[tuple[int, int, int]]:
    """(in channels, inner width, stride) of every bottleneck, in order."""
    shapes, c_in = [], dims.width
    for stage, depth in enumerate(dims.depths):
        inner = dims.width * 2**stage
        for i in range(depth):
            shapes.append((c_in, inner, 2 if i == 0 and stage > 0 else 1))
            c_in = inner * EXPANSION
    return shapes


def build_resnet_layer(dims: ResNetDims, path: str, tp: int = 1) -> nn.Module:
    """One top-level layer (``stem``, ``blocks.i``, ``pool``, ``fc``); ``tp`` > 1 splits only ``fc``."""
    if path == "stem":
        return Stem(dims)
    if path.startswith("blocks."):
        return Bottleneck(*block_shapes(dims)[int(path.split(".")[1])])
    if path == "pool":
        return Pool()
    if path == "fc":
        return nn.Linear(dims.features, dims.num_classes // tp)
    raise KeyError(path)


def build_resnet(dims: ResNetDims) -> LayeredModel:
    return LayeredModel(
        {
            "stem": Stem(dims),
            "blocks": blocks_dict([Bottleneck(*shape) for shape in block_shapes(dims)]),
            "pool": Pool(),
            "fc": build_resnet_layer(dims, "fc"),
        }
    )
