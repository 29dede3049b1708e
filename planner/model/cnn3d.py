"""The layer tables of the zoo's 3D CNNs (``unet3d``, ``cosmoflow``): what each top-level layer does to a volume.

Planner and runtime share these tables: the runtime builds its modules from them
(``runtime/models/cnn3d.py``), the spatial cost model reads the geometry (extents, kernel, stride, halo) from
them (``planner/cost/spatial.py``). Volumes are cubic (``volume`` voxels per side); tensors are ``(N, C, D, H, W)``.

- **3D U-Net** (Çiçek et al., MICCAI 2016, "3D U-Net: learning dense volumetric segmentation from sparse
  annotation", Fig. 1): ``levels`` resolution levels; each level has two 3x3x3 convolutions, each followed by a
  normalisation and ReLU; 2x2x2 max pooling with stride 2 between levels on the analysis path; a 2x2x2
  transposed convolution with stride 2 ("up-convolution") on the synthesis path, whose output is concatenated
  with the same level's analysis features (the skip connection); a final 1x1x1 convolution to the classes.
  Channels double per level from ``base_channels`` (the paper: 32 at the top level, 512 at the bottom of 4).
  Differences from the paper: "same" padding, so output and input have the same extent (the paper's valid
  convolutions give 132x132x116 -> 44x100x100), and GroupNorm (Wu & He, ECCV 2018) instead of BatchNorm: it
  normalises per sample, so a spatial split needs only the sample's own statistics (one all-reduce over the
  spatial group), not the batch's.
- **CosmoFlow** (Mathuriya et al., SC18, arXiv:1808.04728), as LBANN builds it for Oyama et al. (TPDS 2021,
  arXiv:2007.12856; github.com/LLNL/lbann ``applications/physics/cosmology/cosmoflow/
  cosmoflow_network_architectures.py``): ``conv_layers`` (= log2(volume) - 2) blocks of a 3x3x3 same-padded
  convolution with ``min(base_channels * 2**i, max_channels)`` filters, LeakyReLU (slope 0.3) and 2x2x2 max
  pooling; flatten; dense ``fc1`` and ``fc2`` with LeakyReLU; a dense output of the 4 cosmological parameters
  (MSE regression). Input 4 channels (redshifts), 128^3 (MLPerf HPC) to 512^3 voxels. Differences: no dropout,
  no tanh scaling of the output, and max pooling in every variant (LBANN's non-MLPerf variant average-pools
  3x3x3 with stride 2, whose window would need a halo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from planner.core import StratagemError

if TYPE_CHECKING:  # annotations only: planner.model.spec checks a volume model through check_volume below
    from planner.model.spec import ModelSpec

VolumeOp = Literal["conv", "pool", "upconv", "dense"]
SPATIAL_FAMILIES = ("unet3d", "cosmoflow")
NORM_GROUPS = 8  # GroupNorm groups (Wu & He 2018 use 32; 8 keeps the tiny test models valid), min(8, channels)


def norm_groups(channels: int) -> int:
    """GroupNorm groups of a ``channels``-wide layer: the largest of 8, 4, 2, 1 dividing it."""
    return next(g for g in (NORM_GROUPS, 4, 2, 1) if channels % g == 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class VolumeLayer:
    """One top-level layer of a 3D CNN and its geometry.

    ``in_extent``/``out_extent``: voxels per side (cubic) of its input and output. ``kernel``/``stride`` of
    its convolution or pooling; ``halo`` = voxels each side it needs from a neighbouring shard under a
    spatial split ((kernel - 1) / 2 for a stride-1 same-padded convolution, 0 for pooling, up-convolution and
    1x1x1 convolutions, whose windows stay inside a shard whose extent the stride divides). ``skip_from``:
    the layer whose output this layer's input is concatenated with (U-Net decoder); ``c_in`` counts both.
    ``pool``: a fused max-pool factor after the convolution (CosmoFlow). ``norm``: GroupNorm after it.
    """

    path: str
    op: VolumeOp
    c_in: int
    c_out: int
    in_extent: int
    out_extent: int
    kernel: int = 1
    stride: int = 1
    halo: int = 0
    pool: int = 1
    norm: bool = False
    activation: Literal["relu", "leaky_relu", "none"] = "none"
    skip_from: str | None = None

    @property
    def splittable(self) -> bool:
        """Dense layers hold no volume: they run on the whole sample (data parallel)."""
        return self.op != "dense"


def _unet_layers(spec: ModelSpec) -> list[VolumeLayer]:
    levels, base = int(spec.dim("levels")), int(spec.dim("base_channels"))
    side, c_prev = int(spec.dim("volume")), int(spec.dim("in_channels"))
    layers: list[VolumeLayer] = []

    def add(**kw) -> str:
        path = f"blocks.{len(layers)}"
        layers.append(VolumeLayer(path=path, **kw))
        return path

    def conv(c_in: int, c_out: int, skip: str | None = None) -> str:
        return add(
            op="conv", c_in=c_in, c_out=c_out, in_extent=side, out_extent=side, kernel=3, halo=1,
            norm=True, activation="relu", skip_from=skip,
        )  # fmt: skip

    skips: list[str] = []
    for level in range(levels):
        ch = base * 2**level
        conv(c_prev, ch)
        skips.append(conv(ch, ch))
        c_prev = ch
        if level < levels - 1:
            add(op="pool", c_in=ch, c_out=ch, in_extent=side, out_extent=side // 2, kernel=2, stride=2)
            side //= 2
    for level in reversed(range(levels - 1)):
        ch = base * 2**level
        add(op="upconv", c_in=c_prev, c_out=ch, in_extent=side, out_extent=side * 2, kernel=2, stride=2)
        side *= 2
        conv(2 * ch, ch, skip=skips[level])
        conv(ch, ch)
        c_prev = ch
    layers.append(
        VolumeLayer(
            path="head", op="conv", c_in=c_prev, c_out=int(spec.dim("num_classes")), in_extent=side, out_extent=side
        )
    )
    return layers


def _cosmoflow_layers(spec: ModelSpec) -> list[VolumeLayer]:
    side, c_prev = int(spec.dim("volume")), int(spec.dim("in_channels"))
    kernel = int(spec.dim("kernel"))
    layers: list[VolumeLayer] = []
    cap = int(spec.dim("max_channels")) or None
    for i in range(int(spec.dim("conv_layers"))):
        ch = int(spec.dim("base_channels")) * 2**i
        ch = min(ch, cap) if cap else ch
        layers.append(
            VolumeLayer(
                path=f"blocks.{i}", op="conv", c_in=c_prev, c_out=ch, in_extent=side, out_extent=side // 2,
                kernel=kernel, halo=(kernel - 1) // 2, pool=2, activation="leaky_relu",
            )
        )  # fmt: skip
        side, c_prev = side // 2, ch
    flat = c_prev * side**3
    for path, c_in, c_out, act in (
        ("dense.0", flat, int(spec.dim("fc1")), "leaky_relu"),
        ("dense.1", int(spec.dim("fc1")), int(spec.dim("fc2")), "leaky_relu"),
        ("head", int(spec.dim("fc2")), int(spec.dim("outputs")), "none"),
    ):
        layers.append(VolumeLayer(path=path, op="dense", c_in=c_in, c_out=c_out, in_extent=side, out_extent=1,
                                  activation=act))  # type: ignore[arg-type]  # fmt: skip
        side = 1
    return layers


def volume_layers(spec: ModelSpec) -> list[VolumeLayer]:
    """The layer table of a ``unet3d`` or ``cosmoflow`` spec, in forward order.

    >>> from planner.model.spec import parse_model
    >>> [(l.path, l.op, l.out_extent) for l in volume_layers(parse_model("unet3d:tiny"))][:3]
    [('blocks.0', 'conv', 16), ('blocks.1', 'conv', 16), ('blocks.2', 'pool', 8)]
    """
    if spec.family == "unet3d":
        return _unet_layers(spec)
    if spec.family == "cosmoflow":
        return _cosmoflow_layers(spec)
    raise StratagemError(
        f"{spec.name} is not a 3D CNN; spatial parallelism applies to {', '.join(SPATIAL_FAMILIES)} models"
    )


def check_volume(spec: ModelSpec) -> None:
    """The volume must halve cleanly at every pooling: a one-line error naming the size that works."""
    if spec.family == "cosmoflow" and int(spec.dim("kernel")) % 2 == 0:
        raise StratagemError(
            f"cosmoflow kernel {spec.dim('kernel')} is even, so same padding is one-sided; use an odd kernel (3)"
        )
    pools = int(spec.dim("levels")) - 1 if spec.family == "unet3d" else int(spec.dim("conv_layers"))
    side = int(spec.dim("volume"))
    if side % 2**pools:
        fixed = -(-side // 2**pools) * 2**pools
        raise StratagemError(
            f"{spec.family} volume {side} does not halve {pools} times into whole voxels; "
            f"use a volume divisible by {2**pools} (e.g. {fixed})"
        )
